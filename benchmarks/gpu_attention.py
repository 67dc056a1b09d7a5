"""The torch track on a GPU: explicit attention against F.scaled_dot_product_attention, and whole training steps.

Run from the repository root on a machine with a CUDA GPU (needs only torch and numpy; our packages are imported
from this checkout):

    python benchmarks/gpu_attention.py                                   # -> benchmarks/results/gpu_<name>.json
    python benchmarks/gpu_attention.py --out benchmarks/results/gpu_h100.json
    python benchmarks/gpu_attention.py --device cpu --quick --out /tmp/smoke.json   # a smoke test without a GPU

It measures, and stores in one JSON file (read by chapter 15a):
  1. attention alone, causal, batch 4, 8 heads, head size 64, as the length T grows (128 ... 8192), in float32 and
     bfloat16, forward and forward + backward, median of several CUDA-event timings, and the peak memory:
       explicit     softmax(Q K^T / sqrt(dk) masked) V, every (T x T) score matrix built in memory: the formula of
                    our libraries in three lines, with torch.softmax (explicit_attention below), in both dtypes
       explicit (tfm_torch)  tfm_torch.scaled_dot_product_attention itself, float32 only (its input checks do not
                    accept bfloat16): the same formula with the softmax written out so that a row with nothing to
                    attend to gets zeros, which costs more T x T temporaries (kept for the backward)
       sdpa         torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), torch's choice of
                    kernel; and each backend forced in turn (flash, efficient, cudnn, math) where it runs;
  2. a whole training step (forward, cross-entropy, backward, Adam) of the tfm_torch Transformer at the paper's base
     size: on this GPU in float32 (and with TF32 matmuls), with our explicit attention and with the attention of
     every MultiHeadAttention swapped for F.scaled_dot_product_attention (a benchmark-only patch, below), at the
     CPU benchmark's batch (16 x 64 tokens) and a larger one; and on this machine's CPU at the small batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import bench  # noqa: E402  (benchmarks/ is on the path: this script's own folder)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tfm_torch as tpt  # noqa: E402

BASE = dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, vocab=8000)


# -- timing ---------------------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn, device: str, repeats: int, warmup: int = 2) -> dict:
    """Median and best of `repeats` calls, in milliseconds (CUDA events on a GPU, perf_counter on a CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "best_ms": min(times), "repeats": repeats}


def peak_memory_mb(fn, device: str) -> float | None:
    """Peak GPU memory allocated during one call, beyond what was allocated before it (None on a CPU)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def describe_error(e: BaseException) -> str:
    """The exception's type and the first line of its message (for the JSON and the progress lines)."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


# -- 1. attention alone -----------------------------------------------------------------------------------------


def explicit_attention(q, k, v, mask):
    """The libraries' formula, spelled out (any dtype): masked scores, softmax over the keys, weights @ V."""
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, T): the T^2 matrix
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def attention_impls(dtype: torch.dtype) -> dict:
    """name -> fn(q, k, v, mask) for one dtype; the forced sdpa backends are added by the caller."""
    impls = {"explicit": explicit_attention}
    if dtype == torch.float32:
        impls["explicit (tfm_torch)"] = lambda q, k, v, mask: tpt.scaled_dot_product_attention(q, k, v, mask)[0]
    impls["sdpa"] = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return impls


def forced_backend(backend):
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v, mask):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn


def measure_attention(fn, q, k, v, mask, ref, device: str, repeats: int) -> dict:
    """Forward and forward + backward timings of one implementation, its peak memory and its error."""
    row = {}
    out = fn(q, k, v, mask)
    if ref is not None:
        row["max_abs_diff_vs_float32_explicit"] = float((out.float() - ref).abs().max())
    row["forward"] = time_ms(lambda: fn(q, k, v, mask), device, repeats)
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    grad = torch.randn_like(out)

    def forward_backward():
        fn(qg, kg, vg, mask).backward(grad)
        qg.grad = kg.grad = vg.grad = None

    row["forward_backward"] = time_ms(forward_backward, device, repeats)
    row["peak_memory_mb_forward_backward"] = peak_memory_mb(forward_backward, device)
    return row


def bench_attention(device: str, lengths: list[int], repeats: int, B=4, H=8, dk=64) -> list[dict]:
    from torch.nn.attention import SDPBackend

    backends = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
                "sdpa cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa math": SDPBackend.MATH}  # fmt: skip
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        impls = attention_impls(dtype)
        impls.update({name: forced_backend(b) for name, b in backends.items()})
        for T in lengths:
            mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]  # True = may attend
            q, k, v = (torch.randn(B, H, T, dk, generator=g, device=device, dtype=dtype) for _ in range(3))
            ref = explicit_attention(q.float(), k.float(), v.float(), mask) if T <= 2048 else None
            for name, fn in impls.items():
                row = {"impl": name, "dtype": str(dtype).removeprefix("torch."), "T": T, "B": B, "H": H, "dk": dk}
                try:
                    row.update(measure_attention(fn, q, k, v, mask, ref, device, repeats))
                except Exception as e:  # noqa: BLE001 - no kernel for this dtype/backend, out of memory: noted, go on
                    row["error"] = describe_error(e)
                rows.append(row)
                fb = row.get("forward_backward", {}).get("median_ms")
                note = f"fwd+bwd {fb:9.3f} ms" if fb is not None else row["error"][:90]
                print(f"  attention {row['dtype']:8s} T={T:5d} {name:22s} {note}", flush=True)
            if device.startswith("cuda"):
                q = k = v = mask = ref = None
                torch.cuda.empty_cache()
    return rows


# -- 2. whole training steps --------------------------------------------------------------------------------------


def use_sdpa(model: torch.nn.Module) -> None:
    """Benchmark-only patch: every MultiHeadAttention computes softmax(QK^T/sqrt(dk)) V with F.sdpa (the same
    projections and masks, True = may attend, which is also sdpa's meaning of a boolean attn_mask). No weights are
    kept (`attn_weights` stays None). Only for batches without fully-masked query rows (no padding here)."""

    for m in model.modules():
        if isinstance(m, tpt.MultiHeadAttention):

            def forward(query, key, value, mask=None, m=m):
                q, k, v = m._split(m.q_proj(query)), m._split(m.k_proj(key)), m._split(m.v_proj(value))
                p = m.dropout.p if m.training else 0.0
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
                return m.out_proj(m._merge(ctx))

            m.forward = forward


def make_step(device: str, batch: int, length: int, attn_impl: str):
    c = BASE
    model = tpt.Transformer(c["vocab"], c["vocab"], c["d_model"], c["n_heads"], c["d_ff"], c["n_layers"],
                            dropout=0.0, max_len=length + 1, rng=0).to(device)  # fmt: skip
    if attn_impl == "sdpa":
        use_sdpa(model)
    g = np.random.default_rng(1)
    src = torch.from_numpy(g.integers(3, c["vocab"], (batch, length))).to(device)
    tgt = torch.from_numpy(g.integers(3, c["vocab"], (batch, length + 1))).to(device)
    opt, loss_fn = tpt.make_adam(model, lr=1e-4), tpt.CrossEntropyLoss(ignore_index=0)

    def step():
        opt.zero_grad()
        loss = loss_fn(model(src, tgt[:, :-1]), tgt[:, 1:])
        loss.backward()
        opt.step()

    return step


def train_flops(batch: int, length: int) -> int:
    """The FLOP count of benchmarks/bench.py (matmuls only, training step = 3 x forward), for BASE."""
    return bench.train_flops(dict(BASE, batch=batch, length=length))


def bench_training(device: str, cases: list[tuple], repeats: int) -> list[dict]:
    rows = []
    for dev, batch, length, attn_impl, tf32 in cases:
        if dev.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        row = {"device": dev, "config": "base", "batch": batch, "length": length, "dtype": "float32",
               "tf32_matmul": tf32, "attn_impl": attn_impl, "flops": train_flops(batch, length)}  # fmt: skip
        try:
            step = make_step(dev, batch, length, attn_impl)
            row["step"] = time_ms(step, dev, repeats if dev.startswith("cuda") else max(3, repeats // 3))
            row["gflops"] = row["flops"] / (row["step"]["median_ms"] * 1e6)
            row["peak_memory_mb"] = peak_memory_mb(step, dev)
        except Exception as e:  # noqa: BLE001 - out of memory or anything else: noted in the JSON, go on
            row["error"] = describe_error(e)
        finally:
            step = None
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
        rows.append(row)
        ms = row.get("step", {}).get("median_ms")
        note = f"{ms:9.2f} ms  {row['gflops']:8.0f} GFLOP/s" if ms is not None else row["error"]
        print(
            f"  train step {dev:5s} batch {batch:3d} x {length:4d} tf32={tf32!s:5s} {attn_impl:8s} {note}", flush=True
        )
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return rows


# -- main -------------------------------------------------------------------------------------------------------


def device_info(device: str) -> dict:
    info = {"device_type": device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}  # fmt: skip
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), cuda=torch.version.cuda, memory_gb=p.total_memory / 2**30,
                    capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version())  # fmt: skip
    else:
        info["name"] = platform.processor() or "cpu"
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    p.add_argument("--quick", action="store_true", help="short lengths and few repeats")
    p.add_argument("--out", help="JSON path (default benchmarks/results/gpu_<device name>.json)")
    args = p.parse_args(argv)
    dev = args.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_attention.py: no CUDA device (torch.cuda.is_available() is False); --device cpu smoke-tests")
    info = device_info(dev)
    print(f"device: {info['name']}; torch {info['torch']}" + (f", CUDA {info['cuda']}" if "cuda" in info else ""))
    quick = args.quick
    lengths = [64, 128] if quick else [128, 256, 512, 1024, 2048, 4096, 8192]
    repeats = 3 if quick else 10
    t0 = time.perf_counter()
    res = {"info": info, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
    print("1. attention alone (causal, B=4, H=8, dk=64)")
    res["attention"] = bench_attention(dev, lengths, repeats)
    print("2. training step of the base model (float32, dropout 0)")
    small, large = (2, 16), (4, 32)
    if not quick:
        small, large = (16, 64), (64, 256)
    cases = []
    if dev.startswith("cuda"):
        for batch, length in (small, large):
            for attn_impl in ("explicit", "sdpa"):
                for tf32 in (False, True):
                    cases.append((dev, batch, length, attn_impl, tf32))
    cases.append(("cpu", *small, "explicit", False))
    cases.append(("cpu", *small, "sdpa", False))
    res["train_step"] = bench_training(dev, cases, repeats)
    res["seconds"] = time.perf_counter() - t0
    name = info["name"].lower().replace(" ", "_")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"gpu_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"stored in {out} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
