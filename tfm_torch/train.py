"""Training, PyTorch track: the same names and arguments as tfm_numpy.train; autograd does the backward.

One step, with the learning rate of the warm-up schedule (`noam_lr`) at that step:

    logits = model(src, tgt_in)                      (B, T, V)   teacher forcing: tgt_in = [BOS] + y
    loss   = CrossEntropyLoss(logits, tgt_out)       mean over the non-pad target tokens, label-smoothed
    loss.backward()                                  autograd fills every parameter's .grad
    clip_grad_norm(params, clip_norm)                optional: the global gradient norm at most clip_norm
    optimizer.step()                                 Adam

Batches are the NumPy `Batch`es of `tfm_common.data` (both tracks train on the very same ones); they become
tensors here, on the model's device. The library never changes torch's global settings: set
`torch.set_num_threads` yourself.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from torch import nn

from tfm_common.data import BOS_ID, EOS_ID, PAD_ID, Batch
from tfm_common.training import (
    Evaluation,
    History,
    StepResult,
    batch_stream,
    check_cooldown,
    check_finite_step,
    check_int,
    check_loop_args,
    check_optimizer_of,
    cooldown_scale,
    evaluate_pairs,
    import_tqdm,
    n_total_steps,
)
from tfm_common.validate import check_size

from .checkpoint import save_checkpoint
from .decoding import greedy_decode
from .loss import CrossEntropyLoss
from .optim import clip_grad_norm, noam_lr, set_lr
from .parallel import split_batch, train_step_accumulated

__all__ = ["History", "StepResult", "Evaluation", "grad_norm", "train_step", "train", "evaluate"]


def grad_norm(params) -> float:
    """The global L2 norm of the gradients, ||(||g_1||, ..., ||g_n||)||_2, as `clip_grad_norm` measures it
    (parameters without a gradient count as zero)."""
    params = params.parameters() if isinstance(params, nn.Module) else params
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's step count (our Adam's `step_count`; for another torch optimizer, its per-parameter
    "step" state, 0 before the first step)."""
    if hasattr(optimizer, "step_count"):
        return int(optimizer.step_count)
    return max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)


def train_step(
    model: nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    loss_fn: CrossEntropyLoss,
    lr: float,
    clip_norm: float | None = None,
) -> StepResult:
    """One update of `model` on `batch` with learning rate `lr`; returns (loss before the update, gradient norm
    before clipping). The model should be in training mode (dropout on), as `train` sets it."""
    if not isinstance(batch, Batch):
        raise TypeError(f"train_step: batch expected a tfm_common.data.Batch, got {type(batch).__name__}")
    check_optimizer_of("train_step", model.parameters(), _params(optimizer))
    device = next(model.parameters()).device
    src, tgt_in, tgt_out = (torch.from_numpy(a).to(device) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    model.zero_grad(set_to_none=True)
    logits = model(src, tgt_in)  # (B, T, V)
    loss = loss_fn(logits, tgt_out)  # mean over the batch's non-pad target tokens
    loss.backward()  # autograd: every parameter's .grad
    params = _params(optimizer)
    norm = grad_norm(params)
    check_finite_step(loss.item(), norm)  # before anything changes: clipping, the lr, Adam's state and step count
    if clip_norm is not None:
        norm = clip_grad_norm(params, clip_norm)  # the same norm, measured as it clips
    set_lr(optimizer, lr)
    optimizer.step()
    return StepResult(loss.item(), norm)


def train(
    model: nn.Module,
    batches,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    warmup: int = 4000,
    factor: float = 1.0,
    d_model: int | None = None,
    lr_schedule=None,
    cooldown: int = 0,
    label_smoothing: float | None = None,
    loss_fn: CrossEntropyLoss | None = None,
    clip_norm: float | None = None,
    accumulate: int = 1,
    eval_fn=None,
    eval_every: int | None = None,
    checkpoint_path=None,
    checkpoint_every: int | None = None,
    history: History | None = None,
    progress: bool = True,
    log_every: int = 10,
    desc: str = "train",
) -> History:
    """Train `model` with `optimizer` for `steps` updates or `epochs` passes over `batches`; return the History.

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
    update: the model and optimizer are those of the step before. The model is left in the mode
    it had before (training or eval); it is in training mode (dropout on) during the steps.
    """
    name = "train"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name}: model expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{name}: optimizer expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    steps, epochs, log_every, checkpoint_every, eval_every = check_loop_args(
        name, steps, epochs, log_every, checkpoint_path, checkpoint_every, eval_fn, eval_every
    )
    if lr_schedule is None:
        d_model = check_int(name, "d_model", getattr(model, "d_model", None) if d_model is None else d_model, 1)
        noam_lr(1, d_model, warmup, factor)  # checks warmup and factor now, not at the first step
        lr_schedule = lambda s: noam_lr(s, d_model, warmup, factor)  # noqa: E731
    elif not callable(lr_schedule):
        raise TypeError(f"{name}: lr_schedule expected a callable step -> lr, got {type(lr_schedule).__name__}")
    if loss_fn is None:
        loss_fn = CrossEntropyLoss(
            ignore_index=PAD_ID, label_smoothing=0.1 if label_smoothing is None else label_smoothing
        )
    elif label_smoothing is not None:
        raise ValueError(f"{name}: give label_smoothing or loss_fn, not both (the loss_fn has its own)")
    accumulate = check_size(name, "accumulate", accumulate)
    total = n_total_steps(batches, steps, epochs)
    cooldown = check_cooldown(name, cooldown, total)
    if history is None:
        history = History()
    elif not isinstance(history, History):
        raise TypeError(f"{name}: history expected a History or None, got {type(history).__name__}")
    tqdm = import_tqdm(name) if progress else None

    was_training = model.training
    model.train()
    start = time.perf_counter()
    bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr) if tqdm else None
    done, epoch = 0, 0
    try:
        for epoch, batch in batch_stream(batches, steps, epochs, name):
            step = _steps_taken(optimizer) + 1
            lr = float(lr_schedule(step)) * cooldown_scale(done + 1, total, cooldown)
            try:
                result = _step(model, batch, optimizer, loss_fn, lr, clip_norm, accumulate)
            except FloatingPointError as e:  # raised before the update: the model is as it was after step - 1
                raise FloatingPointError(f"{name}: at step {step} (lr {lr:.3g}): {e}") from e
            history.append(step, result, lr, batch.n_tokens)
            done += 1
            if eval_every is not None and done % eval_every == 0:
                _evaluate_into(history, eval_fn, model, step)
            if checkpoint_every is not None and done % checkpoint_every == 0:
                _checkpoint(checkpoint_path, model, optimizer, history, epoch, start)
            if bar is not None:
                bar.update(1)
                if done % log_every == 0:
                    bar.set_postfix(_postfix(history, log_every), refresh=False)
        if eval_fn is not None and (eval_every is None or done % eval_every != 0):
            _evaluate_into(history, eval_fn, model, history.step[-1])
        history.seconds += time.perf_counter() - start
        if checkpoint_path is not None and (checkpoint_every is None or done % checkpoint_every != 0):
            _checkpoint(checkpoint_path, model, optimizer, history, epoch, None)
        if bar is not None:
            bar.set_postfix(_postfix(history, log_every), refresh=True)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    return history


def _step(model, batch, optimizer, loss_fn, lr: float, clip_norm, accumulate: int) -> StepResult:
    if accumulate == 1:
        return train_step(model, batch, optimizer, loss_fn, lr, clip_norm)
    micro = split_batch(batch, min(accumulate, len(batch)))
    return train_step_accumulated(model, micro, optimizer, loss_fn, lr, clip_norm)


def _evaluate_into(history: History, eval_fn, model: nn.Module, step: int) -> None:
    metrics = eval_fn(model)
    if not isinstance(metrics, dict):
        raise TypeError(f"train: eval_fn must return a dict of metrics, got {type(metrics).__name__}")
    history.evals.append({"step": int(step), **metrics})
    model.train()  # eval_fn may have switched to eval mode


def _checkpoint(path, model, optimizer, history: History, epoch: int, start: float | None) -> None:
    if start is not None:  # mid-run: the seconds so far
        history = History(**{**history.__dict__, "seconds": history.seconds + time.perf_counter() - start})
    save_checkpoint(path, model, optimizer, extra={"epoch": int(epoch), "history": history.to_dict()})


def _postfix(history: History, log_every: int) -> dict:
    out = {"loss": f"{history.mean_loss(log_every):.4f}", "lr": f"{history.lr[-1]:.2e}"}
    if history.evals:
        out.update({k: f"{v:.4g}" for k, v in history.evals[-1].items() if k != "step" and isinstance(v, float)})
    return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    pairs,
    src_vocab,
    tgt_vocab,
    *,
    max_len: int | None = None,
    batch_size: int = 256,
    bleu: bool = True,
    bleu_tokenize: str | None = None,
    use_cache: bool = True,
) -> Evaluation:
    """Greedy-decode the source of every (source text, reference text) pair and score the outputs: exact match
    and corpus BLEU (`tfm_common.metrics`). Never teacher-forced: the model reads its own predictions.

    bleu_tokenize: sacrebleu's tokenization; None: "char" for a char-level target vocabulary (German number
    words are mostly one word each), "13a" (words) otherwise.
    max_len: the longest output, in tokens (EOS included); None: the model's max_len. Sources are decoded in
    batches of `batch_size`, grouped by length. The model is in eval mode (no dropout) while decoding, and is
    left in the mode it had before.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"evaluate: model expected a torch.nn.Module, got {type(model).__name__}")
    max_len = getattr(model, "max_len", None) if max_len is None else max_len

    device = next(model.parameters()).device

    def decode(src: np.ndarray, n: int) -> np.ndarray:
        out = greedy_decode(model, torch.from_numpy(src).to(device), BOS_ID, EOS_ID, n, use_cache=use_cache)
        return out.cpu().numpy()

    was_training = model.training
    model.eval()
    try:
        return evaluate_pairs(
            decode, pairs, src_vocab, tgt_vocab, max_len=max_len, batch_size=batch_size, bleu=bleu,
            bleu_tokenize=bleu_tokenize,
        )  # fmt: skip
    finally:
        model.train(was_training)
