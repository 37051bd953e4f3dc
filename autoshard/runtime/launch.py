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

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


class SpawnError(RuntimeError):
    """A spawned rank raised, died, or the run timed out; the message holds its traceback."""


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, timeout, threads, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if threads:
        # N processes on few cores: one intra-op thread each avoids oversubscription stalls.
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickle here, not in the queue: torch's queue pickler would pass tensors through
        # shared memory that disappears when this process exits.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - the parent needs every failure, with its traceback
        results.put((rank, "error", traceback.format_exc()))


def spawn(fn: Callable[..., Any], nprocs: int, *args, timeout: float = 120.0,
          threads: int | None = 1) -> list:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` fresh processes; results by rank.

    Each process gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK/WORLD_SIZE, and a
    ``gloo`` default process group (destroyed afterwards). ``fn`` must be a module-level
    function and its result picklable. The first rank to fail stops the run: the others are
    killed and :class:`SpawnError` carries that rank's traceback. After ``timeout`` seconds
    everything still running is killed and SpawnError says which ranks had not reported.

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
    error: str | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(out) < nprocs and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(nprocs)) - set(out))
                error = f"timeout after {timeout:g}s; ranks {missing} did not finish"
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 0.2))
            except queue_mod.Empty:
                # A process that died without reporting (segfault, os._exit, OOM kill)?
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if not dead:
                    continue
                try:  # it may have reported just before dying
                    rank, status, payload = results.get(timeout=1.0)
                except queue_mod.Empty:
                    error = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} without reporting"
                    break
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                error = f"rank {rank} failed:\n{payload}"
    finally:
        for p in procs:
            if p.is_alive() and (error is not None or len(out) < nprocs):
                p.kill()
        for p in procs:
            p.join(5)
            if p.is_alive():  # pragma: no cover - kill did not take
                p.kill()
                p.join(5)
        results.close()
    if error is not None:
        raise SpawnError(error)
    return [out[r] for r in range(nprocs)]
