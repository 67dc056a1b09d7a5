"""The NumPy track keeps its dtype: a float32 model computes in float32 everywhere, a float64 model in float64.

A stray float64 scalar or array (np.float64(1 / n), a float64 random draw multiplied in, np.sqrt of a float64
constant) silently upcasts a float32 array: the results stay right but every later operation runs at half
the speed, on twice the memory. These tests walk one whole training step (forward, loss, backward, gradient
clipping, Adam) and check the dtype of every array a module caches, every gradient a module's backward returns,
every parameter gradient, and the optimizer's state; and the key/value cache of incremental decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfm_numpy as tn

OPTIONS = {
    "post-ln": dict(),
    "pre-ln-gelu-learned-untied": dict(norm_first=True, activation="gelu", positional="learned", tie_output=False),
    "shared-embeddings": dict(share_embeddings=True),
}


def _floating_arrays(obj, path: str):
    """(path, array) for every floating array inside nested tuples, lists and dicts."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f":
            yield path, obj
    elif isinstance(obj, np.floating):
        yield path, np.asarray(obj)
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from _floating_arrays(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from _floating_arrays(x, f"{path}[{k!r}]")


def _record_backward_outputs(model: tn.Module) -> list:
    """Wrap every submodule's backward so that what it returns is recorded: [(module name, returned value)]."""
    seen = []
    for name, module in model.named_modules():
        original = module.backward

        def wrapped(*args, _original=original, _name=name or "model", **kwargs):
            out = _original(*args, **kwargs)
            seen.append((_name, out))
            return out

        object.__setattr__(module, "backward", wrapped)  # an instance attribute: the class is untouched
    return seen


def _one_step(dtype, options: dict):
    model = tn.Transformer(23, 23, d_model=16, n_heads=4, d_ff=32, n_layers=2, dropout=0.1, max_len=12,
                           rng=0, dtype=dtype, **options)  # fmt: skip
    g = np.random.default_rng(0)
    src, tgt = g.integers(1, 23, (3, 7)), g.integers(1, 23, (3, 6))
    src[0, -2:] = tgt[1, -1:] = 0  # some padding on both sides
    loss_fn = tn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    opt = tn.make_adam(model, lr=1e-3, weight_decay=0.01)
    returned = _record_backward_outputs(model)
    logits = model(src, tgt[:, :-1])
    caches = [(name, module._cache) for name, module in model.named_modules()]
    loss = loss_fn(logits, tgt[:, 1:])
    dlogits = loss_fn.backward()
    model.backward(dlogits)
    tn.clip_grad_norm(model.parameters(), 0.5)
    opt.step()
    return model, opt, logits, loss, dlogits, caches, returned


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_a_training_step_never_changes_dtype(dtype, options):
    model, opt, logits, loss, dlogits, caches, returned = _one_step(dtype, options)
    assert logits.dtype == dtype and dlogits.dtype == dtype
    assert isinstance(loss, np.floating) and loss.dtype == dtype
    bad = [f"{name}._cache{path}: {a.dtype}" for name, cache in caches for path, a in _floating_arrays(cache, "")
           if a.dtype != dtype]  # fmt: skip
    assert not bad, f"cached arrays of another dtype: {bad}"
    assert len(returned) > 50  # every layer's backward ran
    bad = [f"{name}.backward -> {path}: {a.dtype}" for name, out in returned for path, a in _floating_arrays(out, "")
           if a.dtype != dtype]  # fmt: skip
    assert not bad, f"gradients of another dtype: {bad}"
    for name, p in model.named_parameters():
        assert p.data.dtype == p.grad.dtype == dtype, name
        assert np.isfinite(p.grad).all(), name
    assert all(a.dtype == dtype for a in opt.exp_avg + opt.exp_avg_sq)


def test_float32_attention_and_softmax_functions_stay_float32():
    g = np.random.default_rng(0)
    q, k, v = (g.standard_normal((2, 3, 5, 4)).astype(np.float32) for _ in range(3))
    mask = tn.causal_mask(5)
    out, w = tn.scaled_dot_product_attention(q, k, v, mask)
    grads = tn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, w)
    assert out.dtype == w.dtype == np.float32 and all(d.dtype == np.float32 for d in grads)
    x = g.standard_normal((4, 7)).astype(np.float32)
    for f in (tn.softmax, tn.log_softmax):
        assert f(x).dtype == np.float32
    assert tn.softmax_backward(tn.softmax(x), x).dtype == np.float32
    assert tn.log_softmax_backward(tn.log_softmax(x), x).dtype == np.float32


def test_float32_decoding_cache_stays_float32():
    model = tn.Transformer(23, 23, d_model=16, n_heads=4, d_ff=32, n_layers=2, dropout=0.0, max_len=12, rng=0)
    src = np.random.default_rng(0).integers(1, 23, (2, 5))
    memory, src_mask = model.encode(src)
    cache: dict = {}
    tokens = np.ones((2, 1), dtype=np.int64)
    for _ in range(3):
        logits = model.decode_step(tokens[:, -1:], memory, src_mask, cache)
        assert logits.dtype == np.float32
        tokens = np.concatenate([tokens, logits[:, -1].argmax(-1)[:, None]], axis=1)
    arrays = list(_floating_arrays(cache, "cache"))
    assert arrays and all(a.dtype == np.float32 for _, a in arrays)
