"""The Vision Transformer in both tracks: the patch embedding against torch.nn.Conv2d, whole-model gradient checks
in float64, the two tracks' logits and every gradient, identical keys, bad input refused alike; the digits split."""

import numpy as np
import pytest
import torch
from helpers_tracks import TOL, assert_tracks_agree, load_np_into_torch, run_numpy, run_torch, to_torch
from test_sublayers import assert_grad_check  # every k_proj.bias has a true gradient of 0: checked as ~0

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.images import load_digits_split, upsample_nearest, wilson_interval

GRAD_TOL = 1e-7
TINY = dict(image_size=4, patch_size=2, in_channels=2, n_classes=3, d_model=4, n_heads=2, d_ff=8, n_layers=2)


def images(B=2, C=2, S=4, seed=1):
    return np.random.default_rng(seed).standard_normal((B, C, S, S))


def perturb_norms(model, seed=0):
    """LayerNorms away from 1 and 0, so that a swapped pair of norms shows in every comparison."""
    rng = np.random.default_rng(seed)
    for _, m in model.named_modules():
        if isinstance(m, tn.LayerNorm):
            m.weight.data[...] = 1 + 0.3 * rng.standard_normal(m.weight.shape)
            m.bias.data[...] = 0.3 * rng.standard_normal(m.bias.shape)
    return model


def np_vit(pool="cls", **kw):
    return perturb_norms(tn.ViT(**{**TINY, **kw}, pool=pool, rng=0, dtype=np.float64))


# -- patch embedding ---------------------------------------------------------------------------------------------


def test_patchify_row_major_and_inverse():
    x = np.arange(2 * 3 * 6 * 6, dtype=np.float64).reshape(2, 3, 6, 6)
    p = tn.patchify(x, 3)  # (2, 4, 27)
    assert p.shape == (2, 4, 27)
    # patch 1 is the top-right block (row-major), flattened channel-first
    np.testing.assert_array_equal(p[1, 1], x[1, :, 0:3, 3:6].reshape(-1))
    np.testing.assert_array_equal(tn.unpatchify(p, 3, 3, 6, 6), x)
    np.testing.assert_array_equal(tt.patchify(torch.from_numpy(x), 3).numpy(), p)


@pytest.mark.parametrize("patch", [1, 2, 4])
def test_patch_embedding_equals_conv2d(patch):
    pe = tn.PatchEmbedding(8, patch, 3, 5, rng=0, dtype=np.float64)
    x = images(B=2, C=3, S=8)
    conv = torch.nn.Conv2d(3, 5, patch, stride=patch, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(pe.proj.weight.data.reshape(5, 3, patch, patch)))
        conv.bias.copy_(torch.from_numpy(pe.proj.bias.data))
    ref = conv(torch.from_numpy(x)).flatten(2).transpose(1, 2)  # (B, d, g, g) -> (B, N, d), row-major
    assert np.abs(pe(x) - ref.detach().numpy()).max() < 1e-12


def test_patch_embedding_gradients_and_tracks():
    pe = tn.PatchEmbedding(4, 2, 2, 6, rng=0, dtype=np.float64)
    assert max(tn.grad_check(pe, images()).values()) < GRAD_TOL
    twin = tt.PatchEmbedding(4, 2, 2, 6, rng=0, dtype=torch.float64)
    load_np_into_torch(pe, twin)
    g = np.random.default_rng(2).standard_normal((2, 4, 6))
    assert_tracks_agree(run_numpy(pe, (images(),), g), run_torch(twin, (images(),), g))


# -- the whole model ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_whole_model_grad_check(pool):
    model = np_vit(pool).eval()
    errors = assert_grad_check(model, (images(),), GRAD_TOL)
    assert "input0" in errors and ("cls_token" in errors) == (pool == "cls")


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_vit_tracks_agree_and_keys(pool):
    model = np_vit(pool)
    twin = tt.ViT(**TINY, pool=pool, rng=0, dtype=torch.float64)
    assert list(model.state_dict()) == list(twin.state_dict())
    load_np_into_torch(model, twin)
    g = np.random.default_rng(3).standard_normal((2, 3))
    diff = assert_tracks_agree(run_numpy(model, (images(),), g), run_torch(twin, (images(),), g))
    assert diff < TOL
    assert model.num_parameters() == twin.num_parameters()


def test_vit_tracks_agree_with_dropout_masks():
    """Training mode with dropout: the same masks copied from NumPy into torch give the same logits."""
    model = np_vit(dropout=0.2).train()
    twin = tt.ViT(**TINY, dropout=0.2, rng=0, dtype=torch.float64).train()
    load_np_into_torch(model, twin)
    out = model(images())
    masks = {n: torch.from_numpy(m.mask) for n, m in model.named_modules() if isinstance(m, tn.Dropout)}
    drops = dict(twin.named_modules())
    originals = {}
    for n, mask in masks.items():
        mod = drops[n]
        originals[n] = mod.forward
        mod.forward = (lambda f, mk: lambda x, mask=None: f(x, mask=mk))(mod.forward, mask)
    ref = twin(to_torch(images()))
    assert np.abs(out - ref.detach().numpy()).max() < TOL


def test_vit_attention_weights_shape():
    model = np_vit()
    model(images())
    w = model.attention_weights()
    assert len(w) == 2 and w[0].shape == (2, 2, 5, 5)
    np.testing.assert_allclose(w[0].sum(-1), 1.0)


def test_vit_float32_runs():
    model = tn.ViT(**TINY, rng=0)
    out = model(images().astype(np.float32))
    assert out.dtype == np.float32 and out.shape == (2, 3)
    assert model.backward(np.ones_like(out)).dtype == np.float32


# -- bad input, refused alike ----------------------------------------------------------------------------------


BAD_CONFIGS = [
    (dict(image_size=5), ValueError, "image_size=5 must be divisible by patch_size=2"),
    (dict(n_heads=3), ValueError, "d_model=4 must be divisible by n_heads=3"),
    (dict(d_model=0), ValueError, "d_model must be an int >= 1"),
    (dict(n_layers=2.0), TypeError, "n_layers expected an int"),
    (dict(dropout=1.0), ValueError, "dropout must be in"),
    (dict(pool="max"), ValueError, "pool must be one of"),
]


@pytest.mark.parametrize("kw, err, msg", BAD_CONFIGS)
def test_bad_config_refused_alike(kw, err, msg):
    pool = kw.pop("pool", "cls") if "pool" in kw else "cls"
    args = {**TINY, **kw}
    for lib in (tn, tt):
        with pytest.raises(err, match=msg):
            lib.ViT(**args, pool=pool)


@pytest.mark.parametrize(
    "shape, msg", [((2, 3, 4, 4), r"images expected shape \(B, 2, 4, 4\)"), ((2, 2, 6, 6), r"\(B, 2, 4, 4\)")]
)
def test_bad_images_refused_alike(shape, msg):
    x = np.zeros(shape)
    with pytest.raises(ValueError, match=msg):
        np_vit()(x)
    with pytest.raises(ValueError, match=msg):
        tt.ViT(**TINY, dtype=torch.float64)(torch.from_numpy(x))


def test_backward_before_forward_refused():
    with pytest.raises(RuntimeError, match="before forward"):
        np_vit().backward(np.zeros((2, 3)))


# -- data --------------------------------------------------------------------------------------------------------


def test_digits_split_fixed_and_stratified():
    a, b = load_digits_split(seed=0), load_digits_split(seed=0)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    assert a.x_train.shape[1:] == (1, 8, 8) and len(a.y_train) + len(a.y_test) == 1797
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
    train_share = np.bincount(a.y_train) / len(a.y_train)
    test_share = np.bincount(a.y_test) / len(a.y_test)
    assert np.abs(train_share - test_share).max() < 0.01  # the same class proportions
    c = load_digits_split(seed=1)
    assert not np.array_equal(a.y_test, c.y_test) or not np.array_equal(a.x_test, c.x_test)


def test_digits_validation_split_is_disjoint_stratified_and_leaves_the_test_set_alone():
    x = load_digits_split(seed=0, val_fraction=0.0).x_test
    d = load_digits_split(seed=0, test_fraction=0.25, val_fraction=0.15)
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (1078, 269, 450)
    np.testing.assert_array_equal(d.x_test, x)  # carving out a validation set does not move a test image
    # a partition: every image of the data set in exactly one of the three sets (compared as sorted rows)
    from sklearn.datasets import load_digits

    whole = load_digits()
    ref = np.column_stack([whole.images.reshape(1797, -1) / 16.0, whole.target])
    parts = [np.column_stack([xs.reshape(len(ys), -1), ys]) for xs, ys in
             ((d.x_train, d.y_train), (d.x_val, d.y_val), (d.x_test, d.y_test))]  # fmt: skip
    got = np.concatenate(parts).astype(np.float64)
    np.testing.assert_array_equal(got[np.lexsort(got.T[::-1])], ref[np.lexsort(ref.T[::-1])])
    shares = [np.bincount(y, minlength=10) / len(y) for y in (d.y_train, d.y_val, d.y_test)]
    assert max(np.abs(s - shares[0]).max() for s in shares) < 0.01  # the class proportions of the whole
    e = load_digits_split(seed=0, val_fraction=0.15)
    np.testing.assert_array_equal(d.x_val, e.x_val)  # fixed: the same seed, the same split
    assert "val=269" in repr(d)
    assert load_digits_split(seed=0).x_val.shape == (0, 1, 8, 8)  # the default: no validation set


@pytest.mark.parametrize("val_fraction", [-0.1, 0.75, 0.9])
def test_digits_bad_validation_fraction_refused(val_fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        load_digits_split(seed=0, test_fraction=0.25, val_fraction=val_fraction)


def test_upsample_and_wilson():
    x = np.arange(4.0).reshape(1, 1, 2, 2)
    np.testing.assert_array_equal(upsample_nearest(x, 2)[0, 0], [[0, 0, 1, 1]] * 2 + [[2, 2, 3, 3]] * 2)
    lo, hi = wilson_interval(95, 100)
    assert 0.88 < lo < 0.95 < hi < 0.98
    lo, hi = wilson_interval(100, 100)
    assert lo < 1.0 and hi == pytest.approx(1.0)
    with pytest.raises(ValueError, match="correct must be <= n"):
        wilson_interval(5, 4)
