"""Chapter 20d's diagram: the experts it draws on each process are expert_owner's, the rows on its arrows are what
ExpertParallelMoE really sends (workers as threads)."""

import io
import re
import threading

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy.expert_parallel as nep  # noqa: E402
from tfm_common.diagrams_expert_parallel import plot_expert_parallel, rows_between  # noqa: E402
from tfm_common.expert_parallel import expert_owner  # noqa: E402
from tfm_numpy.moe import MoEFeedForward  # noqa: E402


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def real_run(moe, x, world):
    """The rows each process sent in its dispatch, per destination (from the bytes of a real run, in threads)."""
    xs, dys = np.array_split(x, world), np.array_split(np.ones_like(x), world)
    a2a, ring = nep.exchanges_for(moe, xs, world)
    out = [None] * world

    def work(r):
        out[r] = nep.expert_parallel_step(moe, xs[r], dys[r], r, world, a2a, ring)

    ts = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
    finally:
        a2a.close()
        ring.close()
    return out


def test_diagram_draws_the_real_layout_and_the_real_exchange():
    E, world, d = 4, 2, 8
    moe = MoEFeedForward(d, 16, E, 2, aux_loss_coef=0.0, z_loss_coef=0.0, rng=0, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((6, 3, d))
    out = real_run(moe, x, world)
    moe(x)
    experts = np.split(moe.routing.experts, 2)  # each process's 9 tokens' choices
    rows = rows_between(experts, E, world)
    for s in range(world):  # what the figure says crosses = what the run sent (bytes / row bytes)
        assert out[s]["exchanges"][0] == rows[s, 1 - s] * d * 8
        assert int(out[s]["load"].sum()) == rows[:, s].sum()
    fig = plot_expert_parallel(experts, E, world, d_model=d)
    t = texts(fig)
    for e in range(E):
        owner = int(expert_owner([e], E, world)[0])
        assert re.search(rf"expert {e}\b", t)
        assert e in range(owner * 2, owner * 2 + 2)
    assert f"dispatch 0→1: {rows[0, 1]} rows ({rows[0, 1] * d * 8} B)" in t
    assert f"combine 1→0: {rows[0, 1]} answers" in t and f"dispatch 1→0: {rows[1, 0]} rows" in t
    assert f"keeps {rows[0, 0]} of its own rows at home" in t
    assert f"its experts compute {out[1]['load'].sum()} rows" in t and "ExpertParallelMoE" in t
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_diagram_refusals():
    e = [np.zeros((2, 1), int)] * 2
    with pytest.raises(ValueError, match="n_experts must be divisible by world"):
        plot_expert_parallel(e, 3, 2)
    with pytest.raises(ValueError, match="world expected 2 to 4, got 5"):
        plot_expert_parallel([np.zeros((2, 1), int)] * 5, 5, 5)
    with pytest.raises(ValueError, match="one \\(N, k\\) array per process"):
        rows_between(e, 4, 4)
