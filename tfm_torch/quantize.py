"""Weight-only quantization (chapter 21a), PyTorch twin of tfm_numpy.quantize: the same functions and layers, the
same codes and scales (bit for bit: the same IEEE divisions and round-half-to-even), on tensors.

Codes and scales are `nn.Parameter`s with requires_grad=False, as in tfm_numpy (where a module holds Parameters
only): the same names in `named_parameters()` and `state_dict()` in both tracks, and `model.double()` leaves the
int8 codes alone. Inference only: a backward through a quantized layer raises.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tfm_common.quantize import check_quantize_args, group_shapes, layer_group_size, packed_bytes, q_max, reduce_axis
from tfm_common.validate import check_flag, check_sizes

from .layers import Embedding, Linear
from .module import Module, check_dtype, check_indices, check_input

__all__ = ["quantize", "dequantize", "QuantizedLinear", "QuantizedEmbedding", "quantize_linears", "model_bytes"]

_FLOATS = (torch.float32, torch.float64)


def _check_quantize(w, bits, axis, group_size, owner: str = "quantize"):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{owner}: w expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _FLOATS:
        raise TypeError(f"{owner}: w expected a float32 or float64 tensor, got dtype {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{owner}: w must be finite (a NaN or inf has no scale), got "
                         f"{int((~torch.isfinite(w)).sum())} non-finite values")  # fmt: skip
    return check_quantize_args(owner, tuple(w.shape), bits, axis, group_size)


def _check_dequantize(codes, scales, axis, group_size):
    owner = "dequantize"
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"{owner}: codes expected a torch.Tensor of dtype int8, got {got}")
    if not isinstance(scales, torch.Tensor) or scales.dtype not in _FLOATS:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"{owner}: scales expected a float32 or float64 torch.Tensor, got {got}")
    axis, group = check_quantize_args(owner, tuple(codes.shape), 8, axis, group_size)
    want = group_shapes(tuple(codes.shape), axis, group)[2]
    if tuple(scales.shape) != want:
        raise ValueError(f"{owner}: scales expected shape {want} for codes {tuple(codes.shape)}, axis={axis}, "
                         f"group_size={group_size}, got {tuple(scales.shape)}")  # fmt: skip
    return axis, group


@torch.no_grad()
def quantize(w: torch.Tensor, bits: int, *, axis: int | None, group_size: int | None = None):
    """(codes, scales): codes int8 in [-q_max, q_max] of w's shape, scales of w's dtype, one per group; as
    tfm_numpy.quantize, on tensors (outside autograd)."""
    axis, group = _check_quantize(w, bits, axis, group_size)
    grouped, _, scales_shape = group_shapes(tuple(w.shape), axis, group)
    wg = w.reshape(grouped)  # each group along its own axis
    scales = wg.abs().amax(dim=reduce_axis(axis), keepdim=True) / q_max(bits)  # one step per group
    codes = torch.round(wg / torch.where(scales > 0, scales, torch.ones_like(scales)))  # all-zero group: 0, 0
    return codes.clamp(-q_max(bits), q_max(bits)).to(torch.int8).reshape(w.shape), scales.reshape(scales_shape)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, axis: int | None, group_size: int | None = None):
    """codes * scales, each code times the scale of its group: a tensor of codes' shape and the scales' dtype."""
    axis, group = _check_dequantize(codes, scales, axis, group_size)
    grouped, scale_grouped, _ = group_shapes(tuple(codes.shape), axis, group)
    return (codes.reshape(grouped) * scales.reshape(scale_grouped)).reshape(codes.shape)


class _InferenceOnly(torch.autograd.Function):
    """The identity, whose backward refuses: what a quantized layer's output goes through."""

    @staticmethod
    def forward(ctx, y, owner: str):
        ctx.owner = owner
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"{ctx.owner} is inference only (weight-only quantization): no backward; train the float "
                           "model and quantize it afterwards")  # fmt: skip


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _QuantizedTable(Module):
    """codes (rows, cols) int8 and scales, quantized along the columns (axis 1): per channel, per group, or per
    tensor. Inference only: a backward raises."""

    def _init_table(self, rows: int, cols: int, bits: int, group_size, per_tensor: bool, dtype) -> None:
        owner = type(self).__name__
        check_flag(owner, "per_tensor", per_tensor)
        axis, group = check_quantize_args(owner, (rows, cols), bits, None if per_tensor else 1,
                                          group_size)  # fmt: skip
        self.bits, self.group_size, self.per_tensor, self.axis = bits, group_size, per_tensor, axis
        self.codes = _frozen(torch.zeros(rows, cols, dtype=torch.int8))
        self.scales = _frozen(torch.zeros(group_shapes((rows, cols), axis, group)[2], dtype=check_dtype(dtype)))

    @torch.no_grad()
    def _set_codes(self, weight: torch.Tensor) -> None:
        codes, scales = quantize(weight.detach(), self.bits, axis=self.axis, group_size=self.group_size)
        self.codes.copy_(codes)
        self.scales.copy_(scales)

    def weight(self) -> torch.Tensor:
        """The dequantized weight (rows, cols), in the scales' dtype."""
        return dequantize(self.codes, self.scales, axis=self.axis, group_size=self.group_size)

    def _scheme(self) -> str:
        where = "per_tensor=True" if self.per_tensor else f"group_size={self.group_size}"
        return f"bits={self.bits}, {where}"


class QuantizedLinear(_QuantizedTable):
    """y = x W^T + b with W = dequantize(codes, scales), as tfm_numpy.QuantizedLinear. state_dict keys: codes,
    scales, bias."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None = None,
                 bias: bool = True, *, per_tensor: bool = False, dtype=None):  # fmt: skip
        super().__init__()
        sizes = check_sizes("QuantizedLinear", in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features = sizes.values()
        self._init_table(out_features, in_features, bits, group_size, per_tensor, dtype)
        self.bias = _frozen(torch.zeros(out_features, dtype=self.scales.dtype)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: Linear, bits: int, group_size: int | None = None, *, per_tensor: bool = False):
        """A QuantizedLinear computing `linear`'s function with its weight quantized (the bias kept as it is)."""
        q = cls(linear.in_features, linear.out_features, bits, group_size, linear.bias is not None,
                per_tensor=per_tensor, dtype=linear.weight.dtype)  # fmt: skip
        q._set_codes(linear.weight)
        if linear.bias is not None:
            q.bias.copy_(linear.bias)
        return q

    def _check_forward(self, x) -> None:
        check_input("QuantizedLinear", x, last_dim=self.in_features, dtype=self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.codes, self.scales, axis=self.axis, group_size=self.group_size)  # (out, in)
        return _InferenceOnly.apply(F.linear(x, w, self.bias), "QuantizedLinear")  # activations stay float

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._scheme()}"


class QuantizedEmbedding(_QuantizedTable):
    """An Embedding whose table is stored as codes and scales, as tfm_numpy.QuantizedEmbedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int | None = None, *,
                 per_tensor: bool = False, dtype=None):  # fmt: skip
        super().__init__()
        sizes = check_sizes("QuantizedEmbedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim = sizes.values()
        self._init_table(num_embeddings, embedding_dim, bits, group_size, per_tensor, dtype)

    @classmethod
    def from_embedding(cls, embedding: Embedding, bits: int, group_size: int | None = None, *,
                       per_tensor: bool = False):  # fmt: skip
        q = cls(embedding.num_embeddings, embedding.embedding_dim, bits, group_size, per_tensor=per_tensor,
                dtype=embedding.weight.dtype)  # fmt: skip
        q._set_codes(embedding.weight)
        return q

    @classmethod
    def tied_to(cls, linear: QuantizedLinear) -> QuantizedEmbedding:
        """The embedding of a tied output projection: the same codes and scales (one Parameter each, two names)."""
        q = cls(linear.out_features, linear.in_features, linear.bits, linear.group_size, per_tensor=linear.per_tensor,
                dtype=linear.scales.dtype)  # fmt: skip
        q.codes, q.scales = linear.codes, linear.scales
        return q

    def _check_forward(self, ids) -> None:
        check_indices("QuantizedEmbedding: ids", ids, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight()[ids]  # (*ids.shape, D): no gradient reaches the frozen codes

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, {self._scheme()}"


def _submodule(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


def quantize_linears(model: nn.Module, bits: int, group_size: int | None = None, *,
                     prefixes: tuple[str, ...] | None = None, per_tensor: bool = False) -> nn.Module:  # fmt: skip
    """A copy of `model` with its Linear layers (all, or those whose name starts with one of `prefixes`) replaced
    by QuantizedLinear, as tfm_numpy.quantize_linears; `model` itself is unchanged."""
    linears = _selected_linears(model, prefixes)
    for _, lin in linears:  # every layer's arguments before anything is built
        check_quantize_args("quantize_linears", tuple(lin.weight.shape), bits, None if per_tensor else 1,
                            layer_group_size(group_size, lin.in_features))  # fmt: skip
    new = copy.deepcopy(model)
    embeddings = [(n, m) for n, m in new.named_modules() if isinstance(m, Embedding)]
    for name, _ in linears:
        lin = new.get_submodule(name)
        q = QuantizedLinear.from_linear(lin, bits, layer_group_size(group_size, lin.in_features), per_tensor=per_tensor)
        setattr(*_submodule(new, name), q)  # torch keeps the submodule's place (and the state_dict's order)
        for ename, emb in embeddings:
            if emb.weight is lin.weight:
                setattr(*_submodule(new, ename), QuantizedEmbedding.tied_to(q))
    return new


def _selected_linears(model: nn.Module, prefixes) -> list[tuple[str, Linear]]:
    if prefixes is not None and (isinstance(prefixes, str) or not all(isinstance(p, str) for p in prefixes)):
        raise TypeError(f"quantize_linears: prefixes expected a tuple of str or None, got {prefixes!r}")
    linears = [(n, m) for n, m in model.named_modules() if type(m) is Linear]
    if prefixes is None:
        return linears
    for p in prefixes:
        if not any(n.startswith(p) for n, _ in linears):
            names = [n for n, _ in linears]
            raise ValueError(f"quantize_linears: prefix {p!r} names no Linear layer of the model ({names})")
    return [(n, m) for n, m in linears if n.startswith(tuple(prefixes))]


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's unique parameters stored at their bit widths, as tfm_numpy.model_bytes."""
    bits = {id(m.codes): m.bits for m in model.modules() if isinstance(m, _QuantizedTable)}
    return packed_bytes((p.numel(), bits.get(id(p), 8 * p.element_size())) for p in model.parameters())
