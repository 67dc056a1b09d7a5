"""benchmarks/gpu_train.py's case sets, and the stored GPU results that chapter 15a prints, checked on the CPU.

The stored numbers come from a GPU that CI does not have, so they cannot be re-measured here; what can be checked
is that each row is consistent with itself and with the book's FLOP formula (the MFU and throughput printed in
chapter 15a follow from the measured step time), and that the cases are the ones the script runs."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402
import gpu_train  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRAIN_FILES = sorted(RESULTS.glob("gpu_train_*.json"))


def test_every_case_set_is_well_formed():
    assert set(gpu_train.CASE_SETS) == {"all", "mfu", "levers"}
    for name, cases in gpu_train.CASE_SETS.items():
        for case in cases:
            row = gpu_train.case_row(case, 96)
            assert set(row) == set(gpu_train.KEYS), (name, case)
            assert row["batch"] % 96 == 0 and row["vocab"] in (8000, 37000)
            assert row["adam"] in ("foreach", "fused") and 0 <= row["dropout"] < 1
            assert (row["model"] == "ours") == (row["attn_impl"] != "torch.nn"), case
            if "cudagraphs" in str(row["compiled"]):  # replayed graphs: the whole step, fused Adam included
                assert row["adam"] == "fused", case


def test_case_row_fills_dropout_and_adam_and_scales_the_batch():
    row = gpu_train.case_row(("ours", "bf16 autocast", "sdpa", "model+loss", 8000, 2), 96)
    assert (row["batch"], row["dropout"], row["adam"]) == (192, 0.0, "foreach")
    row = gpu_train.case_row(gpu_train.MFU_CASES[-1], 96)
    assert (row["vocab"], row["dropout"], row["adam"]) == (37000, 0.1, "fused")


@pytest.mark.parametrize("path", TRAIN_FILES, ids=lambda p: p.name)
def test_stored_rows_agree_with_the_flop_formula_and_their_own_timings(path):
    run = json.loads(path.read_text())
    config, peak = run["config"], run["matmul_bf16"][0]["tflops"]
    assert run["info"]["name"] and run["info"]["torch"]
    timed = [r for r in run["train_step"] if "step" in r]
    assert timed, "no timed row"
    for r in timed:
        sizes = {k: config[k] for k in ("d_model", "n_heads", "d_ff", "n_layers")}
        flops = bench.train_flops(dict(sizes, vocab=r["vocab"], batch=r["batch"], length=config["length"]))
        assert r["flops"] == flops, r
        seconds = r["step"]["median_ms"] / 1e3
        assert r["step"]["best_ms"] <= r["step"]["median_ms"]
        assert math.isclose(r["tflops"], flops / seconds / 1e12, rel_tol=1e-9)
        assert math.isclose(r["tokens_per_s"], 2 * r["batch"] * config["length"] / seconds, rel_tol=1e-9)
        assert math.isclose(r["mfu"], r["tflops"] / peak, rel_tol=1e-9)
        assert math.isfinite(r["first_loss"]) and r["first_loss"] > 0


@pytest.mark.parametrize(
    "name, cases",
    [("gpu_train_mfu_h200.json", "mfu"), ("gpu_train_mfu_h200_second.json", "mfu"),
     ("gpu_train_levers_h200.json", "levers")],
)  # fmt: skip
def test_the_runs_of_chapter_15_are_the_script_cases_in_order(name, cases):
    run = json.loads((RESULTS / name).read_text())
    got = [tuple(r[k] for k in gpu_train.KEYS) for r in run["train_step"]]
    batch = run["config"]["batch"]
    want = [tuple(gpu_train.case_row(c, batch)[k] for k in gpu_train.KEYS) for c in gpu_train.CASE_SETS[cases]]
    assert got == want
