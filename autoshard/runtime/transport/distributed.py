"""torch.distributed backend: one process group per mesh axis, from a DeviceMesh.

Works with gloo on CPU and nccl on GPU. torch 2.13's gloo implements every primitive used
here natively (all_reduce, all_gather_single / all_gather_into_tensor,
reduce_scatter_single / reduce_scatter_tensor, all_to_all_single), so no emulation is needed.
Those primitives work on dim 0 of contiguous tensors, so gathers and scatters along another
dim move it to the front, run, and move it back.

Point to point (pipeline stage boundaries) uses ``send`` / ``recv`` of the default group with the
message number as the tag, so gloo matches messages by tag whatever order they were sent in.
Sends do not copy and are waited for only in ``wait_sends``; on gloo, ``post_recv`` starts a
receive ahead of the ``recv`` that reads it, so the data can land while this rank still computes
(nccl matches by posting order, so there it waits for the ``recv``).
NCCL ignores tags and matches messages between two ranks in the order they were posted; the
pipeline schedules post them in matching order, but that path has not been run here.

Where every rank runs on one host (gloo on CPU, x86-64), all-reduces, gathers and all-to-alls
of equal blocks move through shared memory instead (:mod:`.shm`), several times faster than
gloo's sockets; ``shared_memory=False`` keeps them on gloo.

Values equal the simulated backend's bit for bit with shared memory (sums in rank order) and
on gloo except for the order of floating-point summation in all-reduces (and reduce-scatters
on nccl), which gloo/nccl choose (ring, halving-doubling, ...): expect relative differences
around ``n * eps`` (fp32: ~1e-6 with 4 ranks). Gathers and all-to-all are bit-exact, and so are
reduce-scatters on gloo, which run as an all-to-all and a sum in rank order (faster there than
gloo's own reduce-scatter).

Example (inside a process started by torchrun or :func:`autoshard.runtime.transport.launch.spawn`)::

    mesh = Mesh({"dp": 2, "tp": 2})
    backend = DistributedBackend(mesh)                 # builds init_device_mesh("cpu", ...)
    with rank_context(mesh, dist.get_rank(), backend):
        y = all_reduce(x, "tp")
"""
from __future__ import annotations

import math
import os
from collections import deque

import torch
import torch.distributed as dist

from autoshard.runtime.transport.backend import (Backend, CollectiveError, Pending, check_divisible, check_splits, shares_memory)
from autoshard.runtime.transport.shm import SharedMemoryGroup, all_on_this_host, job_token, usable_here

# torch 2.13 renamed the tensor-form collectives (the old names warn as deprecated).
_all_gather_1 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_1 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Gloo:
    """torch.distributed's tensor-form collectives under :class:`SharedMemoryGroup`'s names."""

    all_reduce = staticmethod(dist.all_reduce)
    all_gather_single = staticmethod(_all_gather_1)
    all_to_all_single = staticmethod(dist.all_to_all_single)


def _group_timeout(group):
    """The timeout of a process group's backend (None if torch does not say)."""
    try:
        backend = group._get_backend(torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


def _timeout_override(mesh, timeout):
    """``backend_override`` for ``init_device_mesh`` giving every axis group ``timeout`` (a
    timedelta or seconds; None: the default group's). None when torch offers no options."""
    from datetime import timedelta

    if timeout is None:
        timeout = _group_timeout(dist.distributed_c10d._get_default_group())
        if timeout is None:
            return None
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    name = dist.get_backend()
    make = {"gloo": getattr(dist.ProcessGroupGloo, "_Options", None) if hasattr(dist, "ProcessGroupGloo") else None,
            "nccl": getattr(dist.ProcessGroupNCCL, "Options", None) if hasattr(dist, "ProcessGroupNCCL") else None
            }.get(name)
    if make is None:
        return None
    override = {}
    for axis in mesh.names:
        if mesh.axes[axis] == mesh.size:
            continue  # init_device_mesh reuses the default group (its timeout) for a whole-world axis
        opts = make()
        opts._timeout = timeout
        override[axis] = (name, opts)
    return override or None


def _sum_blocks(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of the ``n`` equal blocks of dim 0 of ``rows``, left to right (rank order, as
    the simulated backend sums)."""
    blocks = rows.chunk(n, 0)
    out = blocks[0].clone() if n == 1 else blocks[0] + blocks[1]
    for b in blocks[2:]:
        out += b
    return out


def _rank_blocks_first(x: torch.Tensor, dim: int, n: int) -> tuple:
    """``x`` with ``dim`` cut into ``n`` rank blocks, laid out block after block along dim 0
    (the layout a dim-0 reduce-scatter or all-to-all splits by rank), and whether that is a
    copy of its own: ``x`` itself for dim 0, else at most one copy (moving ``dim`` to the
    front and back again was two)."""
    x = x.detach()
    front = x.contiguous() if dim == 0 else x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    return front.flatten(0, 1) if dim else front, not shares_memory(front, x)


def _merge_rank_blocks(out: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The inverse for a gather: ``out`` holds the ``n`` ranks' blocks one after the other
    along dim 0; the result has them side by side along ``dim``, contiguous (one copy, or a
    view of ``out`` where its layout already is that)."""
    if dim == 0:
        return out
    return out.unflatten(0, (n, out.shape[0] // n)).movedim(0, dim).flatten(dim, dim + 1)


class DistributedBackend(Backend):
    """Collectives over the process groups of ``device_mesh`` (built if not given).

    ``mesh`` may itself wrap a DeviceMesh (``Mesh(device_mesh)``); then that one is used.
    Every axis group gets ``timeout`` (seconds or a timedelta; default: the default process
    group's), so a stalled peer fails a collective within it on every axis.

    ``shared_memory``: on gloo, when every rank runs on this host (x86-64), all-reduces,
    gathers and the all-to-all of reduce-scatters move through a shared memory segment per
    group instead of gloo's sockets (:mod:`.shm`: several times faster; sums in rank order).
    The environment variable ``AUTOSHARD_SHARED_MEMORY=0`` turns it off as ``False`` does.
    """

    def __init__(self, mesh, device_type: str = "cpu", device_mesh=None, timeout=None,
                 shared_memory: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedBackend needs torch.distributed.init_process_group() first")
        if dist.get_world_size() != mesh.size:
            raise ValueError(f"{mesh} has {mesh.size} ranks but the process group has "
                             f"{dist.get_world_size()}")
        if device_mesh is None:
            device_mesh = getattr(mesh, "device_mesh", None)
        if device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            # Every axis group gets the job's timeout (init_device_mesh's own groups would get
            # torch's default, 30 minutes, whatever init_process_group was given).
            device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.names,
                                           backend_override=_timeout_override(mesh, timeout))
        self.mesh = mesh
        self.device_mesh = device_mesh
        self._sends: list = []  # (work, buffer, its version when sent) of sends in flight
        self._to_self: dict = {}  # message -> tensors a rank sent to itself
        self._posted: dict = {}  # (source rank, message) -> receives started early: (work, buffer)
        self._peers: dict = {}  # (axis, peer coordinate) -> (this rank, peer's global rank)
        self._world = dist.group.WORLD
        self._spares: dict = {}  # (elements, dtype) -> free CPU buffers (see buffer())
        # gloo matches point-to-point messages by tag, so receives can be posted in any order;
        # nccl matches them in posting order, which ahead-of-time posting would change.
        self._by_tag = self._gloo = dist.get_backend() == "gloo"
        self.groups = {axis: device_mesh.get_group(axis) for axis in mesh.names}
        # Both layouts are row-major over the axes; check rather than assume.
        rank = dist.get_rank()
        for axis in mesh.names:
            got = dist.get_process_group_ranks(self.groups[axis])
            if got != mesh.group(axis, rank):
                raise ValueError(f"DeviceMesh group for axis {axis!r} on rank {rank} is {got}, "
                                 f"but {mesh} expects {mesh.group(axis, rank)}")
        self._shm: dict = {}  # axis -> SharedMemoryGroup where collectives go through shared memory
        if (shared_memory and os.environ.get("AUTOSHARD_SHARED_MEMORY", "1") != "0" and self._gloo
                and device_type == "cpu" and usable_here() and all_on_this_host()):
            token = job_token()
            for axis, group in self.groups.items():
                if mesh.axis_size(axis) > 1:
                    seconds = _group_timeout(group)
                    seconds = 1800.0 if seconds is None else seconds.total_seconds()
                    self._shm[axis] = SharedMemoryGroup(group, seconds, name=f"autoshard-{token}-{axis}")

    @property
    def transports(self) -> dict:
        """{axis: "shared memory" or "gloo" or "nccl"}: how that axis's collectives move (an
        axis whose segment could not be made is on gloo; before :meth:`connect` or the axis's
        first collective, shared memory is what it will try)."""
        wire = "gloo" if self._gloo else dist.get_backend()
        return {axis: "shared memory" if axis in self._shm and self._shm[axis].usable else wire
                for axis in self.mesh.names}

    def connect(self) -> dict:
        """Make every axis's shared memory segment now (a collective: every rank calls it at the
        same point), so :attr:`transports` says what the job's collectives really use; returns it.

        Example (each process of a torchrun job)::

            backend = DistributedBackend(mesh)
            print(backend.connect())    # {'dp': 'shared memory', 'tp': 'shared memory'}
        """
        for axis in self.mesh.names:
            if axis in self._shm:
                self._shm[axis].prepare(torch.empty(1, dtype=torch.uint8))
        return self.transports

    def _wire(self, axis, payload):
        """Where a collective with per-rank ``payload`` goes: the axis's shared memory group when
        it takes it (the same answer on every rank), else torch.distributed."""
        group = self._shm.get(axis)
        return group if group is not None and group.prepare(payload) else _Gloo

    @property
    def timeouts(self) -> dict:
        """{axis: timeout of its process group} (what a stalled peer costs at most)."""
        return {axis: _group_timeout(g) for axis, g in self.groups.items()}

    def check(self, mesh, rank):
        if mesh != self.mesh:
            raise ValueError(f"DistributedBackend built for {self.mesh} cannot serve {mesh}")
        if rank != dist.get_rank():
            raise ValueError(f"rank context says rank {rank} but this process is rank {dist.get_rank()}")

    def all_reduce(self, x, axis):
        out = x.detach().clone(memory_format=torch.contiguous_format)
        self._wire(axis, out).all_reduce(out, op=dist.ReduceOp.SUM, group=self.groups[axis])
        return out

    def all_reduce_async(self, x, axis, consume=False):
        out = x if consume and x.is_contiguous() else x.contiguous().clone()
        work = self._wire(axis, out).all_reduce(out, op=dist.ReduceOp.SUM, group=self.groups[axis], async_op=True)
        return Pending(out, work)

    # Free buffers kept per (elements, dtype): a ZeRO-3 step allocates unit-sized buffers for
    # every gather and reduce-scatter, and freshly allocated CPU memory costs a page fault per
    # 4 KiB page when first written (the allocator hands large freed blocks back to the system):
    # thousands of faults per step. A few unit-sized spares (no more than a step holds at once)
    # are reused instead; on GPU the caching allocator does this.
    SPARES = 4

    def buffer(self, shape, dtype, device=None):
        if self._gloo and (device is None or torch.device(device).type == "cpu"):
            free = self._spares.get((math.prod(shape), dtype))
            if free:
                return free.pop().view(shape)
        return torch.empty(shape, dtype=dtype, device=device)

    def recycle(self, t):
        whole = (t.is_contiguous() and t.storage_offset() == 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        if not (self._gloo and t.device.type == "cpu" and whole):
            return  # a view of something larger, or not a CPU buffer: left to the allocator
        free = self._spares.setdefault((t.numel(), t.dtype), [])
        if len(free) < self.SPARES and all(f.data_ptr() != t.data_ptr() for f in free):
            free.append(t.detach().view(-1))

    def _recycling(self, *buffers):
        """A ``Pending.finish`` that gives ``buffers`` back once the transfer is done."""
        def finish(result):
            for b in buffers:
                self.recycle(b)
            return result
        return finish

    def all_gather_async(self, x, axis, dim, consume=False):
        n = self.mesh.axis_size(axis)
        front = x.detach().contiguous()
        shape = (n * front.shape[0],) + front.shape[1:]
        # on another dim the blocks arrive one after the other along dim 0 and are put side by
        # side along dim once they are all here (a copy, or a view of the buffer: not recycled)
        out = self.buffer(shape, front.dtype, front.device) if dim == 0 else front.new_empty(shape)
        work = self._wire(axis, front).all_gather_single(out, front, group=self.groups[axis], async_op=True)
        if dim != 0:
            return Pending(out, work, finish=lambda rows: _merge_rank_blocks(rows, dim, n))
        return Pending(out, work, finish=self._recycling(front) if consume else None)

    def reduce_scatter_async(self, x, axis, dim, consume=False):
        n = self.mesh.axis_size(axis)
        check_divisible(x, axis, dim, n, "reduce_scatter")
        front, private = _rank_blocks_first(x, dim, n)
        # the dim-0 sum of the blocks already has the result's shape and layout
        return self._start_reduce_scatter(front, axis, async_op=True, consume=consume or private)

    def _start_reduce_scatter(self, front, axis, async_op, consume=False):
        """Sum-reduce-scatter of dim 0 of the contiguous ``front``; a ``Pending``.

        On gloo it runs as an all-to-all (block ``j`` of every rank to rank ``j``) and a local
        sum of the ``n`` received blocks in rank order: the same bytes on the wire as a ring
        reduce-scatter, faster than gloo's own on CPU (``benchmarks/collectives.py``), and the
        sum order is the simulated backend's, so results equal the simulation bit for bit at any
        group size. The cost: the ``n`` blocks are received whole (a buffer the size of the
        input) until the sum; that buffer (and ``front`` with ``consume``) is recycled after it."""
        n = self.mesh.axis_size(axis)
        group = self.groups[axis]
        if not self._gloo:
            out = front.new_empty((front.shape[0] // n,) + front.shape[1:])
            # (work is None when not async_op)
            return Pending(out, _reduce_scatter_1(out, front, op=dist.ReduceOp.SUM, group=group, async_op=async_op))
        received = self.buffer(front.shape, front.dtype, front.device)
        work = self._wire(axis, front).all_to_all_single(received, front, group=group, async_op=async_op)
        spent = self._recycling(received, front) if consume else self._recycling(received)
        return Pending(received, work, finish=lambda rows: spent(_sum_blocks(rows, n)))

    def all_gather(self, x, axis, dim):
        n = self.mesh.axis_size(axis)
        front = x.detach().contiguous()
        out = front.new_empty((n * front.shape[0],) + front.shape[1:])
        self._wire(axis, front).all_gather_single(out, front, group=self.groups[axis])
        return _merge_rank_blocks(out, dim, n)

    def reduce_scatter(self, x, axis, dim):
        n = self.mesh.axis_size(axis)
        check_divisible(x, axis, dim, n, "reduce_scatter")
        front, private = _rank_blocks_first(x, dim, n)
        return self._start_reduce_scatter(front, axis, async_op=False, consume=private).wait()

    def all_to_all(self, x, axis, scatter_dim, gather_dim):
        n = self.mesh.axis_size(axis)
        check_divisible(x, axis, scatter_dim, n, "all_to_all")
        front = x.detach().movedim(scatter_dim, 0).contiguous()
        out = torch.empty_like(front)
        # all_to_all_single sends chunk j of dim 0 to rank j and stacks what it receives along
        # dim 0 in rank order: out[j] is our chunk from rank j, still with scatter_dim in front.
        self._wire(axis, front).all_to_all_single(out, front, group=self.groups[axis])
        pieces = [p.movedim(0, scatter_dim) for p in out.chunk(n, 0)]
        return torch.cat(pieces, gather_dim)

    def all_to_all_v(self, x, axis, send_splits, recv_splits):
        check_splits(x, axis, self.mesh.axis_size(axis), send_splits, recv_splits)
        rows = x.detach().contiguous()
        out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows, output_split_sizes=list(recv_splits),
                               input_split_sizes=list(send_splits), group=self.groups[axis])
        return out

    def _peer_rank(self, axis, peer):
        """(this rank, the global rank at coordinate ``peer`` on ``axis``), cached: point to
        point runs it per message."""
        key = (axis, peer)
        pair = self._peers.get(key)
        if pair is None:
            rank = dist.get_rank()
            pair = self._peers[key] = (rank, self.mesh.rank_of({**self.mesh.coords(rank), axis: peer}))
        return pair

    # Point to point goes to the default ProcessGroup object itself (global ranks are its
    # ranks): dist.isend / dist.recv add per-call checks and logging wrappers that cost as much
    # CPU as a small message's transfer.

    def send(self, x, axis, peer, message):
        me, dst = self._peer_rank(axis, peer)
        if dst == me:
            self._to_self.setdefault(message, deque()).append(x.detach().clone())
            return
        # No copy: the caller leaves x unmodified until wait_sends (checked there).
        buf = x.detach().contiguous()
        if len(self._sends) >= 64:
            self._sends = [s for s in self._sends if not s[0].is_completed()]
        self._sends.append((self._world.send([buf], dst, message), buf, buf._version))

    def post_recv(self, buffer, axis, peer, message):
        if not self._by_tag:
            return  # matched in posting order: receives are posted in the order recv asks
        me, src = self._peer_rank(axis, peer)
        if src != me:
            self._posted.setdefault((src, message), deque()).append((self._world.recv([buffer], src, message), buffer))

    def recv(self, template, axis, peer, message):
        me, src = self._peer_rank(axis, peer)
        if src == me:
            return self._to_self[message].popleft()
        queue = self._posted.get((src, message))
        if queue:
            work, out = queue.popleft()
            if not queue:
                del self._posted[(src, message)]
            if out.shape != template.shape or out.dtype != template.dtype:
                raise CollectiveError(f"recv of message {message} from rank {src}: posted for shape "
                                      f"{tuple(out.shape)}, {out.dtype}, read as {tuple(template.shape)}, "
                                      f"{template.dtype}")
        else:
            out = torch.empty(template.shape, dtype=template.dtype, device=template.device)
            work = self._world.recv([out], src, message)
        work.wait()
        return out

    def wait_sends(self):
        sends, self._sends = self._sends, []
        for work, buf, version in sends:
            work.wait()
            if buf._version != version:
                raise CollectiveError("a tensor was modified in place while it was being sent; "
                                      "send() does not copy it")
