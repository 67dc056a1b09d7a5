"""Checkpoints: bit-exact round trips in each track and across tracks (.npz <-> torch), optimizer state included,
and clear errors for a damaged, mismatched or foreign file. The model is a small stack of existing layers."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch
from helpers_tracks import load_np_into_torch

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.npz_checkpoint import META_KEY, zip_kind


def np_model(dtype=np.float64, seed=0, d=6, tie=False):
    m = tn.Module()
    m.emb = tn.Embedding(7, d, padding_idx=0, rng=seed, dtype=dtype)
    m.norm = tn.LayerNorm(d, dtype=dtype)
    m.out = tn.Linear(d, 7, rng=seed + 1, dtype=dtype)
    if tie:
        m.out.weight = m.emb.weight
    return m


class TorchModel(torch.nn.Module):
    def __init__(self, dtype=torch.float64, seed=0, d=6, tie=False):
        super().__init__()
        self.emb = tt.Embedding(7, d, padding_idx=0, rng=seed, dtype=dtype)
        self.norm = tt.LayerNorm(d, dtype=dtype)
        self.out = tt.Linear(d, 7, rng=seed + 1, dtype=dtype)
        if tie:
            self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.norm(self.emb(ids)))


IDS = np.array([[1, 2, 3, 0], [4, 5, 6, 6]])


def np_train(model, opt, steps=3):
    """A few Adam steps on L = sum(logits^2) / 100, so that weights and moments are non-trivial."""
    for _ in range(steps):
        opt.zero_grad()
        y = model.out(model.norm(model.emb(IDS)))
        model.emb.backward(model.norm.backward(model.out.backward(y / 50)))
        opt.step()


def torch_train(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        (model(torch.from_numpy(IDS)) ** 2 / 100).sum().backward()
        opt.step()


def assert_same_state(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and np.array_equal(x, y), k


def t2n(sd):
    return {k: v.detach().numpy() for k, v in sd.items()}


# -- round trips -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_round_trip_is_bit_exact(tmp_path, dtype):
    src = np_model(dtype, tie=True)
    opt = tn.make_adam(src, lr=0.01)
    np_train(src, opt)
    path = tn.save_checkpoint(tmp_path / "ckpt.npz", src, opt, extra={"epoch": 3, "losses": [1.5, 0.25], "t": (1, 2)})
    dst = np_model(dtype, seed=5, tie=True)
    opt2 = tn.make_adam(dst, lr=0.5)
    extra = tn.load_checkpoint(path, dst, opt2)
    assert extra == {"epoch": 3, "losses": [1.5, 0.25], "t": [1, 2]}  # as JSON gives it back: tuples are lists
    assert_same_state(src.state_dict(), dst.state_dict())
    assert dst.out.weight is dst.emb.weight  # loading keeps the tie
    sa, sb = opt.state_dict(), opt2.state_dict()
    assert (sa["step"], sa["lr"], sa["betas"]) == (sb["step"], sb["lr"], sb["betas"]) == (3, 0.01, [0.9, 0.98])
    for part in ("exp_avg", "exp_avg_sq"):
        assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(sa[part], sb[part], strict=True))
    np_train(src, opt, 2)  # resuming gives the same run
    np_train(dst, opt2, 2)
    assert_same_state(src.state_dict(), dst.state_dict())


def test_numpy_file_is_a_plain_npz_read_without_pickle(tmp_path):
    model = np_model()
    path = tn.save_checkpoint(tmp_path / "weights", model, extra={"note": "no suffix needed"})
    assert path == tmp_path / "weights" and path.is_file() and zip_kind(path) == "npz"
    assert [p.name for p in tmp_path.iterdir()] == ["weights"]  # no temporary file left behind
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == sorted([f"model/{k}" for k in model.state_dict()] + [META_KEY])
        meta = json.loads(str(z[META_KEY][()]))
    assert meta["track"] == "numpy" and meta["extra"] == {"note": "no suffix needed"} and "optim" not in meta
    assert tn.load_checkpoint(path, np_model(seed=3)) == {"note": "no suffix needed"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_round_trip_is_bit_exact(tmp_path, dtype):
    src = TorchModel(dtype, tie=True)
    opt = tt.make_adam(src, lr=0.01)
    torch_train(src, opt)
    path = tt.save_checkpoint(tmp_path / "ckpt.pt", src, opt, extra={"epoch": 3})
    assert zip_kind(path) == "torch"
    dst = TorchModel(dtype, seed=5, tie=True)
    opt2 = tt.make_adam(dst, lr=0.5)
    assert tt.load_checkpoint(path, dst, opt2) == {"epoch": 3}
    assert_same_state(t2n(src.state_dict()), t2n(dst.state_dict()))
    assert opt2.lr == 0.01 and opt2.step_count == 3
    torch_train(src, opt, 2)
    torch_train(dst, opt2, 2)
    assert_same_state(t2n(src.state_dict()), t2n(dst.state_dict()))
    raw = torch.load(path, weights_only=True)  # the file is plain: loads with weights_only
    assert set(raw) >= {"model", "optim", "extra"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_checkpoint_loads_into_torch_and_back(tmp_path, dtype):
    tdtype = {np.float32: torch.float32, np.float64: torch.float64}[dtype]
    src = np_model(dtype)
    opt = tn.make_adam(src, lr=0.01)
    np_train(src, opt)
    tn.save_checkpoint(tmp_path / "np.npz", src, opt, extra={"from": "numpy"})
    tmodel = TorchModel(tdtype, seed=9)
    topt = tt.make_adam(tmodel, lr=0.5)
    assert tt.load_checkpoint(tmp_path / "np.npz", tmodel, topt) == {"from": "numpy"}
    assert_same_state(src.state_dict(), t2n(tmodel.state_dict()))
    assert topt.step_count == 3 and topt.lr == 0.01
    for i, p in enumerate(tmodel.parameters()):
        assert np.array_equal(topt.state[p]["exp_avg"].numpy(), opt.exp_avg[i])
    # torch -> npz -> numpy: the same bits come back
    tt.export_npz(tmp_path / "t.npz", tmodel, topt, extra={"from": "torch"})
    back = np_model(dtype, seed=7)
    opt_back = tn.make_adam(back)
    assert tn.load_checkpoint(tmp_path / "t.npz", back, opt_back) == {"from": "torch"}
    assert_same_state(src.state_dict(), back.state_dict())
    sa, sb = opt.state_dict(), opt_back.state_dict()
    assert sa["step"] == sb["step"] and sa["lr"] == sb["lr"]
    assert all(np.array_equal(x, y) for x, y in zip(sa["exp_avg_sq"], sb["exp_avg_sq"], strict=True))


def test_training_continues_identically_across_tracks(tmp_path):
    """NumPy trains 3 steps, torch resumes from its checkpoint (weights and Adam state) and matches NumPy."""
    a = np_model()
    opt_a = tn.make_adam(a, lr=0.01)
    np_train(a, opt_a)
    tn.save_checkpoint(tmp_path / "a.npz", a, opt_a)
    b = TorchModel(seed=4)
    opt_b = tt.make_adam(b)
    tt.load_checkpoint(tmp_path / "a.npz", b, opt_b)
    np_train(a, opt_a, 3)
    torch_train(b, opt_b, 3)
    for k, v in a.state_dict().items():
        assert np.abs(v - b.state_dict()[k].detach().numpy()).max() < 1e-12, k


def test_torch_model_without_optimizer_state_exports(tmp_path):
    tmodel = TorchModel()
    topt = tt.make_adam(tmodel)  # no step yet: no state
    tt.export_npz(tmp_path / "t.npz", tmodel, topt)
    model = np_model(seed=3)
    opt = tn.make_adam(model)
    np_train(model, opt)  # a state of its own, which the file's empty one must replace
    tn.load_checkpoint(tmp_path / "t.npz", model, opt)
    assert opt.step_count == 0 and all((m == 0).all() for m in opt.exp_avg + opt.exp_avg_sq)
    assert_same_state(t2n(tmodel.state_dict()), model.state_dict())


def test_float64_file_loads_into_float32_model(tmp_path):
    tn.save_checkpoint(tmp_path / "c.npz", np_model(np.float64))
    m32 = np_model(np.float32, seed=3)
    tn.load_checkpoint(tmp_path / "c.npz", m32)
    assert m32.emb.weight.dtype == np.float32
    assert np.array_equal(m32.emb.weight.data, np_model(np.float64).emb.weight.data.astype(np.float32))


# -- clear errors ------------------------------------------------------------------------------------------------


def test_mismatched_model_names_the_key_or_the_shape(tmp_path):
    tn.save_checkpoint(tmp_path / "c.npz", np_model(d=6))
    tt.save_checkpoint(tmp_path / "c.pt", TorchModel(d=6))
    for load, wide in ((tn.load_checkpoint, np_model(d=8)), (tt.load_checkpoint, TorchModel(d=8))):
        for f in ("c.npz", "c.pt") if load is tt.load_checkpoint else ("c.npz",):
            with pytest.raises(ValueError, match=r"'emb.weight' expected shape \(7, 8\), got \(7, 6\)"):
                load(tmp_path / f, wide)
    other = np_model()
    other.extra_layer = tn.Linear(2, 2)
    with pytest.raises(KeyError, match=r"missing keys \['extra_layer.weight', 'extra_layer.bias'\]"):
        tn.load_checkpoint(tmp_path / "c.npz", other)
    small = tn.Module()
    small.emb = tn.Embedding(7, 6)
    with pytest.raises(KeyError, match=r"unexpected keys \['norm.weight', 'norm.bias', 'out.weight', 'out.bias'\]"):
        tn.load_checkpoint(tmp_path / "c.npz", small)


def test_failed_load_changes_nothing(tmp_path):
    tn.save_checkpoint(tmp_path / "c.npz", np_model(seed=1))
    model = np_model(seed=2)
    model.norm.weight = tn.module.Parameter(np.ones(5))  # wrong shape for the file
    opt = tn.make_adam(model)
    before = model.state_dict()
    with pytest.raises(ValueError, match="norm.weight"):
        tn.load_checkpoint(tmp_path / "c.npz", model)
    assert_same_state(before, model.state_dict())
    model = np_model(seed=2)
    opt = tn.make_adam(model)
    with pytest.raises(KeyError, match="no optimizer state"):
        tn.load_checkpoint(tmp_path / "c.npz", model, opt)
    assert_same_state(np_model(seed=2).state_dict(), model.state_dict())


def test_mismatched_optimizer_is_a_clear_error(tmp_path):
    model = np_model()
    opt = tn.make_adam(model)
    np_train(model, opt, 1)
    tn.save_checkpoint(tmp_path / "c.npz", model, opt)
    fewer = tn.Adam(model.parameters()[:2])
    with pytest.raises(ValueError, match="exp_avg: 5 arrays, the optimizer has 2"):
        tn.load_checkpoint(tmp_path / "c.npz", np_model(), fewer)
    tmodel = TorchModel()
    topt = tt.make_adam(tmodel)
    torch_train(tmodel, topt, 1)
    tt.save_checkpoint(tmp_path / "c.pt", tmodel, topt)
    t2 = TorchModel()
    wrong = tt.Adam(list(t2.parameters())[::-1])  # same sizes, moments would land on the wrong shapes
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' of parameter 0 expected shape \(7\,\)"):
        tt.load_checkpoint(tmp_path / "c.pt", t2, wrong)
    with pytest.raises(TypeError, match="only Adam with one param group"):
        tt.load_checkpoint(tmp_path / "c.npz", TorchModel(), torch.optim.SGD(TorchModel().parameters(), lr=0.1))


def _damaged_copies(path, tmp_path):
    data = path.read_bytes()
    truncated = tmp_path / ("truncated" + path.suffix)
    truncated.write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    with zipfile.ZipFile(path) as z:  # flip bytes in the middle of the largest member's data: a CRC error
        info = max(z.infolist(), key=lambda i: i.file_size)
    o = info.header_offset  # the local header: 30 bytes, then the name and the extra field (lengths at 26, 28)
    start = o + 30 + int.from_bytes(data[o + 26 : o + 28], "little") + int.from_bytes(data[o + 28 : o + 30], "little")
    for i in range(start + info.compress_size // 2, start + info.compress_size // 2 + 8):
        flipped[i] ^= 0xFF
    corrupted = tmp_path / ("corrupted" + path.suffix)
    corrupted.write_bytes(bytes(flipped))
    garbage = tmp_path / ("garbage" + path.suffix)
    garbage.write_bytes(b"this is not a checkpoint at all")
    return [truncated, corrupted, garbage]


def test_damaged_files_give_a_clear_error(tmp_path):
    npz = tn.save_checkpoint(tmp_path / "c.npz", np_model())
    pt = tt.save_checkpoint(tmp_path / "c.pt", TorchModel())
    for bad in _damaged_copies(npz, tmp_path):
        with pytest.raises(ValueError, match="cannot read .* checkpoint"):
            tn.load_checkpoint(bad, np_model())
    for bad in _damaged_copies(pt, tmp_path) + [tmp_path / "truncated.npz"]:
        with pytest.raises(ValueError, match="cannot read .* checkpoint"):
            tt.load_checkpoint(bad, TorchModel())
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        tn.load_checkpoint(tmp_path / "missing.npz", np_model())
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        tt.load_checkpoint(tmp_path / "missing.pt", TorchModel())


def test_foreign_files_give_a_clear_error(tmp_path, capsys):
    tt.save_checkpoint(tmp_path / "c.pt", TorchModel())
    with pytest.raises(ValueError, match="is a torch checkpoint.*export_npz"):
        tn.load_checkpoint(tmp_path / "c.pt", np_model())
    np.savez(tmp_path / "plain.npz", a=np.ones(3))
    with pytest.raises(ValueError, match="not a checkpoint: no '__meta__'"):
        tn.load_checkpoint(tmp_path / "plain.npz", np_model())
    np.savez(tmp_path / "fake.npz", __meta__=np.array('{"format": "something else"}'))
    with pytest.raises(ValueError, match="not a transformer-twice-checkpoint file .format 'something else'"):
        tn.load_checkpoint(tmp_path / "fake.npz", np_model())
    path = tn.save_checkpoint(tmp_path / "good.npz", np_model())
    with np.load(path) as z:
        entries = dict(z)
    np.savez(tmp_path / "stray.npz", **entries, **{"model/extra.weight": np.ones(2)})
    with pytest.raises(KeyError, match=r"not recorded \['extra.weight'\]"):
        tn.load_checkpoint(tmp_path / "stray.npz", np_model())
    del entries["model/out.bias"]
    np.savez(tmp_path / "lacking.npz", **entries)
    with pytest.raises(KeyError, match=r"missing \['out.bias'\]"):
        tn.load_checkpoint(tmp_path / "lacking.npz", np_model())
    np.save(tmp_path / "single.npy", np.ones(3))
    with pytest.raises(ValueError, match="not an .npz archive"):
        tn.load_checkpoint(tmp_path / "single.npy", np_model())
    np.savez(tmp_path / "pickled.npz", a=np.array([{"x": 1}], dtype=object))  # needs pickle to load: refused
    with pytest.raises(ValueError, match="allow_pickle=False"):
        tn.load_checkpoint(tmp_path / "pickled.npz", np_model())
    torch.save({"model": TorchModel().state_dict()}, tmp_path / "bare.pt")
    with pytest.raises(ValueError, match="not a transformer-twice-checkpoint file"):
        tt.load_checkpoint(tmp_path / "bare.pt", TorchModel())

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled code ran",))

    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="cannot read .* (weights_only|Unpickl)"):
        tt.load_checkpoint(tmp_path / "evil.pt", TorchModel())
    assert "unpickled code ran" not in capsys.readouterr().out


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="extra must be JSON-serializable"):
        tn.save_checkpoint(tmp_path / "c.npz", np_model(), extra={"a": np.ones(2)})
    with pytest.raises(TypeError, match="extra must be JSON-serializable"):
        tt.save_checkpoint(tmp_path / "c.pt", TorchModel(), extra={"a": object()})
    with pytest.raises(TypeError, match="extra expected a dict"):
        tn.save_checkpoint(tmp_path / "c.npz", np_model(), extra=[1, 2])
    assert list(tmp_path.iterdir()) == []  # nothing written when the arguments are wrong
    with pytest.raises(TypeError, match="model expected a tfm_numpy Module"):
        tn.save_checkpoint(tmp_path / "c.npz", TorchModel())
    with pytest.raises(TypeError, match="model expected a torch.nn.Module"):
        tt.save_checkpoint(tmp_path / "c.pt", np_model())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tn.save_checkpoint(tmp_path / "no" / "dir.npz", np_model())


def test_the_books_one_liner_and_the_checkpoint_agree(tmp_path):
    """Loading through a file gives exactly what the in-memory state_dict transfer gives."""
    src, via_file, via_memory = np_model(), TorchModel(seed=3), TorchModel(seed=4)
    tn.save_checkpoint(tmp_path / "c.npz", src)
    tt.load_checkpoint(tmp_path / "c.npz", via_file)
    load_np_into_torch(src, via_memory)
    assert_same_state(t2n(via_file.state_dict()), t2n(via_memory.state_dict()))


def test_a_transformer_moves_between_tracks_through_files(tmp_path):
    """The real model on a real batch: NumPy -> .npz -> torch gives the same logits, and back through export_npz."""
    from tfm_common import data as D

    pairs = D.number_pairs([21, 345, 7, 1000])
    src_vocab, tgt_vocab = D.Vocab.build(s for s, _ in pairs), D.Vocab.build(t for _, t in pairs)
    (batch,) = D.make_batches(D.encode_pairs(pairs, src_vocab, tgt_vocab), 4, shuffle=False)
    cfg = dict(d_model=8, n_heads=2, d_ff=16, n_layers=1, dropout=0.0, max_len=64, pad_id=D.PAD_ID)
    np_tf = tn.Transformer(len(src_vocab), len(tgt_vocab), **cfg, rng=0, dtype=np.float64)
    logits = np_tf(batch.src, batch.tgt_in)
    tn.save_checkpoint(tmp_path / "tf.npz", np_tf, extra={"config": cfg, "tgt_vocab": tgt_vocab.to_dict()})
    t_tf = tt.Transformer(len(src_vocab), len(tgt_vocab), **cfg, rng=1, dtype=torch.float64).eval()
    extra = tt.load_checkpoint(tmp_path / "tf.npz", t_tf)
    assert extra["config"] == cfg and D.Vocab.from_dict(extra["tgt_vocab"]) == tgt_vocab
    t_logits = t_tf(torch.from_numpy(batch.src), torch.from_numpy(batch.tgt_in)).detach().numpy()
    assert np.abs(t_logits - logits).max() < 1e-10
    tt.export_npz(tmp_path / "back.npz", t_tf)
    back = tn.Transformer(len(src_vocab), len(tgt_vocab), **cfg, rng=2, dtype=np.float64)
    tn.load_checkpoint(tmp_path / "back.npz", back)
    assert np.array_equal(back(batch.src, batch.tgt_in), logits)


@pytest.mark.parametrize("src, dst", [(tn, tt), (tt, tn)])
def test_load_model_builds_a_bert_and_a_moe_gpt_from_a_file(tmp_path, src, dst):
    """BERT (chapter 22a) and MoEGPT (chapter 20c) record their configuration: either track builds them from a file."""
    sizes = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=12)
    made = [src.BERT(**sizes, dropout=0.0, pad_id=0, dtype=src_float64(src)),
            src.MoEGPT(**sizes, n_experts=2, top_k=1, dtype=src_float64(src))]  # fmt: skip
    x = np.array([[1, 2, 3, 0]])
    for model in made:
        path = tmp_path / f"{type(model).__name__}.npz"
        (src.export_npz if src is tt else src.save_checkpoint)(path, model)  # torch writes .npz on request
        built = dst.load_model(path)
        assert type(built).__name__ == type(model).__name__
        assert built.config == model.config
        np.testing.assert_allclose(as_numpy(built.eval()(as_tokens(dst, x))), as_numpy(model.eval()(as_tokens(src, x))),
                                   atol=1e-12)  # fmt: skip


def src_float64(track):
    return torch.float64 if track is tt else np.float64


def as_tokens(track, x):
    return torch.as_tensor(x) if track is tt else x


def as_numpy(y):
    return y.detach().numpy() if isinstance(y, torch.Tensor) else y
