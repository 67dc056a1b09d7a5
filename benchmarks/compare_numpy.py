"""Before/after for a change to the NumPy track: two checkouts of tfm_numpy timed side by side, interleaved.

    git archive <old commit> tfm_numpy | tar -x -C /tmp/before      # the old tree, once
    python benchmarks/compare_numpy.py /tmp/before                   # old vs this checkout, training step
    python benchmarks/compare_numpy.py /tmp/before --task forward --configs small --threads 1

Each checkout runs in its own worker process of benchmarks/bench.py (same thread settings, same model, same
batch); the driver alternates between them, so a machine that gets busier during the run slows both alike.
Prints the median time of each, their ratio, and the achieved GFLOP/s (bench.py's FLOP formula).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import bench


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="a directory holding the old tfm_numpy package")
    p.add_argument("--after", default=str(bench.REPO), help="the new one (default: this checkout)")
    p.add_argument("--task", choices=["train", "forward"], default="train")
    p.add_argument("--configs", nargs="+", choices=sorted(bench.CONFIGS), default=["small", "base"])
    p.add_argument("--threads", type=int, default=0, help="threads per worker (default: every usable core)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    threads = args.threads or bench.machine_info()["usable_cores"]
    workers = [bench.Worker("numpy", threads, str(Path(args.before).resolve()), label="before"),
               bench.Worker("numpy", threads, str(Path(args.after).resolve()), label="after")]  # fmt: skip
    try:
        for w in workers:
            print(f"{w.label}: {w.ask(op='info')['tfm_numpy']}")
        for c in args.configs:
            cfg = bench.CONFIGS[c]
            task_args = {"cfg": cfg, "dtype": "float32"} | ({"dropout": 0.0} if args.task == "train" else {})
            r = bench.measure(workers, args.task, task_args, args.repeats, 0.3, 0.2)
            before, after = r["before"]["median_s"], r["after"]["median_s"]
            flops = bench.train_flops(cfg) // (3 if args.task == "forward" else 1)
            rates = f"GFLOP/s {flops / before / 1e9:.1f} -> {flops / after / 1e9:.1f}"
            print(f"{c} {args.task}, {threads} thread(s): before {before * 1e3:.1f} ms, after {after * 1e3:.1f} ms, "
                  f"after/before {after / before:.3f}; {rates}")  # fmt: skip
    finally:
        for w in workers:
            w.close()


if __name__ == "__main__":
    main()
