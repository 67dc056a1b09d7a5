"""benchmarks/step_breakdown.py: every kind of work it reports is found in both libraries' steps (an operator
renamed by a torch release would otherwise move silently into "the rest"), and the kinds, self times, never
exceed the profiled time (in NumPy they fill it: "the rest" takes what no wrapper timed)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_breakdown as sb  # noqa: E402

TINY = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, batch=2, length=8)


def test_module_types_and_operators_map_to_their_kinds():
    assert sb.numpy_kind("Linear") == sb.torch_kind("aten::addmm", []) == "matrix products"
    assert sb.numpy_kind("GroupedQueryAttention") == "attention"
    assert sb.torch_kind("aten::_scaled_dot_product_flash_attention_for_cpu_backward", []) == "attention"
    assert sb.numpy_kind("GELU") == sb.torch_kind("aten::gelu_backward", []) == "GELU"
    assert sb.numpy_kind("Adam") == "optimizer"
    assert sb.torch_kind("aten::lerp_", ["Optimizer.step#Adam.step"]) == "optimizer"  # by its ancestor
    assert sb.torch_kind("aten::lerp_", []) == sb.numpy_kind("Embedding") == "the rest"


@pytest.mark.parametrize("rounds", [sb.numpy_rounds, sb.torch_rounds], ids=["numpy", "torch.nn"])
def test_a_round_finds_every_kind_and_the_kinds_add_up(monkeypatch, rounds):
    monkeypatch.setattr(sb, "WARMUP", 1)
    r = rounds(TINY)(2)
    kinds = r["kinds_ms"]
    assert set(kinds) == set(sb.KINDS)
    for k in ("matrix products", "attention", "GELU", "LayerNorm", "optimizer"):
        assert kinds[k] > 0, f"no {k} found in the step: {kinds}"
    assert min(kinds.values()) >= 0
    assert sum(kinds.values()) <= r["profiled_ms"] * 1.001  # self times are disjoint parts of the profiled time


def test_the_table_lists_every_kind_and_the_ratio():
    one = {"step_ms": 2.0, "profiled_ms": 2.0, "kinds_ms": dict.fromkeys(sb.KINDS, 2.0 / len(sb.KINDS))}
    text = sb.table("tiny", one, {**one, "step_ms": 1.0})
    assert all(k in text for k in sb.KINDS)
    assert "NumPy / torch.nn 2.00" in text


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        sb.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        sb.main(["--configs", "huge"])
