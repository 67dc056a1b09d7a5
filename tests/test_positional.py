"""Positional encodings in both tracks: known values of the sinusoidal table, the modules, gradients, agreement."""

import math

import numpy as np
import pytest
import torch

import tfm_numpy as tn
import tfm_torch as tt

GRAD_TOL = 1e-7
TRACK_TOL = 1e-10


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    denom = np.linalg.norm(a) + np.linalg.norm(b)
    return 0.0 if denom == 0 else float(np.linalg.norm(a - b) / denom)


def numeric_grad(loss, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar `loss()` with respect to the array `x`, perturbed in place."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = loss()
        x[i] = old - eps
        down = loss()
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


# -- the sinusoidal table ------------------------------------------------------------------------------------


@pytest.fixture(params=["numpy", "torch"])
def table(request):
    """sinusoidal_positional_encoding of either track, returning a float64 numpy array."""
    if request.param == "numpy":
        return lambda n, d: tn.sinusoidal_positional_encoding(n, d, dtype=np.float64)
    return lambda n, d: tt.sinusoidal_positional_encoding(n, d, dtype=torch.float64).numpy()


def test_pe_known_values(table):
    pe = table(50, 512)
    assert pe.shape == (50, 512)
    np.testing.assert_array_equal(pe[0], np.tile([0.0, 1.0], 256))  # sin 0, cos 0, sin 0, cos 0, ...
    w1 = 1 / 10000 ** (2 / 512)  # the frequency of the second (sin, cos) pair
    np.testing.assert_allclose(pe[1, :4], [math.sin(1), math.cos(1), math.sin(w1), math.cos(w1)], rtol=0, atol=1e-15)
    w100 = 1 / 10000 ** (200 / 512)  # pair i = 100: columns 200 (sin) and 201 (cos)
    np.testing.assert_allclose(pe[7, 200:202], [math.sin(7 * w100), math.cos(7 * w100)], rtol=0, atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(pe, axis=1), math.sqrt(512 / 2), rtol=1e-13)


def test_pe_dot_product_depends_only_on_the_offset(table):
    pe = table(200, 64)
    for k in (1, 5, 30):
        dots = np.einsum("pd,pd->p", pe[:-k], pe[k:])  # PE[p] . PE[p+k] for every p
        np.testing.assert_allclose(dots, dots[0], atol=1e-10)
    assert abs(pe[0] @ pe[1] - pe[0] @ pe[30]) > 1.0  # and it does change with the offset


def test_pe_offset_is_a_rotation_of_each_pair(table):
    """PE[p+k] = R(k) PE[p], R block-diagonal with a 2x2 rotation per frequency: a linear map independent of p."""
    pe, d, k = table(100, 16), 16, 7
    w = 1 / 10000 ** (np.arange(0, d, 2) / d)  # (d/2,) frequencies
    c, s = np.cos(k * w), np.sin(k * w)
    R = np.zeros((d, d))
    R[0::2, 0::2], R[0::2, 1::2] = np.diag(c), np.diag(s)  # sin(a+b) = sin a cos b + cos a sin b
    R[1::2, 0::2], R[1::2, 1::2] = np.diag(-s), np.diag(c)  # cos(a+b) = cos a cos b - sin a sin b
    np.testing.assert_allclose(pe[:-k] @ R.T, pe[k:], atol=1e-12)


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_pe_dtypes_and_bad_sizes(lib):
    pe = lib.sinusoidal_positional_encoding(10, 8)
    assert pe.dtype in (np.float32, torch.float32)
    with pytest.raises(ValueError, match="even d_model"):
        lib.sinusoidal_positional_encoding(10, 7)
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        lib.sinusoidal_positional_encoding(0, 8)


def test_pe_tracks_agree():
    a = tn.sinusoidal_positional_encoding(5000, 512, dtype=np.float64)
    b = tt.sinusoidal_positional_encoding(5000, 512, dtype=torch.float64).numpy()
    assert np.abs(a - b).max() < TRACK_TOL


# -- PositionalEncoding --------------------------------------------------------------------------------------


def test_positional_encoding_adds_the_table_and_has_no_state():
    rng = np.random.default_rng(0)
    pe = tn.PositionalEncoding(16, max_len=64, dtype=np.float64)
    x = rng.standard_normal((2, 10, 16))
    np.testing.assert_array_equal(pe(x), x + tn.sinusoidal_positional_encoding(64, 16, dtype=np.float64)[:10])
    np.testing.assert_array_equal(pe(x[:, :3], offset=4), x[:, :3] + pe.pe[4:7])
    assert pe.state_dict() == {}
    twin = tt.PositionalEncoding(16, max_len=64, dtype=torch.float64)
    assert twin.state_dict() == {} and "pe" in dict(twin.named_buffers())  # a buffer, but not persistent
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in pe.state_dict().items()})  # strict: keys match
    assert np.abs(pe(x) - twin(torch.from_numpy(x)).numpy()).max() < TRACK_TOL


def test_positional_encoding_too_long_is_a_clear_error():
    for lib, conv in ((tn, lambda s: np.zeros(s, np.float32)), (tt, lambda s: torch.zeros(s, dtype=torch.float32))):
        for module in (lib.PositionalEncoding(8, max_len=64), lib.LearnedPositionalEmbedding(64, 8)):
            assert module(conv((2, 64, 8))).shape == (2, 64, 8)  # exactly max_len is fine
            with pytest.raises(ValueError, match="sequence length 70 exceeds max_len 64"):
                module(conv((2, 70, 8)))
            with pytest.raises(ValueError, match="sequence length 3 starting at position 62 exceeds max_len 64"):
                module(conv((2, 3, 8)), offset=62)


@pytest.mark.parametrize("lib", [tn, tt], ids=["numpy", "torch"])
def test_positional_modules_reject_bad_input(lib):
    if lib is tn:
        conv = lambda s, dtype=np.float32: np.zeros(s, dtype)  # noqa: E731
    else:
        conv = lambda s, dtype=torch.float32: torch.zeros(s, dtype=dtype)  # noqa: E731
    f64 = np.float64 if lib is tn else torch.float64
    for module in (lib.PositionalEncoding(8, max_len=16), lib.LearnedPositionalEmbedding(16, 8)):
        with pytest.raises(ValueError, match="last dimension 8"):
            module(conv((2, 4, 6)))
        with pytest.raises(TypeError, match="expected dtype"):
            module(conv((2, 4, 8), dtype=f64))
        with pytest.raises(ValueError, match="offset must be >= 0"):
            module(conv((2, 4, 8)), offset=-1)


def test_positional_encoding_dropout_and_gradcheck():
    rng = np.random.default_rng(1)
    pe = tn.PositionalEncoding(8, max_len=16, dropout=0.5, dtype=np.float64)
    x = rng.standard_normal((2, 6, 8))
    G = rng.standard_normal((2, 6, 8))

    def run():
        pe.dropout.rng = np.random.default_rng(2)  # the same dropout mask in every forward
        return pe(x)

    y = run()
    table = pe.pe[:6]
    dropped = y == 0
    assert 0 < dropped.mean() < 1
    np.testing.assert_allclose(y[~dropped], 2 * (x + table)[~dropped])  # inverted dropout: kept entries x 1/(1-p)
    dx = pe.backward(G)
    assert rel_err(dx, numeric_grad(lambda: float((run() * G).sum()), x)) < GRAD_TOL
    pe.eval()
    np.testing.assert_array_equal(pe(x), x + table)
    np.testing.assert_array_equal(pe.backward(G), G)


def test_positional_encoding_float32_and_astype():
    x = np.ones((2, 5, 8), dtype=np.float32)
    pe = tn.PositionalEncoding(8, max_len=16)
    y = pe(x)
    assert y.dtype == np.float32 and pe.backward(np.ones_like(y)).dtype == np.float32
    pe.double()  # no parameters: the table follows the module's dtype
    y64 = pe(x.astype(np.float64))
    assert y64.dtype == np.float64 and pe.pe.dtype == np.float64
    np.testing.assert_array_equal(y64[0], 1 + tn.sinusoidal_positional_encoding(16, 8, dtype=np.float64)[:5])
    twin = tt.PositionalEncoding(8, max_len=16)
    assert twin(torch.from_numpy(x)).dtype == torch.float32
    assert twin.double()(torch.from_numpy(x).double()).dtype == torch.float64


# -- LearnedPositionalEmbedding ------------------------------------------------------------------------------


def test_learned_positional_embedding_gradcheck_and_offset():
    rng = np.random.default_rng(3)
    emb = tn.LearnedPositionalEmbedding(10, 4, rng=4, dtype=np.float64)
    assert list(emb.state_dict()) == ["weight"] and emb.weight.shape == (10, 4)
    x = rng.standard_normal((3, 6, 4))
    G = rng.standard_normal((3, 6, 4))
    for offset in (0, 3):

        def loss():
            return float((emb(x, offset=offset) * G).sum())  # noqa: B023 (offset is fixed while it runs)

        np.testing.assert_array_equal(emb(x, offset=offset), x + emb.weight.data[offset : offset + 6])
        emb.zero_grad()
        dx = emb.backward(G)
        assert rel_err(dx, numeric_grad(loss, x)) < GRAD_TOL
        assert rel_err(emb.weight.grad, numeric_grad(loss, emb.weight.data)) < GRAD_TOL
        unused = np.ones(10, dtype=bool)
        unused[offset : offset + 6] = False
        assert np.all(emb.weight.grad[unused] == 0)  # rows past the sequence get nothing


def test_learned_positional_embedding_init_and_accumulation():
    emb = tn.LearnedPositionalEmbedding(500, 64, rng=5)
    assert emb.weight.dtype == np.float32
    assert abs(emb.weight.data.mean()) < 0.01 and abs(emb.weight.data.std() - 1) < 0.01  # N(0, 1)
    np.testing.assert_array_equal(emb.weight.data, tn.LearnedPositionalEmbedding(500, 64, rng=5).weight.data)
    G = np.ones((2, 3, 64), dtype=np.float32)
    emb(G)
    emb.backward(G)
    emb(G)
    emb.backward(G)  # gradients add up until zero_grad
    np.testing.assert_array_equal(emb.weight.grad[:3], 4.0)
    assert emb.weight.grad.dtype == np.float32
    twin = tt.LearnedPositionalEmbedding(500, 64, rng=5)
    assert twin.weight.dtype == torch.float32 and abs(twin.weight.detach().std().item() - 1) < 0.01


def test_learned_positional_embedding_numpy_vs_torch_twin():
    rng = np.random.default_rng(6)
    emb = tn.LearnedPositionalEmbedding(12, 8, rng=7, dtype=np.float64)
    twin = tt.LearnedPositionalEmbedding(12, 8, rng=8, dtype=torch.float64)
    assert list(twin.state_dict()) == list(emb.state_dict())
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in emb.state_dict().items()})
    x, G = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    y = emb(x, offset=2)
    dx = emb.backward(G)
    xt = torch.tensor(x, requires_grad=True)
    yt = twin(xt, offset=2)
    (yt * torch.from_numpy(G)).sum().backward()
    assert np.abs(y - yt.detach().numpy()).max() < TRACK_TOL
    assert np.abs(dx - xt.grad.numpy()).max() < TRACK_TOL
    assert np.abs(emb.weight.grad - twin.weight.grad.numpy()).max() < TRACK_TOL
    emb.load_state_dict({k: v.numpy() for k, v in tt.LearnedPositionalEmbedding(12, 8, rng=9).state_dict().items()})
    np.testing.assert_allclose(emb.weight.data, tt.LearnedPositionalEmbedding(12, 8, rng=9).weight.detach().numpy())
