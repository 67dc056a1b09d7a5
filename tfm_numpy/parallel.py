"""Past one device, NumPy track: gradient accumulation, activation recomputation, and the collectives of data
parallelism (a ring all-reduce, reduce-scatter and all-gather over shared memory). `tfm_torch.parallel` has the
same names where the mechanism exists in torch.

Gradient accumulation. A loss that is a mean over the batch's N non-pad target tokens,

    L = (1/N) sum_tokens l_t = sum_i (n_i/N) L_i        L_i: the mean over micro-batch i's n_i tokens,

has the gradient sum_i (n_i/N) dL_i. So k micro-batches give the gradient of their union exactly when each
micro-batch's backward is weighted by n_i/N (its share of the tokens), not by 1/k: with padding the micro-batches
hold different numbers of tokens, and 1/k weights the tokens of a short micro-batch more.

Recomputation (checkpointing). `Recompute(layer)` runs the layer's forward, keeps only its inputs, and drops the
caches of everything inside; its backward runs the forward again (with the same dropout masks: the generators are
rewound) to rebuild the caches, then the layer's own backward. The gradients are those of the cached layer, bit
for bit; the activations inside the layer live only while its backward runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from multiprocessing import shared_memory

import numpy as np

from tfm_common.data import Batch
from tfm_common.parallel import check_micro_batches, generators, micro_weights, run_processes, split_batch, wrap_layers
from tfm_common.schedules import LossScaler
from tfm_common.training import (
    HALF,
    MixedStepResult,
    StepResult,
    check_mixed,
    check_mixed_step,
    check_step,
    record_overflow,
    with_door,
)
from tfm_common.validate import check_choice, check_flag, check_size

from .loss import CrossEntropyLoss
from .module import Module, ModuleList, Parameter, inner_calls
from .optim import Adam, apply_update, grad_norm

__all__ = [
    "split_batch",
    "micro_weights",
    "train_step_accumulated",
    "Recompute",
    "recompute",
    "Ring",
    "RingMember",
    "ring_bytes",
    "train_data_parallel",
    "HALF",
    "to_half",
    "LossScaler",
    "MixedStepResult",
    "train_step_mixed",
]


# -- gradient accumulation ---------------------------------------------------------------------------------------
def train_step_accumulated(
    model: Module,
    micro_batches,
    optimizer: Adam,
    loss_fn: CrossEntropyLoss,
    lr: float,
    clip_norm: float | None = None,
    normalize: str = "tokens",
) -> StepResult:
    """One update from the gradients of several micro-batches (e.g. `split_batch(batch, k)`), accumulated in
    `.grad`: with normalize="tokens" the update of `train_step` on their union. Returns the token-weighted loss
    and the gradient norm before clipping, as `train_step` does. Memory: one micro-batch's activations at a time."""
    check_step("train_step_accumulated", model.parameters(), optimizer.params, micro_batches=micro_batches)
    weights = micro_weights(micro_batches, normalize)  # n_i / N (normalize="tokens"): its share of the tokens
    model.zero_grad()
    loss = 0.0
    for batch, w in zip(micro_batches, weights, strict=True):
        logits = model(batch.src, batch.tgt_in)  # (b, T_i, V)
        loss += w * float(loss_fn(logits, batch.tgt_out))
        model.backward(loss_fn.backward(w))  # adds w * dL_i/dtheta into every .grad
    norm = apply_update("train_step_accumulated", optimizer, loss, lr, clip_norm)  # norm, clipping, lr, Adam's step
    return StepResult(loss, norm)


# -- activation recomputation ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _replay(saved: list[tuple[np.random.Generator, dict]]):
    """Rewind each generator to its state before the forward, and afterwards put it back where it is now (so the
    draws after this backward are those a cached run would make)."""
    now = [g.bit_generator.state for g, _ in saved]
    for g, state in saved:
        g.bit_generator.state = state
    try:
        with inner_calls():  # the saved inputs were copied at the first forward: do not copy them again
            yield
    finally:
        for (g, _), state in zip(saved, now, strict=True):
            g.bit_generator.state = state


class Recompute(Module):
    """`Recompute(layer)` behaves as `layer` (same parameters, same state_dict keys, its attributes readable) but
    keeps no activations between forward and backward: only the inputs of its forward. Backward recomputes the
    forward (same dropout masks) and then runs the layer's backward: the same gradients, bit for bit, for one more
    forward's worth of compute. Attention weights (`attn_weights`) are dropped too."""

    def __init__(self, module: Module):
        super().__init__()
        if not isinstance(module, Module) or isinstance(module, Recompute):
            raise TypeError(
                f"Recompute: module expected a tfm_numpy Module (not a Recompute), got {type(module).__name__}"
            )
        # Share the layer's registries: parameters and submodules appear under the layer's own names.
        object.__setattr__(self, "_parameters", module._parameters)
        object.__setattr__(self, "_modules", module._modules)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "training", module.training)

    def __getattr__(self, name: str):
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(module, name)

    def forward(self, *args, **kwargs):
        gens = generators(self.module, np.random.Generator)  # dropout's
        saved = [(g, g.bit_generator.state) for g in gens]
        out = self.module.forward(*args, **kwargs)
        self._drop_caches()
        self._cache = (args, kwargs, saved)
        return out

    def _drop_caches(self) -> None:
        """Free every activation the layer cached (and its attention weights)."""
        for _, m in self.module.named_modules():
            object.__setattr__(m, "_cache", None)
            if "attn_weights" in m.__dict__:
                object.__setattr__(m, "attn_weights", None)

    def backward(self, grad_out):
        args, kwargs, saved = self._saved()
        with _replay(saved):
            self.module.forward(*args, **kwargs)  # rebuilds the caches: the very same values as the first forward
        out = self.module.backward(grad_out)
        self._drop_caches()  # the recomputed activations live only while this layer's backward runs
        # The inputs are no longer needed; the used, emptied cache still makes a second backward an error.
        object.__setattr__(self, "_cache", ((), {}, []))
        return out

    def train(self, mode: bool = True) -> Module:
        object.__setattr__(self, "training", bool(mode))
        self.module.train(mode)
        return self

    def astype(self, dtype) -> Module:
        self.module.astype(dtype)
        object.__setattr__(self, "_cache", None)
        return self

    def extra_repr(self) -> str:
        return type(self.module).__name__


def recompute(model: Module, enabled: bool = True) -> Module:
    """Wrap (enabled=True) or unwrap every layer of every layer stack (a `ModuleList` named `layers`) in `model`
    with `Recompute`, in place; returns `model`. State dict keys do not change."""
    if not isinstance(model, Module):
        raise TypeError(f"recompute: model expected a tfm_numpy Module, got {type(model).__name__}")
    enabled = check_flag("recompute", "enabled", enabled)
    wrap_layers([m for _, m in model.named_modules() if isinstance(m, ModuleList)], Recompute, enabled)
    return model


# -- collectives: a ring over shared memory ------------------------------------------------------------------------
class Ring:
    """The shared part of a ring of `world` workers: one slot per worker in a shared-memory block (large enough for
    one chunk of the longest vector, `n` elements of `dtype`) and a barrier. Make it in the parent, pass it to the
    workers, and in each worker take `ring.member(rank)`. `close()` (the parent, in a finally) frees the block.

    One exchange: every worker writes what it sends into its own slot, waits for all, reads the slot of its left
    neighbor (rank - 1), and waits again (so nobody overwrites a slot before it was read). Each worker sends to its
    right neighbor only, so on a real network every link carries the same load at the same time.
    """

    def __init__(self, world: int, n: int, dtype=np.float64, *, context=None):
        self.world = check_size("Ring", "world", world)
        self.chunk = -(-check_size("Ring", "n", n) // self.world)  # ceil(n / world): the largest chunk
        self.dtype = np.dtype(dtype)
        ctx = context or mp.get_context("spawn")
        self.shm = shared_memory.SharedMemory(create=True, size=self.world * self.chunk * self.dtype.itemsize)
        self.name = self.shm.name
        self.barrier = ctx.Barrier(self.world)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "shm"}  # workers attach by name

    def member(self, rank: int) -> RingMember:
        return RingMember(self, rank)

    def close(self) -> None:
        """Free the shared block (the parent, once every worker is done)."""
        shm = self.__dict__.pop("shm", None)
        if shm is not None:
            shm.close()
            shm.unlink()


class RingMember:
    """One worker's end of a `Ring`: all_reduce, reduce_scatter and all_gather of 1-D arrays, counting the bytes
    this worker sends (`bytes_sent`). A vector of n elements is cut in `world` chunks (`np.array_split`);
    reduce-scatter leaves worker r with chunk r of the sum, all-gather gives every worker every chunk."""

    def __init__(self, ring: Ring, rank: int):
        self.ring, self.rank, self.world = ring, rank, ring.world
        self._shm = shared_memory.SharedMemory(name=ring.name)
        self.slots = np.ndarray((ring.world, ring.chunk), dtype=ring.dtype, buffer=self._shm.buf)  # (W, chunk)
        self.bytes_sent = 0

    def _exchange(self, send: np.ndarray, recv_size: int) -> np.ndarray:
        """Send `send` to the right neighbor; return what the left neighbor sent (recv_size elements)."""
        self.slots[self.rank, : send.size] = send
        self.ring.barrier.wait()
        recv = self.slots[(self.rank - 1) % self.world, :recv_size].copy()
        self.ring.barrier.wait()
        self.bytes_sent += send.nbytes
        return recv

    def _chunks(self, x: np.ndarray) -> list[np.ndarray]:
        if x.ndim != 1 or x.dtype != self.ring.dtype or x.size > self.ring.chunk * self.world:
            raise ValueError(
                f"Ring: expected a 1-D {self.ring.dtype} array of at most {self.ring.chunk * self.world} elements, "
                f"got shape {x.shape} dtype {x.dtype}"
            )
        return [c.copy() for c in np.array_split(x, self.world)]

    def reduce_scatter(self, x: np.ndarray) -> np.ndarray:
        """Chunk `rank` of the sum over the workers of x: W - 1 steps, each sending one chunk to the right."""
        buf, r, w = self._chunks(x), self.rank, self.world
        for s in range(w - 1):
            send, recv = (r - s - 1) % w, (r - s - 2) % w  # send the partial sum received last step (own at s=0)
            buf[recv] += self._exchange(buf[send], buf[recv].size)
        return buf[r]  # after W - 1 steps: every worker's contribution added, once

    def all_gather(self, shard: np.ndarray, n: int) -> np.ndarray:
        """The full vector of n elements from every worker's chunk (this worker's: `shard`, chunk `rank`)."""
        buf, r, w = [c.copy() for c in np.array_split(np.zeros(n, self.ring.dtype), self.world)], self.rank, self.world
        if shard.shape != buf[r].shape:
            raise ValueError(f"Ring.all_gather: shard expected shape {buf[r].shape}, got {shard.shape}")
        buf[r][...] = shard
        for s in range(w - 1):
            send, recv = (r - s) % w, (r - s - 1) % w  # pass on the chunk received last step (own at s=0)
            buf[recv] = self._exchange(buf[send], buf[recv].size)
        return np.concatenate(buf)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum over the workers of x, on every worker: reduce-scatter, then all-gather. Each worker sends
        2 (W - 1)/W of the vector, whatever W: the ring's bandwidth cost."""
        return self.all_gather(self.reduce_scatter(x), x.size)

    def close(self) -> None:
        self.slots = None
        self._shm.close()


def ring_bytes(n_bytes: int, world: int, op: str = "all_reduce") -> int:
    """Bytes each worker sends in a ring collective over a vector of n_bytes (chunks of equal size): (W-1)/W of it
    for reduce-scatter or all-gather, twice that for all-reduce."""
    check_choice("ring_bytes", "op", op, ("all_reduce", "reduce_scatter", "all_gather"))
    return (2 if op == "all_reduce" else 1) * (world - 1) * n_bytes // world


# -- data parallelism: every worker a replica (or a shard of the optimizer), one global batch per step ----------
def _flat_grads(params) -> np.ndarray:
    return np.concatenate([p.grad.ravel() for p in params])


def _unflatten(flat: np.ndarray, params, attr: str) -> None:
    offset = 0
    for p in params:
        getattr(p, attr)[...] = flat[offset : offset + p.data.size].reshape(p.shape)
        offset += p.data.size


def _data_parallel_worker(rank, world, model, batches, ring, lr, label_smoothing, zero):
    """One worker: its rows of each global batch, the gradient of its share of the global loss, summed over the
    ring; then either the full Adam step on every worker (plain data parallelism: replicated optimizer) or ZeRO:
    reduce-scatter, Adam on this worker's chunk of the flat parameters only, all-gather of the new parameters."""
    comm = ring.member(rank)
    try:
        params = model.parameters()
        n = sum(p.data.size for p in params)
        loss_fn = CrossEntropyLoss(ignore_index=0, label_smoothing=label_smoothing)
        if zero:  # this worker owns chunk `rank` of the flat parameter vector, and its Adam moments only
            flat = np.concatenate([p.data.ravel() for p in params])
            shard = Parameter(np.array_split(flat, world)[rank].copy())
            optimizer = Adam([shard], lr=lr)
        else:
            optimizer = Adam(params, lr=lr)
        losses = []
        for batch in batches:
            local = split_batch(batch, world)[rank]  # this worker's rows, trimmed
            model.zero_grad()
            loss = loss_fn(model(local.src, local.tgt_in), local.tgt_out)
            model.backward(loss_fn.backward(local.n_tokens / batch.n_tokens))  # its share of the global tokens
            losses.append(float(loss) * local.n_tokens / batch.n_tokens)
            if zero:
                shard.grad = comm.reduce_scatter(_flat_grads(params))
                optimizer.step()
                _unflatten(comm.all_gather(shard.data, n), params, "data")
            else:
                _unflatten(comm.all_reduce(_flat_grads(params)), params, "grad")
                optimizer.step()
        opt_bytes = sum(a.nbytes for a in optimizer.exp_avg + optimizer.exp_avg_sq)
        return {
            "state": model.state_dict(),
            "losses": losses,
            "bytes_sent": comm.bytes_sent,
            "optimizer_bytes": opt_bytes,
            "param_bytes": sum(p.data.nbytes for p in params),
        }
    finally:
        comm.close()


def train_data_parallel(
    model: Module,
    batches,
    *,
    world: int = 2,
    lr: float = 1e-3,
    label_smoothing: float = 0.0,
    zero: bool = False,
    timeout: float = 120.0,
) -> list[dict]:
    """Train copies of `model` in `world` worker processes, one optimizer step (Adam, lr) per global batch of
    `batches`, each worker computing the gradient on its rows; gradients combined by the NumPy ring. zero=True:
    the optimizer state is sharded (ZeRO stage 2: reduce-scatter of gradients, all-gather of parameters).

    Returns one dict per worker: its final "state" (a state_dict), its "losses" (its share of each global loss:
    they sum to the global loss), "bytes_sent" by the ring, "optimizer_bytes" (Adam's moments it holds) and
    "param_bytes". `model` itself is not changed. The workers are stopped and the shared memory freed, always."""
    if not isinstance(model, Module):
        raise TypeError(f"train_data_parallel: model expected a tfm_numpy Module, got {type(model).__name__}")
    batches = check_micro_batches("train_data_parallel", batches)
    world = check_size("train_data_parallel", "world", world)
    if min(len(b) for b in batches) < world:
        raise ValueError(f"train_data_parallel: every batch needs at least world={world} rows")
    zero = check_flag("train_data_parallel", "zero", zero)
    ring = Ring(world, sum(p.data.size for p in model.parameters()), model.param_dtype)
    try:
        args = (model, batches, ring, lr, label_smoothing, zero)
        return run_processes(_data_parallel_worker, world, args, timeout=timeout)
    finally:
        ring.close()


# -- mixed precision -------------------------------------------------------------------------------------------------
def to_half(x: np.ndarray, half: str) -> np.ndarray:
    """Round a float32/float64 array to the nearest float16 or bfloat16 value (ties to even), returned as float32:
    half-precision *storage*, float32 arithmetic. float16 overflows to +-inf beyond 65504 and loses values below
    6e-8; bfloat16 keeps float32's range with 8 bits of mantissa (NumPy has no bfloat16: its rounding is written
    out on the float32 bit pattern)."""
    check_choice("to_half", "half", half, HALF)
    x32 = np.asarray(x, dtype=np.float32)
    if half == "float16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    bits = x32.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even on the top 16 bits
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x32), x32, out).reshape(x32.shape)


def train_step_mixed(
    model: Module,
    batch: Batch,
    optimizer: Adam,
    loss_fn: CrossEntropyLoss,
    lr: float,
    scaler: LossScaler | None = None,
    half: str = "float16",
    clip_norm: float | None = None,
) -> MixedStepResult:
    """One mixed-precision update of a float32 `model` (its parameters are the float32 master weights, Adam's
    moments float32 too). The forward and backward see the weights rounded to `half` and the gradients are stored
    in `half` (scaled by `scaler.scale`, so that small ones do not flush to zero); their unscaling, the overflow
    check and the Adam step are float32. An overflow skips the step (the model and optimizer do not change) and
    backs the scale off. Emulated: the arithmetic inside the layers stays float32."""
    params = optimizer.params
    check_mixed(model.parameters(), params, model.param_dtype, np.float32, half)
    scale = 1.0 if scaler is None else scaler.scale
    master = [p.data for p in params]
    model.zero_grad()
    try:  # an overflow (inf, then nan) is expected now and then: it is detected below, not warned about
        for p in params:  # the half-precision copy of the weights that the matrix products read
            p.data = to_half(p.data, half)
        with np.errstate(over="ignore", invalid="ignore"):
            logits = model(batch.src, batch.tgt_in)  # (B, T, V)
            loss = float(loss_fn(to_half(logits, half), batch.tgt_out))
            model.backward(to_half(loss_fn.backward(np.float32(scale)), half))  # scaled dL/dlogits, in half
    finally:
        for p, m in zip(params, master, strict=True):
            p.data = m
    with np.errstate(over="ignore", invalid="ignore"):
        for p in params:  # gradients stored in half, unscaled in float32
            p.grad = to_half(p.grad, half) / np.float32(scale)
        norm = grad_norm(params)
    found_inf = record_overflow(scaler, loss, norm)  # the scale follows; without a scaler, refused
    if found_inf:  # skipped: the model and the optimizer stay as they were
        return MixedStepResult(loss, norm, True, scale)
    apply_update("train_step_mixed", optimizer, loss, lr, clip_norm)  # clipping, lr, Adam's step (float32)
    return MixedStepResult(loss, norm, False, scale)


def _check_mixed_step(batch, lr, scaler, clip_norm, **_) -> None:
    check_mixed_step("train_step_mixed", batch, lr, scaler, clip_norm)


# batch, lr, scaler and clip_norm checked before the printed step runs (a step refused at its update must not move
# the scale)
train_step_mixed = with_door(train_step_mixed, _check_mixed_step)
