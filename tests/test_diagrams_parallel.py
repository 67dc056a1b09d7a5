"""Chapter 20a's diagrams: the ring's schedule is what RingMember really sends; ZeRO's names are the library's."""

import inspect
import io
import threading

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

import tfm_numpy as tnp  # noqa: E402
import tfm_torch as tpt  # noqa: E402
from tfm_common.diagrams_parallel import (  # noqa: E402
    plot_ring_allreduce,
    plot_zero_sharding,
    ring_steps,
    zero_bytes_per_parameter,
)


def texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def renders(fig: Figure) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


class Recording(tnp.RingMember):
    """RingMember that keeps a copy of every array it sends."""

    def __init__(self, ring, rank):
        super().__init__(ring, rank)
        self.sent = []

    def _exchange(self, send, recv_size):
        self.sent.append(send.copy())
        return super()._exchange(send, recv_size)


def run_ring(world, xs):
    """The chapter's ring, its members as threads of this process: every member's all_reduce of its own x."""
    ring = tnp.Ring(world, xs[0].size)
    members = [Recording(ring, r) for r in range(world)]
    out = [None] * world

    def work(r):
        out[r] = members[r].all_reduce(xs[r])

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return out, [m.sent for m in members], [m.bytes_sent for m in members]
    finally:
        for m in members:
            m.close()
        ring.close()


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_ring_steps_are_what_ringmember_sends(world):
    """Step by step, each rank sends the chunk ring_steps says, holding the sum of the ranks it says."""
    n = 3 * world + 1  # chunks of unequal size, as np.array_split cuts them
    xs = [np.random.default_rng(r).standard_normal(n) for r in range(world)]
    out, sent, sent_bytes = run_ring(world, xs)
    for o in out:
        np.testing.assert_allclose(o, sum(xs), atol=1e-12)
    steps = ring_steps(world)
    assert len(steps) == 2 * (world - 1) and all(len(s) == len(steps) for s in sent)
    for i, step in enumerate(steps):
        for r, (chunk, ranks) in enumerate(step["sends"]):
            expected = sum(np.array_split(xs[q], world)[chunk] for q in ranks)
            np.testing.assert_allclose(sent[r][i], expected, atol=1e-12, err_msg=f"step {i}, rank {r}")
    assert all(len(cell) == world for row in steps[-1]["state"] for cell in row)  # every chunk the full sum
    after_rs = steps[world - 2]["state"]
    assert all(len(after_rs[r][r]) == world for r in range(world))  # reduce_scatter: rank r holds chunk r
    assert sum(sent_bytes) / world == pytest.approx(tnp.ring_bytes(n * 8, world), abs=8)


def test_ring_figure_carries_the_library_names():
    fig = plot_ring_allreduce(4)
    found = texts(fig)
    for label in ("RingMember.all_reduce", "reduce_scatter", "all_gather", "ring_bytes(n_bytes, W)", "rank 3",
                  "reduce-scatter\nstep 3 of 3", "all-gather\nstep 1 of 3", "2(W − 1) messages", "Σ"):  # fmt: skip
        assert label in found, label
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        assert callable(getattr(tnp.RingMember, name))
    assert len(fig.axes) == 2 * 4  # the ring, the start, 2 (W - 1) steps
    renders(fig)


def test_zero_figure_names_are_real_and_bytes_match_the_chapter_table():
    fig = plot_zero_sharding(4)
    found = texts(fig)
    for label in ("DDP (replicated)", "ZeRO-1 (optimizer)", "ZeRO-2 (+ gradients)", "ZeRO-3 / FSDP (+ weights)",
                  "train_data_parallel(..., zero=True)", "train_ddp(..., shard=True): fully_shard", "exp_avg_sq",
                  "16 bytes per parameter", "10 bytes per parameter", "7 bytes per parameter",
                  "4 bytes per parameter"):  # fmt: skip
        assert label in found, label
    assert "zero" in inspect.signature(tnp.train_data_parallel).parameters
    assert "shard" in inspect.signature(tpt.train_ddp).parameters
    adam = tnp.Adam([tnp.Parameter(np.zeros(3))])
    assert len(adam.exp_avg) == len(adam.exp_avg_sq) == 1  # Adam's two moments, by the drawn names
    # the chapter's per_device formulas, per parameter
    for w in (2, 8, 64):
        assert zero_bytes_per_parameter("DDP (replicated)", w) == 16
        assert zero_bytes_per_parameter("ZeRO-1 (optimizer)", w) == 4 + 4 + 8 / w
        assert zero_bytes_per_parameter("ZeRO-2 (+ gradients)", w) == 4 + 12 / w
        assert zero_bytes_per_parameter("ZeRO-3 / FSDP (+ weights)", w) == 16 / w
    renders(fig)


def test_refused_arguments():
    with pytest.raises(ValueError, match="world expected an integer from 2 to 8, got 1"):
        plot_ring_allreduce(1)
    with pytest.raises(ValueError, match="world expected an integer from 2 to 8, got 9"):
        plot_zero_sharding(9)
    with pytest.raises(ValueError, match="scheme expected one of"):
        zero_bytes_per_parameter("ZeRO-4", 2)
