"""benchmarks/bench.py's worker environment: each library as a user runs it unless told otherwise, and the stored
CPU results say which setting measured them (chapter 15a compares the two)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def test_the_default_leaves_the_wait_policy_unset_whatever_the_shell_says(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = bench._worker_env(2)
    assert "OMP_WAIT_POLICY" not in env
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert "OMP_WAIT_POLICY" not in bench._thread_env(2)


@pytest.mark.parametrize("policy", ["passive", "active"])
def test_a_chosen_wait_policy_reaches_the_workers(monkeypatch, policy):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert bench._worker_env(1, policy)["OMP_WAIT_POLICY"] == policy.upper()


def test_the_option_accepts_the_policies_only():
    with pytest.raises(SystemExit):
        bench.main(["--omp-wait-policy", "sometimes"])


def test_the_stored_cpu_runs_record_their_wait_policy():
    default = json.loads((RESULTS / "cpu.json").read_text())
    assert default["omp_wait_policy"] == "default" and "OMP_WAIT_POLICY" not in default["env"]
    passive = json.loads((RESULTS / "cpu_omp_passive.json").read_text())
    assert passive["omp_wait_policy"] == "passive" and passive["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    for res in (default, passive):
        assert "OMP_WAIT_POLICY" in res["report"]  # the printed header says which
