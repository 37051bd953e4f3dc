"""A simulated mesh: every rank is a thread of this process, collectives meet in shared slots.

Exact and deterministic: each rank deposits a private copy of its tensor, and every rank then
computes its own result from the same snapshot, summing in axis-coordinate order, so all ranks
get bitwise-identical values and a run is reproducible.

The backend also watches for the ways SPMD programs go wrong, and raises instead of hanging:

- *lost messages*: a point-to-point message nobody received by the end -> :class:`CollectiveError`;
- *mismatch*: two ranks of one group meet in a collective with different kind, dims, shape,
  dtype or tag -> :class:`CollectiveError` naming both calls;
- *deadlock*: every unfinished rank waits in a collective that cannot complete (e.g. ranks
  issued collectives on different axes in different orders, or one rank finished early) ->
  :class:`CollectiveError` listing what each rank waits on;
- *timeout*: a wait exceeds ``timeout`` seconds while some rank is still computing;
- *failure*: one rank raises -> every other rank is released with :class:`SimulationAborted`
  and :func:`run_simulated` re-raises the original exception, naming its rank.

Meant for CPU tensors: CPU autograd runs backward on the calling (rank) thread. With CUDA
tensors, autograd runs every backward on one shared device thread, so a collective in one
rank's backward would wait forever for the other ranks' backwards queued behind it.

Example::

    >>> import torch
    >>> from autoshard import Mesh
    >>> from autoshard.runtime import run_simulated, all_reduce
    >>> run_simulated(Mesh({"x": 2}), lambda r: all_reduce(torch.tensor([r + 1.0]), "x"))
    [tensor([3.]), tensor([3.])]
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from autoshard.runtime.transport.backend import (Backend, CollectiveError, Pending, check_divisible, check_splits)
from autoshard.runtime.transport.rank_context import describe_call, rank_context


class SimulationAborted(RuntimeError):
    """Raised in a rank's thread because another rank failed first."""


class _Exchange:
    """Rendezvous of one axis group: slots filled once per step, published as a snapshot."""

    def __init__(self, axis: str, ranks: tuple[int, ...]):
        self.axis = axis
        self.ranks = ranks
        self.slots: list[tuple[str, tuple, torch.Tensor] | None] = [None] * len(ranks)
        self.arrived = 0
        self.generation = 0
        # Only one snapshot is ever outstanding: the next step cannot complete until every
        # rank, including any that has not yet read this one, deposits again.
        self.snapshot: tuple[torch.Tensor, ...] = ()


class _Mail:
    """What a rank waiting in ``recv`` waits for: one message from one rank."""

    def __init__(self, src: int, dst: int, message: int):
        self.key = (src, dst, message)
        self.ranks = (src,)


class SimulatedBackend(Backend):
    """In-process backend for ranks that are threads; one instance is shared by all ranks.

    Example::

        backend = SimulatedBackend(mesh, timeout=30)
        # in each rank's thread:
        with rank_context(mesh, rank, backend):
            ...
            backend.finish(rank)      # run_simulated does this bookkeeping for you
    """

    def __init__(self, mesh, timeout: float = 120.0):
        self.mesh = mesh
        self.timeout = float(timeout)
        self._cond = threading.Condition()
        self._exchanges: dict[tuple[str, tuple[int, ...]], _Exchange] = {}
        self._mail: dict[tuple[int, int, int], deque] = {}  # (src, dst, message) -> tensors in flight
        # rank -> "running" | "finished" | "failed" | (exchange, description) while waiting
        self._state: dict[int, Any] = {r: "running" for r in range(mesh.size)}
        self.failure: tuple[int | None, BaseException] | None = None   # the first failure

    # ---- bookkeeping used by run_simulated ------------------------------------------------

    def check(self, mesh, rank):
        if mesh != self.mesh:
            raise ValueError(f"SimulatedBackend built for {self.mesh} cannot serve {mesh}")

    def finish(self, rank: int) -> None:
        """Mark ``rank``'s program as returned: nobody may wait on it any more."""
        with self._cond:
            self._state[rank] = "finished"
            self._detect_deadlock(None)

    def fail(self, rank: int | None, exc: BaseException) -> None:
        """Record ``exc`` (if it is the first failure) and release every waiting rank."""
        with self._cond:
            if rank is not None:
                self._state[rank] = "failed"
            if self.failure is None and not isinstance(exc, SimulationAborted):
                self.failure = (rank, exc)
            self._cond.notify_all()

    # ---- the four collectives --------------------------------------------------------------

    def all_reduce(self, x, axis):
        parts, _ = self._meet("all_reduce", x, axis, ())
        return _ordered_sum(parts)

    def all_reduce_async(self, x, axis, consume=False):
        # as the gloo backend does: a consumed contiguous input receives the sum (so the
        # simulation runs the same in-place path, autograd's checks included)
        out = self.all_reduce(x, axis)
        if consume and x.is_contiguous():
            out = x.copy_(out)
        return Pending(out)

    def all_gather(self, x, axis, dim):
        parts, _ = self._meet("all_gather", x, axis, (dim,))
        return torch.cat(parts, dim)

    def reduce_scatter(self, x, axis, dim):
        n = self.mesh.axis_size(axis)
        s = check_divisible(x, axis, dim, n, "reduce_scatter")
        parts, i = self._meet("reduce_scatter", x, axis, (dim,))
        return _ordered_sum([p.narrow(dim, i * s, s) for p in parts])

    def all_to_all(self, x, axis, scatter_dim, gather_dim):
        n = self.mesh.axis_size(axis)
        s = check_divisible(x, axis, scatter_dim, n, "all_to_all")
        parts, i = self._meet("all_to_all", x, axis, (scatter_dim, gather_dim))
        return torch.cat([p.narrow(scatter_dim, i * s, s) for p in parts], gather_dim)

    def all_to_all_v(self, x, axis, send_splits, recv_splits):
        check_splits(x, axis, self.mesh.axis_size(axis), send_splits, recv_splits)
        # Row counts differ per rank: the group agrees on kind, row shape and dtype, and every
        # sender's split for this rank must equal what this rank expects from it.
        signature = ("all_to_all_v", tuple(x.shape[1:]), x.dtype, x.device)
        parts, i = self._meet("all_to_all_v", x, axis, (), signature=signature, meta=tuple(send_splits))
        ranks = self.mesh.group(axis, self._ctx().rank)
        pieces = []
        for j, (p, splits) in enumerate(parts):
            if splits[i] != recv_splits[j]:
                raise CollectiveError(
                    f"all_to_all_v on mesh axis {axis!r}: rank {ranks[j]} sends {splits[i]} rows to rank "
                    f"{ranks[i]}, which expects {recv_splits[j]}")
            pieces.append(p.narrow(0, sum(splits[:i]), splits[i]))
        return torch.cat(pieces, 0)

    # ---- point to point ---------------------------------------------------------------------

    def send(self, x, axis, peer, message):
        ctx = self._ctx()
        src = ctx.rank
        dst = self.mesh.rank_of({**ctx.coords, axis: peer})
        with self._cond:
            self._raise_if_failed(src)
            self._mail.setdefault((src, dst, message), deque()).append(x.detach().clone())
            st = self._state.get(dst)
            if isinstance(st, tuple) and isinstance(st[0], _Mail) and st[0].key == (src, dst, message):
                self._state[dst] = "running"  # runnable now, under the lock (see _meet)
            self._cond.notify_all()

    def recv(self, template, axis, peer, message):
        ctx = self._ctx()
        dst = ctx.rank
        src = self.mesh.rank_of({**ctx.coords, axis: peer})
        key = (src, dst, message)
        desc = (f"recv(axis={axis!r}, from rank {src}, message {message}, shape={tuple(template.shape)}, "
                f"dtype={template.dtype})")
        with self._cond:
            self._raise_if_failed(dst)
            if not self._mail.get(key):
                self._wait_locked(dst, _Mail(src, dst, message), desc, lambda: bool(self._mail.get(key)))
                self._state[dst] = "running"
            t = self._mail[key].popleft()
            if not self._mail[key]:
                del self._mail[key]
        if t.shape != template.shape or t.dtype != template.dtype:
            raise CollectiveError(f"rank {dst} expected {desc} but rank {src} sent shape {tuple(t.shape)}, "
                                  f"dtype {t.dtype}")
        return t

    def undelivered(self) -> list:
        """(sender, receiver, message, shape) of every message sent but never received."""
        return [(s, d, m, tuple(q[0].shape)) for (s, d, m), q in sorted(self._mail.items()) if q]

    # ---- the rendezvous --------------------------------------------------------------------

    def _meet(self, kind: str, x: torch.Tensor, axis: str, dims: tuple[int, ...], signature=None, meta=None):
        """Deposit ``x``, wait for the group, return (all tensors in axis order, my index).
        ``signature``: what every rank of the group must agree on (default: kind, dims, shape,
        dtype, device); ``meta``: a value deposited with ``x`` (then (tensor, meta) pairs come back)."""
        ctx = self._ctx()
        rank = ctx.rank
        ranks = tuple(self.mesh.group(axis, rank))
        me = ranks.index(rank)
        desc = describe_call(ctx, kind, axis, dims, x)
        tag = ctx.call[1] if ctx.call else None
        if signature is None:
            signature = (kind, dims, tuple(x.shape), x.dtype, x.device)
        # A private copy: the caller may modify x in place as soon as we return, while slower
        # ranks are still reading the snapshot.
        payload = x.detach().clone() if meta is None else (x.detach().clone(), meta)
        with self._cond:
            self._raise_if_failed(rank)
            ex = self._exchanges.get((axis, ranks))
            if ex is None:
                ex = self._exchanges[(axis, ranks)] = _Exchange(axis, ranks)
            for j, slot in enumerate(ex.slots):
                if slot is None:
                    continue
                other_desc, other_sig, other_tag = slot[0], slot[1], slot[2]
                if other_sig != signature or (tag is not None and other_tag is not None and tag != other_tag):
                    self._fail_locked(rank, CollectiveError(
                        f"mismatched collectives on mesh axis {axis!r} (group {list(ranks)}): "
                        f"rank {ranks[j]} called {other_desc}, but rank {rank} called {desc}"))
            ex.slots[me] = (desc, signature, tag, payload)
            ex.arrived += 1
            if ex.arrived == len(ranks):
                ex.snapshot = tuple(s[3] for s in ex.slots)
                ex.slots = [None] * len(ranks)
                ex.arrived = 0
                ex.generation += 1
                # Waiters become runnable now, under the lock, so the deadlock check never
                # sees a completed exchange as blocked.
                for r in ranks:
                    if r != rank:
                        self._state[r] = "running"
                self._cond.notify_all()
                return ex.snapshot, me
            gen = ex.generation
            self._wait_locked(rank, ex, f"{desc} on group {list(ranks)}", lambda: ex.generation != gen)
            return ex.snapshot, me

    def _wait_locked(self, rank: int, what, desc: str, done: Callable[[], bool]) -> None:
        """Wait (lock held) until ``done()``, as ``rank`` blocked on ``what`` (an exchange or a
        message); fails on deadlock, timeout or another rank's failure."""
        self._state[rank] = (what, desc)
        self._detect_deadlock(rank)
        deadline = time.monotonic() + self.timeout
        while not done():
            self._raise_if_failed(rank)
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail_locked(rank, CollectiveError(
                    f"timeout after {self.timeout:g}s: rank {rank} waits in {desc}; {self._describe_missing(what)}"))
            self._cond.wait(left)

    # ---- failure handling (call with the lock held) ----------------------------------------

    def _raise_if_failed(self, rank: int) -> None:
        if self.failure is not None:
            frank, exc = self.failure
            self._state[rank] = "failed"
            who = f"rank {frank}" if frank is not None else "the simulation"
            raise SimulationAborted(f"rank {rank} stopped because {who} failed: {exc}")

    def _fail_locked(self, rank: int, exc: BaseException):
        self._state[rank] = "failed"
        if self.failure is None:
            self.failure = (rank, exc)
        self._cond.notify_all()
        raise exc

    def _describe_missing(self, ex) -> str:
        if isinstance(ex, _Mail):
            return self._describe_rank(ex.key[0])
        return "; ".join(self._describe_rank(r) for j, r in enumerate(ex.ranks) if ex.slots[j] is None)

    def _describe_rank(self, r: int) -> str:
        st = self._state[r]
        if isinstance(st, tuple):
            other, desc = st
            return f"rank {r} waits in {desc}"
        if st == "running":
            return f"rank {r} is still computing"
        return f"rank {r} has {st}"

    def _detect_deadlock(self, rank: int | None) -> None:
        """If no rank can make progress, fail with a description of every wait."""
        waiting = [r for r, st in self._state.items() if isinstance(st, tuple)]
        if not waiting or any(st == "running" for st in self._state.values()):
            return
        lines = []
        for r in waiting:
            ex, desc = self._state[r]
            lines.append(f"rank {r} waits in {desc}, where {self._describe_missing(ex)}")
        exc = CollectiveError(
            "deadlock: no rank can proceed (collectives issued in different orders on different "
            "ranks, or a rank skipped one):\n  " + "\n  ".join(lines))
        if rank is not None:
            self._fail_locked(rank, exc)
        if self.failure is None:
            self.failure = (waiting[0], exc)
        self._cond.notify_all()


def _ordered_sum(parts) -> torch.Tensor:
    # Fixed left-to-right order in axis coordinates: every rank computes bitwise the same sum.
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def run_simulated(mesh, fn: Callable[[int], Any], *, timeout: float = 120.0) -> list:
    """Run ``fn(rank)`` for every rank of ``mesh`` as threads; return the results by rank.

    Each thread runs inside ``rank_context(mesh, rank, backend)`` with one shared
    :class:`SimulatedBackend`, so collectives (and their adjoints in ``loss.backward()``)
    work as on a real mesh. If any rank raises, the others are released and the first
    exception is re-raised here with ``"rank N"`` prefixed to its message.

    Example::

        def step(rank):
            x = torch.full((2,), float(rank))
            return all_gather(x, "tp", 0)
        run_simulated(Mesh({"tp": 2}), step)   # [tensor([0., 0., 1., 1.])] * 2
    """
    backend = SimulatedBackend(mesh, timeout=timeout)
    results: list[Any] = [None] * mesh.size

    def body(rank: int) -> None:
        try:
            with rank_context(mesh, rank, backend):
                results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - must release the other ranks on anything
            backend.fail(rank, exc)
        else:
            backend.finish(rank)

    threads = [threading.Thread(target=body, args=(r,), name=f"autoshard-rank{r}", daemon=True)
               for r in range(mesh.size)]
    for t in threads:
        t.start()
    # Collective waits time out on their own; this guards against a rank stuck in compute after
    # the others failed (a thread cannot be killed, so we stop waiting for it instead).
    give_up_at = None
    for t in threads:
        while t.is_alive():
            t.join(0.1)
            if backend.failure is not None and give_up_at is None:
                give_up_at = time.monotonic() + max(timeout, 1.0)
            if give_up_at is not None and time.monotonic() > give_up_at:
                break
    stuck = [t.name for t in threads if t.is_alive()]
    if backend.failure is not None:
        rank, exc = backend.failure
        _prefix_rank(exc, rank, stuck)
        raise exc
    if stuck:  # pragma: no cover - unreachable: live threads without failure means join waited
        raise CollectiveError(f"threads {stuck} did not finish")
    lost = backend.undelivered()
    if lost:
        raise CollectiveError("messages sent but never received (sender, receiver, message, shape): "
                              + ", ".join(map(str, lost[:8])) + (" ..." if len(lost) > 8 else ""))
    return results


def _prefix_rank(exc: BaseException, rank: int | None, stuck: list[str]) -> None:
    where = f"rank {rank}" if rank is not None else "simulation"
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(where):
        exc.args = (f"{where}: {exc.args[0]}",) + exc.args[1:]
    elif not exc.args:
        exc.args = (f"{where}: {type(exc).__name__}",)
    note = f"raised on {where} of a simulated mesh"
    if stuck:
        note += f"; threads still running and abandoned: {stuck}"
    exc.add_note(note)
