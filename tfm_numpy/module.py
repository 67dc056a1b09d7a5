"""The NumPy module contract: parameters with gradients, submodules, state dicts.

A `Module` caches in `forward` what `backward` needs; `backward(grad_out)` returns the
gradient with respect to the inputs and *adds* parameter gradients into `Parameter.grad`.
Parameter names and their order follow `torch.nn.Module`, so the torch twin's
`named_parameters()` / `state_dict()` keys are identical.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator

import numpy as np

from tfm_common.npz_checkpoint import DTYPES as DTYPE_NAMES  # the names both tracks accept for dtype
from tfm_common.npz_checkpoint import check_ties, same_values, tied_groups_of
from tfm_common.validate import check_probability as check_probability  # re-exported: the layers' import
from tfm_common.validate import check_seed

FLOAT_DTYPES = (np.float32, np.float64)


class Parameter:
    """An array and the gradient accumulated into it (same shape, same dtype)."""

    __slots__ = ("data", "grad")

    def __init__(self, data: np.ndarray):
        self.data = np.asarray(data)
        self.grad = np.zeros_like(self.data)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def zero_grad(self) -> None:
        """Set the gradient to zero, in place; a `.grad` set to None (torch's "no gradient") becomes zeros again."""
        if self.grad is None:
            self.grad = np.zeros_like(self.data)
        else:
            self.grad[...] = 0

    def __repr__(self) -> str:
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


def as_rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    """A `numpy.random.Generator` from a generator, a seed, or None (seed 0: never hidden global state)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(0 if rng is None else check_seed("rng", rng))


def check_dtype(dtype) -> np.dtype:
    """float32 or float64: a NumPy dtype (or type), or its name "float32" / "float64". One rule with tfm_torch, which
    takes its own torch dtypes and the same two names: any other string (say "f8" or "double") is refused in both."""
    expected = f"float32 or float64 (numpy.float32, numpy.float64 or their names {DTYPE_NAMES})"
    if isinstance(dtype, str) and dtype not in DTYPE_NAMES:
        raise TypeError(f"dtype: expected {expected}, got {dtype!r}")
    try:
        dt = np.dtype(dtype)
    except TypeError:  # e.g. torch.float64: numpy's own message would not say what is expected
        raise TypeError(f"dtype: expected {expected}, got {dtype!r:.80} of type {type(dtype).__name__}") from None
    if dt.type not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32 or float64, got {dt}")
    return dt


# -- initializers shared by the models' constructors (tfm_common's doors build with them) ----------------------------
def normal_parameter(shape: tuple[int, ...], std: float, rng: np.random.Generator, dtype) -> Parameter:
    """A Parameter drawn N(0, std^2) from `rng`: in float64, stored in `dtype` (a class token, a bias table)."""
    return Parameter((std * rng.standard_normal(shape)).astype(dtype))


def scale_(p: Parameter, factor: float) -> Parameter:
    """In place: p times `factor`, a scalar of p's dtype (an initialization rescaled, as torch's `p.mul_`)."""
    p.data *= p.data.dtype.type(factor)
    return p


# -- the door: what a forward keeps, what a call from outside is checked for (see `Module`) ---------------------------
# Only the outermost call comes from a caller outside the library: there the caller's arrays are copied (NumPy has no
# version counter: an array changed in place between forward and backward would silently corrupt the gradients;
# torch refuses that, we copy) and `_check_<method>` runs; inner calls trust their caller, so a printed `forward`
# holds the chapter's math, not its guard rails. `_BACKWARDS`: each backward and the forward whose output it takes.
_ENTRY_POINTS = ("forward", "encode", "decode", "decode_step", "forward_step")
_BACKWARDS = {"backward": "forward", "decode_backward": "decode", "encode_backward": "encode"}
_CALLS = threading.local()  # .depth: how many entry points are running (0: the next call comes from the caller)


def _depth() -> int:
    return getattr(_CALLS, "depth", 0)


@contextlib.contextmanager
def inner_calls():
    """The calls made in this block are inner calls, as a model's calls to its layers: past the door (their arrays
    are not copied, their arguments not checked). For a layer that calls its forward again on inputs that passed
    the door once (`Recompute`)."""
    depth = _depth()
    _CALLS.depth = depth + 1
    try:
        yield
    finally:
        _CALLS.depth = depth


def at_the_door() -> bool:
    """Whether no Module entry point is running: the caller is outside the library, so a public function (say
    `attention_weights`) checks its arguments; inside a module's forward, that module's door has checked them."""
    return _depth() == 0


def _at_the_door(method, kept: tuple[str, ...] | None):
    name, names = method.__name__, list(inspect.signature(method).parameters)[1:]  # without self

    def copied(arg: str, value):
        keep = kept is None or arg in kept
        return np.array(value, copy=True) if keep and isinstance(value, np.ndarray) else value

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        depth = _depth()
        if depth == 0:
            args = tuple(copied(names[i] if i < len(names) else "", a) for i, a in enumerate(args))
            kwargs = {k: copied(k, v) for k, v in kwargs.items()}
            check = getattr(self, f"_check_{name}", None)
            if check is not None:
                check(*args, **kwargs)
        _CALLS.depth = depth + 1
        try:
            out = method(self, *args, **kwargs)
        finally:
            _CALLS.depth = depth
        if isinstance(out, np.ndarray):  # what the matching backward's grad_out must look like
            self.__dict__.setdefault("_outputs", {})[name] = (out.shape, out.dtype)
        return out

    wrapper._at_boundary = True
    return wrapper


def _backward_at_the_door(method):
    """A backward checked at the door (after a forward whose cache it may use); one that fails leaves its module's
    cache usable for a corrected call."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        used, depth = self.__dict__.get("_cache_used", False), _depth()
        try:
            fresh = self._cache is not None and not (used and self._has_parameters())
            if depth == 0 and (fresh or name in self._cacheless_backwards):
                getattr(self, f"_check_{name}")(*args, **kwargs)
            _CALLS.depth = depth + 1
            return method(self, *args, **kwargs)
        except BaseException:
            object.__setattr__(self, "_cache_used", used)
            raise
        finally:
            _CALLS.depth = depth

    wrapper._at_boundary = True
    return wrapper


class Module:
    """Base class of every NumPy layer: registers parameters and submodules on assignment.

    Three guarantees hold for every subclass, without code of its own:
    - the arrays a caller passes to `forward` (and `encode`, `decode`, ...) are copied once at the outermost call
      (`_kept_inputs` names the arguments a forward keeps for backward; None: all array arguments), so changing
      them in place afterwards cannot corrupt the gradients;
    - that outermost call (the door) runs the module's `_check_forward` (`_check_decode`, ...) where it has one,
      and `backward`'s door checks grad_out against the forward's output: a call from outside is checked once,
      and the calls a model makes to its own layers are not checked again;
    - `backward` of a module with parameters uses a forward's cache once: a second backward without a new forward
      raises RuntimeError instead of adding the same gradients into `.grad` again (torch refuses a second backward
      through freed buffers the same way). A module without parameters (an activation, dropout, the loss) only
      returns a gradient and adds nothing, so calling its backward again, e.g. with another grad_out, is allowed.

    `state_dict()` returns copies: `best = model.state_dict()` keeps those values while training goes on. torch's
    `state_dict()` (tfm_torch) returns the live tensors instead (detached, sharing the parameters' storage): there
    `best` changes with every step unless copied (`{k: v.clone() for k, v in ...}`). Both tracks keep their own
    library's semantics; code that keeps a best state in either track copies it. `load_state_dict` refuses two names
    of one tied parameter holding different values (as a checkpoint is refused), rather than let the last one win.
    """

    _kept_inputs: tuple[str, ...] | None = None
    # backwards of a module that keeps no cache of its own (a stack: its layers keep theirs): their door checks
    # grad_out after any forward (the others only while the module's cache is fresh)
    _cacheless_backwards: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in _ENTRY_POINTS + tuple(_BACKWARDS):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "_at_boundary", False):
                wrap = _backward_at_the_door(method) if name in _BACKWARDS else _at_the_door(method, cls._kept_inputs)
                setattr(cls, name, wrap)

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_cache", None)
        object.__setattr__(self, "_cache_used", False)

    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}: call Module.__init__() before assigning attributes")
        if name == "_cache":  # a new forward: its cache is fresh
            object.__setattr__(self, "_cache_used", False)
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    # -- forward / backward -------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def backward(self, grad_out):
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _check_grad_out(self, name: str, grad_out=None, *args, **kwargs) -> None:
        """At the door of backward `name`: grad_out shaped and typed like the last output of its forward (when it was
        one array). A module whose backward takes something else overrides `_check_backward` (or its twin)."""
        spec = self.__dict__.get("_outputs", {}).get(_BACKWARDS[name])
        if spec is not None:
            check_grad(type(self).__name__, grad_out, *spec, method=name)

    _check_backward = functools.partialmethod(_check_grad_out, "backward")
    _check_decode_backward = functools.partialmethod(_check_grad_out, "decode_backward")
    _check_encode_backward = functools.partialmethod(_check_grad_out, "encode_backward")

    def _saved(self):
        """What `forward` cached, for one backward; a clear error when `backward` comes first or comes twice."""
        if self._cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward() called before forward()")
        if self.__dict__.get("_cache_used", False) and self._has_parameters():
            raise RuntimeError(
                f"{type(self).__name__}.backward() called twice after one forward: this forward's gradients were "
                "already added into .grad; run forward again first (to accumulate gradients over batches, "
                "call forward and backward once per batch)"
            )
        object.__setattr__(self, "_cache_used", True)
        return self._cache

    def _has_parameters(self) -> bool:
        return next(self._named_parameters_all(), None) is not None

    # -- traversal ----------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, module in self._modules.items():
            yield from module.named_modules(f"{prefix}.{name}" if prefix else name)

    def _named_parameters_all(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        # Torch order: a module's own parameters first, then each submodule's, depth first.
        for name, p in self._parameters.items():
            yield (f"{prefix}.{name}" if prefix else name), p
        for name, module in self._modules.items():
            yield from module._named_parameters_all(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """Unique parameters in torch order: a tied array is listed once, under its first name."""
        seen: set[int] = set()
        for name, p in self._named_parameters_all():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return int(sum(p.data.size for p in self.parameters()))

    def grads(self) -> dict[str, np.ndarray]:
        """Gradients keyed like the torch twin's `named_parameters()`."""
        return {name: p.grad for name, p in self.named_parameters()}

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> Module:
        for _, m in self.named_modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> Module:
        return self.train(False)

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of every parameter, tied ones under each of their names (as torch does)."""
        return {name: p.data.copy() for name, p in self._named_parameters_all()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays (or anything `np.asarray` takes, e.g. CPU tensors) into the parameters in place."""
        own = dict(self._named_parameters_all())
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        values = {name: np.asarray(state[name]) for name in own if name in state}
        for name, value in values.items():  # check every shape before copying anything: all or nothing
            if value.shape != own[name].data.shape:
                raise ValueError(f"load_state_dict: '{name}' expected shape {own[name].data.shape}, got {value.shape}")
        check_ties(tied_groups_of(own.items()), values, same_values, "load_state_dict", what="state_dict")
        for name, value in values.items():
            own[name].data[...] = value.astype(own[name].data.dtype, copy=False)

    def astype(self, dtype) -> Module:
        """Convert every parameter (and its gradient) to float32 or float64; ties are kept."""
        dt = check_dtype(dtype)
        for p in self.parameters():
            p.data = p.data.astype(dt)
            p.grad = None if p.grad is None else p.grad.astype(dt)
        for _, m in self.named_modules():
            object.__setattr__(m, "_cache", None)
            if hasattr(m, "dtype"):
                object.__setattr__(m, "dtype", dt)
        return self

    def double(self) -> Module:
        return self.astype(np.float64)

    def float(self) -> Module:
        return self.astype(np.float32)

    @property
    def param_dtype(self) -> np.dtype:
        params = self.parameters()
        return params[0].data.dtype if params else np.dtype(np.float32)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            lines.append(f"  ({name}): " + repr(m).replace("\n", "\n  "))
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"


class ModuleList(Module):
    """A list of modules registered as '0', '1', ... (torch's `nn.ModuleList` naming)."""

    def __init__(self, modules=()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        setattr(self, str(len(self._modules)), module)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


def check_input(name: str, x, ndim_min: int = 1, last_dim: int | None = None, dtype=None) -> np.ndarray:
    """Validate a floating input at a public boundary; the message names the layer and what was expected."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if x.dtype.type not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float32 or float64 array, got dtype {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)} (the parameters' dtype), got {x.dtype}")
    if x.ndim < ndim_min:
        raise ValueError(f"{name}: expected at least {ndim_min} dimension(s), got shape {x.shape}")
    if last_dim is not None and x.shape[-1] != last_dim:
        raise ValueError(f"{name}: expected last dimension {last_dim}, got shape {x.shape}")
    return x


def check_grad(name: str, grad_out, shape: tuple[int, ...], dtype, method: str = "backward") -> np.ndarray:
    """Validate the gradient handed to `backward`: an array shaped and typed like the forward's output."""
    where = f"{name}.{method}"
    if not isinstance(grad_out, np.ndarray):
        raise TypeError(f"{where}: grad_out expected a numpy.ndarray, got {type(grad_out).__name__}")
    if grad_out.shape != tuple(shape):
        raise ValueError(f"{where}: grad_out expected shape {tuple(shape)} (the output's), got {grad_out.shape}")
    if grad_out.dtype != dtype:
        raise TypeError(f"{where}: grad_out expected dtype {np.dtype(dtype)} (the output's), got {grad_out.dtype}")
    return grad_out


def check_indices(name: str, x, high: int, ignore: int | None = None) -> np.ndarray:
    """Validate integer indices (token ids, class targets): an integer array with values in [0, high).

    `ignore`, if given, is one more allowed value (a loss's `ignore_index`).
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray of integers, got {type(x).__name__}")
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer array, got dtype {x.dtype}")
    bad = (x < 0) | (x >= high)
    if ignore is not None:
        bad &= x != ignore
    if bad.any():
        allowed = f"[0, {high})" + (f" or {ignore}" if ignore is not None else "")
        raise ValueError(f"{name}: values must be in {allowed}, got {x[bad].flat[0]} (and {int(bad.sum()) - 1} more)")
    return x
