"""Collectives through shared memory (autoshard/runtime/shm.py) on real processes: every
primitive DistributedBackend uses equals the sum in rank order / the concatenation computed
from all ranks' inputs, bit for bit (the simulated backend's values), through segment growth,
more collectives in flight than slots, and payloads too large for it (gloo then). A segment
that cannot be made leaves the group on gloo on every rank; a peer that exits or stalls fails
the wait with CollectiveError; nothing is left in /dev/shm."""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoshard import Mesh  # noqa: E402
from autoshard.runtime import CollectiveError, DistributedBackend, rank_context  # noqa: E402
from autoshard.runtime import shm  # noqa: E402
from autoshard.runtime.launch import spawn  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shm.usable_here(), reason="shared memory needs x86-64")]


def _inputs(rank, case, numel, dtype):
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _ordered_sum(parts):
    out = parts[0] + parts[1]
    for p in parts[2:]:
        out = out + p
    return out


def _segments():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("autoshard-"))


def primitives_worker(rank, world):
    import torch.distributed as dist
    mesh = Mesh({"x": world})
    backend = DistributedBackend(mesh)
    assert backend.transports == {"x": "shared memory"}
    group = backend._shm["x"]
    finish, two_steps = group._finish, []
    group._finish = lambda transfer: (two_steps.append(transfer.two_steps), finish(transfer))[1]
    checked, case = [], 0
    with rank_context(mesh, rank, backend):
        # an empty payload first: it makes the segment like any other
        assert backend.all_reduce(torch.empty(0), "x").shape == (0,) and group.capacity > 0
        # sizes from one element to 8 MiB per rank: the segment grows three times on the way
        for numel, dtype in ((4, torch.float32), (4000, torch.float64), (300_000, torch.float32),
                             (2_000_000, torch.float32), (6000, torch.bfloat16)):
            case += 1
            parts = [_inputs(r, case, numel * world, dtype) for r in range(world)]
            mine = parts[rank]
            total = _ordered_sum(parts)
            got = {
                "all_reduce": backend.all_reduce(mine, "x"),
                "all_gather dim 0": backend.all_gather(mine.view(world, -1), "x", 0),
                "all_gather dim 1": backend.all_gather(mine.view(world, -1), "x", 1),
                "reduce_scatter dim 0": backend.reduce_scatter(mine.view(world, -1), "x", 0),
                "reduce_scatter dim 1": backend.reduce_scatter(mine.view(-1, world), "x", 1),
                "all_to_all": backend.all_to_all(mine.view(world, -1), "x", 0, 1),
            }
            want = {
                "all_reduce": total,
                "all_gather dim 0": torch.cat([p.view(world, -1) for p in parts], 0),
                "all_gather dim 1": torch.cat([p.view(world, -1) for p in parts], 1),
                "reduce_scatter dim 0": total.view(world, -1)[rank:rank + 1],
                "reduce_scatter dim 1": total.view(-1, world)[:, rank:rank + 1],
                "all_to_all": torch.cat([p.view(world, -1)[rank:rank + 1] for p in parts], 1),
            }
            for name in got:
                assert torch.equal(got[name], want[name]), (name, numel, dtype)
                checked.append((name, numel))
        capacity = group.capacity

        # 11 collectives in flight through 4 slots, waited for last first
        case += 1
        parts = [[_inputs(r, case + i, 5000 * world, torch.float32) for r in range(world)] for i in range(11)]
        kinds = ["all_reduce", "all_gather", "reduce_scatter"]
        pending = []
        for i, p in enumerate(parts):
            kind = kinds[i % 3]
            if kind == "all_reduce":
                pending.append(backend.all_reduce_async(p[rank], "x"))
            elif kind == "all_gather":
                pending.append(backend.all_gather_async(p[rank], "x", 0))
            else:
                pending.append(backend.reduce_scatter_async(p[rank], "x", 0))
        results = [w.wait() for w in reversed(pending)][::-1]
        for i, (p, got) in enumerate(zip(parts, results)):
            kind = kinds[i % 3]
            want = (_ordered_sum(p) if kind == "all_reduce" else torch.cat(p) if kind == "all_gather"
                    else _ordered_sum(p).view(world, -1)[rank])
            assert torch.equal(got, want), (i, kind)
            checked.append((kind, "in flight"))

        # above the size limit: through gloo, the segment untouched
        group.MAX_BYTES = 1024
        big = [_inputs(r, 99, 4096, torch.float32) for r in range(world)]
        assert torch.equal(backend.all_gather(big[rank], "x", 0), torch.cat(big))
        torch.testing.assert_close(backend.all_reduce(big[rank], "x"), _ordered_sum(big), rtol=1e-6, atol=1e-6)
        assert group.capacity == capacity and group.usable
    dist.barrier()
    return checked, capacity, group.generation, _segments(), sum(two_steps), len(two_steps)


def test_every_primitive_through_shared_memory_equals_rank_order_sums_and_concatenation():
    results = spawn(primitives_worker, 4, timeout=180)
    checked, capacity, generations, left, in_parts, transfers = results[0]
    assert len(checked) == 5 * 6 + 11
    assert 0 < in_parts < transfers  # all-reduces of 64 KiB or more on 4 ranks sum in parts, others at once
    assert capacity >= 2_000_000 * 4 * 4 and generations >= 3  # grew to the a2a payload of 8M floats x 4
    assert all(r[3] == [] for r in results), [r[3] for r in results]  # unlinked once mapped


def unavailable_worker(rank, world, broken):
    import torch.distributed as dist
    if broken == "create" and rank == 0:
        shm._create = lambda path, size: False  # /dev/shm full: posix_fallocate failed
    if broken == "map" and rank == 1:
        class _NoMap:
            MAP_SHARED = 1

            @staticmethod
            def mmap(*args, **kwargs):
                raise OSError("cannot map")
        shm.mmap = _NoMap  # another IPC namespace: the file is not there to map
    if broken == "grow" and rank == 0:
        make = shm._create
        shm._create = lambda path, size: size < (20 << 20) and make(path, size)  # room for 1 MiB slots only
    mesh = Mesh({"x": world})
    backend = DistributedBackend(mesh)
    group = backend._shm["x"]
    results = []
    with rank_context(mesh, rank, backend):
        for numel in (1000, 1 << 20, 1000):  # 4 KB, 4 MiB (needs a larger segment), 4 KB
            x = _inputs(rank, numel, numel, torch.float32)
            results.append((backend.all_reduce(x, "x"), backend.all_gather(x, "x", 0), group.capacity))
    dist.barrier()
    return group.usable, group.too_big, results, _segments()


@pytest.mark.parametrize("broken", ["create", "map", "grow"])
def test_a_segment_that_cannot_be_made_leaves_its_payloads_on_gloo(broken):
    """No segment at all: every collective through gloo, on every rank. A larger one not
    possible: the 4 MiB payload through gloo, the small ones still through the 1 MiB slots."""
    for usable, too_big, results, left in spawn(unavailable_worker, 2, broken, timeout=120):
        assert usable is (broken == "grow") and left == []
        assert too_big == (4 << 20 if broken == "grow" else shm.SharedMemoryGroup.MAX_BYTES + 1)
        assert [capacity for *_, capacity in results] == ([1 << 20] * 3 if broken == "grow" else [0] * 3)
        for (summed, gathered, _), numel in zip(results, (1000, 1 << 20, 1000)):
            parts = [_inputs(r, numel, numel, torch.float32) for r in range(2)]
            assert torch.equal(summed, parts[0] + parts[1]) and torch.equal(gathered, torch.cat(parts))


def lost_peer_worker(rank, world, how):
    import torch.distributed as dist
    group = shm.SharedMemoryGroup(dist.group.WORLD, timeout_s=2.0 if how == "stalls" else 60.0, name="autoshard-test")
    x = torch.ones(8)
    assert group.prepare(x)
    group.all_reduce(x)  # both ranks take part in one collective
    if rank == 1:
        if how == "stalls":
            time.sleep(4)  # past rank 0's timeout, then it arrives and reads rank 0's payload
            group.all_reduce(torch.ones(8))
        return None  # "exits": returns and its process ends without the second collective
    t0 = time.monotonic()
    try:
        group.all_reduce(torch.ones(8))
    except CollectiveError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.parametrize("how", ["exits", "stalls"])
def test_a_lost_peer_fails_the_wait(how):
    message, seconds = spawn(lost_peer_worker, 2, how, timeout=60)[0]
    if how == "exits":
        assert "peer rank 1" in message and "exited" in message, message
        assert seconds < 10, seconds  # noticed from the process table, not after the 60 s timeout
    else:
        assert "timed out after 2s" in message and "peer rank(s) [1]" in message, message
        assert 2 <= seconds < 10, seconds


def switch_worker(rank, world):
    os.environ["AUTOSHARD_SHARED_MEMORY"] = "0"
    by_env = DistributedBackend(Mesh({"x": world})).transports
    del os.environ["AUTOSHARD_SHARED_MEMORY"]
    return by_env, DistributedBackend(Mesh({"x": world}), shared_memory=False).transports


def test_shared_memory_can_be_switched_off():
    for by_env, by_argument in spawn(switch_worker, 2, timeout=60):
        assert by_env == by_argument == {"x": "gloo"}


def connect_worker(rank, world, broken):
    if broken and rank == 0:
        shm._create = lambda path, size: False  # /dev/shm full: posix_fallocate failed
    backend = DistributedBackend(Mesh({"x": world}))
    before = backend.transports
    return before, backend.connect(), backend.transports, _segments()


@pytest.mark.parametrize("broken", [False, True])
def test_connect_reports_the_transport_the_collectives_use(broken):
    """run.py's first line names the transport after connect(): shared memory only where the
    segment was made (before, the backend can only say what it will try)."""
    for before, connected, after, left in spawn(connect_worker, 2, broken, timeout=60):
        assert before == {"x": "shared memory"} and left == []
        assert connected == after == {"x": "gloo" if broken else "shared memory"}
