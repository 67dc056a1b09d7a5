"""Splitting the model, PyTorch track: the names of `tfm_numpy.model_parallel`, on torch.distributed (gloo, the
processes on loopback). Autograd does the backward; the all-reduces enter it as two autograd functions (Megatron's
f and g): `_CopyToShards` is the identity forward and all-reduces the gradient backward, `_SumShards`
all-reduces forward and passes the gradient through backward. The pipeline sends activations and gradients with
`isend` / `recv`; a stage's activations are counted through `torch.autograd.graph.saved_tensors_hooks`.
"""

from __future__ import annotations

import copy
import datetime
import math
import pickle
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tfm_common.model_parallel import (
    check_pipeline,
    check_tensor_split,
    pipeline_schedule,
    shard,
    stage_layers,
)
from tfm_common.parallel import run_processes
from tfm_common.validate import check_size

from .attention import scaled_dot_product_attention
from .gpt import GPT, GPTBlock
from .layers import Dropout, Linear
from .loss import CrossEntropyLoss
from .masks import causal_mask
from .modern import GroupedQueryAttention, repeat_kv
from .module import Module
from .sublayers import PositionwiseFeedForward

__all__ = [
    "TensorParallelFeedForward",
    "TensorParallelAttention",
    "tensor_parallel",
    "tensor_parallel_run",
    "PipelineStage",
    "train_pipeline_step",
]


class _Counter:
    """The bytes of every tensor this process all-reduced (the payload; a ring sends 2 (W-1)/W of it)."""

    def __init__(self):
        self.payload = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y)
        self.payload += y.numel() * y.element_size()
        return y


class _SumShards(torch.autograd.Function):
    """g: forward, the sum over the processes of their partial outputs; backward, the gradient as it is."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToShards(torch.autograd.Function):
    """f: forward, the (replicated) input as it is; backward, the sum over the processes of its gradients."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad), None


def _shard_linear(lin: Linear, axis: int, rank: int, world: int) -> Linear:
    w = shard(lin.weight.detach(), axis, rank, world)
    out = Linear(w.shape[1], w.shape[0], lin.bias is not None, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if lin.bias is not None:
            out.bias.copy_(shard(lin.bias.detach(), 0 if axis == 0 else None, rank, world))
    return out


def _refuse_dropout(owner: str, module: nn.Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, Dropout) and m.p > 0:
            raise ValueError(f"{owner}: dropout expected 0 (each process would draw its own masks), got p={m.p} "
                             f"in {name or type(module).__name__}")  # fmt: skip


class TensorParallelFeedForward(Module):
    """Process `rank`'s hidden units of a PositionwiseFeedForward (as tfm_numpy's)."""

    def __init__(self, ff: PositionwiseFeedForward, rank: int, world: int, comm):
        super().__init__()
        _refuse_dropout("TensorParallelFeedForward", ff)
        check_tensor_split("TensorParallelFeedForward", world, d_ff=ff.d_ff)
        self.d_model, self.d_ff = ff.d_model, ff.d_ff // world
        self.linear1 = _shard_linear(ff.linear1, 0, rank, world)  # (d_ff/W, d): column parallel
        self.activation = copy.deepcopy(ff.activation)
        self.linear2 = _shard_linear(ff.linear2, 1, rank, world)  # (d, d_ff/W): row parallel, bias whole
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.linear1(_CopyToShards.apply(x, self.comm)))  # (..., d_ff/W)
        partial = h @ self.linear2.weight.T  # (..., d): this process's share of the sum
        return _SumShards.apply(partial, self.comm) + self.linear2.bias


class TensorParallelAttention(Module):
    """Process `rank`'s heads of a GroupedQueryAttention (as tfm_numpy's)."""

    def __init__(self, attn: GroupedQueryAttention, rank: int, world: int, comm):
        super().__init__()
        _refuse_dropout("TensorParallelAttention", attn)
        check_tensor_split("TensorParallelAttention", world, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads)
        self.d_model, self.d_head = attn.d_model, attn.d_head
        self.n_heads, self.n_kv_heads = attn.n_heads // world, attn.n_kv_heads // world
        self.q_proj = _shard_linear(attn.q_proj, 0, rank, world)
        self.k_proj = _shard_linear(attn.k_proj, 0, rank, world)
        self.v_proj = _shard_linear(attn.v_proj, 0, rank, world)
        self.out_proj = _shard_linear(attn.out_proj, 1, rank, world)
        self.rotary = attn.rotary
        self.comm = comm

    def _split(self, x: torch.Tensor, n: int) -> torch.Tensor:  # (B, T, n dh) -> (B, n, T, dh)
        B, T, _ = x.shape
        return x.reshape(B, T, n, self.d_head).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
        x = _CopyToShards.apply(x, self.comm)
        q = self._split(self.q_proj(x), self.n_heads)  # (B, H/W, T, dh): this process's heads only
        k = self._split(self.k_proj(x), self.n_kv_heads)
        v = self._split(self.v_proj(x), self.n_kv_heads)
        if self.rotary is not None:
            q, k = self.rotary.rotate(q, offset), self.rotary.rotate(k, offset)
        n_rep = self.n_heads // self.n_kv_heads
        ctx, _ = scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)  # (B, H/W, T, dh)
        ctx = ctx.transpose(1, 2).reshape(*x.shape[:-1], self.n_heads * self.d_head)
        return _SumShards.apply(ctx @ self.out_proj.weight.T, self.comm) + self.out_proj.bias


def tensor_parallel(model: nn.Module, rank: int, world: int, comm) -> nn.Module:
    """A copy of `model` (GPT, GPTBlock, GroupedQueryAttention, PositionwiseFeedForward) holding process `rank`'s
    share of every attention and feed-forward; refusals as tfm_numpy's."""
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
    out.zero_grad(set_to_none=True)
    return out


def _init_gloo(rank, world, store_path, timeout):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)  # gloo itself on loopback (GLOO_SOCKET_IFNAME=lo)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))  # fmt: skip


def _tensor_parallel_worker(rank, world, store_path, model_bytes, inputs, targets, timeout):
    _init_gloo(rank, world, store_path, timeout)
    try:
        model, comm = pickle.loads(model_bytes), _Counter()
        tp = tensor_parallel(model, rank, world, comm)
        x = torch.from_numpy(inputs)
        if isinstance(model, GPT):
            output = tp(x)
            loss = CrossEntropyLoss()(output, torch.from_numpy(targets))
            forward_bytes = comm.payload
            loss.backward()
            loss, grad_input = loss.item(), None
        else:
            x.requires_grad_(True)
            mask = None if isinstance(model, PositionwiseFeedForward) else causal_mask(x.shape[1])
            output = tp(x) if mask is None else tp(x, mask)
            forward_bytes = comm.payload
            output.backward(torch.from_numpy(targets))
            loss, grad_input = None, x.grad.numpy().copy()
        grads = {k: p.grad.numpy().copy() for k, p in tp.named_parameters()}
        return {"output": output.detach().numpy().copy(), "loss": loss, "grad_input": grad_input, "grads": grads,
                "payload_bytes": comm.payload, "forward_bytes": forward_bytes,
                "param_bytes": sum(p.numel() * p.element_size() for p in tp.parameters())}  # fmt: skip
    finally:
        dist.destroy_process_group()


def tensor_parallel_run(model: nn.Module, inputs, targets, *, world: int = 2, timeout: float = 60.0) -> list[dict]:
    """As tfm_numpy's, on gloo: `inputs`, `targets` NumPy arrays; per rank "output", "loss", "grad_input",
    "grads" (NumPy), "payload_bytes" (what it handed to all-reduce, forward and backward; gloo's ring sends
    2 (W-1)/W of it), "forward_bytes", "param_bytes"."""
    tensor_parallel(model, 0, world, None)  # refused here, before any process starts
    with tempfile.TemporaryDirectory(prefix="tfm_tp_") as tmp:
        args = (f"{tmp}/store", pickle.dumps(model), np.asarray(inputs), np.asarray(targets), timeout)
        return run_processes(_tensor_parallel_worker, world, args, timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})


# -- pipeline parallelism ------------------------------------------------------------------------------------------
class PipelineStage(Module):
    """Stage `stage` of `n_stages` of a GPT, as tfm_numpy's (a copy of its parts; tied output refused for
    n_stages > 1). forward: tokens or activations -> activations, or logits on the last stage."""

    def __init__(self, model: GPT, stage: int, n_stages: int):
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"PipelineStage: model expected a tfm_torch GPT, got {type(model).__name__}")
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
        self.layers = nn.ModuleList([m.layers[i] for i in self.layer_ids])
        if self.last:
            self.norm, self.output_projection = m.norm, m.output_projection
        self.zero_grad(set_to_none=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) * math.sqrt(self.d_model)
            if self.pos is not None:
                x = self.pos(x, 0)
        mask = causal_mask(x.shape[1])
        for layer in self.layers:
            x = layer(x, mask)
        return self.output_projection(self.norm(x)) if self.last else x

    def global_key(self, key: str) -> str:
        if key.startswith("layers."):
            i, rest = key[len("layers.") :].split(".", 1)
            return f"layers.{self.layer_ids[int(i)]}.{rest}"
        return key


class _SavedBytes:
    """saved_tensors_hooks that add up the distinct storages autograd keeps for backward (parameters excluded)."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


def _pipeline_worker(rank, world, store_path, model_bytes, tokens, targets, m, schedule, lr, timeout):
    _init_gloo(rank, world, store_path, timeout)
    try:
        stage = PipelineStage(pickle.loads(model_bytes), rank, world)
        ops = pipeline_schedule(world, m, schedule)[rank]
        xs, ys = torch.from_numpy(tokens).chunk(m), torch.from_numpy(targets).chunk(m)
        dtype = next(stage.parameters()).dtype
        shape = (*xs[0].shape, stage.d_model)
        kept, timeline, pending, losses, sizes = {}, [], [], [], {}
        held = peak = sent = 0
        with torch.no_grad():  # warm-up, untimed and kept nowhere
            stage(xs[0] if stage.first else torch.zeros(shape, dtype=dtype))
        dist.barrier()  # every stage built and warm: the clock starts together (not with the processes' start-up)
        for op, i in ops:
            if op == "F":
                if stage.first:
                    x = xs[i]
                else:
                    x = torch.empty(shape, dtype=dtype)
                    dist.recv(x, rank - 1)
                    x.requires_grad_(True)
                t = time.perf_counter()
                hooks = _SavedBytes(stage.parameters())
                with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                    y = stage(x)
                    if stage.last:
                        y = CrossEntropyLoss()(y, ys[i]) / m  # micro-batch i's share of the batch's mean loss
                        losses.append(y.item())
                kept[i] = (x, y)
                timeline.append(("F", i, t, time.perf_counter()))
                sizes[i] = sum(hooks.seen.values())
                held += sizes[i]
                peak = max(peak, held)
                if not stage.last:
                    pending.append(dist.isend(y.detach().contiguous(), rank + 1))
                    sent += y.numel() * y.element_size()
            else:
                g = None
                if not stage.last:
                    g = torch.empty(shape, dtype=dtype)
                    dist.recv(g, rank + 1)
                t = time.perf_counter()
                x, y = kept.pop(i)
                y.backward(g)
                held -= sizes.pop(i)
                timeline.append(("B", i, t, time.perf_counter()))
                if not stage.first:
                    pending.append(dist.isend(x.grad, rank - 1))
                    sent += x.grad.numel() * x.grad.element_size()
        for req in pending:
            req.wait()
        grads = {stage.global_key(k): p.grad.numpy().copy() for k, p in stage.named_parameters()}
        torch.optim.Adam(stage.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9).step()
        state = {stage.global_key(k): v.detach().numpy().copy() for k, v in stage.state_dict().items()}
        return {"grads": grads, "state": state, "loss": sum(losses) if stage.last else None, "timeline": timeline,
                "peak_bytes": peak, "bytes_sent": sent}  # fmt: skip
    finally:
        dist.destroy_process_group()


def train_pipeline_step(model: GPT, tokens, targets, *, n_stages: int = 2, micro_batches: int = 1,
                        schedule: str = "gpipe", lr: float = 1e-3, timeout: float = 60.0) -> list[dict]:  # fmt: skip
    """As tfm_numpy's, on gloo (point-to-point isend/recv); "peak_bytes" from the tensors autograd saved."""
    if not isinstance(model, GPT):
        raise TypeError(f"train_pipeline_step: model expected a tfm_torch GPT, got {type(model).__name__}")
    tokens = np.asarray(tokens)
    p, _ = check_pipeline("train_pipeline_step", n_stages, micro_batches, tokens.shape[0], schedule)
    stage_layers(len(model.layers), p)
    PipelineStage(model, 0, p)  # refusals here, before any process starts
    with tempfile.TemporaryDirectory(prefix="tfm_pp_") as tmp:
        args = (f"{tmp}/store", pickle.dumps(model), tokens, np.asarray(targets), micro_batches, schedule, lr, timeout)
        return run_processes(_pipeline_worker, p, args, timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})
