"""Swin's pieces in both tracks: window partition and reverse, the cyclic shift, the shifted-window mask against a
brute-force construction, the relative position index, window attention against a reference written out here,
every block's gradient check in float64, the two tracks' outputs and gradients, identical keys, bad input."""

import itertools

import numpy as np
import pytest
import torch
from helpers_tracks import TOL, assert_tracks_agree, load_np_into_torch, run_numpy, run_torch
from test_sublayers import assert_grad_check  # every k_proj.bias has a true gradient of 0: checked as ~0

import tfm_numpy as tn
import tfm_torch as tt

GRAD_TOL = 1e-7
SWIN = dict(image_size=4, patch_size=1, in_channels=1, n_classes=3, d_model=4, depths=(2, 1), n_heads=(1, 2),
            window_size=2, mlp_ratio=1)  # fmt: skip


def rand(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


def perturb_norms(model, seed=0):
    rng = np.random.default_rng(seed)
    for _, m in model.named_modules():
        if isinstance(m, tn.LayerNorm):
            m.weight.data[...] = 1 + 0.3 * rng.standard_normal(m.weight.shape)
            m.bias.data[...] = 0.3 * rng.standard_normal(m.bias.shape)
    return model


# -- windows, shift, mask ------------------------------------------------------------------------------------------


def test_window_partition_round_trip_and_order():
    x = rand(2, 4, 6, 3)
    w = tn.window_partition(x, 2)  # (2 * 2 * 3, 4, 3)
    assert w.shape == (12, 4, 3)
    np.testing.assert_array_equal(w[4], x[0, 2:4, 2:4].reshape(4, 3))  # image 0: window row 1, col 1 (3 per row)
    np.testing.assert_array_equal(tn.window_reverse(w, 2, 4, 6), x)
    np.testing.assert_array_equal(tt.window_partition(torch.from_numpy(x), 2).numpy(), w)
    np.testing.assert_array_equal(tt.window_reverse(torch.from_numpy(w), 2, 4, 6).numpy(), x)


def test_cyclic_shift_inverse():
    x = rand(1, 4, 4, 2)
    s = tn.cyclic_shift(x, 1)
    np.testing.assert_array_equal(s[0, 0, 0], x[0, 1, 1])  # row i+1, col j+1 moved to (i, j)
    np.testing.assert_array_equal(tn.cyclic_shift(s, -1), x)
    np.testing.assert_array_equal(tt.cyclic_shift(torch.from_numpy(x), 1).numpy(), s)


def _wrapped(pos: int, n: int, s: int) -> bool:
    """Whether the token at `pos` of the shifted grid came from the other edge: its original (pos + s) mod n wrapped."""
    return pos + s >= n


def brute_force_mask(H, W, M, s):
    """Tokens i, j of a window of the shifted grid may attend iff the roll did not bring them together: their rows
    wrapped around alike (both from the bottom-of-image side or both from the top) and their columns too."""
    n_w = (H // M) * (W // M)
    mask = np.zeros((n_w, M * M, M * M), dtype=bool)
    for w, i, j in itertools.product(range(n_w), range(M * M), range(M * M)):
        wr, wc = divmod(w, W // M)
        (ri, ci), (rj, cj) = divmod(i, M), divmod(j, M)
        yi, xi, yj, xj = wr * M + ri, wc * M + ci, wr * M + rj, wc * M + cj  # positions on the shifted grid
        same_rows = _wrapped(yi, H, s) == _wrapped(yj, H, s)
        mask[w, i, j] = same_rows and _wrapped(xi, W, s) == _wrapped(xj, W, s)
    return mask


@pytest.mark.parametrize("H, W, M, s", [(4, 4, 2, 1), (8, 8, 4, 2), (6, 9, 3, 1), (8, 4, 4, 3), (4, 4, 2, 0)])
def test_shifted_window_mask_brute_force(H, W, M, s):
    mask = tn.shifted_window_mask(H, W, M, s)
    assert mask.shape == ((H // M) * (W // M), M * M, M * M) and mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, brute_force_mask(H, W, M, s))
    np.testing.assert_array_equal(tt.shifted_window_mask(H, W, M, s).numpy(), mask)
    assert mask[0].all() or W == M or H == M  # the first window holds wrapped tokens only if it is the only one


def test_relative_position_index():
    idx = tn.relative_position_index(3)
    assert idx.shape == (9, 9) and idx.min() == 0 and idx.max() == 24
    assert (np.diag(idx) == 12).all()  # offset (0, 0): the center of the 5 x 5 table
    assert idx[0, 8] == 0 and idx[8, 0] == 24  # (-2, -2) and (2, 2)
    np.testing.assert_array_equal(tt.relative_position_index(3).numpy(), idx)


# -- window attention against a reference written out -----------------------------------------------------------


def reference_window_attention(wa: tn.WindowAttention, x, mask):
    """Every window, every head, every pair of tokens by loops: scores + bias, -inf where masked, softmax."""
    M, h, dk = wa.window_size, wa.n_heads, wa.d_head
    lin = lambda m, a: a @ m.weight.data.T + m.bias.data  # noqa: E731
    q, k, v = lin(wa.q_proj, x), lin(wa.k_proj, x), lin(wa.v_proj, x)
    table = wa.relative_position_bias_table.data
    out = np.zeros_like(x)
    n_w = 1 if mask is None else mask.shape[0]
    for b, head in itertools.product(range(x.shape[0]), range(h)):
        sl = slice(head * dk, (head + 1) * dk)
        s = np.empty((M * M, M * M))
        for i, j in itertools.product(range(M * M), range(M * M)):
            (yi, xi), (yj, xj) = divmod(i, M), divmod(j, M)
            row = (yi - yj + M - 1) * (2 * M - 1) + (xi - xj + M - 1)
            s[i, j] = q[b, i, sl] @ k[b, j, sl] / np.sqrt(dk) + table[row, head]
            if mask is not None and not mask[b % n_w, i, j]:
                s[i, j] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[b, :, sl] = (p / p.sum(axis=1, keepdims=True)) @ v[b, :, sl]
    return lin(wa.out_proj, out)


def test_window_attention_against_reference():
    wa = tn.WindowAttention(4, 2, 2, rng=0, dtype=np.float64)
    wa.relative_position_bias_table.data[...] = rand(9, 2, seed=5)  # large enough to matter
    x = rand(2 * 4, 4, 4)  # two images of four windows
    mask = tn.shifted_window_mask(4, 4, 2, 1)
    assert np.abs(wa(x, mask) - reference_window_attention(wa, x, mask)).max() < 1e-12
    assert np.abs(wa(x) - reference_window_attention(wa, x, None)).max() < 1e-12


def test_window_attention_grad_and_tracks():
    wa = tn.WindowAttention(4, 2, 2, rng=0, dtype=np.float64)
    mask = tn.shifted_window_mask(4, 4, 2, 1)
    x = rand(8, 4, 4)
    errors = tn.grad_check(wa, x, forward_kwargs={"mask": mask})
    assert max(v for k, v in errors.items() if k != "k_proj.bias") < GRAD_TOL, errors
    twin = tt.WindowAttention(4, 2, 2, rng=0, dtype=torch.float64)
    assert list(wa.state_dict()) == list(twin.state_dict())
    load_np_into_torch(wa, twin)
    g = rand(8, 4, 4, seed=2)
    result = run_numpy(wa, (x,), g, mask=mask)
    assert np.abs(result[2]["k_proj.bias"]).max() < 1e-12  # shifts a whole row of scores: softmax ignores it
    assert_tracks_agree(result, run_torch(twin, (x,), g, mask=torch.from_numpy(mask)))


@pytest.mark.parametrize("shift", [0, 1])
def test_swin_block_grad_and_tracks(shift):
    block = perturb_norms(tn.SwinBlock(4, 2, 8, (4, 4), 2, shift, rng=0, dtype=np.float64))
    x = rand(2, 16, 4)
    assert_grad_check(block, (x,), GRAD_TOL)
    twin = tt.SwinBlock(4, 2, 8, (4, 4), 2, shift, rng=0, dtype=torch.float64)
    assert list(block.state_dict()) == list(twin.state_dict())
    load_np_into_torch(block, twin)
    g = rand(2, 16, 4, seed=2)
    assert_tracks_agree(run_numpy(block, (x,), g), run_torch(twin, (x,), g))


def test_shifted_block_differs_from_regular():
    """The same weights with and without the shift give different outputs (the shift is not a no-op)."""
    a = tn.SwinBlock(4, 2, 8, (4, 4), 2, 0, rng=0, dtype=np.float64)
    b = tn.SwinBlock(4, 2, 8, (4, 4), 2, 1, rng=0, dtype=np.float64)
    b.load_state_dict(a.state_dict())
    x = rand(1, 16, 4)
    assert np.abs(a(x) - b(x)).max() > 1e-3


def test_patch_merging_grad_order_and_tracks():
    pm = perturb_norms(tn.PatchMerging((4, 4), 3, rng=0, dtype=np.float64))
    x = rand(2, 16, 3)
    assert_grad_check(pm, (x,), GRAD_TOL)
    # the first merged token is [x(0,0), x(1,0), x(0,1), x(1,1)] (Swin's order), before the norm
    grid = x.reshape(2, 4, 4, 3)
    pm(x)
    xhat = pm.norm._cache[0]
    cat = np.concatenate([grid[:, 0, 0], grid[:, 1, 0], grid[:, 0, 1], grid[:, 1, 1]], axis=-1)
    ref = (cat - cat.mean(-1, keepdims=True)) / np.sqrt(cat.var(-1, keepdims=True) + 1e-5)
    assert np.abs(xhat[:, 0] - ref).max() < 1e-12
    twin = tt.PatchMerging((4, 4), 3, rng=0, dtype=torch.float64)
    load_np_into_torch(pm, twin)
    g = rand(2, 4, 6, seed=2)
    assert_tracks_agree(run_numpy(pm, (x,), g), run_torch(twin, (x,), g))


# -- the whole classifier ------------------------------------------------------------------------------------------


def test_swin_whole_model_grad_check_and_tracks():
    model = perturb_norms(tn.Swin(**SWIN, rng=0, dtype=np.float64)).eval()
    x = rand(2, 1, 4, 4)
    errors = assert_grad_check(model, (x,), GRAD_TOL)
    assert "input0" in errors
    shifts = [b.shift for stage in model.stages for b in stage]
    assert shifts == [0, 1, 0]
    twin = tt.Swin(**SWIN, rng=0, dtype=torch.float64)
    assert list(model.state_dict()) == list(twin.state_dict())
    load_np_into_torch(model, twin)
    g = rand(2, 3, seed=2)
    diff = assert_tracks_agree(run_numpy(model, (x,), g), run_torch(twin, (x,), g))
    assert diff < TOL


# -- bad input, refused alike --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, err, msg",
    [
        (lambda lib: lib.shifted_window_mask(6, 6, 4, 2), ValueError, "window_size=4 must divide H=6 and W=6"),
        (lambda lib: lib.shifted_window_mask(4, 4, 2, 2), ValueError, r"shift must be in \[0, window_size=2\)"),
        (lambda lib: lib.SwinBlock(4, 2, 8, (6, 6), 4), ValueError, "window_size=4 must divide"),
        (lambda lib: lib.WindowAttention(6, 4, 2), ValueError, "d_model=6 must be divisible by n_heads=4"),
        (lambda lib: lib.PatchMerging((5, 4), 3), ValueError, "resolution must be even"),
        (lambda lib: lib.Swin(**{**SWIN, "window_size": 3}), ValueError, "not divisible by window_size=3"),
        (lambda lib: lib.Swin(**{**SWIN, "image_size": 9, "patch_size": 2}), ValueError, "must be divisible by"),
        (lambda lib: lib.Swin(**{**SWIN, "n_heads": (1,)}), ValueError, "of one length"),
        (lambda lib: lib.Swin(**{**SWIN, "n_heads": (3, 2)}), ValueError, "not divisible by n_heads"),
    ],
)
def test_bad_arguments_refused_alike(call, err, msg):
    for lib in (tn, tt):
        with pytest.raises(err, match=msg):
            call(lib)


def test_bad_inputs_refused_alike():
    for lib, conv in ((tn, np.asarray), (tt, torch.from_numpy)):
        dt = np.float64 if lib is tn else torch.float64
        with pytest.raises(ValueError, match=r"images expected shape \(B, 1, 4, 4\)"):
            lib.Swin(**SWIN, dtype=dt)(conv(rand(2, 3, 4, 4)))
        with pytest.raises(ValueError, match=r"x expected shape \(B, 16, 4\)"):
            lib.SwinBlock(4, 2, 8, (4, 4), 2, dtype=dt)(conv(rand(2, 15, 4)))
        with pytest.raises(ValueError, match=r"mask expected a bool"):
            lib.WindowAttention(4, 2, 2, dtype=dt)(conv(rand(4, 4, 4)), conv(np.ones((4, 4, 4))))
