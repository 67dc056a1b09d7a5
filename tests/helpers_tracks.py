"""Shared test helpers: move weights and data between the NumPy and PyTorch tracks, run a forward and a
backward in each, and measure agreement. Read-only for other test files: import, do not modify."""

from __future__ import annotations

import numpy as np
import torch

TOL = 1e-10  # float64 agreement between tracks: outputs and every gradient


def to_torch(a, requires_grad: bool = False) -> torch.Tensor:
    """A torch copy of a numpy array (floats may require grad; integers and bools never do)."""
    t = torch.from_numpy(np.array(a, copy=True))
    return t.requires_grad_(True) if requires_grad and t.is_floating_point() else t


def to_numpy(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def load_np_into_torch(np_mod, torch_mod) -> None:
    """The book's one-liner: the NumPy module's weights into a torch module (twin or torch.nn reference)."""
    torch_mod.load_state_dict({k: torch.from_numpy(v) for k, v in np_mod.state_dict().items()})


def max_abs_diff(a, b) -> float:
    a, b = to_numpy(a), to_numpy(b)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def run_numpy(mod, inputs: tuple, grad_out, **kwargs):
    """Forward then backward(grad_out) on a NumPy module, from zeroed gradients.

    Returns (output, input gradients as returned by backward, {param name: grad copy})."""
    mod.zero_grad()
    out = mod(*inputs, **kwargs)
    grads_in = mod.backward(grad_out)
    return out, grads_in, {k: v.copy() for k, v in mod.grads().items()}


def run_torch(mod, inputs: tuple, grad_out, **kwargs):
    """Forward then autograd backward with the given output gradient on a torch module.

    inputs are numpy arrays (converted here); returns (output, [grad of each float input], {name: grad})."""
    xs = [to_torch(x, requires_grad=True) for x in inputs]
    mod.zero_grad(set_to_none=True)
    out = mod(*xs, **kwargs)
    out.backward(to_torch(grad_out))
    grads_in = [x.grad for x in xs if x.is_floating_point()]
    grads_p = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in mod.named_parameters()}
    return out, grads_in, grads_p


def assert_tracks_agree(np_result, torch_result, tol: float = TOL) -> float:
    """Outputs, input gradients and parameter gradients (same names) within tol; returns the largest difference."""
    np_out, np_gin, np_gp = np_result
    t_out, t_gin, t_gp = torch_result
    np_gin = [g for g in (np_gin if isinstance(np_gin, tuple) else (np_gin,)) if g is not None]
    assert len(np_gin) == len(t_gin)
    assert list(np_gp) == list(t_gp), f"parameter names differ: {list(np_gp)} vs {list(t_gp)}"
    diffs = [max_abs_diff(np_out, t_out)]
    diffs += [max_abs_diff(a, b) for a, b in zip(np_gin, t_gin, strict=True)]
    diffs += [max_abs_diff(np_gp[k], t_gp[k]) for k in np_gp]
    # every entry compared (a NaN difference fails `d < tol`; the built-in max would skip a NaN after the first entry)
    assert all(d < tol for d in diffs), f"tracks differ (output, input grads, param grads): {diffs}"
    return max(diffs)
