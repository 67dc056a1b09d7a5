"""Hostile files and data, both tracks (issue 32, items 9, 10, 12, 13): the tokenizer, the data helpers, the dtype
argument, crafted checkpoints and tied weights. Every case is refused with a clear error naming the argument, or
gives a documented result; a crafted checkpoint is refused before anything is built, under a memory limit.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hostile import TRACKS, refused_before_allocating

import tfm_numpy as tn
import tfm_torch as tt
from tfm_common.bpe import ByteBPE
from tfm_common.config import config_numbers
from tfm_common.corpus import split_ids
from tfm_common.npz_checkpoint import META_KEY, UNSTORED_ALLOWANCE

ROOT = Path(__file__).resolve().parents[1]
GPT_TINY = dict(vocab_size=11, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=12)


def gpt(L, **kw):
    return L.GPT(**{**GPT_TINY, **kw}, dtype=np.float64 if L is tn else torch.float64)


# -- item 9: the tokenizer and the data helpers -----------------------------------------------------------------


@pytest.mark.parametrize("ids", [{104: "x"}, {104, 105}], ids=["dict", "set"])
def test_bpe_decode_refuses_a_dict_or_a_set(ids):
    with pytest.raises(TypeError, match="ByteBPE.decode: ids expected a sequence of ints, got (dict|set)"):
        ByteBPE().decode(ids)


@pytest.mark.parametrize("ids", [torch.tensor([True, False]), torch.tensor([104.0])], ids=["bool", "float"])
def test_bpe_decode_refuses_bool_and_float_tensors(ids):
    with pytest.raises(
        TypeError, match="ByteBPE.decode: ids expected integer token ids, got dtype torch.(bool|float32)"
    ):
        ByteBPE().decode(ids)


@pytest.mark.parametrize("pair", [(True, False), (104, True), 104, "ab"])
def test_bpe_merges_are_pairs_of_int_ids(pair):
    with pytest.raises(ValueError, match=r"ByteBPE: merge 0 must be a pair of ids below 256 \(ints, not bools\)"):
        ByteBPE([pair])


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: ByteBPE(pattern=b"(unclosed"), ValueError, "ByteBPE: pattern is not a valid regular expression"),
        (lambda: ByteBPE(pattern="\u20ac+"), ValueError, "ByteBPE: pattern as a str must hold only latin-1"),
        (lambda: ByteBPE.train("ab ab", 260, pretokenize="[a-"), ValueError, "pretokenize is not a valid regular"),
        (lambda: ByteBPE.train("ab ab", 260, pretokenize="\u20ac"), ValueError, "pretokenize as a str must hold"),
    ],
)
def test_bpe_patterns_are_checked_when_given(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_a_latin_1_str_pattern_still_works():
    assert ByteBPE(pattern="[a-z\u00e9]+").encode("caf\u00e9") == list("café".encode())


@pytest.mark.parametrize(
    "content, match",
    [
        ({"format": "tfm_common.bpe.ByteBPE", "version": 1, "pattern": None}, "has no valid 'merges' entry"),
        ({"format": "tfm_common.bpe.ByteBPE", "version": 1, "merges": {}, "pattern": None}, "no valid 'merges'"),
        ({"format": "tfm_common.bpe.ByteBPE", "version": 1, "merges": []}, "has no valid 'pattern' entry"),
        ({"format": "tfm_common.bpe.ByteBPE", "version": 1, "merges": [7], "pattern": None}, "merge 0 must be"),
        (
            {"format": "tfm_common.bpe.ByteBPE", "version": 1, "merges": [], "pattern": None, "merge_counts": 3},
            "merge_counts must be a list of ints",
        ),
        ("{not json", "is not a saved ByteBPE .not JSON"),
    ],
)
def test_bpe_load_names_what_a_damaged_file_lacks(tmp_path, content, match):
    path = tmp_path / "bpe.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match):
        ByteBPE.load(path)


@pytest.mark.parametrize("n, fraction", [(3, 0.1), (1, 0.9), (2, 0.2)])
def test_split_ids_refuses_an_empty_part(n, fraction):
    with pytest.raises(ValueError, match=rf"split_ids: val_fraction={fraction} of {n} ids leaves"):
        split_ids(np.arange(n), fraction)


def test_split_ids_keeps_both_parts_when_they_fit():
    head, tail = split_ids(np.arange(3), 0.4)
    assert head.tolist() == [0, 1] and tail.tolist() == [2]


# -- item 10: one dtype rule for both tracks ----------------------------------------------------------------------


@TRACKS
@pytest.mark.parametrize("name", ["float32", "float64"])
def test_dtype_names_are_accepted_by_both_tracks(L, name):
    layer = L.Linear(2, 3, dtype=name)
    assert str(layer.weight.dtype).removeprefix("torch.") == name
    assert str(L.GPT(**GPT_TINY, dtype=name).embed.weight.dtype).removeprefix("torch.") == name


@TRACKS
@pytest.mark.parametrize("dtype", ["f8", "double", "float16", "int32"])
def test_other_dtype_strings_are_refused_by_both_tracks(L, dtype):
    with pytest.raises(TypeError, match=rf"dtype: expected .*float32 or .*float64 .*names.*, got '{dtype}'"):
        L.Linear(2, 3, dtype=dtype)


def test_numpy_names_what_it_expects_for_a_torch_dtype():
    with pytest.raises(TypeError, match=r"dtype: expected float32 or float64 \(numpy.float32, .*got torch.float64"):
        tn.Linear(2, 3, dtype=torch.float64)


def test_torch_names_what_it_expects_for_a_numpy_dtype():
    with pytest.raises(TypeError, match=r"dtype: expected torch.float32 or torch.float64 .*float64"):
        tt.Linear(2, 3, dtype=np.float64)


# -- item 12: a crafted checkpoint's configuration is compared with its arrays before anything is built ------------


def _rewrite_npz_config(path, **config):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays[META_KEY][()]))
    meta["model"]["config"].update(config)
    arrays[META_KEY] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    return path


def _rewrite_pt_config(path, **config):
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_meta"]["config"].update(config)
    torch.save(ckpt, path)
    return path


CLAIMS = {  # what a few KB of file may declare: far more than it stores
    "vocab 1e9 x d_model 1e4": dict(vocab_size=10**9, d_model=10**4, n_heads=1),
    "d_model 1e6": dict(d_model=10**6, n_heads=1),
    "n_layers 1e6": dict(n_layers=10**6),
    "d_ff 1e9": dict(d_ff=10**9),
    "max_len 1e9": dict(max_len=10**9),
    "huge ints": dict(vocab_size=10**40, d_model=10**40),
}


def _huge_header(tmp_path) -> Path:
    """A checkpoint whose 'model/embed.weight' entry is a .npy header claiming (10**6, 10**4) float32 and 64 bytes."""
    path = tn.save_checkpoint(tmp_path / "header.npz", gpt(tn))
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**4)})
    entries["model/embed.weight.npy"] = header.getvalue() + bytes(64)
    with zipfile.ZipFile(path, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)
    return path


def _stride_0_view(tmp_path) -> Path:
    """A torch file whose embedding is one stored number viewed as (10**6, 10**4) with stride 0, and a configuration
    that matches that claimed shape: shapes alone would call it 10**10 stored numbers."""
    path = tt.save_checkpoint(tmp_path / "view.pt", gpt(tt))
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_meta"]["config"].update(vocab_size=10**6, d_model=10**4, n_heads=1)
    view = torch.zeros(1).as_strided((10**6, 10**4), (0, 0))
    ckpt["model"]["embed.weight"] = ckpt["model"]["output_projection.weight"] = view
    torch.save(ckpt, path)
    return path


def _crafted(tmp_path, kind: str, claim: str) -> Path:
    if claim == "npy header":
        return _huge_header(tmp_path)
    if claim == "stride-0 view":
        return _stride_0_view(tmp_path)
    if kind == "npz":
        return _rewrite_npz_config(tn.save_checkpoint(tmp_path / f"{claim}.npz", gpt(tn)), **CLAIMS[claim])
    return _rewrite_pt_config(tt.save_checkpoint(tmp_path / f"{claim}.pt", gpt(tt)), **CLAIMS[claim])


# In this process only the claims that fail fast on an unguarded loader (a regression must not take the machine's
# memory); every claim runs in the child process below, under an address-space limit.
@pytest.mark.parametrize("claim", ["vocab 1e9 x d_model 1e4", "huge ints"])
@pytest.mark.parametrize("L, kind", [(tn, "npz"), (tt, "npz"), (tt, "pt")], ids=["numpy-npz", "torch-npz", "torch-pt"])
def test_a_crafted_configuration_is_refused_before_building(L, kind, claim, tmp_path):
    path = _crafted(tmp_path, kind, claim)
    assert path.stat().st_size < 64 * 2**10
    with refused_before_allocating(limit=16 * 2**20):  # NumPy's allocations traced; torch's: the test below
        with pytest.raises(ValueError, match=r"declares a GPT of at least .* numbers .*, but stores \d+"):
            L.load_model(path)


CHILD = """
import json, resource, sys, time
import tfm_numpy as tn, tfm_torch as tt
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))  # 256 MiB above what runs now
out = []
for track, path in json.loads(sys.argv[1]):
    t0 = time.perf_counter()
    try:
        (tn if track == "numpy" else tt).load_model(path)
        out.append([path, "loaded", "", 0.0])
    except BaseException as e:
        out.append([path, type(e).__name__, str(e)[:300], time.perf_counter() - t0])
print(json.dumps(out))
"""


def test_crafted_checkpoints_are_refused_under_a_memory_limit(tmp_path):
    """Every claim, both formats, both tracks, in a child process whose address space is capped at 256 MiB above
    what it holds after the imports: building any of these models would fail there (MemoryError, or torch's
    RuntimeError), so a ValueError naming the declared size shows the refusal came before building."""
    for part in ("n", "tn", "tp"):
        (tmp_path / part).mkdir()
    jobs = [("numpy", str(_crafted(tmp_path / "n", "npz", c))) for c in [*CLAIMS, "npy header"]]
    jobs += [("torch", str(_crafted(tmp_path / "tn", "npz", c))) for c in [*CLAIMS, "npy header"]]
    jobs += [("torch", str(_crafted(tmp_path / "tp", "pt", c))) for c in [*CLAIMS, "stride-0 view"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), json.dumps(jobs)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    bad = [
        (Path(p).name, kind, msg[:120]) for p, kind, msg, _ in results if kind != "ValueError" or "declares" not in msg
    ]
    assert not bad, bad
    assert max(t for *_, t in results) < 5.0  # a guard against a hang; each refusal takes milliseconds


@pytest.mark.parametrize("L, kind", [(tn, "npz"), (tt, "npz"), (tt, "pt")], ids=["numpy-npz", "torch-npz", "torch-pt"])
def test_a_file_naming_a_layer_class_is_not_built_from_its_sizes(L, kind, tmp_path):
    """A layer records no configuration, so no honest file names one; a crafted one would pass the file's sizes
    straight to its constructor (Linear(10**9, 10**4))."""
    path = _crafted(tmp_path, kind, "vocab 1e9 x d_model 1e4")
    meta_class, config = "Linear", {"in_features": 10**9, "out_features": 10**4}
    if kind == "npz":
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays[META_KEY][()]))
        meta["model"].update({"class": meta_class, "config": config})
        arrays[META_KEY] = np.array(json.dumps(meta))
        np.savez(path, **arrays)
    else:
        ckpt = torch.load(path, weights_only=True)
        ckpt["model_meta"].update({"class": meta_class, "config": config})
        torch.save(ckpt, path)
    with refused_before_allocating(limit=16 * 2**20):
        with pytest.raises(ValueError, match="names a Linear, which records no configuration: only a Transformer"):
            L.load_model(path)


@TRACKS
def test_an_npy_header_claiming_more_than_its_entry_holds_is_refused(L, tmp_path):
    path = _huge_header(tmp_path)
    with refused_before_allocating(limit=16 * 2**20):
        with pytest.raises(ValueError, match=r"'model/embed.weight.npy' declares shape \(1000000, 10000\) of float32 "
                                             r"\(40000000000 bytes\) but holds 64 bytes"):  # fmt: skip
            L.load_model(path)
    with pytest.raises(ValueError, match="declares shape"):
        L.load_checkpoint(path, gpt(L))


def test_a_torch_view_counts_the_numbers_it_stores_not_its_shape(tmp_path):
    with pytest.raises(ValueError, match=r"declares a GPT of at least 1e\+10 numbers .*, but stores \d{3} "):
        tt.load_model(_stride_0_view(tmp_path))


@pytest.mark.parametrize(
    "cls, kw",
    [
        ("Transformer", dict(src_vocab_size=11, tgt_vocab_size=13, d_model=8, n_heads=2, d_ff=16, n_layers=2,
                             positional="learned", max_len=12)),
        ("GPT", dict(GPT_TINY, positional="learned")),
        ("ViT", dict(image_size=16, patch_size=4, in_channels=3, n_classes=5, d_model=8, n_heads=2, d_ff=12,
                     n_layers=2)),
    ],
)  # fmt: skip
def test_config_numbers_is_a_lower_bound_of_what_a_model_stores(cls, kw):
    m = getattr(tn, cls)(**kw)
    stored = sum(v.size for v in m.state_dict().values())
    assert 0 < config_numbers(cls, m.config) <= stored


@TRACKS
@pytest.mark.parametrize(
    "cls, kw",
    [
        ("Transformer", dict(src_vocab_size=11, tgt_vocab_size=11, d_model=16, n_heads=2, d_ff=16, n_layers=1)),
        ("GPT", dict(GPT_TINY, positional="rope", max_len=4096)),
        ("GPT", dict(GPT_TINY, positional="sinusoidal", max_len=4096, activation="swiglu")),
        ("ViT", dict(image_size=16, patch_size=4, in_channels=3, n_classes=5, d_model=8, n_heads=2, d_ff=12,
                     n_layers=1)),
        ("Swin", dict(image_size=16, patch_size=2, in_channels=3, n_classes=5, d_model=8)),
    ],
    ids=["transformer-5000-positions", "gpt-rope", "gpt-sinusoidal-swiglu", "vit", "swin"],
)  # fmt: skip
def test_honest_checkpoints_with_computed_tables_still_load(L, cls, kw, tmp_path):
    """Models whose tables are computed, not stored (max_len=5000 sinusoidal positions by default), stay within the
    allowance: load_model builds them as before."""
    m = getattr(L, cls)(**kw)
    path = tn.save_checkpoint(tmp_path / "m.npz", m) if L is tn else tt.save_checkpoint(tmp_path / "m.pt", m)
    got = L.load_model(path)
    assert got.config == m.config
    assert UNSTORED_ALLOWANCE >= 5000 * 16 * 2


# -- item 13: tied weights --------------------------------------------------------------------------------------


def _save_path(L, tmp_path):
    return tmp_path / ("c.npz" if L is tn else "c.pt")


@TRACKS
def test_a_nan_in_a_tied_embedding_saves_and_loads(L, tmp_path):
    m = gpt(L)  # tie_output=True: embed.weight and output_projection.weight are one parameter
    if L is tn:
        m.embed.weight.data[3, 1] = np.nan
    else:
        with torch.no_grad():
            m.embed.weight[3, 1] = float("nan")
    path = L.save_checkpoint(_save_path(L, tmp_path), m)
    got = L.load_model(path)
    w = np.asarray(got.embed.weight.data if L is tn else got.embed.weight.detach())
    assert np.isnan(w[3, 1]) and np.isnan(w).sum() == 1
    dst = gpt(L)
    L.load_checkpoint(path, dst)
    assert np.isnan(np.asarray(dst.state_dict()["output_projection.weight"])[3, 1])


def _copy_state(L, m):
    return {k: (v.copy() if L is tn else v.detach().clone()) for k, v in m.state_dict().items()}


@TRACKS
@pytest.mark.parametrize("key", ["embed.weight", "output_projection.weight"])
def test_load_state_dict_refuses_two_values_for_one_tied_weight(L, key):
    m = gpt(L)
    before = _copy_state(L, m)
    state = _copy_state(L, gpt(L))
    state[key] = state[key] + 1
    with pytest.raises(ValueError, match="'embed.weight' and 'output_projection.weight' are one tied parameter in "
                                         "this model, but the state_dict holds different values"):  # fmt: skip
        m.load_state_dict(state)
    after = m.state_dict()
    assert all(np.array_equal(np.asarray(after[k]), np.asarray(v)) for k, v in before.items())  # nothing changed


@TRACKS
def test_load_state_dict_takes_a_tied_weight_holding_nan_under_both_names(L):
    m, state = gpt(L), _copy_state(L, gpt(L))
    state["embed.weight"][0, 0] = float("nan")
    state["output_projection.weight"][0, 0] = float("nan")
    m.load_state_dict(state)
    assert np.isnan(np.asarray(m.state_dict()["output_projection.weight"])[0, 0])


# -- Also: state_dict semantics differ by design: NumPy copies, torch returns the live tensors -------------------


def test_numpy_state_dict_is_a_copy():
    m = gpt(tn)
    best = m.state_dict()
    m.embed.weight.data += 1.0  # training goes on
    assert not np.array_equal(best["embed.weight"], m.embed.weight.data)  # best keeps the old values


def test_torch_state_dict_is_live_so_a_best_state_must_be_cloned():
    m = gpt(tt)
    best, kept = m.state_dict(), {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m.embed.weight += 1.0  # training goes on (optimizers update in place)
    assert torch.equal(best["embed.weight"], m.embed.weight)  # the "best" state changed with the model
    assert not torch.equal(kept["embed.weight"], m.embed.weight)  # a clone did not
    assert not best["embed.weight"].requires_grad  # detached, but the same storage
