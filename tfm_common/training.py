"""What the two training loops share (pure Python and NumPy, never a track): the record of a run, the stream of
batches, the checks of the loop's arguments, and the evaluation on decoded text.

The loops themselves live in `tfm_numpy.train` and `tfm_torch.train`, one per track, written alike; the only
real difference between them is the backward pass (by hand in NumPy, autograd in torch).

- `History`: one entry per optimizer step (the step number, the loss, the learning rate, the gradient norm
  before clipping, the target tokens in the batch) and the evaluations made during training. It survives a
  JSON round trip (`to_dict` / `from_dict`), so it rides along in a checkpoint's `extra`.
- `StepResult`: what one `train_step` returns, `(loss, grad_norm)`, the unit compared across tracks.
- `Evaluation`: exact match and corpus BLEU of greedily decoded outputs against the references, with the texts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from .data import PAD_ID, Batch, Vocab

__all__ = [
    "check_finite_step",
    "check_optimizer_of",
    "History",
    "StepResult",
    "Evaluation",
    "batch_stream",
    "evaluate_pairs",
]


def check_finite_step(loss: float, grad_norm: float) -> None:
    """Before the optimizer step: a non-finite loss or gradient would turn finite weights into NaN and move the
    step count. Raise instead, so the model, the optimizer's state and its step count stay as they were."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise FloatingPointError(
            f"train_step: the loss is {loss} and the gradient norm {grad_norm}: not finite, so the update was not "
            "applied (weights, optimizer state and step count unchanged); lower the lr, clip gradients or check "
            "the batch"
        )


def check_optimizer_of(name: str, model_params, optimizer_params) -> None:
    """Before a step: every parameter the optimizer updates must be one of the model's. An optimizer made for
    another model, or before the model was rebuilt (a notebook cell run again), would step those parameters with
    this model's gradients never applied: the loss would not move, and nothing would say why."""
    own, params = {id(p) for p in model_params}, list(optimizer_params)
    stray = sum(id(p) not in own for p in params)
    if stray:
        raise ValueError(
            f"{name}: {stray} of the optimizer's {len(params)} parameters are not this model's: was the optimizer "
            "made for another model, or before the model was rebuilt? Make it after the model (make_adam(model))"
        )


class StepResult(NamedTuple):
    """One training step: the batch's loss (before the update) and the global gradient norm (before clipping)."""

    loss: float
    grad_norm: float


@dataclass
class History:
    """The record of training, one entry per optimizer step in each list.

    step       the optimizer's step number (1 = the first update; it continues across resumed runs)
    loss       the batch's mean loss per target token, computed before that step's update
    lr         the learning rate of that step
    grad_norm  the global L2 norm of all gradients, before clipping
    tokens     the number of (non-pad) target tokens in the batch
    evals      the evaluations made during training: {"step": s, "exact_match": ..., ...} each
    seconds    wall-clock seconds spent in `train` (machine-dependent: do not print it where a re-run must match)
    """

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def append(self, step: int, result: StepResult, lr: float, tokens: int) -> None:
        self.step.append(int(step))
        self.loss.append(float(result.loss))
        self.lr.append(float(lr))
        self.grad_norm.append(float(result.grad_norm))
        self.tokens.append(int(tokens))

    def __len__(self) -> int:
        return len(self.step)

    def mean_loss(self, last: int | None = None) -> float:
        """The mean of the last `last` losses (all of them if None); nan if there are none."""
        losses = self.loss if last is None else self.loss[-last:]
        return float(np.mean(losses)) if losses else math.nan

    def to_dict(self) -> dict:
        """A JSON-able dict (for a checkpoint's `extra`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> History:
        if not isinstance(d, dict):
            raise TypeError(f"History.from_dict: expected a dict, got {type(d).__name__}")
        expected = {f for f in cls.__dataclass_fields__}
        if set(d) != expected:
            raise KeyError(f"History.from_dict: expected keys {sorted(expected)}, got {sorted(d)}")
        h = cls(**{k: list(v) if k != "seconds" else float(v) for k, v in d.items()})
        n = len(h.step)
        for k in ("loss", "lr", "grad_norm", "tokens"):
            if len(getattr(h, k)) != n:
                raise ValueError(f"History.from_dict: '{k}' has {len(getattr(h, k))} entries, 'step' has {n}")
        return h

    def __repr__(self) -> str:
        if not self.step:
            return "History(0 steps)"
        last = f", last eval {self.evals[-1]}" if self.evals else ""
        return (
            f"History({len(self)} steps {self.step[0]}..{self.step[-1]}, loss {self.loss[0]:.4f} -> "
            f"{self.loss[-1]:.4f}{last})"
        )


# -- arguments ------------------------------------------------------------------------------------------------


def check_int(name: str, arg: str, value, low: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {arg} expected an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}: {arg} must be >= {low}, got {value}")
    return int(value)


def check_loop_args(name: str, steps, epochs, log_every, checkpoint_path, checkpoint_every, eval_fn, eval_every):
    """The loop's arguments, checked before any step: (steps, epochs, log_every, checkpoint_every, eval_every)."""
    if (steps is None) == (epochs is None):
        raise ValueError(f"{name}: give exactly one of steps and epochs, got steps={steps!r}, epochs={epochs!r}")
    steps = check_int(name, "steps", steps, 1, allow_none=True)
    epochs = check_int(name, "epochs", epochs, 1, allow_none=True)
    log_every = check_int(name, "log_every", log_every, 1)
    checkpoint_every = check_int(name, "checkpoint_every", checkpoint_every, 1, allow_none=True)
    if checkpoint_every is not None and checkpoint_path is None:
        raise ValueError(f"{name}: checkpoint_every={checkpoint_every} needs a checkpoint_path")
    eval_every = check_int(name, "eval_every", eval_every, 1, allow_none=True)
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(f"{name}: eval_fn expected a callable model -> dict of metrics, got {type(eval_fn).__name__}")
    if eval_every is not None and eval_fn is None:
        raise ValueError(f"{name}: eval_every={eval_every} needs an eval_fn")
    return steps, epochs, log_every, checkpoint_every, eval_every


def batch_stream(batches, steps: int | None, epochs: int | None, name: str = "train") -> Iterator[tuple[int, Batch]]:
    """(epoch, batch) pairs: `epochs` full passes, or as many passes as it takes to give `steps` batches.

    batches: a non-empty sequence of `Batch` (the same order every epoch), or a callable `epoch -> iterable of
    Batch` (epoch counts from 0), e.g. `lambda epoch: make_batches(ids, 64, rng=epoch)` for a new, reproducible
    shuffle every epoch.
    """
    if callable(batches):
        make = batches
    elif isinstance(batches, Sequence) and not isinstance(batches, (str, bytes)):
        if not batches:
            raise ValueError(f"{name}: batches is empty")
        make = lambda epoch: batches  # noqa: E731
    else:
        raise TypeError(
            f"{name}: batches expected a list of Batch or a callable epoch -> batches, got {type(batches).__name__}"
        )
    given, epoch = 0, 0
    while epochs is None or epoch < epochs:
        n_before = given
        for batch in make(epoch):
            if not isinstance(batch, Batch):
                raise TypeError(f"{name}: epoch {epoch}: expected a tfm_common.data.Batch, got {type(batch).__name__}")
            yield epoch, batch
            given += 1
            if steps is not None and given == steps:
                return
        if given == n_before:
            raise ValueError(f"{name}: epoch {epoch} gave no batches")
        epoch += 1


def n_total_steps(batches, steps: int | None, epochs: int | None) -> int | None:
    """The number of steps `batch_stream` will give, if it is known in advance (for the progress bar)."""
    if steps is not None:
        return steps
    return epochs * len(batches) if isinstance(batches, Sequence) else None


def check_cooldown(name: str, cooldown, total: int | None) -> int:
    """`cooldown` checked against the number of steps of the call (which must be known if cooldown > 0)."""
    cooldown = check_int(name, "cooldown", cooldown, 0)
    if cooldown and total is None:
        raise ValueError(
            f"{name}: cooldown={cooldown} needs the number of steps in advance: pass steps, or epochs with a list "
            "of batches (not a callable)"
        )
    if cooldown > (total or 0):
        raise ValueError(f"{name}: cooldown={cooldown} is longer than the {total} steps of this call")
    return cooldown


def cooldown_scale(k: int, total: int | None, cooldown: int) -> float:
    """The factor on the scheduled lr at the k-th step of a call of `total` steps (k = 1 .. total): 1, then over
    the last `cooldown` steps (total - k + 1) / cooldown, down to 1 / cooldown at the last step."""
    if not cooldown:
        return 1.0
    return min(1.0, (total - k + 1) / cooldown)


def import_tqdm(name: str):
    try:
        from tqdm import tqdm
    except ImportError as e:  # an optional dependency (the book's extra)
        raise ImportError(
            f"{name}: the progress bar needs the tqdm package (pip install tqdm), or pass progress=False"
        ) from e
    return tqdm


# -- evaluation on decoded text -------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """Metrics on greedily decoded outputs (never teacher-forced), with the texts to look into.

    exact_match  the fraction of outputs equal to their reference, in [0, 1]
    bleu         corpus BLEU (sacrebleu, 0..100), or None if not computed
    sources, hypotheses, references  the texts, in the order of the pairs given
    """

    exact_match: float
    bleu: float | None
    sources: list[str]
    hypotheses: list[str]
    references: list[str]

    def errors(self) -> list[tuple[str, str, str]]:
        """The (source, hypothesis, reference) triples that do not match exactly."""
        return [(s, h, r) for s, h, r in zip(self.sources, self.hypotheses, self.references, strict=True) if h != r]

    def metrics(self) -> dict:
        """{"exact_match": ..., "bleu": ...}: what `train` stores in `History.evals`."""
        out = {"exact_match": self.exact_match}
        if self.bleu is not None:
            out["bleu"] = self.bleu
        return out

    def __repr__(self) -> str:
        bleu = "" if self.bleu is None else f", bleu={self.bleu:.2f}"
        return f"Evaluation(n={len(self.sources)}, exact_match={self.exact_match:.4f}{bleu})"


def evaluate_pairs(
    decode: Callable[[np.ndarray, int], np.ndarray],
    pairs,
    src_vocab: Vocab,
    tgt_vocab: Vocab,
    *,
    max_len: int,
    batch_size: int,
    bleu: bool,
    bleu_tokenize: str | None,
    name: str = "evaluate",
) -> Evaluation:
    """Decode every source of `pairs` ((source text, reference text)) with `decode(src (B, S) int64, max_len)`
    -> ids (B, L), in batches of similar source length; compare the decoded texts with the references."""
    from .metrics import corpus_bleu, exact_match  # here: metrics imports sacrebleu lazily as well

    if not isinstance(src_vocab, Vocab) or not isinstance(tgt_vocab, Vocab):
        raise TypeError(f"{name}: src_vocab and tgt_vocab expected tfm_common.data.Vocab objects")
    pairs = list(pairs)
    if not pairs:
        raise ValueError(f"{name}: pairs is empty")
    for i, p in enumerate(pairs):
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise ValueError(f"{name}: pair {i} expected a (source, reference) pair of texts, got {p!r:.60}")
    max_len = check_int(name, "max_len", max_len, 1)
    batch_size = check_int(name, "batch_size", batch_size, 1)
    sources = [s for s, _ in pairs]
    references = [r if isinstance(r, str) else " ".join(r) for _, r in pairs]  # word level: a list of tokens
    ids = [src_vocab.encode(s, add_eos=True) for s in sources]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths together: little padding
    hypotheses: list[str | None] = [None] * len(ids)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(ids[i]) for i in idx)
        src = np.full((len(idx), width), PAD_ID, dtype=np.int64)
        for row, i in enumerate(idx):
            src[row, : len(ids[i])] = ids[i]
        out = np.asarray(decode(src, max_len))
        if out.ndim != 2 or out.shape[0] != len(idx):
            raise ValueError(f"{name}: the decoder returned shape {out.shape}, expected ({len(idx)}, L)")
        for row, i in enumerate(idx):
            hypotheses[i] = tgt_vocab.decode(out[row])  # drops BOS and PAD, stops at the first EOS
    em = float(exact_match(hypotheses, references))
    score = None
    if bleu:
        if bleu_tokenize is None:  # char-level outputs are often one word each: count character n-grams
            bleu_tokenize = "char" if tgt_vocab.level == "char" else "13a"
        score = float(corpus_bleu(hypotheses, references, tokenize=bleu_tokenize))
    return Evaluation(em, score, sources, hypotheses, references)
