"""Plumbing of gradient accumulation shared by both tracks (`tfm_numpy.parallel`, `tfm_torch.parallel`): splitting
a batch into micro-batches, and the weight of each micro-batch's loss; the layers and generators that recomputation
wraps and rewinds; and the start, collection and clean stop of worker processes for data parallelism."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback

import numpy as np

from .data import PAD_ID, Batch
from .validate import check_choice, check_real, check_size

__all__ = ["NORMALIZE", "split_batch", "micro_weights", "check_micro_batches", "generators", "wrap_layers",
           "ONE_THREAD", "run_processes"]  # fmt: skip

NORMALIZE = ("tokens", "micro_batches")


def split_batch(batch: Batch, k: int) -> list[Batch]:
    """Split `batch` by rows into `k` micro-batches (sizes differ by at most one), each trimmed of the columns that
    are padding in all of its rows: what a loader would have built for the smaller batches."""
    if not isinstance(batch, Batch):
        raise TypeError(f"split_batch: batch expected a tfm_common.data.Batch, got {type(batch).__name__}")
    k = check_size("split_batch", "k", k)
    if k > len(batch):
        raise ValueError(f"split_batch: k expected at most the batch size {len(batch)}, got {k}")
    out = []
    for rows in np.array_split(np.arange(len(batch)), k):
        src, tgt_in, tgt_out = batch.src[rows], batch.tgt_in[rows], batch.tgt_out[rows]
        s = _used_columns(src != PAD_ID)
        t = _used_columns(tgt_out != PAD_ID)
        out.append(Batch(src[:, :s], tgt_in[:, :t], tgt_out[:, :t], int((tgt_out != PAD_ID).sum())))
    return out


def _used_columns(not_pad: np.ndarray) -> int:
    cols = np.flatnonzero(not_pad.any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 1


def check_micro_batches(name: str, micro_batches) -> list[Batch]:
    micro_batches = list(micro_batches) if isinstance(micro_batches, (list, tuple)) else None
    if not micro_batches or not all(isinstance(b, Batch) for b in micro_batches):
        raise TypeError(f"{name}: micro_batches expected a non-empty list of tfm_common.data.Batch")
    return micro_batches


def micro_weights(micro_batches: list[Batch], normalize: str) -> list[float]:
    """The weight of each micro-batch's mean loss: n_i / N ("tokens", exact) or 1/k ("micro_batches", the common
    mistake: exact only when every micro-batch holds the same number of tokens)."""
    check_choice("micro_weights", "normalize", normalize, NORMALIZE)
    if normalize == "micro_batches":
        return [1.0 / len(micro_batches)] * len(micro_batches)
    total = max(sum(b.n_tokens for b in micro_batches), 1)
    return [b.n_tokens / total for b in micro_batches]


# -- recomputation -------------------------------------------------------------------------------------------------
def generators(module, kind: type) -> list:
    """The random generators (an `rng` attribute of type `kind`: dropout's) used inside `module`, each once."""
    seen: dict[int, object] = {}
    for _, m in module.named_modules():
        g = m.__dict__.get("rng")
        if isinstance(g, kind):
            seen.setdefault(id(g), g)
    return list(seen.values())


def wrap_layers(stacks, wrapper: type, enabled: bool) -> None:
    """Wrap (enabled) or unwrap every layer of the layer `stacks` with `wrapper` (whose `.module` is the layer)."""
    for stack in stacks:
        for key, layer in list(stack._modules.items()):
            if enabled and not isinstance(layer, wrapper):
                setattr(stack, key, wrapper(layer))
            elif not enabled and isinstance(layer, wrapper):
                setattr(stack, key, layer.module)


# -- worker processes -----------------------------------------------------------------------------------------------
# Every worker runs one thread (two workers share this 2-core machine), started with the "spawn" method: a fresh
# interpreter, so nothing of the parent's threads (OpenBLAS's, torch's) is inherited half-initialized, as with fork.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _worker_entry(target, rank: int, world: int, args: tuple, results) -> None:
    try:
        results.put((rank, True, target(rank, world, *args)))
    except BaseException:  # the parent raises it, with the worker's traceback
        results.put((rank, False, traceback.format_exc()))


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """Set environment variables while the workers start (they inherit them), and restore the parent's."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_processes(target, world: int, args: tuple = (), *, timeout: float = 60.0, env: dict | None = None) -> list:
    """Run `target(rank, world, *args)` in `world` fresh processes and return their results, by rank.

    `target` must be importable (a module-level function). A worker that raises makes this raise RuntimeError with
    its traceback; after `timeout` seconds, TimeoutError. Either way, and on success, every worker is joined,
    terminated if still alive, and killed if that fails: no process outlives the call.
    """
    world = check_size("run_processes", "world", world)
    timeout = check_real("run_processes", "timeout", timeout, 0.0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_entry, args=(target, r, world, args, results), daemon=True) for r in range(world)
    ]
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        with _environment({**ONE_THREAD, **(env or {})}):
            for p in procs:
                p.start()
        while len(out) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"run_processes: the workers did not finish within timeout={timeout} s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    code = procs[dead[0]].exitcode
                    raise RuntimeError(f"run_processes: worker {dead[0]} died with exit code {code}") from None
                continue
            if not ok:
                raise RuntimeError(f"run_processes: worker {rank} failed:\n{payload}")
            out[rank] = payload
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        _stop(procs)
        results.close()
        results.join_thread()
    return [out[r] for r in range(world)]


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
        if p.exitcode is not None:
            p.close()
