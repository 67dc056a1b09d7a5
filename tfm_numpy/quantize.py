"""Weight-only quantization (chapter 21a), NumPy track: integer codes and scales, a Linear layer that computes with
them, and the whole model quantized in one call.

`quantize(w, bits, axis=..., group_size=...)` returns int8 codes and the scales they share (the layout and the
rules: `tfm_common.quantize`); `dequantize` undoes it up to half a step per number. `QuantizedLinear` keeps codes and
scales instead of a float weight and multiplies by the dequantized weight: the activations stay float (weight-only
quantization, as in serving a model on a CPU or a memory-bound GPU, where what costs is reading the weights).
Inference only: its backward refuses.
"""

from __future__ import annotations

import copy

import numpy as np

from tfm_common.quantize import check_quantize_args, group_shapes, layer_group_size, packed_bytes, q_max, reduce_axis
from tfm_common.validate import check_flag, check_sizes

from .layers import Embedding, Linear
from .module import FLOAT_DTYPES, Module, Parameter, check_dtype, check_indices, check_input

__all__ = ["quantize", "dequantize", "QuantizedLinear", "QuantizedEmbedding", "quantize_linears", "model_bytes"]


def _check_quantize(w, bits, axis, group_size, owner: str = "quantize"):
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{owner}: w expected a numpy.ndarray, got {type(w).__name__}")
    if w.dtype.type not in FLOAT_DTYPES:
        raise TypeError(f"{owner}: w expected a float32 or float64 array, got dtype {w.dtype}")
    if not np.isfinite(w).all():
        raise ValueError(f"{owner}: w must be finite (a NaN or inf has no scale), got {int((~np.isfinite(w)).sum())} "
                         "non-finite values")  # fmt: skip
    return check_quantize_args(owner, w.shape, bits, axis, group_size)


def _check_dequantize(codes, scales, axis, group_size):
    owner = "dequantize"
    if not isinstance(codes, np.ndarray) or codes.dtype != np.int8:
        got = codes.dtype if isinstance(codes, np.ndarray) else type(codes).__name__
        raise TypeError(f"{owner}: codes expected a numpy.ndarray of dtype int8, got {got}")
    if not isinstance(scales, np.ndarray) or scales.dtype.type not in FLOAT_DTYPES:
        got = scales.dtype if isinstance(scales, np.ndarray) else type(scales).__name__
        raise TypeError(f"{owner}: scales expected a float32 or float64 numpy.ndarray, got {got}")
    axis, group = check_quantize_args(owner, codes.shape, 8, axis, group_size)
    want = group_shapes(codes.shape, axis, group)[2]
    if scales.shape != want:
        raise ValueError(f"{owner}: scales expected shape {want} for codes {codes.shape}, axis={axis}, "
                         f"group_size={group_size}, got {scales.shape}")  # fmt: skip
    return axis, group


def quantize(w: np.ndarray, bits: int, *, axis: int | None, group_size: int | None = None):
    """(codes, scales): codes int8 in [-q_max, q_max] of w's shape, scales of w's dtype, one per group
    (`tfm_common.quantize` says which numbers form a group); w ~ dequantize(codes, scales, ...)."""
    axis, group = _check_quantize(w, bits, axis, group_size)
    grouped, _, scales_shape = group_shapes(w.shape, axis, group)
    wg = w.reshape(grouped)  # each group along its own axis
    scales = np.abs(wg).max(axis=reduce_axis(axis), keepdims=True) / q_max(bits)  # one step per group
    codes = np.round(wg / np.where(scales > 0, scales, 1))  # an all-zero group: codes 0, scale 0
    return np.clip(codes, -q_max(bits), q_max(bits)).astype(np.int8).reshape(w.shape), scales.reshape(scales_shape)


def dequantize(codes: np.ndarray, scales: np.ndarray, *, axis: int | None, group_size: int | None = None):
    """codes * scales, each code times the scale of its group: an array of codes' shape and the scales' dtype."""
    axis, group = _check_dequantize(codes, scales, axis, group_size)
    grouped, scale_grouped, _ = group_shapes(codes.shape, axis, group)
    return (codes.reshape(grouped) * scales.reshape(scale_grouped)).reshape(codes.shape)


class Codes(Parameter):
    """A Parameter holding integer codes: they stay int8 when a model changes its float dtype (`astype` converts
    every parameter; torch's `double()` leaves integer tensors alone too), and they have no gradient."""

    __slots__ = ()

    @property
    def data(self) -> np.ndarray:
        return Parameter.data.__get__(self)

    @data.setter
    def data(self, value) -> None:
        Parameter.data.__set__(self, np.asarray(value).astype(np.int8, copy=False))


class _QuantizedTable(Module):
    """codes (rows, cols) int8 and scales, quantized along the columns (axis 1): per channel, per group, or per
    tensor. Inference only: a backward raises."""

    def _init_table(self, rows: int, cols: int, bits: int, group_size, per_tensor: bool, dtype) -> None:
        owner = type(self).__name__
        check_flag(owner, "per_tensor", per_tensor)
        axis, group = check_quantize_args(owner, (rows, cols), bits, None if per_tensor else 1,
                                          group_size)  # fmt: skip
        self.bits, self.group_size, self.per_tensor, self.axis = bits, group_size, per_tensor, axis
        self.codes = Codes(np.zeros((rows, cols), dtype=np.int8))
        self.scales = Parameter(np.zeros(group_shapes((rows, cols), axis, group)[2], dtype=check_dtype(dtype)))

    def _set_codes(self, weight: np.ndarray) -> None:
        self.codes.data, self.scales.data = quantize(weight, self.bits, axis=self.axis, group_size=self.group_size)

    def weight(self) -> np.ndarray:
        """The dequantized weight (rows, cols), in the scales' dtype."""
        return dequantize(self.codes.data, self.scales.data, axis=self.axis, group_size=self.group_size)

    def backward(self, grad_out):
        raise RuntimeError(f"{type(self).__name__} is inference only (weight-only quantization): no backward; "
                           "train the float model and quantize it afterwards")  # fmt: skip

    def _scheme(self) -> str:
        where = "per_tensor=True" if self.per_tensor else f"group_size={self.group_size}"
        return f"bits={self.bits}, {where}"


class QuantizedLinear(_QuantizedTable):
    """y = x W^T + b with W = dequantize(codes, scales): Linear's function, its weight stored as `bits`-bit codes
    (int8 in memory, one per byte) and one scale per output channel (group_size None), per run of group_size
    inputs, or for the whole matrix (per_tensor). state_dict keys: codes, scales, bias."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None = None,
                 bias: bool = True, *, per_tensor: bool = False, dtype=np.float32):  # fmt: skip
        super().__init__()
        sizes = check_sizes("QuantizedLinear", in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features = sizes.values()
        self._init_table(out_features, in_features, bits, group_size, per_tensor, dtype)
        self.bias = Parameter(np.zeros(out_features, dtype=self.scales.dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: Linear, bits: int, group_size: int | None = None, *, per_tensor: bool = False):
        """A QuantizedLinear computing `linear`'s function with its weight quantized (the bias kept as it is)."""
        q = cls(linear.in_features, linear.out_features, bits, group_size, linear.bias is not None,
                per_tensor=per_tensor, dtype=linear.weight.dtype)  # fmt: skip
        q._set_codes(linear.weight.data)
        if linear.bias is not None:
            q.bias.data = linear.bias.data.copy()
        return q

    def _check_forward(self, x) -> None:
        check_input("QuantizedLinear", x, last_dim=self.in_features, dtype=self.scales.dtype)

    def forward(self, x: np.ndarray) -> np.ndarray:
        w = dequantize(self.codes.data, self.scales.data, axis=self.axis, group_size=self.group_size)  # (out, in)
        y = x.reshape(-1, self.in_features) @ w.T  # (N, out): the activations stay float
        if self.bias is not None:
            y += self.bias.data
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self._scheme()}"


class QuantizedEmbedding(_QuantizedTable):
    """An Embedding whose table (num_embeddings, embedding_dim) is stored as codes and scales (quantized along the
    embedding dimension: per token row, per group of it, or per tensor); a lookup reads dequantized rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int | None = None, *,
                 per_tensor: bool = False, dtype=np.float32):  # fmt: skip
        super().__init__()
        sizes = check_sizes("QuantizedEmbedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim = sizes.values()
        self._init_table(num_embeddings, embedding_dim, bits, group_size, per_tensor, dtype)

    @classmethod
    def from_embedding(cls, embedding: Embedding, bits: int, group_size: int | None = None, *,
                       per_tensor: bool = False):  # fmt: skip
        q = cls(embedding.num_embeddings, embedding.embedding_dim, bits, group_size, per_tensor=per_tensor,
                dtype=embedding.weight.dtype)  # fmt: skip
        q._set_codes(embedding.weight.data)
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

    def forward(self, ids: np.ndarray) -> np.ndarray:
        return self.weight()[ids]  # (*ids.shape, D)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, {self._scheme()}"


def _replace(parent: Module, name: str, new: Module) -> None:
    """parent.<name> = new, keeping the submodules' order (and so the state_dict's)."""
    items = [(k, new if k == name else v) for k, v in parent._modules.items()]
    setattr(parent, name, new)
    parent._modules.clear()
    parent._modules.update(items)


def _submodule(model: Module, path: str) -> tuple[Module, str]:
    *parents, name = path.split(".")
    parent = model
    for p in parents:
        parent = parent._modules[p]
    return parent, name


def quantize_linears(model: Module, bits: int, group_size: int | None = None, *,
                     prefixes: tuple[str, ...] | None = None, per_tensor: bool = False) -> Module:  # fmt: skip
    """A copy of `model` with its Linear layers (all, or those whose name starts with one of `prefixes`) replaced
    by QuantizedLinear; `model` itself is unchanged. A layer with fewer inputs than group_size is quantized per
    channel (`tfm_common.quantize.layer_group_size`). A Linear whose weight is an Embedding's (a tied output
    projection) takes the embedding with it: one set of codes, read by both (a QuantizedEmbedding)."""
    linears = _selected_linears(model, prefixes)
    for _, lin in linears:  # every layer's arguments before anything is built
        check_quantize_args("quantize_linears", lin.weight.shape, bits, None if per_tensor else 1,
                            layer_group_size(group_size, lin.in_features))  # fmt: skip
    new = copy.deepcopy(model)
    embeddings = [(n, m) for n, m in new.named_modules() if isinstance(m, Embedding)]
    for name, _ in linears:
        lin = getattr(*_submodule(new, name))
        q = QuantizedLinear.from_linear(lin, bits, layer_group_size(group_size, lin.in_features), per_tensor=per_tensor)
        _replace(*_submodule(new, name), q)
        for ename, emb in embeddings:
            if emb.weight is lin.weight:
                _replace(*_submodule(new, ename), QuantizedEmbedding.tied_to(q))
    return new


def _selected_linears(model: Module, prefixes) -> list[tuple[str, Linear]]:
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


def model_bytes(model: Module) -> int:
    """Bytes of the model's unique parameters stored at their bit widths: codes at `bits` bits (two int4 codes a
    byte), everything else (scales, biases, norms, float weights) at its dtype's size."""
    bits = {id(m.codes): m.bits for _, m in model.named_modules() if isinstance(m, _QuantizedTable)}
    return packed_bytes((p.data.size, bits.get(id(p), 8 * p.data.itemsize)) for p in model.parameters())
