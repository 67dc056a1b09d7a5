"""Helpers shared by the torch track: explicit generators and input checks.

The torch twin of `tfm_numpy.module`: modules here derive from `Module` below, a `torch.nn.Module` whose
`load_state_dict` is all or nothing and whose `num_parameters` counts a tied weight once; the rest of the contract
(named_parameters, state_dict, train/eval, zero_grad) is torch's own.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from tfm_common.npz_checkpoint import DTYPES as DTYPE_NAMES  # the names both tracks accept for dtype
from tfm_common.npz_checkpoint import check_ties, tied_groups_of
from tfm_common.validate import check_probability as check_probability  # re-exported: the layers' import
from tfm_common.validate import check_seed


def as_generator(rng: torch.Generator | int | None) -> torch.Generator:
    """A `torch.Generator` from a generator, a seed, or None (seed 0: never hidden global state)."""
    if isinstance(rng, torch.Generator):
        return rng
    return torch.Generator().manual_seed(0 if rng is None else check_seed("rng", rng))


def check_dtype(dtype) -> torch.dtype:
    """torch.float32 or torch.float64, or the name "float32" / "float64": one rule with tfm_numpy (which takes NumPy
    dtypes and the same two names); None is torch's default dtype."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        dtype = getattr(torch, dtype)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64 (or their names {DTYPE_NAMES}), got {dtype!r}")
    return dtype


# -- initializers shared by the models' constructors (tfm_common's doors build with them) ----------------------------
def normal_parameter(shape: tuple[int, ...], std: float, rng: torch.Generator, dtype) -> torch.nn.Parameter:
    """A Parameter drawn N(0, std^2) from `rng`, in `dtype` (a class token, a bias table; as tfm_numpy's)."""
    return torch.nn.Parameter(std * torch.randn(*shape, generator=rng, dtype=dtype))


@torch.no_grad()
def scale_(p: torch.Tensor, factor: float) -> torch.Tensor:
    """In place, outside autograd: p times `factor` (an initialization rescaled, as tfm_numpy's)."""
    return p.mul_(factor)


def autocast_dtype(x: torch.Tensor) -> bool:
    """x is bfloat16/float16 inside an enabled torch.autocast region of its device."""
    return x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type)


def check_input(name: str, x, ndim_min: int = 1, last_dim: int | None = None, dtype=None) -> torch.Tensor:
    """Validate a floating input at a public boundary; the message names the layer and what was expected."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not autocast_dtype(x):  # under torch.autocast, activations come in its dtype while parameters stay float32
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name}: expected a float32 or float64 tensor, got dtype {x.dtype}")
        if dtype is not None and x.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (the parameters' dtype), got {x.dtype}")
    if x.dim() < ndim_min:
        raise ValueError(f"{name}: expected at least {ndim_min} dimension(s), got shape {tuple(x.shape)}")
    if last_dim is not None and x.shape[-1] != last_dim:
        raise ValueError(f"{name}: expected last dimension {last_dim}, got shape {tuple(x.shape)}")
    return x


def check_indices(name: str, x, high: int, ignore: int | None = None) -> torch.Tensor:
    """Validate integer indices (token ids, class targets): an integer tensor with values in [0, high).

    `ignore`, if given, is one more allowed value (a loss's `ignore_index`). Returns the ids as int32 or int64
    (other integer dtypes converted to int64): callers index with what this returns.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of integers, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
    if x.dtype not in (torch.int32, torch.int64):  # uint8, int8, int16, ...: accepted as NumPy accepts them,
        x = x.long()  # as the int64 that torch's indexing ops want
    bad = (x < 0) | (x >= high)
    if ignore is not None:
        bad &= x != ignore
    allowed = f"[0, {high})" + (f" or {ignore}" if ignore is not None else "")
    if torch.compiler.is_compiling():
        # Under torch.compile, `if bad.any()` would branch on a tensor's value: the graph would break here (and on a
        # GPU the CPU would wait for the answer). The same check goes into the graph instead, evaluated where the
        # tensor lives; it raises a RuntimeError with this message (without the offending value) when it fails.
        torch._assert_async(~bad.any(), f"{name}: values must be in {allowed}")
        return x
    if bad.any():
        raise ValueError(f"{name}: values must be in {allowed}, got {x[bad][0].item()} (and {int(bad.sum()) - 1} more)")
    return x


def same_tensor_values(a, b) -> bool:
    """Tensors of one shape and equal values, NaN equal to NaN (two names of one tied weight that went NaN hold one
    value); anything else passes here and is refused by torch's own loading."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)):
        return True
    b = b.to(a.device)
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


# -- the door: a call from outside the library is checked once, as in tfm_numpy (see its module.py) ------------------
# Under torch.compile the checks are traced at every level (dynamo inlines the body; the shape checks become guards).
_ENTRY_POINTS = ("forward", "encode", "decode", "decode_step", "forward_step")
_CALLS = threading.local()  # .depth: how many entry points are running (0: the next call comes from the caller)


def at_the_door() -> bool:
    """Whether no Module entry point is running (or torch.compile traces: it checks at every level), as tfm_numpy's:
    a public function (say `attention_weights`) checks its arguments there; inside a module, its door has."""
    return torch.compiler.is_compiling() or getattr(_CALLS, "depth", 0) == 0


def _at_the_door(method):
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        check = getattr(self, f"_check_{name}", None)
        if check is not None and at_the_door():
            check(*args, **kwargs)
        if torch.compiler.is_compiling():
            return method(self, *args, **kwargs)
        depth = getattr(_CALLS, "depth", 0)
        _CALLS.depth = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _CALLS.depth = depth

    wrapper._at_boundary = True
    return wrapper


class Module(torch.nn.Module):
    """torch.nn.Module whose `load_state_dict` is all or nothing, as tfm_numpy's: keys (strict) and shapes are
    checked before any parameter changes (torch's own copies every matching entry first, then raises), with the
    same errors as tfm_numpy (KeyError for keys, ValueError for a shape), and NumPy arrays are taken as tensors
    (tfm_numpy takes tensors), so one state_dict loads into either track. Every module of this track derives from
    it; torch calls the override of the module it loads into, and walks the children itself. Its forwards (and
    `encode`, `decode`, ...) run `_check_forward` (`_check_decode`, ...) at the outermost call only, as tfm_numpy's.

    `state_dict()` is torch's own and returns the live tensors (detached, sharing the parameters' storage): after
    `best = model.state_dict()`, every optimizer step changes `best` too. Keep a best state as a copy:
    `best = {k: v.clone() for k, v in model.state_dict().items()}` (or `copy.deepcopy(model)`). tfm_numpy's
    `state_dict()` returns copies; each track keeps its library's semantics. `load_state_dict` also refuses two names
    of one tied parameter holding different values (torch's own would let the last one win silently).
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in _ENTRY_POINTS:
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "_at_boundary", False):
                setattr(cls, name, _at_the_door(method))

    def num_parameters(self) -> int:
        """Unique parameters (a tied one counted once), as tfm_numpy's Module.num_parameters."""
        return sum(p.numel() for p in self.parameters())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = self.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        state = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state_dict.items()}
        for name, value in state.items():  # every shape before anything is copied
            if name in own and tuple(getattr(value, "shape", ())) != tuple(own[name].shape):
                got = tuple(value.shape) if hasattr(value, "shape") else type(value).__name__
                raise ValueError(f"load_state_dict: '{name}' expected shape {tuple(own[name].shape)}, got {got}")
        groups = tied_groups_of(self.named_parameters(remove_duplicate=False))  # torch would let the last name win
        check_ties(groups, state, same_tensor_values, "load_state_dict", what="state_dict")
        return super().load_state_dict(state, strict=strict, assign=assign)
