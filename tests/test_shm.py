"""Collectives through shared memory (autoshard/runtime/transport/shm.py) on real processes: every
primitive DistributedBackend uses equals the sum in rank order / the concatenation computed
from all ranks' inputs, bit for bit (the simulated backend's values), through segment growth,
more collectives in flight than slots, and payloads too large for it (gloo then). A segment
that cannot be made leaves the group on gloo on every rank; a peer that exits or stalls fails
the wait with CollectiveError; nothing of a job is left behind (in /dev/shm or held by a
process), whichever rank fails at whichever collective of making or growing a segment, by an
exception, SIGKILL, SIGTERM or SIGINT, or under torchrun."""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from autoshard import Mesh
from autoshard.runtime import CollectiveError, DistributedBackend, rank_context
from autoshard.runtime.transport import shm
from autoshard.runtime.transport.launch import spawn

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
    assert all(r[3] == [] for r in results), [r[3] for r in results]  # segments have no name there


def unavailable_worker(rank, world, broken):
    import torch.distributed as dist
    if broken == "create" and rank == 0:
        shm._create = lambda name, size: None  # no memory for it: posix_fallocate failed
    if broken == "map" and rank == 1:
        class _NoMap:
            MAP_SHARED = 1

            @staticmethod
            def mmap(*args, **kwargs):
                raise OSError("cannot map")
        shm.mmap = _NoMap  # the segment cannot be mapped here
    if broken == "grow" and rank == 0:
        make = shm._create
        shm._create = lambda name, size: make(name, size) if size < (20 << 20) else None  # room for 1 MiB slots only
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
        shm._create = lambda name, size: None  # no memory for it: posix_fallocate failed
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


# ---- nothing is left behind, however a job ends ------------------------------------------------

class _Faulty:
    """torch.distributed for shm.py, calling ``fault(k)`` before its ``k``-th all-reduce (the
    gloo collectives that make and replace segments: three each)."""

    def __init__(self, fault):
        self.calls, self.fault = 0, fault

    def __getattr__(self, attr):
        return getattr(torch.distributed, attr)

    def all_reduce(self, *args, **kwargs):
        self.calls += 1
        self.fault(self.calls)
        return torch.distributed.all_reduce(*args, **kwargs)


def fault_worker(rank, world, name, victim, phase, how):
    import signal
    import torch.distributed as dist

    # Python raises KeyboardInterrupt on SIGINT only where SIGINT was not ignored when it started
    # (a job started in the background inherits SIG_IGN): the handler a terminal's Ctrl-C meets
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def fault(call):
        if call != phase or rank != victim:
            return
        if how == "raise":
            raise RuntimeError(f"injected fault before setup collective {phase}")
        os.kill(os.getpid(), getattr(signal, how))  # SIGKILL, SIGTERM: ends here; SIGINT: raises

    shm.dist = _Faulty(fault)
    group = shm.SharedMemoryGroup(dist.group.WORLD, timeout_s=60.0, name=name)
    for numel in (1000, 1 << 20):  # 4 KB: the first segment (1 MiB slots); 4 MiB: its replacement
        x = torch.ones(numel)
        assert group.prepare(x)
        group.all_reduce(x)
    return "no fault"


def _held(name):
    """Files in /dev/shm, and pids of processes mapping or holding a segment, whose name starts
    with ``name``."""
    held = [f for f in os.listdir("/dev/shm") if f.startswith(name)]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"/memfd:{name}" in (d / "maps").read_text():
                    held.append(int(d.name))
            except OSError:
                pass
    return held


# (victim rank, the setup collective it fails before, how): collectives 1-3 make the first
# segment (rank 0 has created it before 1), 4-6 replace it
@pytest.mark.parametrize("victim, phase, how", [
    (1, 1, "raise"),    # a peer fails before the first collective; rank 0 waits in gloo's barrier
    (0, 1, "SIGKILL"),  # the creator killed right after creating it (no handler can run)
    (0, 1, "SIGTERM"),  # the creator SIGTERMed there (what torchrun sends when a peer fails)
    (0, 2, "SIGINT"),   # the creator interrupted (Ctrl-C) once every rank knows where it is
    (1, 4, "raise"),    # growth: a peer fails once rank 0 has created the larger segment
    (0, 5, "SIGKILL"),  # growth: the creator killed with both segments mapped
])
def test_a_rank_that_fails_during_setup_or_growth_leaves_nothing_behind(victim, phase, how):
    name = f"autoshard-test-{os.getpid()}-{victim}{phase}{how}"
    with pytest.raises(Exception) as failed:
        spawn(fault_worker, 2, name, victim, phase, how, timeout=60)
    # the fault happened where it was injected (not some other failure)
    report = str(failed.value)
    if how in ("SIGKILL", "SIGTERM"):
        code = -9 if how == "SIGKILL" else -15
        assert f"rank {victim} failed:\nprocess exited with code {code} without reporting" in report, report
    else:
        assert (f"before setup collective {phase}" if how == "raise" else "KeyboardInterrupt") in report, report
    assert _held(name) == []


_FAILING_JOB = '''
import sys
import torch
import torch.distributed as dist
from autoshard import Mesh
from autoshard.runtime import DistributedBackend
from autoshard.runtime.transport import distributed

dist.init_process_group("gloo")
token = distributed.job_token


def recorded():  # the segments' names start with autoshard-<token>
    t = token()
    with open(sys.argv[1], "a") as f:
        f.write(t + "\\n")
    return t


distributed.job_token = recorded
backend = DistributedBackend(Mesh({"x": 2}))
if dist.get_rank() == 1:
    raise SystemExit("rank 1 fails before the first collective")
backend.all_reduce(torch.ones(4), "x")  # rank 0 makes the segment and waits for rank 1
'''


def test_a_job_torchrun_ends_leaves_nothing_behind(tmp_path):
    """Under torchrun, rank 1 fails before the first collective: rank 0, in the segment's
    setup, fails in gloo's barrier or is SIGTERMed by torchrun; nothing of the job is left."""
    import subprocess
    script, tokens = tmp_path / "job.py", tmp_path / "tokens"
    script.write_text(_FAILING_JOB)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--monitor-interval=0.1", str(script), str(tokens)]
    proc = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "rank 1 fails before the first collective" in proc.stderr, proc.stderr[-3000:]
    token, = set(tokens.read_text().split())  # each rank's line
    assert _held(f"autoshard-{token}") == []


def test_a_peer_maps_only_the_segment_it_was_told_of(tmp_path):
    """A peer opens /proc/<pid>/fd/<descriptor> of the first rank; where that pid is another
    process (another pid namespace) the descriptor may be any file: it is mapped only when the
    link names the segment and the file is the segment's inode and size."""
    fd = shm._create("autoshard-test-attach-1", 1 << 16)
    other = os.open(tmp_path / "some file", os.O_RDWR | os.O_CREAT)
    os.ftruncate(other, 1 << 16)
    try:
        identity = shm._identity(fd)
        mapped = shm._attach(identity, "autoshard-test-attach-1", 1 << 16)
        mapped[:3] = b"abc"  # the same memory as the creator's own mapping
        assert shm._map(fd, 1 << 16)[:3] == b"abc"
        mapped.close()
        assert shm._attach(identity, "autoshard-test-attach-11", 1 << 16) is None  # another name
        assert shm._attach(identity, "autoshard-test-attach-1", 1 << 17) is None  # another size
        pid, _, inode, device = identity
        assert shm._attach((pid, other, inode, device), "autoshard-test-attach-1", 1 << 16) is None  # a plain file
        assert shm._attach((pid, fd, inode + 1, device), "autoshard-test-attach-1", 1 << 16) is None  # another inode
    finally:
        os.close(fd)
        os.close(other)
