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

import numpy as np

from tfm_common.parallel import check_micro_batches, micro_weights, split_batch
from tfm_common.training import StepResult, check_finite_step
from tfm_common.validate import check_flag

from .loss import CrossEntropyLoss
from .module import _CALLS, Module, ModuleList
from .optim import Adam, clip_grad_norm, set_lr

__all__ = ["split_batch", "micro_weights", "train_step_accumulated", "Recompute", "recompute"]


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
    name = "train_step_accumulated"
    micro_batches = check_micro_batches(name, micro_batches)
    weights = micro_weights(micro_batches, normalize)
    model.zero_grad()
    loss = 0.0
    for batch, w in zip(micro_batches, weights, strict=True):
        logits = model(batch.src, batch.tgt_in)  # (b, T_i, V)
        loss += w * float(loss_fn(logits, batch.tgt_out))
        model.backward(loss_fn.backward(w))  # adds w * dL_i/dtheta into every .grad
    from .train import grad_norm  # here: train imports this module for its `accumulate` option

    params = optimizer.params
    norm = grad_norm(params)
    check_finite_step(loss, norm)
    if clip_norm is not None:
        norm = clip_grad_norm(params, clip_norm)
    set_lr(optimizer, lr)
    optimizer.step()
    return StepResult(loss, norm)


# -- activation recomputation ------------------------------------------------------------------------------------
def _generators(module: Module) -> list[np.random.Generator]:
    """The random generators used inside `module` (dropout's), each once."""
    seen: dict[int, np.random.Generator] = {}
    for _, m in module.named_modules():
        g = m.__dict__.get("rng")
        if isinstance(g, np.random.Generator):
            seen.setdefault(id(g), g)
    return list(seen.values())


@contextlib.contextmanager
def _replay(saved: list[tuple[np.random.Generator, dict]]):
    """Rewind each generator to its state before the forward, and afterwards put it back where it is now (so the
    draws after this backward are those a cached run would make)."""
    now = [g.bit_generator.state for g, _ in saved]
    for g, state in saved:
        g.bit_generator.state = state
    depth = getattr(_CALLS, "depth", 0)
    _CALLS.depth = depth + 1  # the saved inputs were copied at the first forward: do not copy them again
    try:
        yield
    finally:
        _CALLS.depth = depth
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
        gens = _generators(self.module)
        saved = [(g, g.bit_generator.state) for g in gens]
        out = self.module.forward(*args, **kwargs)
        for _, m in self.module.named_modules():  # free every activation the layer cached
            object.__setattr__(m, "_cache", None)
            if "attn_weights" in m.__dict__:
                object.__setattr__(m, "attn_weights", None)
        self._cache = (args, kwargs, saved)
        return out

    def backward(self, grad_out):
        args, kwargs, saved = self._saved()
        with _replay(saved):
            self.module.forward(*args, **kwargs)  # rebuilds the caches: the very same values as the first forward
        out = self.module.backward(grad_out)
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
    stacks = [m for _, m in model.named_modules() if isinstance(m, ModuleList)]
    for stack in stacks:
        for key, layer in list(stack._modules.items()):
            if enabled and not isinstance(layer, Recompute):
                setattr(stack, key, Recompute(layer))
            elif not enabled and isinstance(layer, Recompute):
                setattr(stack, key, layer.module)
    return model
