"""Chapter 17b's recipe, once (tfm_common.lm_recipe): the schedule, the loop in either track, bits per byte."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tfm_numpy as tnp
import tfm_torch as tpt
from tfm_common.bpe import ByteBPE
from tfm_common.lm_recipe import bits_per_byte, train_lm, warmup_decay


def test_warmup_decay_shape():
    rates = [warmup_decay(s, 100, 1e-2, 10) for s in range(1, 101)]
    assert rates[9] == pytest.approx(1e-2) and rates[0] == pytest.approx(1e-3)
    assert np.all(np.diff(rates[:10]) > 0) and np.all(np.diff(rates[10:]) < 0) and rates[-1] > 0


def test_train_lm_same_in_both_tracks_and_learns():
    ids = np.tile(np.arange(12, dtype=np.int64), 40)  # a periodic text: learnable in a few steps
    cfg = dict(vocab_size=12, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16)
    m_np = tnp.GPT(**cfg, rng=0, dtype=np.float64)
    m_t = tpt.GPT(**cfg, rng=1, dtype=torch.float64)
    m_t.load_state_dict({k: torch.from_numpy(v) for k, v in m_np.state_dict().items()})
    kw = dict(steps=30, batch_size=4, block_size=8, peak=1e-2, warmup=5, seed=3)
    a, b = train_lm(m_np, tnp, ids, **kw), train_lm(m_t, tpt, ids, **kw)
    assert a.shape == (30,) and np.abs(a - b).max() < 1e-10
    assert a[-5:].mean() < 0.5 * a[:5].mean()


def test_bits_per_byte_of_single_bytes():
    bpe = ByteBPE([])  # no merges: one token per byte
    targets = np.array([[104, 105], [33, 10]])
    assert bits_per_byte(math.log(2), targets, bpe) == pytest.approx(1.0)
