"""autoshard's collectives through shared memory against the same collectives through gloo.

Run (on a quiet machine; launches one torchrun job per world size)::

    .venv/bin/python benchmarks/collectives.py            # 2 and 4 processes
    .venv/bin/python benchmarks/collectives.py --world 2 --sizes-mib 4

Each process builds two :class:`~autoshard.runtime.DistributedBackend` on one mesh axis over
all processes: the default (shared memory, where every rank runs on this host) and
``shared_memory=False`` (gloo's sockets). For each collective and payload size (per rank), the
two are timed alternately (``--rounds`` rounds of ``--calls`` calls), one thread per process;
a call's time is rank 0's wall time over a round (barriers around it) divided by the calls.
Prints a table of milliseconds per call and their ratio (shared memory / gloo).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def run_kind(backend, kind, x):
    if kind == "all_reduce":
        return backend.all_reduce(x, "x")
    if kind == "all_gather":
        return backend.all_gather(x, "x", 0)
    return backend.reduce_scatter(x, "x", 0)


def timed(backend, kind, x, calls):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        run_kind(backend, kind, x)
    dist.barrier()
    return (time.perf_counter() - t0) / calls


def worker(opts):
    from autoshard import Mesh
    from autoshard.runtime import DistributedBackend, rank_context
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh({"x": world})
    shared, sockets = DistributedBackend(mesh), DistributedBackend(mesh, shared_memory=False)
    rows = []
    with rank_context(mesh, rank, shared):
        for mib in opts.sizes_mib:
            numel = max(world, int(mib * 2 ** 20 / 4) // world * world)
            x = torch.randn(numel)
            for kind in KINDS:
                for _ in range(2):  # warm-up: the segment is made, buffers allocated
                    run_kind(shared, kind, x), run_kind(sockets, kind, x)
                a, b = [], []
                for r in range(opts.rounds):
                    first, second = (shared, sockets) if r % 2 == 0 else (sockets, shared)
                    t1, t2 = timed(first, kind, x, opts.calls), timed(second, kind, x, opts.calls)
                    (a, b)[first is sockets].append(t1)
                    (a, b)[second is sockets].append(t2)
                rows.append((kind, mib, statistics.median(a), statistics.median(b)))
    if rank == 0:
        print(f"\n{world} processes, 1 thread each, {shared.transports['x']} vs gloo: ms per call (median of "
              f"{opts.rounds} rounds of {opts.calls} calls)")
        print("| collective | MiB per rank | shared memory | gloo | ratio |")
        print("|---|---|---|---|---|")
        for kind, mib, a, b in rows:
            print(f"| {kind} | {mib:g} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} |")
        sys.stdout.flush()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[4e-6, 4, 12.6])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    opts = ap.parse_args()
    if "RANK" in os.environ:
        return worker(opts)
    for n in opts.world:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               __file__, *sys.argv[1:]]
        rc = subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if rc:
            sys.exit(rc)


if __name__ == "__main__":
    main()
