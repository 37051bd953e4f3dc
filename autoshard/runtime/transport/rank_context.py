"""Rank context: which mesh, which rank, which backend the collectives on this thread talk to.

Collectives are plain functions (the rewritten FX graphs call them as ``call_function``
targets), so the rank they run as cannot be an argument: it lives in a thread-local context.
Threads matter because the simulated mesh runs every rank as a thread of one process.

Example::

    >>> from autoshard import Mesh
    >>> from autoshard.runtime import rank_context, current, SimulatedBackend
    >>> mesh = Mesh({"tp": 1})
    >>> with rank_context(mesh, 0, SimulatedBackend(mesh)):
    ...     current().coord("tp")
    0
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.mesh import Mesh
    from autoshard.runtime.transport.backend import Backend

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class CollectiveRecord:
    """One executed collective as seen by one rank (what tests and ``plan`` reports count)."""

    kind: str                 # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all"
    axis: str                 # mesh axis it ran over
    bytes: int                # payload bytes of the tensor passed in on this rank
    phase: str                # "forward" | "backward" | "optimizer"
    tag: int | None           # tag given to the collective function that caused it
    op: str                   # that function's name, e.g. "all_gather_varying"
    shape: tuple[int, ...]    # shape of the tensor passed in
    dtype: torch.dtype

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,)


@dataclass
class RankContext:
    """What a collective needs to know about the rank it runs as."""

    mesh: "Mesh"
    rank: int
    backend: "Backend"
    trace: list[CollectiveRecord] = field(default_factory=list)
    phase: str = "forward"    # label for collectives outside autograd backward; see trace_phase
    # The collective currently inside the backend (op, tag, phase): lets a backend name the
    # op in mismatch / deadlock messages without widening the Backend interface.
    call: tuple[str, int | None, str] | None = None
    # Gradient accumulation: backward sums (all-reduce, reduce-scatter) on these axes are
    # stashed by (op, tag) instead of sent, and sent once with the last microbatch.
    defer_axes: frozenset = frozenset()
    deferred: dict = field(default_factory=dict)
    # Parameter gathers (by tag) whose full tensors are released after forward and gathered
    # again when backward needs them (ZeRO-3 / FSDP resharding); filled by the plan.
    reshard_tags: frozenset = frozenset()
    reshard_live: dict = field(default_factory=dict)  # storage ptr of a live gather -> (source, index)
    # ZeRO-3 units: gathers started ahead of use (tag -> Pending), and gradient reduce-scatters
    # in flight until backward ends (a runtime.units.GradLanding).
    prefetched: dict = field(default_factory=dict)
    # Mixed precision: backward sums (gradient reductions) run in this dtype, results are cast
    # back to the gradient's dtype.
    reduce_dtype: Any = None
    landing: Any = None
    # ZeRO-3 units: gradient reduce-scatters held until the next collective on their axis has
    # run (a plain one that would otherwise queue behind them), as runtime.collectives._Held.
    held: list = field(default_factory=list)
    # Activation memory: a runtime.recompute.SavedBytes counting what autograd saves for backward.
    saved_tracker: Any = None

    def __post_init__(self):
        self.coords = self.mesh.coords(self.rank)

    def coord(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        self.mesh.check_axis(axis)
        return self.coords[axis]


_local = threading.local()


def _stack() -> list[RankContext]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


@contextlib.contextmanager
def rank_context(mesh: "Mesh", rank: int, backend: "Backend") -> Iterator[RankContext]:
    """Run the body as ``rank`` of ``mesh``; collectives inside use ``backend``.

    Example::

        with rank_context(mesh, rank, backend) as ctx:
            y = all_reduce(x, "tp")
        ctx.trace   # [CollectiveRecord(kind="all_reduce", axis="tp", ...)]
    """
    ctx = RankContext(mesh, rank, backend)
    backend.check(mesh, rank)
    with activate(ctx):
        yield ctx


@contextlib.contextmanager
def activate(ctx: RankContext) -> Iterator[RankContext]:
    """Make an existing context current on this thread (re-entrant)."""
    stack = _stack()
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


def current(what: str = "this call") -> RankContext:
    """The innermost rank context on this thread; a clear error outside one."""
    stack = _stack()
    if not stack:
        raise RuntimeError(
            f"{what} needs a rank context: wrap it in `with rank_context(mesh, rank, backend):` "
            "or run it through autoshard.runtime.run_simulated(mesh, fn)")
    return stack[-1]


def current_or_none() -> RankContext | None:
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def trace_phase(phase: str) -> Iterator[None]:
    """Label collectives run outside autograd backward, e.g. ``with trace_phase("optimizer"):``.

    Collectives run inside an autograd backward are always labelled ``"backward"``.
    """
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    ctx = current("trace_phase")
    old, ctx.phase = ctx.phase, phase
    try:
        yield
    finally:
        ctx.phase = old


def describe_call(ctx: RankContext, kind: str, axis: str, dims: tuple[int, ...],
                  x: Any) -> str:
    """Human-readable description of a collective call, for error messages."""
    op, tag, phase = ctx.call or (kind, None, ctx.phase)
    dim_s = f", dims={dims}" if dims else ""
    tag_s = f", tag={tag}" if tag is not None else ""
    via = f" of {op}" if op != kind else ""
    return (f"{kind}(axis={axis!r}{dim_s}, shape={tuple(x.shape)}, dtype={x.dtype}{tag_s}) "
            f"in {phase}{via}")
