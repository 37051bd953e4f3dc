"""The interface every communication backend implements.

A backend moves plain tensors (no autograd) between the ranks of one mesh axis group, as the
rank of the current :func:`~autoshard.runtime.transport.rank_context.current` context. Reduction is always a
sum; averaging is an explicit scale in the graph (docs/design.md, "The ownership algebra").

Semantics, for a group of ``n`` ranks in axis-coordinate order and this rank at index ``i``:

- ``all_reduce(x, axis)``: ``x_0 + x_1 + ... + x_{n-1}`` on every rank.
- ``all_gather(x, axis, dim)``: ``cat([x_0, ..., x_{n-1}], dim)``.
- ``reduce_scatter(x, axis, dim)``: chunk ``i`` (of ``n`` equal chunks along ``dim``) of the sum.
- ``all_to_all(x, axis, scatter_dim, gather_dim)``: ``cat([chunk_i(x_j, scatter_dim) for j], gather_dim)``.
- ``all_to_all_v(x, axis, send_splits, recv_splits)``: rows of dim 0 with sizes per peer, from
  rank j the ``send_splits_j[i]`` rows after its first ``sum(send_splits_j[:i])``, concatenated
  in j order (``recv_splits[j]`` of them); ``torch.distributed.all_to_all_single`` with splits.

Point to point (pipeline stage boundaries), with ``peer`` a coordinate on ``axis`` (the other
coordinates are this rank's) and ``message`` a number both sides agree on:

- ``send(x, axis, peer, message)``: hand ``x`` over without waiting for the receiver (the
  backend keeps what it needs until ``wait_sends``; the caller must not modify ``x`` in place
  before then);
- ``recv(template, axis, peer, message)``: wait for that message, a tensor shaped like
  ``template``;
- ``post_recv(buffer, axis, peer, message)`` (optional): a ``recv`` of that message will
  follow; a backend that can starts receiving it now, into ``buffer`` (a fresh tensor of the
  message's shape and dtype, which that ``recv`` may return).

Results are always fresh tensors, never views of ``x``.
"""
from __future__ import annotations

import torch

from autoshard.runtime.transport.rank_context import current


class CollectiveError(RuntimeError):
    """A collective could not complete: mismatch between ranks, deadlock or timeout."""


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (so writing one may change the other)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_divisible(x: torch.Tensor, axis: str, dim: int, n: int, what: str) -> int:
    """Chunk size of ``x`` along ``dim`` split ``n`` ways; a clear ValueError if uneven."""
    size = x.shape[dim]
    if size % n:
        raise ValueError(
            f"{what} over mesh axis {axis!r} (size {n}) splits dim {dim} of a tensor of shape "
            f"{tuple(x.shape)}, but its size {size} is not divisible by {n}")
    return size // n


def check_splits(x: torch.Tensor, axis: str, n: int, send_splits, recv_splits) -> None:
    """One split size per rank of the group, and the send splits partition the rows of ``x``."""
    if len(send_splits) != n or len(recv_splits) != n:
        raise ValueError(f"all_to_all_v over mesh axis {axis!r} (size {n}) needs {n} send and {n} receive "
                         f"splits, got {list(send_splits)} and {list(recv_splits)}")
    if x.dim() == 0 or sum(send_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_v over mesh axis {axis!r}: send splits {list(send_splits)} do not "
                         f"partition the {tuple(x.shape)} rows")


class Backend:
    """Communication for the current rank. Subclasses implement the four collectives."""

    def check(self, mesh, rank: int) -> None:
        """Called when a rank context is entered; raise if this backend cannot serve it."""

    def all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def all_to_all(self, x: torch.Tensor, axis: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        raise NotImplementedError

    def all_to_all_v(self, x: torch.Tensor, axis: str, send_splits, recv_splits) -> torch.Tensor:
        raise NotImplementedError

    def send(self, x: torch.Tensor, axis: str, peer: int, message: int) -> None:
        raise NotImplementedError

    def recv(self, template: torch.Tensor, axis: str, peer: int, message: int) -> torch.Tensor:
        raise NotImplementedError

    def post_recv(self, buffer: torch.Tensor, axis: str, peer: int, message: int) -> None:
        """Start receiving ``message`` into ``buffer`` ahead of its ``recv`` (which then returns
        it). Every posted message must be read by a ``recv``. Default: nothing to start."""

    def wait_sends(self) -> None:
        """Block until every send of this rank has left (buffers may be reused after)."""

    def all_reduce_async(self, x: torch.Tensor, axis: str, consume: bool = False) -> "Pending":
        """Start a sum all-reduce; ``.wait()`` returns the result. Backends that cannot overlap
        communication with compute finish it here. ``consume=True``: ``x`` is a private buffer
        the result may be written into (no copy)."""
        return Pending(result=self.all_reduce(x, axis))

    def all_gather_async(self, x: torch.Tensor, axis: str, dim: int, consume: bool = False) -> "Pending":
        """Start an all-gather (ZeRO-3 prefetch); ``.wait()`` returns the result.
        ``consume=True``: ``x`` is a private buffer the backend may reuse once it has been sent
        (see :meth:`recycle`)."""
        return Pending(result=self.all_gather(x, axis, dim))

    def reduce_scatter_async(self, x: torch.Tensor, axis: str, dim: int, consume: bool = False) -> "Pending":
        """Start a sum reduce-scatter (ZeRO gradient sync under backward); ``consume`` as for
        :meth:`all_gather_async`."""
        return Pending(result=self.reduce_scatter(x, axis, dim))

    def buffer(self, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
        """An uninitialized tensor for a collective's input: one given back with
        :meth:`recycle`, if the backend keeps them, else a new one."""
        return torch.empty(shape, dtype=dtype, device=device)

    def recycle(self, t: torch.Tensor) -> None:
        """``t`` (a :meth:`buffer`, or a collective's result) is read by no one any more: the
        backend may hand its memory out again. Default: left to the allocator."""

    @staticmethod
    def _ctx():
        return current("a collective")


class Pending:
    """A collective in flight (``work`` from torch.distributed) or already done. ``finish``,
    if given, turns what ``work`` received into the result once it is waited for (e.g. the
    local sum of a reduce-scatter run as an all-to-all)."""

    def __init__(self, result: torch.Tensor, work=None, finish=None):
        self.result, self.work, self.finish = result, work, finish

    def ready(self) -> bool:
        """Whether the transfer is done (``wait`` then only runs ``finish``)."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            self.result, self.finish = self.finish(self.result), None
        return self.result
