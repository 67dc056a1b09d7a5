"""Where a GPT training step's time goes: the NumPy track next to the GPT built from torch.nn's layers, by kind of work.

    python benchmarks/step_breakdown.py                                   # the small and base configs of bench.py
    python benchmarks/step_breakdown.py --json benchmarks/results/gpt_breakdown_cpu.json

`bench.py` (section 7) times the whole step; this script says where the difference comes from. Each library runs
in its own process with bench.py's thread settings (OMP_WAIT_POLICY unset), on bench.py's GPT (`GPT_CONFIGS`, the
same initial weights and batch in both), and after two warm-up steps reports:

- the median time of a step, unprofiled, and
- the time of a profiled step split into kinds of work. NumPy: the *self* time of every module's forward and
  backward (the time of the modules it calls is theirs), with the optimizer's step and zero_grad. torch: the self
  CPU time of every operator in `torch.profiler`, the operators under `Optimizer.step` or `Optimizer.zero_grad`
  counted as the optimizer's.

The kinds (KINDS) are the matrix products of the linear layers (NumPy: `Linear`, its bias and reshape included;
torch: `aten::mm`, `aten::addmm`, ...), attention between the projections (NumPy: the scores, the masked softmax
and the weighted sum of `MultiHeadAttention`, with its reshapes; torch: the fused `scaled_dot_product_attention`
kernels, forward and backward), GELU, LayerNorm, the optimizer, and the rest (the loss, the embeddings, residual
sums, torch's copies and autograd bookkeeping). Profiling costs time of its own, torch's the more (a record per
operator): compare the kinds with each other, and the unprofiled step with bench.py's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  the configurations, the GPT, its data, the workers' thread settings

WARMUP = 5  # steps before any measurement: first-touch allocations, the allocator and BLAS buffers settle
KINDS = ("matrix products", "attention", "GELU", "LayerNorm", "optimizer", "the rest")
_NUMPY_KIND = {  # module type -> kind; every other module (and the loss) -> "the rest"
    "Linear": "matrix products",
    "MultiHeadAttention": "attention",
    "GroupedQueryAttention": "attention",
    "GELU": "GELU",
    "LayerNorm": "LayerNorm",
}
# operator -> kind, the kernels only: the self time of their wrappers (aten::linear, aten::layer_norm, ...) is
# dispatch, and goes with every other operator to "the rest" (or to "optimizer", by its ancestors)
_TORCH_KIND = {
    **dict.fromkeys(("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"), "matrix products"),
    **dict.fromkeys(("aten::_scaled_dot_product_flash_attention_for_cpu",
                     "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_softmax",
                     "aten::_softmax_backward_data"), "attention"),
    **dict.fromkeys(("aten::gelu", "aten::gelu_backward"), "GELU"),
    **dict.fromkeys(("aten::native_layer_norm", "aten::native_layer_norm_backward"), "LayerNorm"),
}  # fmt: skip


def numpy_kind(module_type: str) -> str:
    return _NUMPY_KIND.get(module_type, "optimizer" if module_type == "Adam" else "the rest")


def torch_kind(name: str, ancestors: list[str]) -> str:
    if any(a.startswith(("Optimizer.step", "Optimizer.zero_grad")) for a in ancestors):
        return "optimizer"
    return _TORCH_KIND.get(name, "the rest")


def _ms(step, n: int) -> float:
    """Milliseconds per step over n steps."""
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return 1e3 * (time.perf_counter() - t0) / n


def numpy_rounds(cfg: dict):
    """The NumPy GPT, warmed up; returns round(steps) -> {"step_ms": unprofiled, "profiled_ms", "kinds_ms"}, the
    kinds from the module self times of `steps` more steps."""
    import numpy as np

    tnp = bench.NumpyTrack().tnp
    model = bench._gpt(tnp, cfg, np.float32)
    x, y = bench._gpt_data(cfg)
    opt, loss_fn = tnp.make_adam(model, lr=1e-4), tnp.CrossEntropyLoss()
    seconds, stack, on = collections.Counter(), [], [False]

    def step():
        return tnp.lm_train_step(model, x, y, opt, loss_fn, lr=1e-4)

    def wrap(obj, method: str, kind: str):
        inner = getattr(obj, method)

        def timed(*args, **kwargs):  # self time: the nested modules' time is theirs
            if not on[0]:
                return inner(*args, **kwargs)
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed, children = time.perf_counter() - t0, stack.pop()
                seconds[kind] += elapsed - children
                if stack:
                    stack[-1] += elapsed

        object.__setattr__(obj, method, timed)  # an instance attribute, the class untouched

    for _, m in model.named_modules():
        for method in ("forward", "backward"):
            wrap(m, method, numpy_kind(type(m).__name__))
    for method in ("forward", "backward"):
        wrap(loss_fn, method, "the rest")
    for method in ("step", "zero_grad"):
        wrap(opt, method, "optimizer")
    for _ in range(WARMUP):
        step()

    def round_(steps: int) -> dict:
        unprofiled = _ms(step, steps)
        seconds.clear()
        on[0] = True
        profiled = _ms(step, steps)
        on[0] = False
        kinds = {k: 1e3 * seconds[k] / steps for k in KINDS}
        kinds["the rest"] += profiled - sum(kinds.values())  # lm_train_step's own work, outside every wrapper
        return {"step_ms": unprofiled, "profiled_ms": profiled, "kinds_ms": kinds}

    return round_


def torch_rounds(cfg: dict):
    """The GPT of torch.nn's layers (bench.py's "torch.nn" column), warmed up; returns round(steps) -> the same
    dict, the kinds from torch.profiler's operator self times."""
    from torch.profiler import ProfilerActivity, profile

    step = bench.TorchTrack().gpt(cfg, "float32", impl="nn")
    for _ in range(WARMUP):
        step()

    def round_(steps: int) -> dict:
        unprofiled = _ms(step, steps)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        profiled = 1e3 * (time.perf_counter() - t0) / steps
        kinds = dict.fromkeys(KINDS, 0.0)
        for e in prof.events():
            ancestors, p = [], e.cpu_parent
            while p is not None:
                ancestors.append(p.name)
                p = p.cpu_parent
            kinds[torch_kind(e.name, ancestors)] += e.self_cpu_time_total / 1e3 / steps  # us -> ms per step
        return {"step_ms": unprofiled, "profiled_ms": profiled, "kinds_ms": kinds}

    return round_


def _worker(library: str, config: str) -> None:
    """Serve rounds: a line with a step count in, one JSON line out; an empty line ends."""
    sys.path.insert(0, str(bench.REPO))  # tfm_numpy, tfm_torch
    out, sys.stdout = sys.stdout, sys.stderr  # what a library prints must not break the protocol
    round_ = (numpy_rounds if library == "numpy" else torch_rounds)(bench.GPT_CONFIGS[config])
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        out.write(json.dumps(round_(int(line))) + "\n")
        out.flush()


def measure(config: str, steps: int, rounds: int, threads: int) -> dict:
    """Both libraries, each in its own process with bench.py's thread settings, taking turns for `rounds` rounds
    (the order alternating, a pause between two): per library the median over the rounds of every figure."""
    procs = {}
    for lib in ("numpy", "torch.nn"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", lib.removesuffix(".nn"), "--configs", config]
        procs[lib] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=bench._worker_env(threads))  # fmt: skip
    try:
        for lib, proc in procs.items():
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"step_breakdown: the {lib} worker failed to start (its stderr is above)")
        got = {lib: [] for lib in procs}
        for r in range(rounds):
            for lib in list(procs)[:: 1 if r % 2 == 0 else -1]:
                procs[lib].stdin.write(f"{steps}\n")
                procs[lib].stdin.flush()
                line = procs[lib].stdout.readline()
                if not line:
                    raise RuntimeError(f"step_breakdown: the {lib} worker died (its stderr is above)")
                got[lib].append(json.loads(line))
                time.sleep(0.2)
    finally:
        for proc in procs.values():
            proc.communicate("\n", timeout=60)
    return {lib: _medians(runs) for lib, runs in got.items()}


def _medians(runs: list[dict]) -> dict:
    med = statistics.median
    return {
        "step_ms": med(r["step_ms"] for r in runs),
        "profiled_ms": med(r["profiled_ms"] for r in runs),
        "kinds_ms": {k: med(r["kinds_ms"][k] for r in runs) for k in KINDS},
        "rounds": runs,
    }


def table(config: str, numpy: dict, torch: dict) -> str:
    """The two breakdowns side by side, ms per step, with NumPy minus torch.nn."""
    lines = [f"GPT training step, {config} config, float32: ms per step",
             f"{'':<22}{'NumPy':>9}{'torch.nn':>10}{'difference':>12}"]  # fmt: skip
    for k in KINDS:
        a, b = numpy["kinds_ms"][k], torch["kinds_ms"][k]
        lines.append(f"  {k:<20}{a:9.1f}{b:10.1f}{a - b:+12.1f}")
    a, b = (sum(r["kinds_ms"].values()) for r in (numpy, torch))
    lines.append(f"{'sum of the kinds':<22}{a:9.1f}{b:10.1f}{a - b:+12.1f}")
    a, b = numpy["step_ms"], torch["step_ms"]
    lines.append(f"{'step, unprofiled':<22}{a:9.1f}{b:10.1f}{a - b:+12.1f}   NumPy / torch.nn {a / b:.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=sorted(bench.GPT_CONFIGS), default=["small", "base"])
    p.add_argument("--steps", type=int, default=0, help="steps per round (default: 5 small, 1 base)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per library, taking turns (default 5)")
    p.add_argument("--threads", type=int, default=0, help="threads per library (default: every usable core)")
    p.add_argument("--json", metavar="PATH", help="store the measurements in this JSON file")
    p.add_argument("--worker", choices=["numpy", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 0 or args.threads < 0 or args.rounds < 1:
        p.error(
            f"expected --steps >= 0, --threads >= 0, --rounds >= 1; got {args.steps}, {args.threads}, {args.rounds}"
        )
    if args.worker:
        _worker(args.worker, args.configs[0])
        return
    threads = args.threads or len(os.sched_getaffinity(0))
    res = {"created": time.strftime("%Y-%m-%d %H:%M"), "threads": threads, "load_avg": os.getloadavg()[0],
           "configs": {}}  # fmt: skip
    for config in args.configs:
        steps = args.steps or (5 if config == "small" else 1)
        both = measure(config, steps, args.rounds, threads)
        res["configs"][config] = {"steps": steps, "rounds": args.rounds, **both}
        print(table(config, both["numpy"], both["torch.nn"]), end="\n\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"results stored in {args.json}")


if __name__ == "__main__":
    main()
