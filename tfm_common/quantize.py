"""Weight quantization (chapter 21a), what both tracks share: the argument rules, the layout of the groups, and the
bytes a quantized model takes. The arithmetic (scales, rounding, the matrix product) is each track's own
(`tfm_numpy.quantize`, `tfm_torch.quantize`).

The scheme is symmetric ("absmax"): a group of numbers w_1 .. w_n shares one scale s = max_i |w_i| / q_max and is
stored as integer codes c_i = round(w_i / s) in [-q_max, q_max], with q_max = 2^(bits - 1) - 1: 127 for int8, 7 for
int4. Dequantized, w_i ~ c_i s, off by at most s / 2. The code -2^(bits - 1) (-128, -8) is never used: with a
symmetric scale the largest magnitude maps to +-q_max, so the range is symmetric, zero is exact and -c is always a
code when c is; the one code given up costs 1/256 of int8's range and 1/16 of int4's.

Which numbers share a scale is set by `axis` and `group_size` (for a Linear weight (out_features, in_features),
axis=1, the input axis, the one a matrix product sums over):
  axis=None            one scale for the whole tensor ("per tensor"); scales shape (1, ..., 1)
  axis=a, no group     one scale per slice along a: each output channel (row) of a Linear weight gets its own
                       ("per channel"); scales shape: w's shape with axis a of length 1
  axis=a, group_size g each run of g consecutive numbers along a gets its own ("group-wise"); g divides the
                       axis' length L; scales shape: w's shape with axis a of length L / g
"""

from __future__ import annotations

import math

import numpy as np

from .validate import check_size

__all__ = ["BITS", "q_max", "check_quantize_args", "group_shapes", "reduce_axis", "packed_bytes", "layer_group_size"]

BITS = (4, 8)


def q_max(bits: int) -> int:
    """The largest code of a symmetric `bits`-bit quantization: 2^(bits - 1) - 1 (127 for 8 bits, 7 for 4)."""
    return 2 ** (bits - 1) - 1


def check_quantize_args(owner: str, shape: tuple[int, ...], bits, axis, group_size) -> tuple[int | None, int]:
    """bits in {4, 8}; axis None or an int in [-ndim, ndim); group_size None or an int >= 1 that divides the axis'
    length (refused with axis=None). Returns (axis made non-negative or None, the group size along it: the whole
    axis' length for per-channel, the tensor's size for per-tensor)."""
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)) or bits not in BITS:
        raise ValueError(f"{owner}: bits must be 4 or 8, got {bits!r}")
    ndim = len(shape)
    if ndim == 0:
        raise ValueError(f"{owner}: expected an array of at least 1 dimension, got shape {tuple(shape)}")
    if axis is None:
        if group_size is not None:
            raise ValueError(f"{owner}: group_size={group_size!r} needs an axis to group along, got axis=None "
                             "(one scale for the whole tensor)")  # fmt: skip
        return None, math.prod(shape)
    axis = check_size(owner, "axis", axis, minimum=-ndim)
    if axis >= ndim:
        raise ValueError(f"{owner}: axis must be in [-{ndim}, {ndim}) for shape {tuple(shape)}, got {axis}")
    axis %= ndim
    length = shape[axis]
    group = check_size(owner, "group_size", group_size, allow_none=True)
    if group is None:
        return axis, length
    if length % group:
        raise ValueError(f"{owner}: group_size must divide the length {length} of axis {axis} (shape "
                         f"{tuple(shape)}), got {group}")  # fmt: skip
    return axis, group


def group_shapes(shape: tuple[int, ...], axis: int | None, group: int):
    """(grouped, scale_grouped, scales): the shape that puts each group on an axis of its own (right after the group
    index), the matching shape of the scales (1 on that axis), and the shape the scales are returned in.
    The reduction runs over axis `axis + 1` of `grouped` (axis 1 for per-tensor, where grouped is (1, size))."""
    shape = tuple(shape)
    if axis is None:
        return (1, math.prod(shape)), (1, 1), (1,) * len(shape)
    n_groups = shape[axis] // group
    grouped = shape[:axis] + (n_groups, group) + shape[axis + 1 :]
    scale_grouped = shape[:axis] + (n_groups, 1) + shape[axis + 1 :]
    return grouped, scale_grouped, shape[:axis] + (n_groups,) + shape[axis + 1 :]


def reduce_axis(axis: int | None) -> int:
    """The axis of `group_shapes`'s grouped shape that holds one group's members."""
    return 1 if axis is None else axis + 1


def layer_group_size(group_size: int | None, in_features: int) -> int | None:
    """The group size a whole-model quantization uses for one Linear: `group_size`, or the whole row when the layer
    has fewer inputs than that (a group of 128 over 64 inputs is the row: per-channel)."""
    return None if group_size is None else min(group_size, in_features)


def packed_bytes(entries) -> int:
    """Bytes of a model stored at its bit widths: `entries` are (number of values, bits per value); each tensor
    rounded up to whole bytes (two int4 codes share a byte)."""
    return sum(math.ceil(n * bits / 8) for n, bits in entries)
