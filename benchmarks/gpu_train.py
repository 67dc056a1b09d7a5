"""The torch track training at the paper's base size on a GPU, against torch.nn.Transformer, in one run.

Run from the repository root on a machine with a CUDA GPU (torch and numpy only; our packages come from this
checkout):

    python benchmarks/gpu_train.py --out benchmarks/results/gpu_train_h200.json
    python benchmarks/gpu_train.py --device cpu --quick --out /tmp/smoke.json     # a smoke test without a GPU

It measures, and stores in one JSON file (read by chapter 15a):
  1. the device's bfloat16 matmul rate (8192^3, and the model's own largest product): the ceiling for MFU;
  2. whole training steps (forward, cross-entropy, backward, Adam) of the base model (d_model 512, 8 heads,
     d_ff 2048, 6 + 6 layers, dropout 0, shared vocabulary of 8000) on one batch of B x T source and target
     tokens (96 x 256: 24,576 + 24,576 tokens, the paper's ~25,000 + 25,000), for
       ours    tfm_torch.Transformer, float32 with our explicit attention; then under bfloat16 autocast with
               explicit attention, with attn_impl="sdpa" (torch's fused kernels), and with attn_impl="sdpa"
               after torch.compile;
       torch.nn  tpt.to_torch_nn_transformer of the same model (the same weights, embeddings and output layer,
               torch.nn.Transformer in between): float32, bfloat16 autocast, and bfloat16 autocast compiled;
     each step's time (median of CUDA-event timings), tokens per second, model FLOP/s (matmul FLOPs of
     benchmarks/bench.py, training = 3 x forward) and MFU (that rate / the measured bf16 matmul rate);
  3. the fastest configuration again with the paper's vocabulary size (37,000), from which the paper's base run
     (100,000 steps of ~25,000 + 25,000 tokens; 12 hours on 8 P100 GPUs) is timed on this one GPU.
`--cases mfu` runs instead the set aimed at 40% MFU (MFU_CASES below: CUDA graphs, a fused Adam, larger batches),
and `--cases levers` gives those levers to torch.nn too (LEVER_CASES), so that the two are compared on equal terms.
Cases are run in order under a time budget (--budget-s); a case that does not fit is recorded as skipped. The JSON
is rewritten after every case, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import bench  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_attention import describe_error, device_info, peak_memory_mb, sync, time_ms  # noqa: E402

import tfm_torch as tpt  # noqa: E402

BASE = dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6)
TINY = dict(d_model=32, n_heads=4, d_ff=64, n_layers=2)  # --quick


def train_flops(c: dict, vocab: int, batch: int, length: int) -> int:
    """Matmul FLOPs of one training step (3 x forward), counted by benchmarks/bench.py's formula (chapter 15a checks
    it against the shapes the NumPy track multiplies; the causal score matrix is counted whole)."""
    return bench.train_flops(dict(c, vocab=vocab, batch=batch, length=length))


def matmul_rate(device: str, m: int, k: int, n: int, repeats: int) -> dict:
    """bfloat16 (m x k) @ (k x n) on random data: TFLOP/s from the median CUDA-event time."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, generator=g, device=device, dtype=torch.bfloat16)
    t = time_ms(lambda: a @ b, device, repeats, warmup=3)
    return {"shape": [m, k, n], **t, "tflops": 2 * m * k * n / (t["median_ms"] * 1e9)}


def make_models(c: dict, vocab: int, length: int, device: str, dropout: float = 0.0):
    """Ours and torch.nn's, the same weights (built on the CPU from one seed, then moved)."""
    ours = tpt.Transformer(vocab, vocab, c["d_model"], c["n_heads"], c["d_ff"], c["n_layers"], dropout=dropout,
                           max_len=length + 1, rng=0)  # fmt: skip
    ref = tpt.to_torch_nn_transformer(ours)
    return ours.to(device), ref.to(device)


def make_step(model, src, tgt, device: str, autocast: bool, compiled: str | None, adam: str = "foreach"):
    """One training step as a closure: zero_grad, forward (autocast or not), our cross-entropy, backward, Adam.
    compiled: None (eager), "model" (torch.compile(model)), "model+loss" (the forward and the loss compiled as one
    function: the (B, T, V) logits never leave the graph), "model+loss max-autotune" (the same, with inductor
    timing its candidate kernels for every matmul), "model+loss cudagraphs" (mode="reduce-overhead": the whole
    forward and backward replayed as CUDA graphs, no kernel launched one by one from Python).
    adam: "foreach" (tpt.make_adam: torch.optim.Adam's default on a GPU) or "fused" (one kernel, fused=True)."""
    loss_fn = tpt.CrossEntropyLoss(ignore_index=0)
    if adam == "fused":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    else:
        opt = tpt.make_adam(model, lr=1e-4)

    def forward_loss(src, tgt):
        return loss_fn(model(src, tgt[:, :-1]), tgt[:, 1:])

    if compiled == "model":
        model = torch.compile(model)
    elif compiled:
        modes = {"model+loss": None, "model+loss max-autotune": "max-autotune-no-cudagraphs"}
        forward_loss = torch.compile(forward_loss, mode=modes.get(compiled, "reduce-overhead"))
    graphs = compiled == "model+loss cudagraphs"

    def step():
        if graphs:  # a new iteration: the graph's outputs of the last one (its loss) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            loss = forward_loss(src, tgt)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


KEYS = ("model", "precision", "attn_impl", "compiled", "vocab", "batch", "dropout", "adam")
CASES = [  # KEYS, with the batch as a multiple of the base batch; dropout 0 and foreach Adam unless given
    ("ours", "float32", "explicit", None, 8000, 1),
    ("ours", "bf16 autocast", "explicit", None, 8000, 1),
    ("ours", "bf16 autocast", "sdpa", None, 8000, 1),
    ("torch.nn", "float32", "torch.nn", None, 8000, 1),
    ("torch.nn", "bf16 autocast", "torch.nn", None, 8000, 1),
    ("ours", "bf16 autocast", "sdpa", "model", 8000, 1),
    ("torch.nn", "bf16 autocast", "torch.nn", "model", 8000, 1),
    ("ours", "bf16 autocast", "sdpa", "model+loss", 8000, 1),
    ("torch.nn", "bf16 autocast", "torch.nn", "model+loss", 8000, 1),
    ("ours", "bf16 autocast", "sdpa", "model+loss", 37000, 1),
    ("ours", "bf16 autocast", "sdpa", "model+loss", 8000, 2),
]  # mode="max-autotune-no-cudagraphs" was tried on an H200 (2026-11-26): still autotuning after 4 minutes, and
# it kept cuBLAS for the largest products; make_step still accepts it ("model+loss max-autotune")

# --cases mfu: what was left untried for 40% MFU (chapter 15a), in order of priority, with torch.nn's baselines
# first so that the ratio comes from the same run. The torch track is one graph under torch.compile since
# 2026-11-26 (no break at the token-id checks or at dropout), so CUDA graphs can take the whole step. Peak memory
# grew about linearly with the batch on the H200 (7 GB at 96 x 256, 14 GB at 192 x 256): 8x fits an 80 GB card.
MFU_CASES = [
    ("torch.nn", "bf16 autocast", "torch.nn", None, 8000, 1),
    ("torch.nn", "bf16 autocast", "torch.nn", "model+loss", 8000, 1),  # one graph since the tgt_is_causal hint
    ("ours", "bf16 autocast", "sdpa", "model+loss", 8000, 1),
    ("ours", "bf16 autocast", "sdpa", "model+loss cudagraphs", 8000, 1, 0.0, "fused"),
    ("ours", "bf16 autocast", "sdpa", "model+loss cudagraphs", 8000, 2, 0.0, "fused"),
    ("ours", "bf16 autocast", "sdpa", "model+loss cudagraphs", 8000, 4, 0.0, "fused"),
    ("ours", "bf16 autocast", "sdpa", "model+loss cudagraphs", 8000, 8, 0.0, "fused"),  # ~60 GB at 768 x 256
    ("ours", "bf16 autocast", "sdpa", "model+loss cudagraphs", 37000, 1, 0.1, "fused"),  # the paper's run
]

# --cases levers: the levers of MFU_CASES given to torch.nn too (compiled with the loss, CUDA graphs, fused Adam),
# at 1x and 2x the batch, next to ours at 2x with and without CUDA graphs: which share of the gain is the levers',
# which the torch track's own. First run on an H200 on 2026-11-26 (benchmarks/results/gpu_train_levers_h200.json).
LEVER_CASES = [
    ("torch.nn", "bf16 autocast", "torch.nn", "model+loss cudagraphs", 8000, 1, 0.0, "fused"),
    ("ours", "bf16 autocast", "sdpa", "model+loss cudagraphs", 8000, 2, 0.0, "fused"),
    ("torch.nn", "bf16 autocast", "torch.nn", "model+loss cudagraphs", 8000, 2, 0.0, "fused"),
    ("torch.nn", "bf16 autocast", "torch.nn", None, 8000, 2),
    ("ours", "bf16 autocast", "sdpa", "model+loss", 8000, 2, 0.0, "fused"),
]
CASE_SETS = {"all": CASES, "mfu": MFU_CASES, "levers": LEVER_CASES}


def total_peak_mb(device: str) -> float | None:
    """All the GPU memory the case held at its peak (weights, Adam, activations, graph pools), in MiB."""
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def case_row(case: tuple, batch: int) -> dict:
    """The case as a JSON row: KEYS, the batch in sequences, dropout 0 and foreach Adam where the case is silent."""
    row = dict(zip(KEYS, case + (0.0, "foreach")[len(case) - 6 :], strict=True))
    row["batch"] *= batch
    return row


def run_case(case, c, batch, length, device, repeats, peak) -> dict:
    row = case_row(case, batch)
    who, attn_impl, vocab, batch = row["model"], row["attn_impl"], row["vocab"], row["batch"]
    row.update(length=length, flops=train_flops(c, vocab, batch, length))
    step = None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        ours, ref = make_models(c, vocab, length, device, row["dropout"])
        model = ours if who == "ours" else ref
        if who == "ours":
            tpt.use_attention(model, attn_impl)
        g = np.random.default_rng(1)
        src = torch.from_numpy(g.integers(3, vocab, (batch, length))).to(device)
        tgt = torch.from_numpy(g.integers(3, vocab, (batch, length + 1))).to(device)
        step = make_step(model, src, tgt, device, row["precision"] != "float32", row["compiled"], row["adam"])
        t0 = time.perf_counter()
        row["first_loss"] = float(step())  # the compile, if any, happens here
        sync(device)
        row["first_step_s"] = time.perf_counter() - t0
        row["step"] = time_ms(step, device, repeats)
        row["tokens_per_s"] = 2 * batch * length / (row["step"]["median_ms"] / 1e3)  # source + target tokens
        row["tflops"] = row["flops"] / (row["step"]["median_ms"] * 1e9)
        row["mfu"] = row["tflops"] / peak if peak else None
        # the activations of one step; a CUDA graph holds them in its pool from the capture on, so none is measured
        row["peak_memory_mb"] = None if "cudagraphs" in str(row["compiled"]) else peak_memory_mb(step, device)
        row["case_peak_memory_mb"] = total_peak_mb(device)
    except Exception as e:  # noqa: BLE001 - out of memory or anything else: noted in the JSON, go on
        row["error"] = describe_error(e)
    finally:
        step = ours = ref = model = None
        torch._dynamo.reset()  # each case compiles afresh: no graph or dynamic-shape decision carried over
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def describe(row: dict) -> str:
    extra = "".join(f" {k}={row[k]}" for k, v in (("dropout", 0.0), ("adam", "foreach")) if row.get(k, v) != v)
    head = f"  {row['model']:8s} {row['precision']:13s} {row['attn_impl']:8s} {row['compiled']!s:24s} " \
           f"V={row['vocab']:5d} B={row['batch']:3d}{extra}"  # fmt: skip
    if "step" not in row:
        return f"{head}  {row.get('error', 'skipped')}"
    mfu = f"  MFU {100 * row['mfu']:5.1f}%" if row["mfu"] else ""
    return (f"{head}  {row['step']['median_ms']:8.2f} ms  {row['tokens_per_s'] / 1e3:8.0f} k tok/s  "
            f"{row['tflops']:7.1f} TFLOP/s{mfu}  first step {row['first_step_s']:5.1f} s")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    p.add_argument("--quick", action="store_true", help="a tiny model and batch, few repeats")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no case after this many seconds")
    p.add_argument("--out", required=True, help="JSON path")
    p.add_argument("--cases", choices=tuple(CASE_SETS), default="all",
                   help="every case (default), the MFU set, or the MFU levers given to torch.nn too")  # fmt: skip
    args = p.parse_args(argv)
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_train.py: no CUDA device (torch.cuda.is_available() is False); --device cpu smoke-tests")
    c, (batch, length), repeats = (TINY, (4, 16), 3) if args.quick else (BASE, (96, 256), 10)
    t0, out = time.perf_counter(), Path(args.out)
    res = {"info": device_info(dev), "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
           "config": {**c, "dropout": 0.0, "batch": batch, "length": length}}  # fmt: skip
    print(f"device: {res['info']['name']}; torch {res['info']['torch']}", flush=True)
    big = (512, 512, 512) if args.quick else (8192, 8192, 8192)
    mine = (batch * length, c["d_model"], c["d_ff"])
    res["matmul_bf16"] = [matmul_rate(dev, *s, repeats) for s in (big, mine)] if dev.startswith("cuda") else []
    peak = res["matmul_bf16"][0]["tflops"] if res["matmul_bf16"] else None
    for m in res["matmul_bf16"]:
        print(f"  bf16 matmul {m['shape']}: {m['tflops']:.0f} TFLOP/s", flush=True)
    res["train_step"] = []
    for case in CASE_SETS[args.cases]:
        if time.perf_counter() - t0 > args.budget_s:
            row = case_row(case, batch)
            row["skipped"] = f"over the {args.budget_s:.0f} s budget"
        else:
            row = run_case(case, c, batch, length, dev, repeats, peak)
        res["train_step"].append(row)
        res["info"]["triton"] = getattr(sys.modules.get("triton"), "__version__", None)  # once torch.compile ran
        print(describe(row), flush=True)
        res["seconds"] = time.perf_counter() - t0
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"stored in {out} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
