"""Collectives between the processes of one host through a shared memory segment.

gloo moves every collective through loopback TCP and its own threads, even when all ranks of a
group run on one machine. There, a rank can instead copy its payload into a segment all of them
map and read the others' payloads from it, without gloo's sockets and threads, which take
their CPU from the compute when a process has one core (``benchmarks/collectives.py`` compares
the two; its results are in benchmarks/README.md).

:class:`SharedMemoryGroup` serves one process group with the three tensor-form primitives
:class:`~autoshard.runtime.transport.distributed.DistributedBackend` uses, with torch.distributed's
signatures: ``all_reduce`` (a sum in rank order, as the simulated backend sums, so results
equal the simulation bit for bit at any group size), ``all_gather_single`` and
``all_to_all_single`` (equal blocks). Each returns a work handle (``wait``, ``is_completed``)
when ``async_op``, else None after finishing.

How a collective runs: a rank copies its payload into its own slot and publishes the
collective's sequence number (it *arrives*); whenever it waits, it spins until every rank has
arrived, reads all slots into the output (rank order), and publishes that it has read them (it
*departs*). Starting never waits for the others to arrive, so an asynchronous collective costs
one copy until it is waited for. ``WINDOW`` collectives can be in flight per group, each in its
own slot; a slot is reused once every rank has departed from its previous collective (a rank
that still holds one there finishes it first). Every rank issues the same collectives in the
same order (the SPMD program), so sequence numbers match across ranks.

The segment is created by the group's first rank with room for the largest payload seen (it is
replaced by a larger one when a payload does not fit: every rank sees the same sizes, so all
replace it at the same collective) as an anonymous file (``memfd_create``): it has no name in
``/dev/shm`` or anywhere else. The others open it through ``/proc/<pid>/fd/<descriptor>`` of the
first rank (checking the link's name and the inode) and map it; the first rank closes its
descriptor once all have. The kernel frees the memory when the last process that maps it ends,
whatever way it ends (an exception, SIGTERM, SIGKILL at any moment of setup or growth): nothing
of the job is left behind, and there is nothing for a later job to clean up. Its memory is
reserved when it is created (``posix_fallocate``), so memory that cannot be had fails there
instead of as a SIGBUS on a later write: payloads too large for the segment the group has then
go through gloo (all of them, if it has none), as they do where the peers cannot open the first
rank's descriptor (another pid namespace).

A wait that sees no progress fails with :class:`CollectiveError` naming the ranks it waits for:
after the group's timeout (a stalled peer), or as soon as a peer's process has exited.

Payloads are published by plain stores after the copy: x86-64 keeps stores in order (and loads
in order), so a rank that sees a sequence number sees the payload. Other architectures need
fences this module does not issue; :func:`usable_here` says where it may be used.

Example (inside a process of a gloo job whose ranks share one host)::

    group = SharedMemoryGroup(dist.group.WORLD, timeout_s=600)
    x = torch.ones(4)
    if group.prepare(x):                 # same answer on every rank
        group.all_reduce(x)              # x is now the sum over ranks
    out = x.new_empty(4 * dist.get_world_size())
    if group.prepare(x):
        work = group.all_gather_single(out, x, async_op=True)
    ...                                  # compute
    work.wait()
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import time

import torch
import torch.distributed as dist

from autoshard.runtime.transport.backend import CollectiveError

_PAGE = 4096


def usable_here() -> bool:
    """Whether shared-memory collectives may run on this machine (ordered stores: x86-64)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")
            and os.path.isdir(f"/proc/{os.getpid()}/fd"))


def all_on_this_host() -> bool:
    """Whether every rank of the job runs on this machine: a collective (every rank must call
    it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (socket.gethostname(), boot))
    return len(set(hosts)) == 1


def job_token() -> str:
    """A name all ranks of the job share and no other job has (rank 0's, broadcast): a
    collective."""
    box = [secrets.token_hex(6)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class SharedMemoryGroup:
    """The collectives of one gloo process group, through shared memory (see the module doc).

    ``name`` makes the segment's file name unique (a job token and the group); ``timeout_s``
    bounds every wait for a peer."""

    WINDOW = 4  # collectives in flight at once per group, one slot each
    # A payload larger than this (per rank) goes through gloo: the segment holds WINDOW x n
    # slots of up to this size, reserved memory (1 GiB for 4 ranks).
    MAX_BYTES = 64 << 20
    MIN_BYTES = 1 << 20  # smallest slot: a segment is not replaced for every larger payload
    SPLIT_BYTES = 64 << 10  # all-reduces from this size on (more than 2 ranks) sum in parts

    def __init__(self, group, timeout_s: float, name: str = "autoshard"):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.n, self.me = len(self.ranks), self.ranks.index(dist.get_rank())
        self.timeout_s = timeout_s
        self.crowded = dist.get_world_size() > len(os.sched_getaffinity(0))  # more ranks than cores here
        self.name = f"{name}-{min(self.ranks)}-{self.n}"  # its segments' names, in /proc/<pid>/fd
        self.seq = 0  # collectives started so far
        self.floor = 0  # collectives before the current segment (all finished in the old one)
        self.capacity = 0  # bytes per slot; 0: no segment yet
        self.generation = 0
        self.usable = True  # False after no segment could be made: gloo from then on
        self.too_big = self.MAX_BYTES + 1  # payloads of this size or more go through gloo
        self.inflight = [None] * self.WINDOW  # this rank's unfinished transfer per slot
        self.pids = []

    # ---- torch.distributed's forms -------------------------------------------------------------

    def prepare(self, t: torch.Tensor) -> bool:
        """Whether the next collective, with per-rank payload ``t``, runs here; makes or grows
        the segment first where needed. Every rank of the group must call it for the same
        collective, and all get the same answer (these collectives' payloads have one size on
        all ranks). Where a larger segment could not be made, payloads that need it go through
        gloo from then on (and all do where none could be made)."""
        return (self.usable and t.device.type == "cpu" and t.nbytes < min(self.too_big, self.MAX_BYTES + 1)
                and self._ensure(t.nbytes))

    # ``group`` and ``op`` are accepted as torch.distributed's calls pass them (the group is
    # this one; the op is always a sum).

    def all_reduce(self, t: torch.Tensor, op=None, group=None, async_op: bool = False):
        """``t`` (contiguous) becomes the sum over ranks, added in rank order.

        With more than two ranks and a payload of ``SPLIT_BYTES`` or more, each rank sums one
        ``n``-th of the elements (over all slots, in rank order) into rank 0's slot, and every
        rank copies the whole sum from there once all parts are in: each reads the payload's
        size twice instead of ``n`` times. The same additions in the same order: the same bits."""
        flat = t.view(-1)
        if self.n > 2 and t.nbytes >= self.SPLIT_BYTES:
            def deliver(slots):
                part = slice(self.me * flat.numel() // self.n, (self.me + 1) * flat.numel() // self.n)
                into = slots[0][part]
                for s in slots[1:]:
                    into.add_(s[part])  # slot 0's part is read by this rank only
                return lambda: flat.copy_(slots[0])  # once every rank has summed its part
            return self._run(t, deliver, async_op, two_steps=True)

        def deliver(slots):
            if self.n == 1:
                flat.copy_(slots[0])
                return
            torch.add(slots[0], slots[1], out=flat)
            for s in slots[2:]:
                flat.add_(s)
        return self._run(t, deliver, async_op)

    def all_gather_single(self, out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
        """``out`` (contiguous, ``n`` times ``t``) gets every rank's ``t`` one after the other."""
        def deliver(slots):
            torch.cat(slots, out=out.view(-1))
        return self._run(t, deliver, async_op)

    def all_to_all_single(self, out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
        """Block ``j`` of ``out`` gets block ``me`` of rank ``j``'s ``t`` (``n`` equal blocks)."""
        block = t.numel() // self.n
        mine = slice(self.me * block, (self.me + 1) * block)

        def deliver(slots):
            torch.cat([s[mine] for s in slots], out=out.view(-1))
        return self._run(t, deliver, async_op)

    # ---- the protocol ---------------------------------------------------------------------------

    def _run(self, t, deliver, async_op, two_steps=False):
        payload = t.detach().reshape(-1)
        assert payload.nbytes <= self.capacity, "prepare() first"
        self.seq += 1
        slot = self.seq % self.WINDOW
        held = self.inflight[slot]
        if held is not None:
            held.wait()  # this rank's previous collective in the slot: read it before reuse
        before = self.seq - self.WINDOW
        if before > self.floor:
            self._spin(self._depart, slot, before, "finish reading the previous collective of its slot")
        self._data(slot, self.me, payload).copy_(payload)
        self._arrive[slot * self.n + self.me] = self.seq
        transfer = _Transfer(self, self.seq, slot, payload, deliver, two_steps)
        self.inflight[slot] = transfer
        if not async_op:
            transfer.wait()
            return None
        return transfer

    def _finish(self, transfer):
        slot = transfer.slot
        self._spin(self._arrive, slot, transfer.seq, "arrive")
        deliver, payload = transfer.deliver, transfer.payload
        then = deliver([self._data(slot, r, payload) for r in range(self.n)])
        if transfer.two_steps:  # a second step that needs every rank's first one
            self._summed[slot * self.n + self.me] = transfer.seq
            self._spin(self._summed, slot, transfer.seq, "sum its part")
            then()
        self._depart[slot * self.n + self.me] = transfer.seq
        if self.inflight[slot] is transfer:
            self.inflight[slot] = None

    def _arrived(self, slot, seq) -> bool:
        row = slot * self.n
        return all(self._arrive[row + r] >= seq for r in range(self.n))

    def _data(self, slot, rank, like):
        start = self._control + (slot * self.n + rank) * self.capacity
        return self._bytes[start:start + like.nbytes].view(like.dtype)

    def _spin(self, flags, slot, seq, what):
        """Until every rank's flag of ``slot`` reaches ``seq``; CollectiveError on no progress."""
        row = slot * self.n
        waiting = [r for r in range(self.n) if flags[row + r] < seq]
        if not waiting:
            return
        t0 = last_check = time.monotonic()
        # Spin first (a peer about to arrive), then sleep in naps growing from 50 us. With more
        # ranks than cores a waiting rank takes the CPU its peers compute on, by spinning and by
        # every wake-up: there it spins 0.2 ms and naps up to 1 ms, else 2 ms and 0.2 ms.
        spin, longest = (2e-4, 1e-3) if self.crowded else (2e-3, 2e-4)
        nap = 0.0
        while True:
            for _ in range(16):
                if all(flags[row + r] >= seq for r in waiting):
                    return
                if nap:
                    time.sleep(nap)
                else:
                    os.sched_yield()
            now = time.monotonic()
            if now - t0 > spin:
                nap = min(longest, 2 * nap or 5e-5)
            if now - last_check < 0.2:
                continue
            last_check = now
            waiting = [r for r in waiting if flags[row + r] < seq]
            for r in waiting:
                if self.pids[r] is not None and not _alive(self.pids[r]):
                    raise CollectiveError(
                        f"shared-memory collective {seq} of process group {self.ranks}: peer rank "
                        f"{self.ranks[r]} (pid {self.pids[r]}) exited before it could {what}")
            if now - t0 > self.timeout_s:
                raise CollectiveError(
                    f"shared-memory collective {seq} of process group {self.ranks} timed out after "
                    f"{self.timeout_s:g}s waiting for peer rank(s) {[self.ranks[r] for r in waiting]} to {what}")

    def _ensure(self, nbytes) -> bool:
        """A segment whose slots hold ``nbytes``: made (or replaced by a larger one) by every
        rank of the group at the same collective. False (on every rank) where it could not be
        made: the current segment, if any, stays for smaller payloads."""
        if self.capacity and nbytes <= self.capacity:
            return True
        for held in self.inflight:
            if held is not None:
                held.wait()  # nothing may be read from the old segment after it is dropped
        capacity = max(nbytes, min(max(2 * self.capacity, self.MIN_BYTES), self.MAX_BYTES))
        capacity = -(-capacity // _PAGE) * _PAGE
        control = -(-8 * (3 * self.WINDOW + 1) * self.n // _PAGE) * _PAGE
        size = control + self.WINDOW * self.n * capacity
        self.generation += 1
        name = f"{self.name}-{self.generation}"
        fd = mapped = None
        try:
            fd = _create(name, size) if self.me == 0 else None
            # Rank 0's pid, descriptor and inode to every rank (zeros: none made); also the
            # barrier after which its descriptor is there to open.
            first = self._from_first_rank(_identity(fd) if fd is not None else (0, 0, 0, 0))
            if first[0]:
                mapped = _map(fd, size) if self.me == 0 else _attach(first, name, size)
            ok = self._all(mapped is not None)  # after it no rank opens rank 0's descriptor
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)  # the mappings hold the memory; the last one gone frees it
        if not ok:
            if self.capacity:
                self.too_big = nbytes
            else:
                self.usable = False
            if mapped is not None:
                mapped.close()
            return False
        self._mapping = mapped
        self._bytes = torch.frombuffer(mapped, dtype=torch.uint8)
        flags = memoryview(mapped)[:control].cast("q")
        rows = self.WINDOW * self.n
        self._arrive, self._summed, self._depart = flags[:rows], flags[rows:2 * rows], flags[2 * rows:3 * rows]
        pids = flags[3 * rows:3 * rows + self.n]
        pids[self.me] = os.getpid()
        self._all(True)  # everyone's pid is written
        # a peer in another pid namespace is not in /proc here: only the timeout watches it
        self.pids = [pids[r] if _alive(pids[r]) else None for r in range(self.n)]
        self._control, self.capacity = control, capacity
        self.floor = self.seq
        return True

    def _from_first_rank(self, numbers) -> list:
        """The group's first rank's ``numbers`` (integers), on every rank (a gloo all-reduce
        of them and the others' zeros: a barrier too)."""
        t = torch.tensor(numbers if self.me == 0 else [0] * len(numbers), dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def _all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a gloo all-reduce: a barrier too)."""
        t = torch.tensor([0 if flag else 1], dtype=torch.int32)
        dist.all_reduce(t, group=self.group)
        return int(t) == 0


class _Transfer:
    """A collective started on a :class:`SharedMemoryGroup`: torch.distributed's work handle."""

    def __init__(self, owner, seq, slot, payload, deliver, two_steps):
        self.owner, self.seq, self.slot, self.payload, self.deliver = owner, seq, slot, payload, deliver
        self.two_steps, self.done = two_steps, False

    def is_completed(self) -> bool:
        """Whether ``wait`` would not block. A two-step sum says no until waited for: its
        second step waits for every rank to reach its own wait, and a rank that waited early,
        because it saw the transfer done, could block a peer that did not."""
        return self.done or (not self.two_steps and self.owner._arrived(self.slot, self.seq))

    def wait(self, *args) -> bool:
        if not self.done:
            self.owner._finish(self)
            self.done = True
            self.payload = self.deliver = None
        return True


def _create(name: str, size: int):
    """A descriptor of a new anonymous file of ``size`` bytes, all reserved; None where memory
    for it cannot be had. It has no name in any directory: nothing is left of it once every
    descriptor and mapping of it is gone, however the processes end.

    No ``/dev/shm`` size limit applies to such a file, so one that would take more than half
    the memory the machine has available is refused here instead."""
    if size > _available_bytes() // 2:
        return None
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return fd
    except OSError:
        os.close(fd)
        return None


def _available_bytes() -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _identity(fd: int) -> tuple:
    """(pid, descriptor, inode, device): what a peer needs to open ``fd`` of this process and
    know that it opened that file."""
    st = os.fstat(fd)
    return os.getpid(), fd, st.st_ino, st.st_dev


def _map(fd: int, size: int):
    """A shared mapping of ``fd``'s ``size`` bytes; None where it cannot be made."""
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED)
    except OSError:
        return None


def _attach(identity, name: str, size: int):
    """A shared mapping of the segment that :func:`_identity` describes, opened through
    ``/proc/<pid>/fd/<descriptor>``; None where it cannot be (another pid namespace, where the
    pid is another process's or none; /proc not readable). The link must name the segment and
    the file opened must be its inode: a descriptor of anything else is never mapped."""
    pid, fd, inode, device = identity
    link = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(link).startswith(f"/memfd:{name} "):
            return None
        mine = os.open(link, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(mine)
        if (st.st_ino, st.st_dev, st.st_size) != (inode, device, size):
            return None
        return _map(mine, size)
    finally:
        os.close(mine)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a stopped one does; an exited, unreaped one not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
