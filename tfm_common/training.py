"""What the two tracks' training shares (pure Python and NumPy, never a track): the loop, the record of a run,
the checks of a step's arguments, the eval mode, and the evaluation on decoded text.

`tfm_numpy.train` and `tfm_torch.train` hold what differs (the step: the backward by hand in NumPy, autograd in
torch) and hand it, as a `Track`, to `fit` (the one loop of both tracks) and `evaluate_pairs`: `track_functions`
makes each track's public `train` and `evaluate` of them.

- `History`: one entry per optimizer step (the step number, the loss, the learning rate, the gradient norm
  before clipping, the target tokens in the batch) and the evaluations made during training. It survives a
  JSON round trip (`to_dict` / `from_dict`), so it rides along in a checkpoint's `extra`.
- `StepResult`: what one `train_step` returns, `(loss, grad_norm)`, the unit compared across tracks
  (`MixedStepResult` for a mixed-precision step).
- `eval_mode`: a block run with dropout off, every submodule's mode restored after.
- `Evaluation`: exact match and corpus BLEU of greedily decoded outputs against the references, with the texts.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from .data import PAD_ID, Batch, Vocab
from .metrics import corpus_bleu, exact_match
from .parallel import check_micro_batches, split_batch
from .schedules import LossScaler, check_cooldown, cooldown_scale, noam_lr
from .validate import check_choice, check_real, check_size

__all__ = ["check_finite_step", "check_step", "check_batch", "check_mixed", "with_door", "check_lm_windows",
           "check_mixed_step", "check_lm_ids", "check_distinct_params", "check_adam_eps", "check_moment", "HALF",
           "History", "StepResult", "MixedStepResult", "record_overflow", "eval_mode", "Track", "track_functions",
           "steps_taken", "fit", "Evaluation", "batch_stream", "evaluate_pairs"]  # fmt: skip

HALF = ("float16", "bfloat16")  # the 16-bit formats of mixed precision
_NOT_GIVEN = object()


def check_finite_step(name: str, loss: float, grad_norm: float) -> None:
    """Before the optimizer step: a non-finite loss or gradient would turn finite weights into NaN and move the
    step count. Raise instead, so the model, the optimizer's state and its step count stay as they were."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise FloatingPointError(
            f"{name}: the loss is {loss} and the gradient norm {grad_norm}: not finite, so the update was not "
            "applied (weights, optimizer state and step count unchanged); lower the lr, clip gradients or check "
            "the batch"
        )


def record_overflow(scaler, loss: float, grad_norm: float) -> bool:
    """After a mixed-precision backward: whether the gradients overflowed (their norm is not finite). A `LossScaler`
    backs its scale off on an overflow and grows it after enough good steps; without a scaler an overflow is refused
    (as `check_finite_step` refuses any non-finite step), since nothing would lower the scale next time."""
    found_inf = not math.isfinite(grad_norm)
    if scaler is not None:
        scaler.update(found_inf)
    elif found_inf:
        check_finite_step("train_step_mixed", loss, grad_norm)
    return found_inf


def check_mixed(model_params, params: list, dtype, float32, half: str) -> None:
    """`train_step_mixed`'s arguments: float32 master weights (`dtype`, the track's `float32`), a format of HALF,
    and an optimizer of the model's parameters."""
    if dtype != float32:
        raise TypeError(f"train_step_mixed: model expected float32 master weights, got {dtype}")
    check_choice("train_step_mixed", "half", half, HALF)
    check_step("train_step_mixed", model_params, params)


def check_step(name: str, model_params, optimizer_params, *, batch=_NOT_GIVEN, micro_batches=_NOT_GIVEN) -> None:
    """Before a step changes anything: its `batch` a `Batch` (or its `micro_batches` a non-empty list of them),
    where the step takes one, and every parameter the optimizer updates one of the model's. An optimizer made for
    another model, or before the model was rebuilt (a notebook cell run again), would step those parameters with
    this model's gradients never applied: the loss would not move, and nothing would say why."""
    if batch is not _NOT_GIVEN:
        check_batch(name, batch)
    if micro_batches is not _NOT_GIVEN and not sum(map(len, check_micro_batches(name, micro_batches))):
        raise ValueError(f"{name}: micro_batches hold no rows: {_EMPTY}")
    own, params = {id(p) for p in model_params}, list(optimizer_params)
    stray = sum(id(p) not in own for p in params)
    if stray:
        raise ValueError(
            f"{name}: {stray} of the optimizer's {len(params)} parameters are not this model's: was the optimizer "
            "made for another model, or before the model was rebuilt? Make it after the model (make_adam(model))"
        )


_EMPTY = (
    "an empty batch has no loss to follow, and the step would still move the weights (weight decay) and the step count"
)


def check_batch(name: str, batch) -> None:
    """A step's `batch`: a `Batch` with at least one row."""
    if not isinstance(batch, Batch):
        raise TypeError(f"{name}: batch expected a tfm_common.data.Batch, got {type(batch).__name__}")
    if not len(batch):
        raise ValueError(f"{name}: batch holds no rows (src shape {batch.src.shape}): {_EMPTY}")


def with_door(func: Callable, check: Callable) -> Callable:
    """`func` behind a door: the public function runs `check(**arguments)` (the call's arguments by name, defaults
    filled in) and then `func` itself. For a step function a chapter prints with its one line of checking: the
    door refuses the rest before the step changes anything, and `show_source` (as `inspect`) still reads `func`
    through `__wrapped__`."""
    signature = inspect.signature(func)

    @functools.wraps(func)
    def door(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        check(**bound.arguments)
        return func(*args, **kwargs)

    return door


def check_lm_windows(name: str, x, y, arrays: tuple[type, ...], words: str) -> None:
    """`lm_train_step`'s windows: x and y arrays of a type in `arrays` (named by `words`; a nested list is refused
    in both tracks), x not an empty batch (B = 0 would give the loss 0 and still take an optimizer step). Their
    dtypes, shapes and values are the model's and the loss's to check."""
    for arg, a in (("x", x), ("y", y)):
        if not isinstance(a, arrays):
            raise TypeError(f"{name}: {arg} expected {words} of token ids (B, T), got {type(a).__name__}")
    if len(x.shape) == 2 and x.shape[0] == 0:
        raise ValueError(f"{name}: x holds no windows (shape {tuple(x.shape)}): {_EMPTY}")


def check_mixed_step(name: str, batch, lr, scaler, clip_norm) -> None:
    """`train_step_mixed`'s batch, lr, scaler and clip_norm, before anything runs: the scaler follows every step it
    sees, so a step refused later (at the update) would have moved the scale already."""
    check_batch(name, batch)
    check_real(name, "lr", lr, 0.0, nonfinite=ValueError)
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"{name}: scaler expected a LossScaler or None, got {type(scaler).__name__}")
    if clip_norm is not None:
        check_real(name, "clip_norm", clip_norm, 0.0, nonfinite=ValueError)


def check_lm_ids(name: str, ids, block_size, vocab_size: int | None) -> tuple[np.ndarray, int]:
    """`lm_eval_loss`'s token array: 1-D integers (not bools, not floats: truncating them would score other
    tokens) in [0, vocab_size) (every one of them is a target; -1 would score token V - 1), at least one window
    of block_size inputs and their targets. Returns (ids as int64, block_size)."""
    block_size = check_size(name, "block_size", block_size)
    a = np.asarray(ids)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: ids expected integer token ids, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name}: ids expected a 1-D array of token ids, got shape {a.shape}")
    bad = (a < 0) if vocab_size is None else (a < 0) | (a >= vocab_size)
    if bad.any():
        allowed = "[0, inf)" if vocab_size is None else f"[0, {vocab_size})"
        raise ValueError(f"{name}: ids: values must be in {allowed}, got {a[bad][0]} (and {int(bad.sum()) - 1} more)")
    if len(a) < block_size + 1:
        raise ValueError(
            f"{name}: ids has {len(a)} tokens, fewer than one window: block_size={block_size} inputs need "
            f"{block_size + 1} tokens"
        )
    return a.astype(np.int64), block_size


def check_distinct_params(name: str, params: list) -> None:
    """Each parameter once: an optimizer would update a repeated one twice per step, and a norm count it twice."""
    if len({id(p) for p in params}) != len(params):
        raise ValueError(
            f"{name}: params contains the same Parameter twice (an optimizer would update it twice per step, a norm "
            "count it twice)"
        )


def check_adam_eps(name: str, eps: float) -> None:
    """eps > 0: with eps = 0 a parameter whose gradient entry is 0 at the first steps gets 0 / 0 = nan."""
    if not eps > 0:
        raise ValueError(f"{name}: eps must be > 0 (m / (sqrt(v) + eps) is 0 / 0 where v = 0), got {eps!r}")


def check_moment(name: str, part: str, i: int, finite: bool, negative: bool) -> None:
    """One of Adam's stored moments: finite, and exp_avg_sq (a mean of squares) never negative: a crafted or
    corrupted state would otherwise turn the weights into nan at the next step, or steer it silently."""
    if not finite:
        raise ValueError(f"{name}: {part}[{i}] holds non-finite values (nan or inf): not the state of a finite run")
    if negative:
        raise ValueError(f"{name}: {part}[{i}] holds negative values: a running mean of squared gradients cannot")


class StepResult(NamedTuple):
    """One training step: the batch's loss (before the update) and the global gradient norm (before clipping)."""

    loss: float
    grad_norm: float


class MixedStepResult(NamedTuple):
    """One mixed-precision step (`train_step_mixed`)."""

    loss: float
    grad_norm: float  # of the unscaled gradients; inf when the step was skipped
    skipped: bool
    scale: float  # the loss scale used for this step


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


def _modes(model) -> list:
    """Every submodule with its mode (`.training`), parents before children (`named_modules`, both tracks; a
    stand-in model without submodules is its only one)."""
    modules = [m for _, m in model.named_modules()] if hasattr(model, "named_modules") else [model]
    return [(m, m.training) for m in modules]


def _restore(modes: list) -> None:
    for m, was in modes:  # `m.train` sets a whole subtree: its children come after it, and set their own mode
        m.train(was)


@contextmanager
def eval_mode(model):
    """Dropout off for the duration of the block (decoding and evaluation are deterministic); after it, error or
    not, every submodule is back in its own mode (`model.train(was)` would put them all in the model's). A NumPy
    model keeps its last forward's cache for backward: the block's (eval) forwards' is dropped, so that a backward
    after it is refused ("before forward") instead of differentiating an eval forward (torch keeps no such cache)."""
    modes = _modes(model)
    model.eval()
    try:
        yield model
    finally:
        _restore(modes)
        if "_cache" in vars(model):
            model._cache = None


# -- the loop -------------------------------------------------------------------------------------------------------


@dataclass
class Track:
    """What a track hands to `fit` and `evaluate_pairs`: its model and optimizer classes (with the words that name
    them in a refusal); `train_step(model, batch, optimizer, loss_fn, lr, clip_norm)` and
    `train_step_accumulated(model, micro_batches, ...)` (one update each, a `StepResult`); `loss_class` (its
    CrossEntropyLoss); `save_checkpoint(path, model, optimizer, extra=...)`; `decode(model, src, max_len, use_cache)`
    (greedy decoding, NumPy ids (B, S) in, (B, L) out)."""

    model: type
    model_word: str
    optimizer: type
    optimizer_word: str
    train_step: Callable
    train_step_accumulated: Callable
    loss_class: type
    save_checkpoint: Callable
    decode: Callable


def track_functions(track: Track) -> tuple[Callable, Callable]:
    """A track's public `train` and `evaluate`: `fit` and `evaluate_pairs` with the `track` given, and their
    signatures and docstrings less that argument."""
    return _bind(fit, "train", track), _bind(evaluate_pairs, "evaluate", track)


def _bind(func: Callable, name: str, track: Track) -> Callable:
    def bound(*args, **kwargs):
        return func(*args, **kwargs, track=track)

    sig = inspect.signature(func)
    bound.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "track"])
    bound.__name__ = bound.__qualname__ = name
    bound.__doc__, bound.__module__ = func.__doc__, track.train_step.__module__
    return bound


def _check_instance(name: str, arg: str, value, kind: type, word: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name}: {arg} expected a {word}, got {type(value).__name__}")


def steps_taken(optimizer) -> int:
    """The optimizer's step count: tfm_numpy's Adam's `step_count`; for a torch optimizer, the largest of its
    per-parameter "step" counts (they agree unless a parameter had no gradient at some step), 0 before the first."""
    if not hasattr(optimizer, "state"):  # tfm_numpy's Adam
        return int(optimizer.step_count)
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def fit(model, batches, optimizer, *, steps: int | None = None, epochs: int | None = None, warmup: int = 4000,
        factor: float = 1.0, d_model: int | None = None, lr_schedule=None, cooldown: int = 0,
        label_smoothing: float | None = None, loss_fn=None, clip_norm: float | None = None, accumulate: int = 1,
        eval_fn=None, eval_every: int | None = None, checkpoint_path=None, checkpoint_every: int | None = None,
        history: History | None = None, progress: bool = True, log_every: int = 10, desc: str = "train",
        track: Track) -> History:  # fmt: skip
    """Train `model` with `optimizer` for `steps` updates or `epochs` passes over `batches`; return the History.
    The loop of both tracks (`tfm_numpy.train` and `tfm_torch.train` are this function with their `Track`).

    batches      a list of `Batch` (the same order each epoch) or a callable `epoch -> batches` (epoch from 0),
                 e.g. `lambda e: make_batches(ids, 64, rng=e)`: a new, reproducible shuffle each epoch
    steps / epochs  exactly one of them: the number of updates to make now, or of full passes
    lr           at optimizer step s (counted by the optimizer, from 1, across resumed runs):
                 `lr_schedule(s)` if given, else `noam_lr(s, d_model, warmup, factor)`, d_model from the model
    cooldown     the lr of the last `cooldown` steps of this call is scaled down linearly, to 1/cooldown of the
                 schedule's at the last step (0: none). Not in the paper (which averaged its last checkpoints
                 instead): a short model trained at a still-high lr ends wherever its last noisy steps left it,
                 and a cool-down lets it settle. Needs the number of steps in advance.
    loss         `loss_fn` if given, else `CrossEntropyLoss(ignore_index=PAD_ID, label_smoothing)`
                 (label_smoothing 0.1 by default, the paper's)
    clip_norm    clip the global gradient norm to this value (None: no clipping)
    accumulate   split each batch into this many micro-batches (`split_batch`) and accumulate their gradients
                 (`train_step_accumulated`, weighted by tokens): the same updates, a fraction of the memory
    eval_fn      `model -> dict` of metrics (e.g. `lambda m: evaluate(m, valid_pairs, ...).metrics()`), called
                 every `eval_every` steps and after the last one; stored in `history.evals` with the step
    checkpoint_path  save model, optimizer and history there (`save_checkpoint`) every `checkpoint_every`
                 steps and after the last one
    history      a History to continue (appended to); a new one if None
    progress     show a tqdm progress bar on stderr (its postfix: the mean loss of the last `log_every`
                 steps, the lr, the last evaluation); False for none

    A non-finite loss or gradient stops training with FloatingPointError naming the step, before that step's
    update: the model and optimizer are those of the step before. The model is in training mode (dropout on)
    during the steps; after, every submodule is back in the mode it had.
    """
    name = "train"
    _check_instance(name, "model", model, track.model, track.model_word)
    _check_instance(name, "optimizer", optimizer, track.optimizer, track.optimizer_word)
    steps, epochs, log_every, checkpoint_every, eval_every = _check_loop_args(
        name, steps, epochs, log_every, checkpoint_path, checkpoint_every, eval_fn, eval_every
    )
    lr_schedule = _lr_schedule(name, model, lr_schedule, d_model, warmup, factor)
    if loss_fn is None:
        smoothing = 0.1 if label_smoothing is None else label_smoothing
        loss_fn = track.loss_class(ignore_index=PAD_ID, label_smoothing=smoothing)
    elif label_smoothing is not None:
        raise ValueError(f"{name}: give label_smoothing or loss_fn, not both (the loss_fn has its own)")
    accumulate = check_size(name, "accumulate", accumulate)
    # the number of steps of this call, if known in advance (the cool-down and the progress bar need it)
    total = epochs * len(batches) if steps is None and isinstance(batches, Sequence) else steps
    cooldown = check_cooldown(name, cooldown, total)
    if history is None:
        history = History()
    elif not isinstance(history, History):
        raise TypeError(f"{name}: history expected a History or None, got {type(history).__name__}")
    tqdm = _import_tqdm(name) if progress else None

    def one_step(batch: Batch, lr: float) -> StepResult:
        if accumulate == 1:
            return track.train_step(model, batch, optimizer, loss_fn, lr, clip_norm)
        micro = split_batch(batch, min(accumulate, len(batch)))
        return track.train_step_accumulated(model, micro, optimizer, loss_fn, lr, clip_norm)

    def checkpoint(epoch: int, start: float | None) -> None:
        record = history.to_dict()
        if start is not None:  # mid-run: the seconds so far
            record["seconds"] = history.seconds + time.perf_counter() - start
        track.save_checkpoint(checkpoint_path, model, optimizer, extra={"epoch": int(epoch), "history": record})

    modes = _modes(model)
    model.train()
    start = time.perf_counter()
    bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr) if tqdm else None
    done, epoch = 0, 0
    try:
        for epoch, batch in batch_stream(batches, steps, epochs, name):
            step = steps_taken(optimizer) + 1
            lr = float(lr_schedule(step)) * cooldown_scale(done + 1, total, cooldown)
            try:
                result = one_step(batch, lr)
            except FloatingPointError as e:  # raised before the update: the model is as it was after step - 1
                raise FloatingPointError(f"{name}: at step {step} (lr {lr:.3g}): {e}") from e
            history.append(step, result, lr, batch.n_tokens)
            done += 1
            if eval_every is not None and done % eval_every == 0:
                _evaluate_into(history, eval_fn, model, step)
            if checkpoint_every is not None and done % checkpoint_every == 0:
                checkpoint(epoch, start)
            if bar is not None:
                bar.update(1)
                if done % log_every == 0:
                    bar.set_postfix(_postfix(history, log_every), refresh=False)
        if eval_fn is not None and (eval_every is None or done % eval_every != 0):
            _evaluate_into(history, eval_fn, model, history.step[-1])
        history.seconds += time.perf_counter() - start
        if checkpoint_path is not None and (checkpoint_every is None or done % checkpoint_every != 0):
            checkpoint(epoch, None)
        if bar is not None:
            bar.set_postfix(_postfix(history, log_every), refresh=True)
    finally:
        if bar is not None:
            bar.close()
        _restore(modes)
    return history


def _evaluate_into(history: History, eval_fn, model, step: int) -> None:
    metrics = eval_fn(model)
    if not isinstance(metrics, dict):
        raise TypeError(f"train: eval_fn must return a dict of metrics, got {type(metrics).__name__}")
    history.evals.append({"step": int(step), **metrics})
    model.train()  # eval_fn may have switched to eval mode


def _postfix(history: History, log_every: int) -> dict:
    out = {"loss": f"{history.mean_loss(log_every):.4f}", "lr": f"{history.lr[-1]:.2e}"}
    if history.evals:
        out.update({k: f"{v:.4g}" for k, v in history.evals[-1].items() if k != "step" and isinstance(v, float)})
    return out


# -- the loop's arguments ---------------------------------------------------------------------------------------


def _check_loop_args(name: str, steps, epochs, log_every, checkpoint_path, checkpoint_every, eval_fn, eval_every):
    """The loop's arguments, checked before any step: (steps, epochs, log_every, checkpoint_every, eval_every)."""
    if (steps is None) == (epochs is None):
        raise ValueError(f"{name}: give exactly one of steps and epochs, got steps={steps!r}, epochs={epochs!r}")
    steps = None if steps is None else check_size(name, "steps", steps)
    epochs = None if epochs is None else check_size(name, "epochs", epochs)
    log_every = check_size(name, "log_every", log_every)
    checkpoint_every = None if checkpoint_every is None else check_size(name, "checkpoint_every", checkpoint_every)
    if checkpoint_every is not None and checkpoint_path is None:
        raise ValueError(f"{name}: checkpoint_every={checkpoint_every} needs a checkpoint_path")
    eval_every = None if eval_every is None else check_size(name, "eval_every", eval_every)
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(f"{name}: eval_fn expected a callable model -> dict of metrics, got {type(eval_fn).__name__}")
    if eval_every is not None and eval_fn is None:
        raise ValueError(f"{name}: eval_every={eval_every} needs an eval_fn")
    return steps, epochs, log_every, checkpoint_every, eval_every


def _lr_schedule(name: str, model, lr_schedule, d_model, warmup, factor) -> Callable[[int], float]:
    """`lr_schedule`, or the paper's `noam_lr` with d_model from the model, checked now, not at the first step."""
    if lr_schedule is None:
        d_model = check_size(name, "d_model", getattr(model, "d_model", None) if d_model is None else d_model)
        noam_lr(1, d_model, warmup, factor)  # checks warmup and factor
        return lambda s: noam_lr(s, d_model, warmup, factor)
    if not callable(lr_schedule):
        raise TypeError(f"{name}: lr_schedule expected a callable step -> lr, got {type(lr_schedule).__name__}")
    return lr_schedule


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


def _import_tqdm(name: str):
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


def evaluate_pairs(model, pairs, src_vocab: Vocab, tgt_vocab: Vocab, *, max_len: int | None = None,
                   batch_size: int = 256, bleu: bool = True, bleu_tokenize: str | None = None, use_cache: bool = True,
                   track: Track) -> Evaluation:  # fmt: skip
    """Greedy-decode the source of every (source text, reference text) pair and score the outputs: exact match
    and corpus BLEU (`tfm_common.metrics`). Never teacher-forced: the model reads its own predictions.

    bleu_tokenize: sacrebleu's tokenization; None: "char" for a char-level target vocabulary (German number
    words are mostly one word each), "13a" (words) otherwise.
    max_len: the longest output, in tokens (EOS included); None: the model's max_len. Sources are decoded in
    batches of `batch_size`, grouped by length (similar lengths: little padding). The model is in eval mode
    (no dropout) while decoding, and is left in the mode it had before.
    """
    name = "evaluate"
    _check_instance(name, "model", model, track.model, track.model_word)
    if not isinstance(src_vocab, Vocab) or not isinstance(tgt_vocab, Vocab):
        raise TypeError(f"{name}: src_vocab and tgt_vocab expected tfm_common.data.Vocab objects")
    pairs = list(pairs)
    if not pairs:
        raise ValueError(f"{name}: pairs is empty")
    for i, p in enumerate(pairs):
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise ValueError(f"{name}: pair {i} expected a (source, reference) pair of texts, got {p!r:.60}")
    max_len = check_size(name, "max_len", getattr(model, "max_len", None) if max_len is None else max_len)
    batch_size = check_size(name, "batch_size", batch_size)
    sources = [s for s, _ in pairs]
    references = [r if isinstance(r, str) else " ".join(r) for _, r in pairs]  # word level: a list of tokens
    ids = [src_vocab.encode(s, add_eos=True) for s in sources]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths together: little padding
    hypotheses: list[str | None] = [None] * len(ids)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(ids[i]) for i in idx)
            src = np.full((len(idx), width), PAD_ID, dtype=np.int64)
            for row, i in enumerate(idx):
                src[row, : len(ids[i])] = ids[i]
            out = np.asarray(track.decode(model, src, max_len, use_cache))
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
