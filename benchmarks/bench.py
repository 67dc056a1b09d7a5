"""The benchmark of "Transformer, Twice": the NumPy track and the PyTorch track (CPU, eager) side by side.

    python benchmarks/bench.py                      # the full table (a few minutes on 2 cores)
    python benchmarks/bench.py --quick              # a smoke test: fewer repeats, no base config (under a minute)
    python benchmarks/bench.py --json results.json  # also store every measurement
    python benchmarks/bench.py --threads 1          # one thread per library (default: every usable core)

What it prints, every figure measured in this one run:
  1. the machine's matrix-multiply rate: an n x n x n matmul (n = 2048) in NumPy and in torch, float32 (and
     NumPy float64), the best of several tries;
  2. a training step (zero_grad, forward, cross-entropy, backward, Adam) of the whole Transformer at the small
     and the base config, float32, dropout 0: milliseconds, the time ratio NumPy / torch, and the achieved
     GFLOP/s (the FLOP count below divided by the time) as a percentage of that library's matmul rate; a third
     column runs `torch.nn.Transformer` (tfm_torch.ReferenceTransformer: torch's own layers, with the same
     embeddings, output layer, initial weights and batches) in a third worker process;
  3. forward-only inference (eval mode; torch under inference_mode);
  4. greedy decoding with and without the key/value cache as the output grows (small config);
  5. the NumPy track in float64 against float32;
  6. the NumPy track's time per decoded token against its position, with the preallocated key/value cache and
     with the concatenating one (cache["preallocate"] = False), one token at a time through decode_step;
  7. a training step of the decoder-only GPT (chapter 17b; LayerNorm, learned positions, GELU, tied output) at a
     small and a base config: the NumPy GPT, the torch GPT and, third, the same GPT built from torch.nn's layers
     (tfm_torch.ReferenceGPT: nn.TransformerEncoderLayer(norm_first=True) with a causal mask, what a user would
     pick; same weights and batches).
  8. greedy GPT decoding with quantized weights (chapter 21a): the small GPT config, float32 and weight-only
     int8 per channel and int4 in groups of 32 (`quantize_linears`), NumPy and torch side by side: tokens per
     second and the model's bytes (codes at their bit width).
  9. speculative decoding (chapter 21b): greedy decoding by `target.generate` and by `speculative_generate` (the draft
     is the small GPT's first block alone), NumPy and torch side by side: tokens per second, target forwards per
     token, acceptance.

How it measures. Each library runs in its own worker process (`--worker numpy|torch`), started with its thread
count in the environment before NumPy or torch is imported (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS /
MKL_NUM_THREADS) and otherwise as a user runs it: OMP_WAIT_POLICY is removed from the workers' environment, so
torch's OpenMP threads spin briefly after a parallel region as they do by default, as OpenBLAS's threads do in
the NumPy worker (its pthreads build ignores the variable). `--omp-wait-policy passive` makes torch's threads
sleep at once instead: every parallel region then wakes them, which on this 2-core machine doubled the time of
torch's small-config training step and of its cached decoding (chapter 15a; earlier stored runs used it). The
two workers never compute at the same time: this process asks one for a measurement, waits for it, pauses
(`--pause`, so that threads still spinning after the last call go to sleep), then asks the other, alternating
which goes first. Every task is set up and warmed up once (a first call
allocates and touches the memory); one repeat then times a block of calls (as many as fill `--block` seconds,
at least one) and reports the time per call. Each figure is the median of the repeats; the matmul rate is the
best (the shortest) of its repeats, as a peak should be.

FLOP count (matmuls only; softmax, LayerNorm, ReLU, dropout, the loss and Adam are elementwise and not
counted). For batch B, source length S, target length T, width d, feed-forward width d_ff, N layers per stack,
target vocabulary V, one multiply-add = 2 FLOPs:
    encoder layer   2 B S (4 d^2 + 2 d d_ff)   projections q, k, v, out and the two feed-forward matmuls
                  + 4 B S^2 d                  scores Q K^T and weights @ V, all heads together (H dk = d)
    decoder layer   2 B T (4 d^2 + 2 d d_ff)   self-attention projections and feed-forward
                  + 4 B T^2 d                  self-attention (the full T x T square: the causal mask does not
                                               skip the upper half, in either track)
                  + 2 B T (2 d^2) + 2 B S (2 d^2)   cross-attention: q and out on the target, k and v on memory
                  + 4 B T S d                  cross-attention scores and weights @ V
    output          2 B T d V                  logits
    forward = N (encoder layer + decoder layer) + output;  backward = 2 x forward (every matmul Y = X W needs
    dX = dY W^T and dW = X^T dY, each as many FLOPs as Y);  training step = 3 x forward.
The embeddings are lookups (no FLOPs). Decoding counts are not converted to FLOP/s.
    GPT layer       2 B T (4 d^2 + 2 d d_ff) + 4 B T^2 d   (the full T x T square again);  output 2 B T d V.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    # name: model sizes and the batch; S = T (source and target lengths equal)
    "small": dict(d_model=128, n_heads=4, d_ff=512, n_layers=2, vocab=1000, batch=32, length=32),
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, vocab=8000, batch=16, length=64),
}
GPT_CONFIGS = {
    # the decoder-only GPT: batch windows of `length` tokens; same widths as the encoder-decoder configs
    "small": dict(vocab_size=1000, d_model=128, n_heads=4, d_ff=512, n_layers=4, batch=16, length=64),
    "base": dict(vocab_size=8000, d_model=512, n_heads=8, d_ff=2048, n_layers=6, batch=8, length=128),
}
SECTIONS = ("train", "forward", "decode", "float64", "positions", "gpt", "quantized", "speculative")
QUANT_FORMATS = {"float32": None, "int8": dict(bits=8), "int4 g32": dict(bits=4, group_size=32)}  # section 8
PAD, BOS = 0, 1  # token ids of the benchmark's vocabulary; real tokens are drawn from [3, vocab)


# -- FLOPs --------------------------------------------------------------------------------------------------------


def forward_flops(d_model, d_ff, n_layers, vocab, batch, src_len, tgt_len, **_) -> int:
    """Matmul FLOPs of one forward pass of the encoder-decoder (the formula in the module docstring)."""
    d, B, S, T = d_model, batch, src_len, tgt_len
    encoder_layer = 2 * B * S * (4 * d * d + 2 * d * d_ff) + 4 * B * S * S * d
    decoder_layer = (
        2 * B * T * (4 * d * d + 2 * d * d_ff) + 4 * B * T * T * d + 2 * B * T * 2 * d * d + 2 * B * S * 2 * d * d
    ) + 4 * B * T * S * d
    return n_layers * (encoder_layer + decoder_layer) + 2 * B * T * d * vocab


def train_flops(cfg: dict) -> int:
    """forward + backward (2 x forward) at a config's batch and lengths."""
    return 3 * forward_flops(**cfg, src_len=cfg["length"], tgt_len=cfg["length"])


# -- the workers: one process per library ------------------------------------------------------------------------


def gpt_train_flops(cfg: dict) -> int:
    """Matmul FLOPs of one GPT training step (3 x forward; the formula in the module docstring)."""
    B, T, d, V = cfg["batch"], cfg["length"], cfg["d_model"], cfg["vocab_size"]
    layer = 2 * B * T * (4 * d * d + 2 * d * cfg["d_ff"]) + 4 * B * T * T * d
    return 3 * (cfg["n_layers"] * layer + 2 * B * T * d * V)


def _gpt(module, cfg: dict, dtype):
    """The GPT of `cfg` in the given track (tfm_numpy or tfm_torch), rng 0, dropout 0."""
    sizes = {k: cfg[k] for k in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers")}
    return module.GPT(**sizes, max_len=cfg["length"], rng=0, dtype=dtype)


def _gpt_data(cfg: dict, seed: int = 2):
    """Random windows x (B, T) and their next tokens y (B, T)."""
    import numpy as np

    ids = np.random.default_rng(seed).integers(0, cfg["vocab_size"], (cfg["batch"], cfg["length"] + 1))
    return ids[:, :-1], ids[:, 1:]


def _speculative_models(module, cfg: dict, dtype):
    """The speculative row's target (the GPT of `cfg`) and its draft: the target's first block alone (its
    embeddings, block 0, final norm), an early exit; random weights, so the acceptance rate is this pair's."""
    target = _gpt(module, cfg, dtype)
    draft = _gpt(module, {**cfg, "n_layers": 1}, dtype)
    keep = lambda name: not name.startswith("layers.") or name.startswith("layers.0.")  # noqa: E731
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if keep(k)})
    return target, draft


def _speculative_task(module, target, draft, prompt, k: int, new_tokens: int, plain: bool):
    """Greedy decoding of new_tokens: target.generate alone (plain) or speculative_generate with k proposals;
    each call returns its target forwards per token and acceptance rate."""
    if plain:
        return lambda: (target.generate(prompt, new_tokens, temperature=0), {"forwards_per_token": 1.0})[1]

    def run():
        out = module.speculative_generate(target, draft, prompt, new_tokens, k=k, temperature=0, rng=0)
        return {"forwards_per_token": out.target_forwards / out.new_tokens, "acceptance": out.acceptance_rate}

    return run


WAIT_POLICIES = ("default", "passive", "active")  # --omp-wait-policy: OMP_WAIT_POLICY unset, PASSIVE, ACTIVE


def _thread_env(threads: int, wait_policy: str = "default") -> dict:
    """Thread settings for a worker, set in its environment before NumPy or torch is imported. wait_policy
    "default" leaves OMP_WAIT_POLICY unset (each library's own behaviour); the others set it."""
    n = str(threads)
    env = {} if wait_policy == "default" else {"OMP_WAIT_POLICY": wait_policy.upper()}
    return env | {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def _worker_env(threads: int, wait_policy: str = "default") -> dict:
    """The caller's environment without its own OMP_WAIT_POLICY (a run does not depend on the shell's), then the
    worker's thread settings."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return env | _thread_env(threads, wait_policy)


def _openblas_threads():
    """NumPy's BLAS thread count, read from the loaded OpenBLAS (threadpoolctl is not a dependency); None if unknown."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and line.split()[-1][0] == "/"})
    except OSError:
        return None
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(lib, name):
                return int(getattr(lib, name)())
    return None


def _numpy_blas() -> str:
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - only informative
        return "unknown"


def _data(cfg: dict, length: int, seed: int = 1):
    """Random token ids (no padding): src (B, S), tgt (B, T + 1); the decoder reads tgt[:, :-1], predicts tgt[:, 1:]."""
    import numpy as np

    g = np.random.default_rng(seed)
    B, V = cfg["batch"], cfg["vocab"]
    return g.integers(3, V, (B, length)), g.integers(3, V, (B, length + 1))


def _numpy_model(cfg: dict, dropout: float, dtype: str, max_len: int):
    import numpy as np

    import tfm_numpy as tnp

    c = cfg
    return tnp.Transformer(c["vocab"], c["vocab"], c["d_model"], c["n_heads"], c["d_ff"], c["n_layers"],
                           dropout=dropout, max_len=max_len, pad_id=PAD, rng=0, dtype=np.dtype(dtype))  # fmt: skip


class NumpyTrack:
    name = "numpy"

    def __init__(self):
        import numpy as np

        import tfm_numpy as tnp

        self.np, self.tnp = np, tnp

    def info(self) -> dict:
        return {
            "numpy": self.np.__version__,
            "blas": _numpy_blas(),
            "blas_threads": _openblas_threads(),
            "tfm_numpy": str(Path(self.tnp.__file__).parent),
        }

    def matmul(self, n: int, dtype: str):
        np = self.np
        g = np.random.default_rng(0)
        a, b = g.standard_normal((n, n)).astype(dtype), g.standard_normal((n, n)).astype(dtype)
        return lambda: a @ b

    def train(self, cfg: dict, dtype: str, dropout: float = 0.0):
        tnp = self.tnp
        model = _numpy_model(cfg, dropout, dtype, max_len=cfg["length"] + 1)
        src, tgt = _data(cfg, cfg["length"])
        opt, loss_fn = tnp.make_adam(model, lr=1e-4), tnp.CrossEntropyLoss(ignore_index=PAD)

        def step():
            opt.zero_grad()
            loss = loss_fn(model(src, tgt[:, :-1]), tgt[:, 1:])
            model.backward(loss_fn.backward())
            opt.step()
            return loss

        return step

    def forward(self, cfg: dict, dtype: str):
        model = _numpy_model(cfg, 0.0, dtype, max_len=cfg["length"] + 1).eval()
        src, tgt = _data(cfg, cfg["length"])
        return lambda: model(src, tgt[:, :-1])

    def decode(self, cfg: dict, out_len: int, use_cache: bool):
        np = self.np
        model = _numpy_model(cfg, 0.0, "float32", max_len=max(out_len + 1, cfg["length"]))
        src, _ = _data(cfg, cfg["length"])
        eos = _eos_never_generated(
            lambda eos: self.tnp.greedy_decode(model, src, BOS, eos, out_len, use_cache=True), np.asarray, out_len
        )
        return lambda: self.tnp.greedy_decode(model, src, BOS, eos, out_len, use_cache=use_cache)

    def positions(self, cfg: dict, out_len: int, preallocate: bool):
        """A call decodes out_len given tokens one at a time through decode_step; returns the seconds per step."""
        np = self.np
        model = _numpy_model(cfg, 0.0, "float32", max_len=out_len).eval()
        src, tgt = _data(cfg, cfg["length"])
        tgt = np.concatenate([np.full((len(tgt), 1), BOS), np.resize(tgt, (len(tgt), out_len - 1))], axis=1)
        memory, src_mask = model.encode(src)

        def run():
            cache, times = {"capacity": out_len, "preallocate": preallocate}, []
            for t in range(out_len):
                t0 = time.perf_counter()
                model.decode_step(tgt[:, t : t + 1], memory, src_mask, cache)
                times.append(time.perf_counter() - t0)
            return times

        return run

    def gpt(self, cfg: dict, dtype: str):
        tnp = self.tnp
        model = _gpt(tnp, cfg, self.np.dtype(dtype))
        x, y = _gpt_data(cfg)
        opt, loss_fn = tnp.make_adam(model, lr=1e-4), tnp.CrossEntropyLoss()
        return lambda: tnp.lm_train_step(model, x, y, opt, loss_fn, lr=1e-4)

    def quantized(self, cfg: dict, fmt: str, new_tokens: int):
        """Greedy decoding (the key/value cache) of new_tokens after an 8-token prompt, weights in format `fmt`."""
        model = _quantized_gpt(self.tnp, _gpt(self.tnp, cfg, self.np.float32), fmt)
        prompt = _gpt_data(cfg)[0][:, :8]
        return lambda: model.generate(prompt, new_tokens, temperature=0.0)

    def quantized_bytes(self, cfg: dict, fmt: str):
        model = _quantized_gpt(self.tnp, _gpt(self.tnp, cfg, self.np.float32), fmt)
        return lambda: self.tnp.model_bytes(model)

    def speculative(self, cfg: dict, k: int, new_tokens: int, plain: bool):
        target, draft = _speculative_models(self.tnp, cfg, self.np.float32)
        prompt = _gpt_data(cfg)[0][:1, :16]
        return _speculative_task(self.tnp, target, draft, prompt, k, new_tokens, plain)


def _quantized_gpt(track, model, fmt: str):
    kw = QUANT_FORMATS[fmt]
    return model.eval() if kw is None else track.quantize_linears(model, **kw).eval()


class TorchTrack:
    name = "torch"

    def __init__(self):
        import torch

        import tfm_torch as tpt

        self.torch, self.tpt = torch, tpt

    def info(self) -> dict:
        torch = self.torch
        cfg = torch.__config__.show()
        backend = "MKL" if "USE_MKL=ON" in cfg or "MKL" in cfg else "?"
        return {"torch": torch.__version__, "threads": torch.get_num_threads(), "blas": backend}

    def _model(self, cfg, dropout, dtype, max_len):
        """The NumPy track's initial weights, loaded into the torch twin: the two tracks run the same model."""
        torch, tpt = self.torch, self.tpt
        c = cfg
        ref = _numpy_model(cfg, dropout, dtype, max_len)
        model = tpt.Transformer(c["vocab"], c["vocab"], c["d_model"], c["n_heads"], c["d_ff"], c["n_layers"],
                                dropout=dropout, max_len=max_len, pad_id=PAD, rng=0,
                                dtype=getattr(torch, dtype))  # fmt: skip
        model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.state_dict().items()})
        return model

    def matmul(self, n: int, dtype: str):
        torch = self.torch
        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, dtype)
        a, b = torch.randn(n, n, generator=g, dtype=dt), torch.randn(n, n, generator=g, dtype=dt)
        return lambda: a @ b

    def train(self, cfg: dict, dtype: str, dropout: float = 0.0, impl: str = "tfm"):
        """impl="tfm": our torch track; "nn": torch.nn.Transformer with the same embeddings, output layer, weights."""
        torch, tpt = self.torch, self.tpt
        model = self._model(cfg, dropout, dtype, max_len=cfg["length"] + 1).train()
        if impl == "nn":
            model = tpt.to_torch_nn_transformer(model).train()
        src, tgt = (torch.from_numpy(a) for a in _data(cfg, cfg["length"]))
        opt, loss_fn = tpt.make_adam(model, lr=1e-4), tpt.CrossEntropyLoss(ignore_index=PAD)

        def step():
            opt.zero_grad()
            loss = loss_fn(model(src, tgt[:, :-1]), tgt[:, 1:])
            loss.backward()
            opt.step()
            return loss

        return step

    def forward(self, cfg: dict, dtype: str):
        torch = self.torch
        model = self._model(cfg, 0.0, dtype, max_len=cfg["length"] + 1).eval()
        src, tgt = (torch.from_numpy(a) for a in _data(cfg, cfg["length"]))

        def run():
            with torch.inference_mode():
                return model(src, tgt[:, :-1])

        return run

    def decode(self, cfg: dict, out_len: int, use_cache: bool):
        torch, tpt = self.torch, self.tpt
        model = self._model(cfg, 0.0, "float32", max_len=max(out_len + 1, cfg["length"]))
        src = torch.from_numpy(_data(cfg, cfg["length"])[0])

        def run(eos, cache=use_cache):
            with torch.inference_mode():
                return tpt.greedy_decode(model, src, BOS, eos, out_len, use_cache=cache)

        eos = _eos_never_generated(lambda eos: run(eos, True), lambda t: t.numpy(), out_len)
        return lambda: run(eos)

    def gpt(self, cfg: dict, dtype: str, impl: str = "tfm"):
        """impl="tfm": our torch GPT; "nn": the GPT from torch.nn's layers (ReferenceGPT), same weights (NumPy's)."""
        torch, tpt = self.torch, self.tpt
        ref = _gpt(NumpyTrack().tnp, cfg, dtype)
        model = _gpt(tpt, cfg, getattr(torch, dtype))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.state_dict().items()})
        if impl == "nn":
            model = tpt.to_torch_nn_gpt(model)
        x, y = (torch.from_numpy(a) for a in _gpt_data(cfg))
        opt, loss_fn = tpt.make_adam(model, lr=1e-4), tpt.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return step

    def quantized(self, cfg: dict, fmt: str, new_tokens: int):
        torch, tpt = self.torch, self.tpt
        model = _gpt(tpt, cfg, torch.float32)
        model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in _gpt(NumpyTrack().tnp, cfg, "float32").state_dict().items()}
        )
        model = _quantized_gpt(tpt, model, fmt)
        prompt = torch.from_numpy(_gpt_data(cfg)[0][:, :8])

        def run():
            with torch.inference_mode():
                return model.generate(prompt, new_tokens, temperature=0.0)

        return run

    def speculative(self, cfg: dict, k: int, new_tokens: int, plain: bool):
        """The NumPy track's models and prompt, in torch: the same weights, the same tokens."""
        torch, tpt = self.torch, self.tpt
        numpy_track = NumpyTrack()
        ref_target, ref_draft = _speculative_models(numpy_track.tnp, cfg, numpy_track.np.float32)
        target, draft = _speculative_models(tpt, cfg, torch.float32)
        for model, ref in ((target, ref_target), (draft, ref_draft)):
            model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.state_dict().items()})
        prompt = torch.from_numpy(_gpt_data(cfg)[0][:1, :16])
        return _speculative_task(tpt, target.eval(), draft.eval(), prompt, k, new_tokens, plain)


def _eos_never_generated(decode, to_numpy, out_len: int) -> int:
    """An eos id that the (untrained) model never generates here, so every run decodes exactly out_len tokens.

    Decoding with eos = e gives the same tokens as with any other eos until e itself is generated; so the first
    candidate absent from the output it produced is never generated (and the output has the full length)."""
    for eos in range(3, 1000):
        out = to_numpy(decode(eos))
        if out.shape[1] == out_len and not (out == eos).any():
            return eos
    raise RuntimeError("bench: no eos id that the model never generates")


def worker_main(track_name: str, root: str | None) -> None:
    """Serve JSON commands on stdin, one per line; answer each with one JSON line on stdout."""
    sys.path.insert(0, root or str(REPO))
    track = NumpyTrack() if track_name == "numpy" else TorchTrack()
    fn, inner = None, 1
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints must not break the protocol
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "info":
                reply = track.info()
            elif op == "setup":
                fn = None
                import gc

                gc.collect()
                fn = getattr(track, cmd["task"])(**cmd["args"])
                t0 = time.perf_counter()
                fn()  # warm-up: first-touch allocations, lazy initializations
                warmup = [time.perf_counter() - t0]
                if warmup[0] < cmd["block"]:  # a quick call: once more, warm, to size the block
                    t0 = time.perf_counter()
                    fn()
                    warmup.append(time.perf_counter() - t0)
                inner = max(1, int(cmd["block"] / max(warmup[-1], 1e-6)))
                reply = {"warmup_s": warmup, "inner": inner}
            elif op == "measure":
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                reply = {"seconds": (time.perf_counter() - t0) / inner}
            elif op == "call":  # a task that measures itself (times per step): its return value
                reply = {"value": fn()}
            elif op == "quit":
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the driver, which stops
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class Worker:
    """A worker process for one library, driven by JSON lines."""

    def __init__(self, track: str, threads: int, root: str | None = None, label: str | None = None, extra=None,
                 wait_policy: str = "default"):  # fmt: skip
        env = _worker_env(threads, wait_policy)
        self.extra = extra or {}  # task arguments of this worker only (torch.nn's impl="nn")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", track]
        if root:
            cmd += ["--root", root]
        self.track, self.label = track, label or track
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench: the {self.label} worker died (see its stderr above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"bench: {self.label} worker: {reply['error']} (command {cmd})")
        return reply

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


def measure(workers: list[Worker], task: str, args: dict, repeats: int, block: float, pause: float) -> dict:
    """Set the task up in every worker, then `repeats` rounds, the workers taking turns (the order alternating)."""
    setup = {w.label: w.ask(op="setup", task=task, args={**args, **w.extra}, block=block) for w in workers}
    times = {w.label: [] for w in workers}
    for r in range(repeats):
        for w in workers if r % 2 == 0 else workers[::-1]:
            time.sleep(pause)
            times[w.label].append(w.ask(op="measure")["seconds"])
    return {
        label: {"median_s": statistics.median(ts), "best_s": min(ts), "times_s": ts, **setup[label]}
        for label, ts in times.items()
    }


# -- the driver ---------------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


REPORT: list[str] = []  # every line printed by the driver, stored in the JSON as "report"


def say(text: str) -> None:
    print(text, flush=True)
    REPORT.append(text)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    say(f"\n{title}")
    for r in [header, *rows]:
        say("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))


def pct(gflops: float, peak: float) -> str:
    return f"{gflops:.1f} ({100 * gflops / peak:.0f}%)"


class Bench:
    """The sections of the table; each measures, prints its table and stores its results in `self.res`."""

    def __init__(self, args, workers: list[Worker]):
        self.args, self.workers = args, workers
        self.npw = workers[0]
        self.repeats = args.repeats or (3 if args.quick else 7)
        self.block = args.block if args.block is not None else (0.1 if args.quick else 0.3)
        self.configs = args.configs or (["small"] if args.quick else ["small", "base"])
        self.res: dict = {}
        self.mm: dict = {}  # (library, dtype) -> GFLOP/s

    def measure(self, workers, task: str, repeats: int | None = None, **task_args) -> dict:
        return measure(workers, task, task_args, repeats or self.repeats, self.block, self.args.pause)

    def header(self) -> None:
        a = self.args
        res = self.res
        res["numpy"], res["torch"] = (w.ask(op="info") for w in self.workers)
        m, nx, tx = res["machine"], res["numpy"], res["torch"]
        load = tuple(round(x, 2) for x in m["load_average"] or ())
        say(f"CPU: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable); {m['platform']}")
        say(f"Python {m['python']}; load average (1, 5, 15 min) at start {load}")
        say(f"NumPy {nx['numpy']} ({nx['blas']}, BLAS threads: {nx['blas_threads']}); "
              f"torch {tx['torch']} ({tx['blas']}, torch.get_num_threads() = {tx['threads']})")  # fmt: skip
        unset = " (OMP_WAIT_POLICY unset: each library's default)" if "OMP_WAIT_POLICY" not in res["env"] else ""
        say("Worker environment: " + " ".join(f"{k}={v}" for k, v in res["env"].items()) + unset)
        if m["load_average"] and m["load_average"][0] > 0.5 * m["usable_cores"]:
            say(
                f"WARNING: the machine is busy (load {m['load_average'][0]:.1f} on {m['usable_cores']} cores): every "
                "figure will be slow and noisy, and NumPy's multithreaded OpenBLAS suffers far more than torch (its "
                "threads wait for each other while other processes hold the cores); --threads 1 is more robust"
            )
        say(f"Each library in its own process, runs interleaved, {a.pause} s pause between them; "
              f"every figure the median of {self.repeats} repeats (matmul: the best).")  # fmt: skip

    def matmul(self) -> None:
        n = 1024 if self.args.quick else 2048
        for dtype in ("float32", "float64"):
            ws = self.workers if dtype == "float32" else [self.npw]
            for label, v in self.measure(ws, "matmul", n=n, dtype=dtype).items():
                self.mm[(label, dtype)] = 2 * n**3 / v["best_s"] / 1e9
        self.res["matmul"] = {"n": n, "gflops": {f"{k[0]} {k[1]}": v for k, v in self.mm.items()}}
        rows = [[f"{k[0]} {k[1]}", f"{v:.1f}"] for k, v in self.mm.items()]
        print_table(f"1. Matrix multiply {n} x {n} x {n} (best of {self.repeats})", ["", "GFLOP/s"], rows)

    def _three_way(self, task: str, configs: dict, flops_of, title: str) -> dict:
        """A training step in three workers (NumPy, torch, torch.nn's layers) per config: the table and the results."""
        res, rows = {}, []
        peak_np, peak_t = self.mm[("numpy", "float32")], self.mm[("torch", "float32")]
        threads, policy = self.res["threads"], self.args.omp_wait_policy
        nn_worker = Worker("torch", threads, label="torch.nn", extra={"impl": "nn"}, wait_policy=policy)
        try:
            for c in self.configs:
                cfg, flops = configs[c], flops_of(configs[c])
                r = self.measure([*self.workers, nn_worker], task, cfg=cfg, dtype="float32")
                res[c] = {"cfg": cfg, "flops": flops, **r}
                tn, tt, tr = (r[k]["median_s"] for k in ("numpy", "torch", "torch.nn"))
                row = [c, f"{flops / 1e9:.2f}", fmt_ms(tn), fmt_ms(tt), fmt_ms(tr), f"{tn / tt:.2f}", f"{tn / tr:.2f}"]
                rates = [pct(flops / x / 1e9, peak) for x, peak in ((tn, peak_np), (tt, peak_t), (tr, peak_t))]
                rows.append(row + rates)
        finally:
            nn_worker.close()
        header = ["config", "GFLOP", "NumPy ms", "torch ms", "torch.nn ms", "NumPy/torch", "NumPy/torch.nn",
                  "NumPy GFLOP/s (% mm)", "torch (% mm)", "torch.nn (% mm)"]  # fmt: skip
        print_table(title, header, rows)
        return res

    def train(self) -> None:
        title = "2. Training step (forward + backward + Adam), float32, dropout 0 (torch.nn: torch.nn.Transformer)"
        self.res["train"] = self._three_way("train", CONFIGS, train_flops, title)

    def gpt(self) -> None:
        title = "7. GPT training step (forward + backward + Adam), float32 (torch.nn: nn.TransformerEncoderLayer)"
        self.res["gpt"] = self._three_way("gpt", GPT_CONFIGS, gpt_train_flops, title)

    def speculative(self) -> None:
        cfg, k, new = {**GPT_CONFIGS["small"], "batch": 1}, 4, 48
        self.res["speculative"], rows = {"cfg": cfg, "k": k, "new_tokens": new}, []
        for label, plain in (("target.generate", True), (f"speculative_generate, k = {k}", False)):
            r = self.measure(self.workers, "speculative", cfg=cfg, k=k, new_tokens=new, plain=plain)
            stats = self.npw.ask(op="call")["value"]  # the same tokens in both tracks: one count
            self.res["speculative"][label] = {**r, **stats}
            tn, tt = r["numpy"]["median_s"], r["torch"]["median_s"]
            rate = f"{stats['acceptance']:.2f}" if "acceptance" in stats else "-"
            rows.append([label, f"{new / tn:.0f}", f"{new / tt:.0f}", f"{stats['forwards_per_token']:.2f}", rate])
        header = ["greedy, 48 tokens", "NumPy tokens/s", "torch tokens/s", "target forwards/token", "acceptance"]
        title = (
            "9. Speculative decoding (chapter 21b), small GPT with random weights, batch 1; draft: its first block "
            "alone (an early exit), which here agrees with the target on nearly every token: a best case"
        )
        print_table(title, header, rows)

    def forward(self) -> None:
        self.res["forward"], rows = {}, []
        for c in self.configs:
            cfg, flops = CONFIGS[c], train_flops(CONFIGS[c]) // 3
            r = self.measure(self.workers, "forward", cfg=cfg, dtype="float32")
            self.res["forward"][c] = {"flops": flops, **r}
            tn, tt = r["numpy"]["median_s"], r["torch"]["median_s"]
            rows.append(
                [c, fmt_ms(tn), fmt_ms(tt), f"{tn / tt:.2f}", f"{flops / tn / 1e9:.1f}", f"{flops / tt / 1e9:.1f}"]
            )
        header = ["config", "NumPy ms", "torch ms", "NumPy/torch", "NumPy GFLOP/s", "torch GFLOP/s"]
        print_table("3. Forward only (inference: eval mode, torch under inference_mode), float32", header, rows)

    def decode(self) -> None:
        a = self.args
        lengths = a.decode_lengths or ([16, 32, 64] if a.quick else [32, 64, 128, 256])
        cfg = {**CONFIGS["small"], "batch": a.decode_batch, "length": 32}
        self.res["decode"], rows = {"cfg": cfg, "lengths": {}}, []
        for L in lengths:
            per = {}
            for cached in (True, False):
                reps = self.repeats if cached or L <= 64 else max(3, self.repeats // 2)  # uncached long runs: fewer
                per["cached" if cached else "uncached"] = self.measure(
                    self.workers, "decode", reps, cfg=cfg, out_len=L, use_cache=cached
                )
            self.res["decode"]["lengths"][L] = per
            row = [str(L)]
            for label in ("numpy", "torch"):
                tc, tu = per["cached"][label]["median_s"], per["uncached"][label]["median_s"]
                row += [fmt_ms(tc), fmt_ms(tu), f"{tu / tc:.1f}x"]
            rows.append(row)
        header = ["tokens", "NumPy cache", "NumPy no cache", "speed-up", "torch cache", "torch no cache", "speed-up"]
        title = f"4. Greedy decoding, small config, batch {a.decode_batch}, source length 32: ms per call"
        print_table(title, header, rows)

    def float64(self) -> None:
        self.res["float64"], rows = {}, []
        for c in self.configs:
            cfg = CONFIGS[c]
            r = {dt: self.measure([self.npw], "train", cfg=cfg, dtype=dt, dropout=0.0)["numpy"]
                 for dt in ("float32", "float64")}  # fmt: skip
            self.res["float64"][c] = r
            t32, t64 = r["float32"]["median_s"], r["float64"]["median_s"]
            g64 = train_flops(cfg) / t64 / 1e9
            rows.append([c, fmt_ms(t32), fmt_ms(t64), f"{t64 / t32:.2f}", pct(g64, self.mm[("numpy", "float64")])])
        ratio = self.mm[("numpy", "float32")] / self.mm[("numpy", "float64")]
        header = ["config", "float32 ms", "float64 ms", "float64/float32", "float64 GFLOP/s (% mm float64)"]
        print_table(f"5. NumPy track, training step, float64 vs float32 (matmul rate ratio: {ratio:.2f})", header, rows)

    def quantized(self) -> None:
        """Greedy GPT decoding with weight-only quantized weights: tokens per second and model bytes."""
        new_tokens = 32 if self.args.quick else 56
        cfg = {**GPT_CONFIGS["small"], "batch": 1}
        self.res["quantized"], rows = {"cfg": cfg, "new_tokens": new_tokens, "formats": {}}, []
        for fmt in QUANT_FORMATS:
            r = self.measure(self.workers, "quantized", cfg=cfg, fmt=fmt, new_tokens=new_tokens)
            self.npw.ask(op="setup", task="quantized_bytes", args=dict(cfg=cfg, fmt=fmt), block=0)
            nbytes = self.npw.ask(op="call")["value"]
            self.res["quantized"]["formats"][fmt] = {"bytes": nbytes, **r}
            tn, tt = r["numpy"]["median_s"], r["torch"]["median_s"]
            rows.append([fmt, f"{nbytes:,}", f"{new_tokens / tn:.0f}", f"{new_tokens / tt:.0f}", f"{tn / tt:.2f}"])
        header = ["weights", "model bytes", "NumPy tokens/s", "torch tokens/s", "NumPy/torch time"]
        title = f"8. Greedy GPT decoding, small GPT config, batch 1, {new_tokens} new tokens: quantized weights"
        print_table(title, header, rows)

    def positions(self) -> None:
        """Time per token against its position: the median over the repeats at every position, both caches."""
        a = self.args
        L = a.position_length or (128 if a.quick else 512)
        cfg = {**CONFIGS["small"], "batch": a.decode_batch, "length": 32}
        per = {}
        for pre in (True, False):
            self.npw.ask(op="setup", task="positions", args=dict(cfg=cfg, out_len=L, preallocate=pre), block=0)
            runs = []
            for _ in range(self.repeats):
                time.sleep(a.pause)
                runs.append(self.npw.ask(op="call")["value"])
            per["preallocated" if pre else "concatenated"] = [statistics.median(ts) for ts in zip(*runs, strict=True)]
        self.res["positions"] = {"cfg": cfg, "length": L, "median_s": per}
        marks = sorted({1, *(p for p in (16, 64, 128, 256, 512, 1024, 2048) if p <= L), L})
        rows = [[str(p)] + [fmt_ms(per[k][p - 1]) for k in ("preallocated", "concatenated")] for p in marks]
        title = f"6. NumPy decode_step, one token, small config, batch {a.decode_batch}: ms per token at position"
        print_table(title, ["position", "preallocated", "concatenated"], rows)
        for k in ("preallocated", "concatenated"):
            say(f"  {k}: the last 10% of the positions take {_tail_ratio(per[k]):.2f}x the time of the first 10%")


def _tail_ratio(times: list[float]) -> float:
    n = max(1, len(times) // 10)
    return statistics.median(times[-n:]) / statistics.median(times[:n])


def run(args) -> dict:
    REPORT.clear()
    m = machine_info()
    threads = args.threads or m["usable_cores"]
    policy = args.omp_wait_policy
    workers = [Worker("numpy", threads, args.numpy_root, wait_policy=policy),
               Worker("torch", threads, wait_policy=policy)]  # fmt: skip
    bench = Bench(args, workers)
    env = _thread_env(threads, policy)
    bench.res.update(machine=m, threads=threads, env=env, omp_wait_policy=policy, repeats=bench.repeats)
    bench.res["settings"] = {
        "block_s": bench.block,
        "pause_s": args.pause,
        "configs": {c: CONFIGS[c] for c in bench.configs},
    }
    try:
        bench.header()
        bench.matmul()  # always: the other sections are compared with it
        for section in SECTIONS:
            if section in args.sections:
                getattr(bench, section)()
    finally:
        for w in workers:
            w.close()
    m["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    say(f"\nload average at the end {tuple(round(x, 2) for x in m['load_average_end'] or ())}")
    bench.res["report"] = "\n".join(REPORT)
    return bench.res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run: small config only, fewer repeats")
    p.add_argument("--json", metavar="PATH", help="store every measurement in this JSON file")
    p.add_argument("--threads", type=int, default=0, help="threads per library (default: every usable core)")
    p.add_argument("--repeats", type=int, default=0, help="repeats per figure (default 7, --quick 3)")
    p.add_argument("--block", type=float, default=None, help="seconds per repeat, at least one call (default 0.3)")
    p.add_argument("--pause", type=float, default=0.2, help="seconds between two measurements (default 0.2)")
    p.add_argument("--omp-wait-policy", choices=WAIT_POLICIES, default="default",
                   help="OMP_WAIT_POLICY of the workers (default: unset, each library's own behaviour)")  # fmt: skip
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="training/forward configs to run")
    p.add_argument("--decode-lengths", nargs="+", type=int, help="output lengths for greedy decoding")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to measure")
    p.add_argument("--decode-batch", type=int, default=8, help="batch size for greedy decoding (default 8)")
    p.add_argument("--position-length", type=int, help="tokens decoded for the per-position times (default 512)")
    p.add_argument("--numpy-root", help=argparse.SUPPRESS)  # import tfm_numpy from another checkout (before/after)
    p.add_argument("--worker", choices=["numpy", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.root)
        return
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"results stored in {args.json}")


if __name__ == "__main__":
    main()
