"""Past one device, PyTorch track: the same names as `tfm_numpy.parallel`, built on torch's own machinery.

Gradient accumulation: k backward passes add into `.grad` (autograd accumulates), each micro-batch's loss weighted
by its share of the tokens n_i/N. Recomputation: `torch.utils.checkpoint.checkpoint` (non-reentrant), with the
layer's own dropout generators rewound for the recomputation (torch's `preserve_rng_state` only covers the global
generator; ours are explicit).
"""

from __future__ import annotations

import contextlib
import pickle
import tempfile

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tfm_common.data import Batch, make_batches
from tfm_common.parallel import generators, micro_weights, run_processes, split_batch, wrap_layers
from tfm_common.schedules import LossScaler
from tfm_common.training import (
    HALF,
    MixedStepResult,
    StepResult,
    check_mixed,
    check_mixed_step,
    check_step,
    record_overflow,
)
from tfm_common.validate import check_choice, check_flag, check_size

from .loss import CrossEntropyLoss
from .module import Module
from .optim import apply_update, grad_norm, make_adam, optimizer_params

__all__ = [
    "split_batch",
    "micro_weights",
    "train_step_accumulated",
    "Recompute",
    "recompute",
    "sampler_batches",
    "train_ddp",
    "HALF",
    "to_half",
    "LossScaler",
    "MixedStepResult",
    "train_step_mixed",
]


# -- gradient accumulation ---------------------------------------------------------------------------------------
def train_step_accumulated(
    model: nn.Module,
    micro_batches,
    optimizer: torch.optim.Optimizer,
    loss_fn: CrossEntropyLoss,
    lr: float,
    clip_norm: float | None = None,
    normalize: str = "tokens",
) -> StepResult:
    """One update from the gradients of several micro-batches accumulated in `.grad` (autograd adds each backward
    into it): with normalize="tokens" the update of `train_step` on their union."""
    check_step("train_step_accumulated", model.parameters(), optimizer_params(optimizer), micro_batches=micro_batches)
    weights = micro_weights(micro_batches, normalize)  # n_i / N (normalize="tokens"): its share of the tokens
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for batch, w in zip(micro_batches, weights, strict=True):
        src, tgt_in, tgt_out = (torch.from_numpy(a).to(device) for a in (batch.src, batch.tgt_in, batch.tgt_out))
        micro_loss = loss_fn(model(src, tgt_in), tgt_out)
        (micro_loss * w).backward()  # adds w * dL_i/dtheta into every .grad
        loss += w * micro_loss.item()
    norm = apply_update("train_step_accumulated", optimizer, loss, lr, clip_norm)  # norm, clipping, lr, the step
    return StepResult(loss, norm)


# -- activation recomputation ------------------------------------------------------------------------------------
def _rng_contexts(gens: list[torch.Generator]):
    """torch.utils.checkpoint's `context_fn`: the forward records the generators' states; the recomputation
    rewinds them, and afterwards puts them back where they were."""
    saved: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward_ctx():
        saved[:] = [g.get_state() for g in gens]
        yield

    @contextlib.contextmanager
    def recompute_ctx():
        now = [g.get_state() for g in gens]
        for g, state in zip(gens, saved, strict=True):
            g.set_state(state)
        try:
            yield
        finally:
            for g, state in zip(gens, now, strict=True):
                g.set_state(state)

    return forward_ctx(), recompute_ctx()


class Recompute(Module):
    """`Recompute(layer)` behaves as `layer` (same parameters, same state_dict keys, its attributes readable) but
    keeps no activations between forward and backward: `torch.utils.checkpoint` recomputes them in backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        if not isinstance(module, nn.Module) or isinstance(module, Recompute):
            raise TypeError(
                f"Recompute: module expected a torch.nn.Module (not a Recompute), got {type(module).__name__}"
            )
        # Share the layer's registries: parameters and submodules appear under the layer's own names.
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        object.__setattr__(self, "module", module)
        self.training = module.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing to keep for a backward
            return self.module(*args, **kwargs)
        gens = generators(self.module, torch.Generator)
        return checkpoint(self.module, *args, use_reentrant=False, context_fn=lambda: _rng_contexts(gens), **kwargs)

    def train(self, mode: bool = True) -> Recompute:
        super().train(mode)
        self.module.training = mode
        return self

    def extra_repr(self) -> str:
        return type(self.module).__name__


def recompute(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Wrap (enabled=True) or unwrap every layer of every `nn.ModuleList` in `model` with `Recompute`, in place;
    returns `model`. State dict keys do not change."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"recompute: model expected a torch.nn.Module, got {type(model).__name__}")
    enabled = check_flag("recompute", "enabled", enabled)
    wrap_layers([m for m in model.modules() if isinstance(m, nn.ModuleList)], Recompute, enabled)
    return model


# -- data parallelism on torch.distributed (gloo) ------------------------------------------------------------------
def sampler_batches(n_pairs: int, batch_size: int, world: int, steps: int, seed: int = 0) -> list[list[list[int]]]:
    """The indices each rank's `DistributedSampler` (shuffled with `seed`, epoch 0) puts in each of its first
    `steps` batches of `batch_size`: [step][rank] -> indices. Their union per step is the global batch, what a
    single process must train on to be compared."""
    from torch.utils.data.distributed import DistributedSampler

    per_rank = [list(DistributedSampler(range(n_pairs), num_replicas=world, rank=r, shuffle=True, seed=seed))
                for r in range(world)]  # fmt: skip
    if steps * batch_size > len(per_rank[0]):
        raise ValueError(f"sampler_batches: {steps} steps of {batch_size} need {steps * batch_size} pairs per rank, "
                         f"the sampler gives {len(per_rank[0])}")  # fmt: skip
    return [[idx[s * batch_size : (s + 1) * batch_size] for idx in per_rank] for s in range(steps)]


def _collate(pairs) -> Batch:
    return make_batches(pairs, len(pairs), shuffle=False, sort_by_length=False)[0]


def _ddp_worker(rank, world, store_path, model_bytes, pairs_ids, batch_size, steps, lr, seed, bucket_cap_mb, timeout,
                shard=False):  # fmt: skip
    import datetime

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    model = pickle.loads(model_bytes)
    # A FileStore for the rendezvous: torch's TCPStore listens on every interface; gloo itself on loopback only.
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    try:
        buckets: list[int] = []
        if shard:  # FSDP2: every parameter split across the ranks, gathered for each forward and backward
            from torch.distributed.fsdp import fully_shard

            ddp = fully_shard(model)
        else:
            ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)  # broadcasts rank 0's weights first

            def counting_hook(state, bucket):  # what DDP all-reduces: one call per bucket, during backward
                buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
                return allreduce_hook(None, bucket)

            ddp.register_comm_hook(None, counting_hook)
        sampler = DistributedSampler(pairs_ids, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        loader = DataLoader(pairs_ids, batch_size=batch_size, sampler=sampler, collate_fn=_collate)
        optimizer = make_adam(model, lr=lr)
        loss_fn = CrossEntropyLoss(ignore_index=0)
        losses, per_step = [], []
        for _, batch in zip(range(steps), loader, strict=False):
            n_global = torch.tensor(batch.n_tokens, dtype=torch.int64)
            dist.all_reduce(n_global)  # the global batch's tokens: the loss is a mean over all of them
            share = batch.n_tokens / int(n_global)  # a Python float: float64, whatever the model's dtype
            src, tgt_in, tgt_out = (torch.from_numpy(a) for a in (batch.src, batch.tgt_in, batch.tgt_out))
            optimizer.zero_grad(set_to_none=True)
            n_before = len(buckets)
            loss = loss_fn(ddp(src, tgt_in), tgt_out) * share  # this rank's share of the global mean
            (loss * world).backward()  # DDP averages over ranks (divides by world): undo that, we want the sum
            per_step.append(len(buckets) - n_before)
            loss_sum = loss.detach().clone()
            dist.all_reduce(loss_sum)
            losses.append(loss_sum.item())
            optimizer.step()
        state = {k: _full(v).numpy().copy() for k, v in model.state_dict().items()}  # (FSDP: gathered)
        moments = [t for st in optimizer.state.values() for t in (st["exp_avg"], st["exp_avg_sq"])]
        return {
            "state": state,
            "losses": losses,
            "bucket_bytes": buckets,
            "buckets_per_step": per_step,
            "optimizer_bytes": sum(_local(t).numel() * t.element_size() for t in moments),
            "param_bytes": sum(_local(p).numel() * p.element_size() for p in model.parameters()),
        }
    finally:
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_ddp(
    model: nn.Module,
    pairs_ids,
    batch_size: int,
    steps: int,
    *,
    world: int = 2,
    lr: float = 1e-3,
    seed: int = 0,
    bucket_cap_mb: float = 25.0,
    shard: bool = False,
    timeout: float = 120.0,
) -> list[dict]:
    """Train `model` with `DistributedDataParallel` in `world` processes on gloo (CPU), each reading its part of
    `pairs_ids` through a `DistributedSampler` (`batch_size` pairs per rank and step), Adam with `lr`, `steps`
    steps. The loss is the mean over the global batch's tokens (see `sampler_batches` for the global batches).

    Returns one dict per rank: "state" (its final state_dict, NumPy arrays), "losses" (the global loss per step),
    "bucket_bytes" (the size of every bucket DDP all-reduced), "buckets_per_step", and the bytes of Adam's moments
    and of the parameters this rank holds. shard=True: `fully_shard` (FSDP2) instead of DDP, every parameter and
    its Adam moments split across the ranks (no bucket hook: "bucket_bytes" stays empty). `model` is not changed.
    Rendezvous through a temporary file; the workers are stopped and the file removed, always."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"train_ddp: model expected a torch.nn.Module, got {type(model).__name__}")
    shard = check_flag("train_ddp", "shard", shard)
    batch_size, steps = check_size("train_ddp", "batch_size", batch_size), check_size("train_ddp", "steps", steps)
    with tempfile.TemporaryDirectory(prefix="tfm_ddp_") as tmp:
        # Plain pickle: multiprocessing's pickler would share the tensors through file descriptors.
        model_bytes, pairs = pickle.dumps(model), list(pairs_ids)
        args = (f"{tmp}/store", model_bytes, pairs, batch_size, steps, lr, seed, bucket_cap_mb, timeout, shard)
        return run_processes(_ddp_worker, world, args, timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})


# -- mixed precision -------------------------------------------------------------------------------------------------
_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def to_half(x: torch.Tensor, half: str) -> torch.Tensor:
    """Round to the nearest float16 / bfloat16 value (torch's own conversion, ties to even), returned as float32:
    the storage of `tfm_numpy.to_half`, whose bfloat16 rounding is written out by hand."""
    check_choice("to_half", "half", half, HALF)
    return x.to(torch.float32).to(_HALF_DTYPES[half]).to(torch.float32)


def train_step_mixed(
    model: nn.Module,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    loss_fn: CrossEntropyLoss,
    lr: float,
    scaler: LossScaler | None = None,
    half: str = "float16",
    clip_norm: float | None = None,
) -> MixedStepResult:
    """The mixed-precision step of `tfm_numpy.train_step_mixed`, step for step: weights, logits and gradients
    stored in `half`, float32 master weights, unscaling and Adam; an overflow skips the step. (The library's
    layers accept float32/float64 only, so `torch.autocast`, which hands 16-bit tensors from layer to layer,
    runs on `torch.nn` modules, not on these: see chapter 20a.)"""
    check_mixed_step("train_step_mixed", batch, lr, scaler, clip_norm)  # before the scaler sees the step
    params = optimizer_params(optimizer)
    check_mixed(model.parameters(), params, params[0].dtype, torch.float32, half)
    scale = 1.0 if scaler is None else scaler.scale
    device = params[0].device
    src, tgt_in, tgt_out = (torch.from_numpy(a).to(device) for a in (batch.src, batch.tgt_in, batch.tgt_out))
    master = [p.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    try:
        with torch.no_grad():
            for p in params:
                p.copy_(to_half(p, half))
        logits = model(src, tgt_in)
        # the value rounded to half, the gradient passed straight through to the logits (and rounded by _HalfGrad)
        logits16 = _HalfGrad.apply(to_half(logits.detach(), half) + (logits - logits.detach()), half)
        loss = loss_fn(logits16, tgt_out)
        (loss * scale).backward()
    finally:
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad = to_half(p.grad, half) / scale
    norm = grad_norm(params)
    found_inf = record_overflow(scaler, loss.item(), norm)  # the scale follows; without a scaler, refused
    if found_inf:  # skipped: the model and the optimizer stay as they were
        return MixedStepResult(loss.item(), norm, True, scale)
    apply_update("train_step_mixed", optimizer, loss.item(), lr, clip_norm)  # clipping, lr, Adam's step (float32)
    return MixedStepResult(loss.item(), norm, False, scale)


class _HalfGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back is rounded to half (dL/dlogits stored in half, as NumPy's)."""

    @staticmethod
    def forward(ctx, x, half):
        ctx.half = half
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return to_half(grad, ctx.half), None
