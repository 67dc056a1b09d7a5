"""Past one device, PyTorch track: the same names as `tfm_numpy.parallel`, built on torch's own machinery.

Gradient accumulation: k backward passes add into `.grad` (autograd accumulates), each micro-batch's loss weighted
by its share of the tokens n_i/N. Recomputation: `torch.utils.checkpoint.checkpoint` (non-reentrant), with the
layer's own dropout generators rewound for the recomputation (torch's `preserve_rng_state` only covers the global
generator; ours are explicit).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tfm_common.parallel import check_micro_batches, micro_weights, split_batch
from tfm_common.training import StepResult, check_finite_step
from tfm_common.validate import check_flag

from .loss import CrossEntropyLoss
from .optim import clip_grad_norm, set_lr

__all__ = ["split_batch", "micro_weights", "train_step_accumulated", "Recompute", "recompute"]


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
    from .train import _params, grad_norm

    micro_batches = check_micro_batches("train_step_accumulated", micro_batches)
    weights = micro_weights(micro_batches, normalize)
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for batch, w in zip(micro_batches, weights, strict=True):
        src, tgt_in, tgt_out = (torch.from_numpy(a).to(device) for a in (batch.src, batch.tgt_in, batch.tgt_out))
        micro_loss = loss_fn(model(src, tgt_in), tgt_out)
        (micro_loss * w).backward()  # adds w * dL_i/dtheta into every .grad
        loss += w * micro_loss.item()
    params = _params(optimizer)
    norm = grad_norm(params)
    check_finite_step(loss, norm)
    if clip_norm is not None:
        norm = clip_grad_norm(params, clip_norm)
    set_lr(optimizer, lr)
    optimizer.step()
    return StepResult(loss, norm)


# -- activation recomputation ------------------------------------------------------------------------------------
def _generators(module: nn.Module) -> list[torch.Generator]:
    seen: dict[int, torch.Generator] = {}
    for m in module.modules():
        g = m.__dict__.get("rng")
        if isinstance(g, torch.Generator):
            seen.setdefault(id(g), g)
    return list(seen.values())


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


class Recompute(nn.Module):
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
        gens = _generators(self.module)
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
    for stack in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for key, layer in list(stack._modules.items()):
            if enabled and not isinstance(layer, Recompute):
                stack._modules[key] = Recompute(layer)
            elif not enabled and isinstance(layer, Recompute):
                stack._modules[key] = layer.module
    return model
