"""A small multi-process launcher for tests: N CPU processes joined by a gloo process group.

Example::

    # in an importable module (spawned processes re-import fn by name):
    def work(rank, world_size, n):
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t

    spawn(work, 4, 3)      # [tensor([6., 6., 6.])] * 4
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class SpawnError(RuntimeError):
    """A spawned rank raised, died, or the run timed out; the message holds its traceback."""


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Tracebacks of ranks that only failed because a peer went away first.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "DistNetworkError", "timed out")


def _worker(rank, world_size, port, timeout, threads, fn, args, results):
    # A hung rank prints its Python stack to stderr shortly before the parent kills it.
    faulthandler.dump_traceback_later(max(timeout - 2.0, 1.0), exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if threads:
        # N processes on few cores: one intra-op thread each avoids oversubscription stalls.
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # Pickle here, not in the queue: torch's queue pickler would pass tensors through
        # shared memory that disappears when this process exits.
        report = (rank, "ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - the parent needs every failure, with its traceback
        report = (rank, "error", traceback.format_exc())
    # Report before tearing down: destroying the group makes blocked peers fail too, and the
    # parent should hear the root cause first.
    results.put(report)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args, timeout: float = 120.0,
          threads: int | None = 1) -> list:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` fresh processes; results by rank.

    Each process gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK/WORLD_SIZE, one
    intra-op thread (``threads``), and a ``gloo`` default process group (destroyed afterwards).
    ``fn`` must be a module-level function and its result picklable. When a rank fails, the
    failures reported within a short grace period are collected, the others are killed, and
    :class:`SpawnError` carries the tracebacks, root cause first (ranks that only lost a peer
    last). After ``timeout`` seconds everything still running is killed and SpawnError names
    the ranks that had not reported (their stacks are dumped to stderr just before).

    Example::

        spawn(my_module.work, 4, 3, timeout=60)
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, name=f"autoshard-rank{r}", daemon=True,
                         args=(r, nprocs, port, timeout, threads, fn, args, results))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < nprocs:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(deadline - now, 0.2))
            except queue_mod.Empty:
                heard = set(out) | {r for r, _ in errors}
                for r, p in enumerate(procs):
                    # died without reporting (segfault, os._exit, OOM kill); allow for a report
                    # still in the pipe by checking only after an empty poll
                    if r not in heard and p.exitcode not in (None, 0):
                        errors.append((r, f"process exited with code {p.exitcode} without reporting"))
                        deadline = min(deadline, time.monotonic() + 1.0)
                continue
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors.append((rank, payload))
                # Collect what else fails right after (usually peers losing this rank).
                deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        for p in procs:
            if p.is_alive() and (errors or len(out) < nprocs):
                p.kill()
        for p in procs:
            p.join(5)
            if p.is_alive():  # pragma: no cover - kill did not take
                p.kill()
                p.join(5)
        results.close()
    if errors:
        errors.sort(key=lambda e: any(s in e[1] for s in _SECONDARY))  # stable: arrival order
        raise SpawnError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors))
    if len(out) < nprocs:
        missing = sorted(set(range(nprocs)) - set(out))
        raise SpawnError(f"timeout after {timeout:g}s; ranks {missing} did not finish")
    return [out[r] for r in range(nprocs)]
