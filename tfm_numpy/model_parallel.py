"""Splitting the model, NumPy track: tensor parallelism (Megatron-LM) over the ring of chapter 20a, and pipeline
parallelism (GPipe, 1F1B) over point-to-point channels in shared memory. `tfm_torch.model_parallel` has the same
names on torch.distributed (gloo).

Tensor parallelism. `tensor_parallel(model, rank, world, comm)` returns a copy of a GPT (or of one GPTBlock, one
attention or feed-forward layer) in which every attention holds n_heads / world heads and every feed-forward
d_ff / world hidden units of the original: process `rank`'s slices (`tfm_common.model_parallel.shard`). Inside
each sublayer nothing is communicated; its output is the all-reduce (sum) of the processes' partial outputs, and in
the backward the gradient of its input is the all-reduce of the partial gradients. Everything else (embeddings,
norms, the output projection) is replicated: its input and its gradient are the same on every process, so its
gradients are too.

Pipeline parallelism. `PipelineStage(model, stage, n_stages)` holds one stage's blocks (the first also the
embeddings, the last the final norm and the output projection). A stage keeps one forward's caches per
micro-batch (`stash` / `restore`) until that micro-batch's backward: what GPipe holds, m of them at once, and
1F1B at most n_stages - stage.
"""

from __future__ import annotations

import copy
import math
import multiprocessing as mp
import time
from multiprocessing import shared_memory

import numpy as np

from tfm_common.model_parallel import (
    check_pipeline,
    check_tensor_split,
    pipeline_schedule,
    shard,
    stage_layers,
)
from tfm_common.parallel import run_processes
from tfm_common.validate import check_real, check_size

from .attention import AttentionImpl
from .gpt import GPT, GPTBlock
from .layers import Dropout, Linear
from .loss import CrossEntropyLoss
from .masks import causal_mask
from .modern import GroupedQueryAttention, repeat_kv
from .module import Module, ModuleList, check_input
from .optim import Adam
from .parallel import Ring
from .sublayers import PositionwiseFeedForward

__all__ = [
    "TensorParallelFeedForward",
    "TensorParallelAttention",
    "tensor_parallel",
    "tensor_parallel_run",
    "Channel",
    "PipelineStage",
    "train_pipeline_step",
]


def _shard_linear(lin: Linear, axis: int, rank: int, world: int, *, bias: str = "shard") -> Linear:
    """A Linear holding process `rank`'s slice of `lin`: axis 0 cuts its outputs (the bias with them), axis 1 its
    inputs (the bias stays whole: it is added once, after the all-reduce)."""
    w = shard(lin.weight.data, axis, rank, world)
    out = Linear(w.shape[1], w.shape[0], lin.bias is not None, dtype=lin.weight.dtype)
    out.weight.data[...] = w
    if lin.bias is not None:
        out.bias.data[...] = shard(lin.bias.data, 0 if axis == 0 else None, rank, world)
    return out


def _refuse_dropout(owner: str, module: Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, Dropout) and m.p > 0:
            raise ValueError(f"{owner}: dropout expected 0 (each process would draw its own masks), got p={m.p} "
                             f"in {name or type(module).__name__}")  # fmt: skip


class TensorParallelFeedForward(Module):
    """Process `rank`'s part of a PositionwiseFeedForward: linear1's rows rank * d_ff/W ..., linear2's columns
    (the same hidden units), linear2's bias whole. `comm`: a RingMember (all_reduce of 1-D arrays)."""

    def __init__(self, ff: PositionwiseFeedForward, rank: int, world: int, comm):
        super().__init__()
        _refuse_dropout("TensorParallelFeedForward", ff)
        check_tensor_split("TensorParallelFeedForward", world, d_ff=ff.d_ff)
        self.d_model, self.d_ff = ff.d_model, ff.d_ff // world  # this process's hidden units
        self.linear1 = _shard_linear(ff.linear1, 0, rank, world)  # (d_ff/W, d): column parallel
        self.activation = copy.deepcopy(ff.activation)
        self.linear2 = _shard_linear(ff.linear2, 1, rank, world)  # (d, d_ff/W): row parallel, bias (d,) whole
        object.__setattr__(self, "comm", comm)

    def _check_forward(self, x) -> None:
        self.linear1._check_forward(x)

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = self.activation(self.linear1(x)).reshape(-1, self.d_ff)  # (N, d_ff/W): no other process's units
        partial = h @ self.linear2.weight.data.T  # (N, d): this process's share of the sum over hidden units
        y = self.comm.all_reduce(partial.ravel()).reshape(partial.shape) + self.linear2.bias.data  # all-reduce 1
        self._cache = (h, x.shape)
        return y.reshape(x.shape)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        h, shape = self._saved()
        g = grad_out.reshape(-1, self.d_model)  # (N, d): the same on every process
        self.linear2.weight.grad += g.T @ h  # (d, d_ff/W)
        self.linear2.bias.grad += g.sum(axis=0)
        dh = (g @ self.linear2.weight.data).reshape(*shape[:-1], self.d_ff)
        partial = self.linear1.backward(self.activation.backward(dh))  # (..., d): through this process's units
        return self.comm.all_reduce(partial.ravel()).reshape(shape)  # all-reduce 2: the sum over all units


class TensorParallelAttention(AttentionImpl, Module):
    """Process `rank`'s heads of a GroupedQueryAttention: n_heads/W query heads and n_kv_heads/W key/value heads
    (the rows of q_proj, k_proj, v_proj that make them; query head h reads key/value head h // (H / Hkv), on the
    same process), and out_proj's columns for those heads (its bias whole)."""

    def __init__(self, attn: GroupedQueryAttention, rank: int, world: int, comm):
        super().__init__()
        _refuse_dropout("TensorParallelAttention", attn)
        H, Hkv = attn.n_heads, attn.n_kv_heads
        check_tensor_split("TensorParallelAttention", world, n_heads=H, n_kv_heads=Hkv)
        self.d_model, self.d_head = attn.d_model, attn.d_head
        self.n_heads, self.n_kv_heads = H // world, Hkv // world
        self.q_proj = _shard_linear(attn.q_proj, 0, rank, world)  # (H/W dh, d)
        self.k_proj = _shard_linear(attn.k_proj, 0, rank, world)  # (Hkv/W dh, d)
        self.v_proj = _shard_linear(attn.v_proj, 0, rank, world)
        self.out_proj = _shard_linear(attn.out_proj, 1, rank, world)  # (d, H/W dh)
        self.rotary = attn.rotary
        self.dropout = Dropout(0.0)
        self.attn_impl, self.tile_size, self.attn_weights = attn.attn_impl, attn.tile_size, None
        object.__setattr__(self, "comm", comm)

    def _check_forward(self, x, mask=None, offset=0) -> None:
        check_input("TensorParallelAttention", x, ndim_min=3, last_dim=self.d_model, dtype=self.q_proj.weight.dtype)

    def _split(self, x: np.ndarray, n: int) -> np.ndarray:  # (B, T, n dh) -> (B, n, T, dh)
        B, T, _ = x.shape
        return x.reshape(B, T, n, self.d_head).transpose(0, 2, 1, 3)

    def _merge(self, x: np.ndarray) -> np.ndarray:  # (B, n, T, dh) -> (B, T, n dh)
        B, n, T, _ = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, T, n * self.d_head)

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None, offset: int = 0) -> np.ndarray:
        q = self._split(self.q_proj(x), self.n_heads)  # (B, H/W, T, dh): this process's heads only
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, offset), self.rotary.rotate(k, offset)
        n_rep = self.n_heads // self.n_kv_heads
        ctx = self._merge(self._attend(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask))  # (B, T, H/W dh)
        partial = ctx.reshape(-1, ctx.shape[-1]) @ self.out_proj.weight.data.T  # (N, d): these heads' share
        y = self.comm.all_reduce(partial.ravel()).reshape(partial.shape) + self.out_proj.bias.data  # all-reduce 1
        object.__setattr__(self, "_heads", (ctx, offset))
        return y.reshape(x.shape)

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        saved = self._saved()
        ctx, offset = self._heads
        g = grad_out.reshape(-1, self.d_model)  # (N, d): the same on every process
        self.out_proj.weight.grad += g.T @ ctx.reshape(-1, ctx.shape[-1])
        self.out_proj.bias.grad += g.sum(axis=0)
        d_ctx = self._split((g @ self.out_proj.weight.data).reshape(ctx.shape), self.n_heads)
        dq, dk, dv = self._attend_backward(d_ctx, saved)  # (B, H/W, T, dh), k and v repeated
        B, _, T, dh = dk.shape
        dk = dk.reshape(B, self.n_kv_heads, -1, T, dh).sum(axis=2)  # a shared key/value head adds up
        dv = dv.reshape(B, self.n_kv_heads, -1, T, dh).sum(axis=2)
        if self.rotary is not None:
            dq, dk = self.rotary.rotate(dq, offset, inverse=True), self.rotary.rotate(dk, offset, inverse=True)
        partial = self.q_proj.backward(self._merge(dq))
        partial += self.k_proj.backward(self._merge(dk))
        partial += self.v_proj.backward(self._merge(dv))
        return self.comm.all_reduce(partial.ravel()).reshape(partial.shape)  # all-reduce 2


def tensor_parallel(model: Module, rank: int, world: int, comm) -> Module:
    """A copy of `model` (a GPT, a GPTBlock, a GroupedQueryAttention or a PositionwiseFeedForward) holding process
    `rank`'s share of every attention and feed-forward (see the classes above); `model` is not changed. Refused:
    dropout > 0, world not dividing n_heads, n_kv_heads or d_ff, a SwiGLU feed-forward."""
    world = check_size("tensor_parallel", "world", world)
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"tensor_parallel: rank expected an int in [0, {world}), got {rank!r}")
    split = {GroupedQueryAttention: TensorParallelAttention, PositionwiseFeedForward: TensorParallelFeedForward}
    if type(model) in split:
        return split[type(model)](model, rank, world, comm)
    if not isinstance(model, (GPT, GPTBlock)):
        raise TypeError(f"tensor_parallel: model expected a GPT, GPTBlock, GroupedQueryAttention or "
                        f"PositionwiseFeedForward, got {type(model).__name__}")  # fmt: skip
    _refuse_dropout("tensor_parallel", model)
    out = copy.deepcopy(model)
    blocks = [out] if isinstance(out, GPTBlock) else list(out.layers)
    for block in blocks:
        if type(block.ff) not in split:
            raise ValueError(f"tensor_parallel: the feed-forward expected a PositionwiseFeedForward (activation "
                             f"relu or gelu), got {type(block.ff).__name__}")  # fmt: skip
        block.self_attn = TensorParallelAttention(block.self_attn, rank, world, comm)
        block.ff = TensorParallelFeedForward(block.ff, rank, world, comm)
    out.zero_grad()
    return out


def _tensor_parallel_worker(rank, world, model, inputs, targets, ring):
    comm = ring.member(rank)
    try:
        tp = tensor_parallel(model, rank, world, comm)
        if isinstance(model, GPT):  # tokens in, the mean cross-entropy of the next tokens
            loss_fn = CrossEntropyLoss()
            output = tp(inputs)
            loss = float(loss_fn(output, targets))
            forward_bytes = comm.bytes_sent
            tp.backward(loss_fn.backward())
            grad_input = None
        else:  # a layer: activations in, `targets` is the gradient of its output
            mask = None if isinstance(model, PositionwiseFeedForward) else causal_mask(inputs.shape[1])
            output = tp(inputs) if mask is None else tp(inputs, mask)
            loss, forward_bytes = None, comm.bytes_sent
            grad_input = tp.backward(targets)
        return {"output": output, "loss": loss, "grad_input": grad_input, "grads": tp.grads(),
                "bytes_sent": comm.bytes_sent, "forward_bytes": forward_bytes,
                "param_bytes": sum(p.data.nbytes for p in tp.parameters())}  # fmt: skip
    finally:
        comm.close()


def tensor_parallel_run(model: Module, inputs, targets, *, world: int = 2, timeout: float = 60.0) -> list[dict]:
    """One forward and backward of `tensor_parallel(model, rank, world, ring)` in `world` processes. A GPT:
    `inputs` tokens (B, T), `targets` (B, T) next tokens, mean cross-entropy; a layer: `inputs` (B, T, d) and
    `targets` the gradient of its output (a GPTBlock or an attention gets the causal mask). Returns per rank:
    "output" (logits or y), "loss", "grad_input" (layers), "grads" (its shards, by state_dict key: join them
    with `tfm_common.model_parallel.unshard` along `shard_axis(key)`), "bytes_sent" (forward and backward),
    "forward_bytes" and "param_bytes". The workers are stopped and the shared memory freed, always."""
    tensor_parallel(model, 0, world, None)  # refused here, before any process starts
    n = int(np.prod(np.shape(inputs)[:2])) * model.d_model
    ring = Ring(world, n, model.param_dtype if isinstance(model, GPT) else _dtype(model))
    try:
        return run_processes(_tensor_parallel_worker, world, (model, inputs, targets, ring), timeout=timeout)
    finally:
        ring.close()


def _dtype(model: Module):
    return next(iter(model.parameters())).dtype


# -- pipeline parallelism ------------------------------------------------------------------------------------------
class Channel:
    """A one-way channel from one process to another over shared memory: `depth` slots of up to `n` elements,
    used in turn, and two semaphores (free slots, filled slots). Make it in the parent, pass it to both workers;
    `close()` (the parent) frees the block. A send waits for a free slot, a recv for a filled one, each at most
    `timeout` seconds."""

    def __init__(self, n: int, dtype=np.float64, depth: int = 1, *, timeout: float = 60.0, context=None):
        self.n, self.depth = check_size("Channel", "n", n), check_size("Channel", "depth", depth)
        self.dtype, self.timeout = np.dtype(dtype), check_real("Channel", "timeout", timeout, 0.0)
        ctx = context or mp.get_context("spawn")
        self.shm = shared_memory.SharedMemory(create=True, size=self.depth * self.n * self.dtype.itemsize)
        self.name = self.shm.name
        self.free, self.filled = ctx.Semaphore(self.depth), ctx.Semaphore(0)
        self.sent = self.received = self.bytes_sent = 0

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("shm", "_slots", "_view")}

    def _buffer(self) -> np.ndarray:
        if "_slots" not in self.__dict__:
            self._view = shared_memory.SharedMemory(name=self.name)
            self._slots = np.ndarray((self.depth, self.n), dtype=self.dtype, buffer=self._view.buf)
        return self._slots

    def _acquire(self, sem, what: str) -> None:
        if not sem.acquire(timeout=self.timeout):
            raise TimeoutError(f"Channel: no {what} within timeout={self.timeout} s")

    def send(self, x: np.ndarray) -> None:
        if x.dtype != self.dtype or x.size > self.n:
            raise ValueError(f"Channel.send: expected a {self.dtype} array of at most {self.n} elements, "
                             f"got shape {x.shape} dtype {x.dtype}")  # fmt: skip
        self._acquire(self.free, "free slot")
        self._buffer()[self.sent % self.depth, : x.size] = x.ravel()
        self.sent += 1
        self.bytes_sent += x.nbytes
        self.filled.release()

    def recv(self, shape: tuple) -> np.ndarray:
        self._acquire(self.filled, "message")
        size = math.prod(shape)
        out = self._buffer()[self.received % self.depth, :size].reshape(shape).copy()
        self.received += 1
        self.free.release()
        return out

    def close(self) -> None:
        """Release this process's view (a worker) and free the block (the parent, which made it)."""
        self.__dict__.pop("_slots", None)
        view = self.__dict__.pop("_view", None)
        if view is not None:
            view.close()
        shm = self.__dict__.pop("shm", None)
        if shm is not None:
            shm.close()
            shm.unlink()


_STRUCTURE = ("_parameters", "_modules", "training")


def _arrays(x, seen: dict) -> None:
    """Collect the distinct memory blocks of the arrays inside x (tuples, lists, dicts, arrays), by id."""
    if isinstance(x, np.ndarray):
        base = x
        while isinstance(base.base, np.ndarray):
            base = base.base
        seen[id(base)] = base.nbytes
    elif isinstance(x, (tuple, list)):
        for y in x:
            _arrays(y, seen)
    elif isinstance(x, dict):
        for y in x.values():
            _arrays(y, seen)


class PipelineStage(Module):
    """Stage `stage` of `n_stages` of a GPT (a copy of its parts; the model is not changed): the blocks
    `stage_layers(n_layers, n_stages)[stage]`, the first stage also the embeddings, the last the final norm and the
    output projection. forward: tokens (B, T) (first stage) or activations (B, T, d) -> activations, or logits
    (last stage); backward: the gradient of its output -> that of its input (None on the first stage). A tied
    output projection is refused for n_stages > 1 (its weight would live on two stages: their gradients would
    have to be summed across them)."""

    def __init__(self, model: GPT, stage: int, n_stages: int):
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"PipelineStage: model expected a tfm_numpy GPT, got {type(model).__name__}")
        check_pipeline("PipelineStage", n_stages, 1)
        if not isinstance(stage, int) or not 0 <= stage < n_stages:
            raise ValueError(f"PipelineStage: stage expected an int in [0, {n_stages}), got {stage!r}")
        if n_stages > 1 and model.config["tie_output"]:
            raise ValueError("PipelineStage: tie_output expected False for n_stages > 1 (the tied embedding would "
                             "live on the first and the last stage), got True")  # fmt: skip
        _refuse_dropout("PipelineStage", model)
        m = copy.deepcopy(model)
        self.first, self.last, self.d_model = stage == 0, stage == n_stages - 1, m.d_model
        self.layer_ids = stage_layers(len(m.layers), n_stages)[stage]
        if self.first:
            self.embed, self.pos = m.embed, m.pos
        self.layers = ModuleList([m.layers[i] for i in self.layer_ids])
        if self.last:
            self.norm, self.output_projection = m.norm, m.output_projection
        self.zero_grad()

    def forward(self, x: np.ndarray) -> np.ndarray:
        if self.first:  # tokens (B, T) -> (B, T, d), as GPT._embed
            x = self.embed(x) * math.sqrt(self.d_model)
            if self.pos is not None:
                x = self.pos(x, 0)
        mask = causal_mask(x.shape[1])
        for layer in self.layers:
            x = layer(x, mask)
        self._cache = x.shape
        return self.output_projection(self.norm(x)) if self.last else x

    def backward(self, grad_out: np.ndarray) -> np.ndarray | None:
        self._saved()
        dx = self.norm.backward(self.output_projection.backward(grad_out)) if self.last else grad_out
        for layer in reversed(list(self.layers)):
            dx = layer.backward(dx)
        if not self.first:
            return dx
        if self.pos is not None:
            dx = self.pos.backward(dx)
        self.embed.backward(dx * math.sqrt(self.d_model))
        return None

    def stash(self) -> list[dict]:
        """What the last forward left in every module (caches, masks, flags), to keep until its backward."""
        return [{k: v for k, v in m.__dict__.items() if k not in _STRUCTURE} for _, m in self.named_modules()]

    def restore(self, saved: list[dict]) -> None:
        """Put a `stash` back: the next backward is that forward's."""
        for (_, m), d in zip(self.named_modules(), saved, strict=True):
            m.__dict__.update(d)

    @staticmethod
    def stash_bytes(saved: list[dict]) -> int:
        """The bytes of the distinct arrays a stash holds: one micro-batch's activations kept for its backward."""
        seen: dict[int, int] = {}
        _arrays(saved, seen)
        return sum(seen.values())

    def global_key(self, key: str) -> str:
        """The GPT's state_dict key of this stage's `key` ("layers.0..." of stage 1 is "layers.<first id>...")."""
        if key.startswith("layers."):
            i, rest = key[len("layers.") :].split(".", 1)
            return f"layers.{self.layer_ids[int(i)]}.{rest}"
        return key


def _pipeline_worker(rank, world, model, tokens, targets, m, schedule, fwd, bwd, lr, ready):
    stage = PipelineStage(model, rank, world)
    ops = pipeline_schedule(world, m, schedule)[rank]
    xs, ys = np.split(tokens, m), np.split(targets, m)
    shape = (*xs[0].shape, model.d_model)  # what crosses between stages: (B/m, T, d)
    stage(xs[0] if stage.first else np.zeros(shape, model.param_dtype))  # warm-up, untimed; its caches are dropped
    ready.wait()  # every stage built and warm: the clock starts together (not with the processes' start-up)
    losses, stashes, timeline = [], {}, []
    held = peak = 0
    loss_fns = [CrossEntropyLoss() for _ in range(m)]
    try:
        for op, i in ops:
            if op == "F":
                x = xs[i] if stage.first else fwd[rank - 1].recv(shape)
                t = time.perf_counter()
                y = stage(x)
                if stage.last:
                    losses.append(float(loss_fns[i](y, ys[i])))
                stashes[i] = stage.stash() + [loss_fns[i].__dict__.copy()]
                timeline.append(("F", i, t, time.perf_counter()))
                held += PipelineStage.stash_bytes(stashes[i])
                peak = max(peak, held)
                if not stage.last:
                    fwd[rank].send(y)
            else:
                g = None if stage.last else bwd[rank].recv(shape)
                t = time.perf_counter()
                saved = stashes.pop(i)
                held -= PipelineStage.stash_bytes(saved)
                stage.restore(saved[:-1])
                if stage.last:
                    loss_fns[i].__dict__.update(saved[-1])
                    g = loss_fns[i].backward(1.0 / m)  # micro-batch i's share of the batch's mean loss
                dx = stage.backward(g)
                timeline.append(("B", i, t, time.perf_counter()))
                if not stage.first:
                    bwd[rank - 1].send(dx)
        grads = {stage.global_key(k): v for k, v in stage.grads().items()}
        optimizer = Adam(stage.parameters(), lr=lr)
        optimizer.step()
        links = ([fwd[rank]] if rank < world - 1 else []) + (
            [bwd[rank - 1]] if rank else []
        )  # what this stage sends on
        return {"grads": grads, "state": {stage.global_key(k): v for k, v in stage.state_dict().items()},
                "loss": sum(losses) / m if stage.last else None, "timeline": timeline, "peak_bytes": peak,
                "bytes_sent": sum(c.bytes_sent for c in links)}  # fmt: skip
    finally:
        for c in fwd + bwd:
            c.close()


def train_pipeline_step(model: GPT, tokens, targets, *, n_stages: int = 2, micro_batches: int = 1,
                        schedule: str = "gpipe", lr: float = 1e-3, timeout: float = 60.0) -> list[dict]:  # fmt: skip
    """One training step of `model` cut into `n_stages` stages (one process each), the batch `tokens` (B, T) with
    next tokens `targets` in `micro_batches` equal micro-batches, run by `schedule` ("gpipe" or "1f1b"): the
    mean cross-entropy's gradients, then one Adam step (lr) on each stage's parameters. Returns per stage: its
    "grads" and new "state" (by the GPT's state_dict keys), "loss" (the last stage: the batch's mean), "timeline"
    [(op, micro, start, end)] of its compute on the shared clock (time.perf_counter), "peak_bytes" (the most
    activation bytes it held at once) and "bytes_sent". `model` is not changed."""
    if not isinstance(model, GPT):
        raise TypeError(f"train_pipeline_step: model expected a tfm_numpy GPT, got {type(model).__name__}")
    tokens = np.asarray(tokens)
    p, m = check_pipeline("train_pipeline_step", n_stages, micro_batches, tokens.shape[0], schedule)
    stage_layers(len(model.layers), p)  # refuses more stages than blocks
    PipelineStage(model, 0, p)  # and the other refusals, before any process starts
    n = tokens.shape[0] // m * tokens.shape[1] * model.d_model
    fwd = [Channel(n, model.param_dtype, m, timeout=timeout) for _ in range(p - 1)]  # stage s -> s + 1
    bwd = [Channel(n, model.param_dtype, m, timeout=timeout) for _ in range(p - 1)]  # stage s + 1 -> s
    try:
        args = (model, tokens, np.asarray(targets), m, schedule, fwd, bwd, lr, mp.get_context("spawn").Barrier(p))
        return run_processes(_pipeline_worker, p, args, timeout=timeout)
    finally:
        for c in fwd + bwd:
            c.close()
