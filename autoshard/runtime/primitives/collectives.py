"""Collectives as autograd functions, each forward paired with its adjoint in one table.

Every function changes the ownership of a value on one mesh axis (docs/design.md, "The
ownership algebra") and is exact for gradients under these conventions:

- the grad of a ``Replicate`` value is the full gradient, on every rank;
- the grad of a ``Shard(d)`` value is this rank's chunk of the full gradient;
- the grad of a ``Partial`` value is the full gradient (replicated).

They are plain module-level functions with simple positional arguments (tensor, axis name,
ints) and an optional ``tag``, so rewritten FX graphs can call them as ``call_function``
targets and exported code can print them. They run as the rank of the current
:func:`~autoshard.runtime.transport.rank_context.rank_context`.

Example (Megatron's f and g around a tensor-parallel MLP)::

    h = mark_varying(x, "tp")          # f: identity forward, all-reduce of dx backward
    y = relu(h @ w1_shard.T) @ w2_shard.T
    y = all_reduce(y, "tp")            # g: all-reduce forward, identity backward
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from autoshard.runtime.primitives import param_sums, zero_units as units
from autoshard.runtime.transport.backend import Pending, check_divisible, shares_memory
from autoshard.runtime.transport.rank_context import (CollectiveRecord, RankContext, activate, current, current_or_none)
from autoshard.runtime.primitives.pending_value import PendingValue


class Adjoint(NamedTuple):
    forward: str    # primitive run in the forward pass
    backward: str   # primitive run on the gradient in the backward pass


# Primitives that communicate (and are recorded in the trace) ...
GROUP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")  # every rank of the axis takes part
POINT_TO_POINT = ("send", "recv")  # one peer
COMM_KINDS = GROUP_KINDS + POINT_TO_POINT
# Primitives with per-rank sizes, recorded (and costed) as the kind they generalize: "all_to_all_v"
# moves rows with split sizes that differ per rank (expert parallelism's dispatch and combine).
VARIABLE_KINDS = {"all_to_all_v": "all_to_all"}
# ... and the local ones: "slice" takes this rank's chunk, "keep_first" keeps x on axis index 0
# and zeros elsewhere (a replicated value read as a pending sum).
LOCAL_KINDS = ("identity", "slice", "keep_first")

# The one table pairing each collective with its adjoint. The backward primitive receives the
# forward's dim arguments in reverse order: a no-op for one dim, the transpose for all_to_all.
ADJOINTS: dict[str, Adjoint] = {
    # op                        forward           backward             # ownership change on axis
    "all_reduce":         Adjoint("all_reduce",     "identity"),        # Partial -> Replicate (Megatron g, psum)
    "mark_varying":       Adjoint("identity",       "all_reduce"),      # Replicate used by varying work (f, pbroadcast)
    "reduce_scatter":     Adjoint("reduce_scatter", "all_gather"),      # Partial -> Shard(d)
    "all_gather":         Adjoint("all_gather",     "slice"),           # Shard(d) -> Replicate, replicated use
    "all_gather_varying": Adjoint("all_gather",     "reduce_scatter"),  # Shard(d) -> Replicate, varying use (FSDP)
    "shard_slice":        Adjoint("slice",          "all_gather"),      # Replicate -> Shard(d)
    "all_to_all":         Adjoint("all_to_all",     "all_to_all"),      # Shard(g) -> Shard(s), reversed backward
    "to_partial":         Adjoint("keep_first",     "identity"),        # Replicate -> Partial
    # A value gathered once for varying readers (all_gather_varying) also read by replicated
    # work: that work's gradient is whole and identical on every rank, so rank 0 keeps it and
    # the gather's backward reduce-scatter counts it once (sequence parallelism, tp > kv heads).
    "replicated_use":     Adjoint("identity",       "keep_first"),      # Replicate, replicated use
    # ZeRO-2: a parameter shard read through the full copy kept since the last optimizer step.
    "use_persistent":     Adjoint("identity",       "reduce_scatter"),  # Shard(d) -> Replicate, varying use
    # ZeRO-3 / FSDP unit: all_gather_varying of several parameters in one flat buffer.
    "gather_unit":        Adjoint("all_gather",     "reduce_scatter"),  # Shard(d_i) -> Replicate, varying use
    # Expert parallelism: token rows to the ranks owning their experts and back, with split
    # sizes (rows per peer) as the dim arguments; the reversed splits are the transpose.
    "dispatch":           Adjoint("all_to_all_v",   "all_to_all_v"),    # rows by token -> rows by expert
    "combine":            Adjoint("all_to_all_v",   "all_to_all_v"),    # rows by expert -> rows by token
    # A pipeline stage boundary (point to point on the pipeline axis): the activation goes to
    # the next stage, its gradient comes back from it, and the other way round.
    "send":               Adjoint("send",           "recv"),            # value leaves for the peer stage
    "recv":               Adjoint("recv",           "send"),            # value arrives from the peer stage
}
# Backward primitives that sum over ranks: linear, so accumulation may defer them.
SUMMING = ("all_reduce", "reduce_scatter")


def comm_kind(primitive: str) -> str | None:
    """The trace ``kind`` a primitive records, or None for local ones (``"slice"`` ...)."""
    return primitive if primitive in COMM_KINDS else VARIABLE_KINDS.get(primitive)


def backward_collective(op: str) -> str | None:
    """Communication that ``op``'s backward performs, e.g. ``"reduce_scatter"``; None if local."""
    return comm_kind(ADJOINTS[op].backward)


def forward_collective(op: str) -> str | None:
    """Communication that ``op``'s forward performs; None if it is local (no bytes move)."""
    return comm_kind(ADJOINTS[op].forward)


# ---- executing one primitive ----------------------------------------------------------------

def _run(ctx: RankContext, primitive: str, x: torch.Tensor, axis: str, dims: tuple[int, ...],
         op: str, tag: int | None, phase: str) -> torch.Tensor:
    n = ctx.mesh.axis_size(axis)
    # Local primitives clone: an output aliasing the input of a custom Function is a view, and
    # autograd forbids in-place ops on it, which captured graphs may contain.
    if primitive == "identity":
        return x.clone()
    if primitive == "slice":
        (dim,) = dims
        s = check_divisible(x, axis, dim, n, f"{op} (local slice)" if op != "shard_slice" else op)
        return x.narrow(dim, ctx.coord(axis) * s, s).clone(memory_format=torch.contiguous_format)
    if primitive == "keep_first":
        return x.clone() if ctx.coord(axis) == 0 else torch.zeros_like(x)
    if primitive == "reduce_scatter" or primitive == "all_to_all":
        check_divisible(x, axis, dims[0], n, op if op == primitive else f"{op} ({primitive})")
    if n == 1 and primitive in GROUP_KINDS:
        # A group of one: the sum, gather or exchange is the input itself. No backend call
        # (nothing to wait for), one copy (the output must not alias the input, as above).
        ctx.trace.append(CollectiveRecord(kind=primitive, axis=axis, bytes=x.numel() * x.element_size(), phase=phase,
                                          tag=tag, op=op, shape=tuple(x.shape), dtype=x.dtype))
        return x.clone()
    out = _call_backend(ctx, primitive, primitive, x, axis, dims, op, tag, phase)
    if ctx.held:
        _release_held(ctx, axis)
    return out


def _call_backend(ctx: RankContext, method: str, primitive: str, x: torch.Tensor, axis: str, dims: tuple,
                  op: str, tag: int | None, phase: str, **options):
    """Run ``ctx.backend.<method>(x, axis, *dims, **options)`` as ``ctx`` and record ``primitive``."""
    backend_fn = getattr(ctx.backend, method)
    # The context captured at forward time is made current for the backend: on GPU, autograd
    # runs backward on its own device threads, where the thread-local context is absent.
    saved_call = ctx.call
    ctx.call = (op, tag, phase)
    try:
        if current_or_none() is ctx:
            out = backend_fn(x, axis, *dims, **options)
        else:
            with activate(ctx):
                out = backend_fn(x, axis, *dims, **options)
    finally:
        ctx.call = saved_call
    ctx.trace.append(CollectiveRecord(
        kind=comm_kind(primitive), axis=axis, bytes=x.numel() * x.element_size(), phase=phase, tag=tag,
        op=op, shape=tuple(x.shape), dtype=x.dtype))
    return out


def _start(ctx: RankContext, primitive: str, x: torch.Tensor, axis: str, op: str, tag: int | None,
           phase: str, dim: int = 0):
    """Issue an all-gather / reduce-scatter on ``dim`` (a flat buffer's 0) without waiting (a
    backend that cannot overlap finishes it here); returns a ``Pending``. Every rank issues it
    at the same point of the program, so the order of collectives stays the same on all ranks.
    ``x`` is the caller's private buffer (a packed unit): the backend may reuse it once sent."""
    if ctx.held:
        _release_held(ctx, axis)
    if ctx.landing is not None and ctx.landing.pending:
        ctx.landing.settle()  # before this one allocates its buffers
    if ctx.mesh.axis_size(axis) == 1:
        return Pending(_run(ctx, primitive, x, axis, (dim,), op, tag, phase))  # a group of one: done
    return _call_backend(ctx, primitive + "_async", primitive, x, axis, (dim,), op, tag, phase, consume=True)


def _buffers(ctx: RankContext, axis: str):
    """The backend's buffer allocator for a flat unit buffer on ``axis`` (None: a group of one,
    which never calls the backend)."""
    return ctx.backend.buffer if ctx.mesh.axis_size(axis) > 1 else None


def _start_unit_gather(ctx: RankContext, shards, axis: str, tag: int, phase: str):
    """Start the flat all-gather of a unit's shards, packed into a backend buffer."""
    return _start(ctx, "all_gather", units.pack_shards(shards, _buffers(ctx, axis)), axis, "gather_unit", tag, phase)


def _unpack_unit(ctx: RankContext, flat: torch.Tensor, shapes, dims, axis: str) -> list:
    """The whole parameters from a unit's gathered buffer, which is then given back to the
    backend unless one of them is a view of it (a unit of one parameter)."""
    n = ctx.mesh.axis_size(axis)
    fulls = units.unpack_full(flat, shapes, dims, n)
    if n > 1 and not any(shares_memory(f, flat) for f in fulls):
        ctx.backend.recycle(flat)
    return fulls


class _Held:
    """A unit's gradient reduce-scatter, ready but not yet started: it starts once the next
    collective on its axis has run (or right before the next one started without waiting, or
    when backward ends), so a plain collective in between does not queue behind it. These
    points are the same on every rank, so the order of collectives is too."""

    def __init__(self, rctx, flat, axis, tag):
        self.rctx, self.flat, self.axis, self.tag, self.pending = rctx, flat, axis, tag, None
        rctx.held.append(self)

    def start(self):
        if self.pending is None:
            if self in self.rctx.held:
                self.rctx.held.remove(self)
            self.pending = _start(self.rctx, "reduce_scatter", self.flat, self.axis, "gather_unit", self.tag,
                                  "backward")
            self.flat = None
        return self.pending

    def wait(self):
        return self.start().wait()


def _release_held(ctx: RankContext, axis: str) -> None:
    held = [h for h in ctx.held if h.axis == axis]
    ctx.held = [h for h in ctx.held if h.axis != axis]
    for h in held:
        h.start()


def _phase(rctx: RankContext) -> str:
    # A forward run inside a backward (activation-checkpoint recompute) communicates during the
    # backward pass, so it is labelled as such.
    in_backward = getattr(torch._C, "_current_graph_task_id", lambda: -1)() != -1
    return "backward" if in_backward else rctx.phase


class _Collective(torch.autograd.Function):
    """One autograd Function for every row of ADJOINTS: forward and backward read the table."""

    @staticmethod
    def forward(fctx, x, op, axis, dims, tag, lazy=False, consume=False, later=False, defer=True):
        rctx = current(f"autoshard collective {op}")
        fctx.rctx, fctx.op, fctx.axis, fctx.dims, fctx.tag = rctx, op, axis, dims, tag
        fctx.defer = defer
        fctx.pending = None
        # a parameter leaf whose gradient sum may land in .grad when backward ends (param_sums)
        fctx.leaf = x if later and x.is_leaf and x.requires_grad else None
        phase = _phase(rctx)
        early = rctx.prefetched.pop(("all_reduce", tag), None) if op == "all_reduce" and phase == "forward" else None
        if early is not None:
            out = early.wait()
        elif lazy and phase == "forward" and rctx.mesh.axis_size(axis) > 1:
            fctx.pending = _launch_all_reduce(rctx, x.detach(), axis, op, tag, phase)
            out = PendingValue.of(fctx.pending, like=x)
        elif consume and rctx.mesh.axis_size(axis) > 1:
            # x is read by nothing else (passes/inplace_sums.py): the backend may sum into it
            # (as _run: held reduce-scatters of a recompute in backward start after it, not before)
            out = _call_backend(rctx, "all_reduce_async", "all_reduce", x.detach(), axis, (), op, tag, phase,
                                consume=True).wait()
            if rctx.held:
                _release_held(rctx, axis)
            if shares_memory(out, x):
                fctx.mark_dirty(x)  # a tensor autograd saved would now fail in backward, not silently
                return x
        else:
            out = _run(rctx, ADJOINTS[op].forward, x.detach(), axis, dims, op, tag, phase)
        if tag is not None and tag in rctx.reshard_tags:
            _register_reshard(rctx, out, _ParamSource(x.detach(), axis, dims, tag))
        return out

    @staticmethod
    @once_differentiable
    def backward(fctx, grad):
        if fctx.pending is not None:
            # a sum returned pending and never read: finished by the end of backward all the same
            torch.autograd.Variable._execution_engine.queue_callback(fctx.pending.wait)
        if fctx.leaf is not None and _sum_later(fctx, grad):
            return (None,) * 9  # the sum lands in the parameter's .grad when backward ends
        return _backward(fctx, grad), None, None, None, None, None, None, None, None


def _backward(fctx, grad: torch.Tensor) -> torch.Tensor:
    """The adjoint of ``fctx.op`` on ``grad``, deferred under gradient accumulation."""
    rctx, primitive = fctx.rctx, ADJOINTS[fctx.op].backward
    if primitive == "identity":
        # The incoming gradient itself, no copy (unlike the forward identity: no captured
        # in-place op runs on a gradient). Returned as the same tensor object, not a detached
        # alias, so autograd sees every reference to it and never accumulates into it in place
        # while another consumer still reads it (as built-in AddBackward hands one tensor to both).
        return grad
    grad = grad.detach()
    if primitive in SUMMING:
        key = (fctx.op, fctx.tag, fctx.axis)
        if fctx.axis in rctx.defer_axes and getattr(fctx, "defer", True):
            # Sum(k microbatches) then reduce == reduce each then sum: send once, at the end.
            # (Only where the sum's result reaches the parameters the same way in every
            # microbatch; an activation's gradient sum (defer=False) is sent in its own.)
            rctx.deferred[key] = rctx.deferred[key] + grad if key in rctx.deferred else grad.clone()
            if primitive == "all_reduce":
                return torch.zeros_like(grad)
            shape = list(grad.shape)
            shape[fctx.dims[0]] //= rctx.mesh.axis_size(fctx.axis)
            return grad.new_zeros(shape)
        return _run(rctx, primitive, _outgoing(fctx, grad), fctx.axis, fctx.dims[::-1], fctx.op, fctx.tag,
                    "backward").to(grad.dtype)
    return _run(rctx, primitive, grad, fctx.axis, fctx.dims[::-1], fctx.op, fctx.tag, "backward")


def run_forward(op: str, x: torch.Tensor, axis: str, dims: tuple, tag: int | None) -> torch.Tensor:
    """``op``'s forward primitive on ``x`` as the current rank, recorded in the trace as
    ``op`` would record it, outside autograd: for fused nodes that run their own backward
    (see ``overlap_linear``).

    Example::

        h = run_forward("all_gather_varying", x_rows, "tp", (1,), tag=3)   # the gathered rows
    """
    rctx = current(f"autoshard collective {op}")
    return _run(rctx, ADJOINTS[op].forward, x.detach(), axis, dims, op, tag, _phase(rctx))


def start_gradient_sum(fctx, grad: torch.Tensor):
    """:func:`_backward` of an op whose adjoint sums over ranks (``fctx.op``, e.g.
    ``"mark_varying"``: an all-reduce; ``"all_gather_varying"``: a reduce-scatter), started
    without waiting where the backend can; returns a function that waits and gives the result.
    Gradient accumulation and mixed precision as in ``_backward``, the same record in the
    trace. ``grad`` is the caller's own buffer: the sum may be written into it.

    Example::

        wait = start_gradient_sum(fctx, dx)   # fctx: rctx, op, axis, dims, tag
        ...                                   # compute that needs no communication
        dx = wait()
    """
    rctx, axis, primitive = fctx.rctx, fctx.axis, ADJOINTS[fctx.op].backward
    assert primitive in SUMMING, fctx.op
    grad = grad.detach()
    if axis in rctx.defer_axes or rctx.mesh.axis_size(axis) == 1:
        out = _backward(fctx, grad)  # stashed for a later step, or a group of one: nothing in flight
        return lambda: out
    sent = _outgoing(fctx, grad)
    if primitive == "all_reduce":
        pending = _launch_all_reduce(rctx, sent, axis, fctx.op, fctx.tag, "backward", consume=True)
    else:
        check_divisible(sent, axis, fctx.dims[0], rctx.mesh.axis_size(axis), fctx.op + " (reduce_scatter)")
        pending = _start(rctx, primitive, sent, axis, fctx.op, fctx.tag, "backward", dim=fctx.dims[0])
    return lambda: pending.wait().to(grad.dtype)


def _sum_later(fctx, grad: torch.Tensor) -> bool:
    """Start the all-reduce of ``fctx.leaf``'s gradient (``mark_varying(..., later=True)``) and
    have it added into the leaf's ``.grad`` when backward ends (:mod:`.param_sums`); the same
    sum and trace record as ``_backward``'s. False, nothing done, where ``_backward`` must run
    now: under gradient accumulation on the axis (stashed as usual), on a group of one, or
    where autograd would not simply add the gradient into ``.grad``."""
    rctx, axis = fctx.rctx, fctx.axis
    if axis in rctx.defer_axes or rctx.mesh.axis_size(axis) == 1 \
            or not param_sums.lands_in_grad(fctx.leaf, fctx.next_functions[0][0]):
        return False
    # not consumed: the incoming gradient may be shared with other consumers (as _run, a copy)
    pending = _launch_all_reduce(rctx, _outgoing(fctx, grad.detach()), axis, fctx.op, fctx.tag, "backward")
    param_sums.LANDING.add(fctx.leaf, pending, grad.dtype)
    return True


def _outgoing(fctx, grad: torch.Tensor) -> torch.Tensor:
    """What the backward sum of ``fctx.op`` sends for ``grad``: plus the sum of earlier
    microbatches' gradients stashed under its key while gradient accumulation deferred the
    collective (see ``_backward``), which is then sent once; in the reduce dtype of mixed
    precision (the caller casts the result back to ``grad.dtype``)."""
    rctx, key = fctx.rctx, (fctx.op, fctx.tag, fctx.axis)
    grad = grad + rctx.deferred.pop(key) if key in rctx.deferred else grad
    wide = reduce_dtype_for(rctx, grad)
    return grad.to(wide) if wide is not None else grad


def _launch_all_reduce(rctx: RankContext, x: torch.Tensor, axis: str, op: str, tag, phase: str,
                      consume: bool = False):
    """Start an all-reduce without waiting; held unit reduce-scatters on ``axis`` start first
    (as in ``_start``: before a collective that is started, not after). Returns a ``Pending``."""
    if rctx.held:
        _release_held(rctx, axis)
    return _call_backend(rctx, "all_reduce_async", "all_reduce", x, axis, (), op, tag, phase, consume=consume)


def reduce_dtype_for(rctx: RankContext, grad: torch.Tensor):
    """The dtype a gradient sum runs in under mixed precision (None: its own)."""
    r = rctx.reduce_dtype
    return r if r is not None and grad.is_floating_point() and grad.dtype != r else None


class _UsePersistent(torch.autograd.Function):
    """ZeRO-2: forward reads the full parameter kept since the last optimizer step (no
    communication); backward reduce-scatters the gradient onto this rank's shard."""

    @staticmethod
    def forward(fctx, shard, full, axis, dim, tag):
        fctx.rctx, fctx.op, fctx.axis, fctx.dims, fctx.tag = current("use_persistent"), "use_persistent", axis, (dim,), tag
        return full.detach()  # an alias, not a copy: the full copy is the persistent parameter

    @staticmethod
    @once_differentiable
    def backward(fctx, grad):
        return _backward(fctx, grad), None, None, None, None


def _dim(x: torch.Tensor, dim: int, op: str, name: str = "dim") -> int:
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: {name}={dim!r} is not a dim of a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _apply(op: str, x: torch.Tensor, axis: str, dims: tuple[int, ...], tag: int | None, lazy: bool = False,
           consume: bool = False, later: bool = False, defer: bool = True):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a tensor, got {type(x).__name__}")
    current(f"autoshard collective {op}").mesh.check_axis(axis)
    return _Collective.apply(x, op, axis, dims, tag, lazy, consume, later, defer)


# ---- the public functions, one per row of ADJOINTS -------------------------------------------

def all_reduce(x: torch.Tensor, axis: str, tag: int | None = None, lazy: bool = False,
               consume: bool = False) -> torch.Tensor:
    """Partial -> Replicate: sum over ``axis``; backward is the identity (Megatron's g).

    ``lazy=True`` (forward only): return the sum started but not waited for, as a
    :class:`~autoshard.runtime.primitives.pending_value.PendingValue` that waits when its data is read;
    for values only the program's outputs read (a loss; placed by ``passes/output_sums.py``).
    ``consume=True``: nothing else reads ``x``, so the sum may be written into it (and ``x``
    returned) instead of a copy; placed by ``passes/inplace_sums.py``.

    Example::

        y = all_reduce(x_partial, "tp")     # every tp rank now holds the sum
        loss = all_reduce(loss_partial, "dp", lazy=True)   # loss.item() waits for it
        y = all_reduce(linear(h, w_row_shard), "tp", consume=True)   # no copy of the partials
    """
    return _apply("all_reduce", x, axis, (), tag, lazy, consume)


def start_all_reduce(x: torch.Tensor, axis: str, tag: int) -> None:
    """Start the forward sum of ``x`` that the ``all_reduce`` node tagged ``tag`` returns, so it
    runs under the compute in between; that node then waits for it instead of sending ``x``.
    Only for values without a gradient whose inputs are ready early (a loss's token count,
    placed by ``passes/early_sums.py``). Outside forward (a recompute in backward) it does
    nothing and the ``all_reduce`` runs as usual.

    Example::

        start_all_reduce(count, "dp", tag=7)   # right after count is computed
        ...                                    # the forward's compute
        total = all_reduce(count, "dp", tag=7)  # waits for the sum started above
    """
    rctx = current("autoshard collective start_all_reduce")
    rctx.mesh.check_axis(axis)
    if _phase(rctx) != "forward" or rctx.mesh.axis_size(axis) == 1:
        return
    rctx.prefetched[("all_reduce", tag)] = _call_backend(rctx, "all_reduce_async", "all_reduce", x.detach(), axis, (),
                                                         "all_reduce", tag, "forward")


def mark_varying(x: torch.Tensor, axis: str, tag: int | None = None, later: bool = False,
                 defer: bool = True) -> torch.Tensor:
    """Replicate consumed by varying work: identity forward; backward sums grads over ``axis``.

    Megatron's f / JAX's pbroadcast; on a data axis, this backward all-reduce is the DDP sync.

    ``later=True``, for a parameter leaf the program reads nowhere else: backward starts the
    sum without waiting and it is added into ``x.grad`` when backward ends (the same values;
    :mod:`~autoshard.runtime.primitives.param_sums`, placed by ``passes/param_sums.py``). ``defer=False``:
    ``x`` is computed from the batch, so gradient accumulation sends its sum in every
    microbatch (as :func:`all_gather_varying`'s).

    Example::

        h = mark_varying(x, "tp") @ w_col_shard.T
        w = mark_varying(norm_weight, "tp", later=True)   # norm_weight.grad summed after backward
    """
    return _apply("mark_varying", x, axis, (), tag, later=later, defer=defer)


def reduce_scatter(x: torch.Tensor, axis: str, dim: int, tag: int | None = None) -> torch.Tensor:
    """Partial -> Shard(dim): this rank's chunk of the sum; backward all-gathers the grad.

    Example::

        y_shard = reduce_scatter(y_partial, "tp", 1)   # (b, s, h) -> (b, s/tp, h)
    """
    return _apply("reduce_scatter", x, axis, (_dim(x, dim, "reduce_scatter"),), tag)


def all_gather(x: torch.Tensor, axis: str, dim: int, tag: int | None = None) -> torch.Tensor:
    """Shard(dim) -> Replicate for replicated use; backward keeps this rank's chunk of the grad.

    Example::

        full = all_gather(logits_shard, "tp", -1)
    """
    return _apply("all_gather", x, axis, (_dim(x, dim, "all_gather"),), tag)


def all_gather_varying(x: torch.Tensor, axis: str, dim: int, tag: int | None = None,
                       defer: bool = True) -> torch.Tensor:
    """Shard(dim) -> Replicate used by varying work: all-gather; backward reduce-scatters.

    This is ``mark_varying(all_gather(x))`` fused; on a data axis it is FSDP's parameter gather.
    ``defer=False``: ``x`` is an activation (context parallelism's K/V), whose gradient differs
    per microbatch and feeds the rest of that microbatch's backward, so gradient accumulation
    (``LocalModule.no_sync``) must not hold its reduce-scatter for a later microbatch.

    Example::

        w = all_gather_varying(w_shard, "dp", 0)     # grads come back reduce-scattered
    """
    return _apply("all_gather_varying", x, axis, (_dim(x, dim, "all_gather_varying"),), tag, defer=defer)


def shard_slice(x: torch.Tensor, axis: str, dim: int, tag: int | None = None) -> torch.Tensor:
    """Replicate -> Shard(dim): keep this rank's chunk (no communication); backward all-gathers.

    Example::

        x_local = shard_slice(x, "dp", 0)           # this rank's part of the batch
    """
    return _apply("shard_slice", x, axis, (_dim(x, dim, "shard_slice"),), tag)


def all_to_all(x: torch.Tensor, axis: str, scatter_dim: int, gather_dim: int,
               tag: int | None = None) -> torch.Tensor:
    """Shard(gather_dim) -> Shard(scatter_dim); backward is all_to_all with the dims swapped.

    Example::

        # sharded on heads (dim 1) -> sharded on sequence (dim 2), as in Ulysses attention
        y = all_to_all(x, "sp", 2, 1)
    """
    sd = _dim(x, scatter_dim, "all_to_all", "scatter_dim")
    gd = _dim(x, gather_dim, "all_to_all", "gather_dim")
    return _apply("all_to_all", x, axis, (sd, gd), tag)


def to_partial(x: torch.Tensor, axis: str, tag: int | None = None) -> torch.Tensor:
    """Replicate -> Partial: axis index 0 keeps ``x``, the others hold zeros; backward identity.

    Example::

        bias_p = to_partial(bias, "tp")    # added to a partial sum, counted once after all_reduce
    """
    return _apply("to_partial", x, axis, (), tag)


def replicated_use(x: torch.Tensor, axis: str, tag: int | None = None) -> torch.Tensor:
    """A gathered value (``all_gather_varying``) read by replicated work: identity forward;
    backward keeps the (identical) gradient on axis index 0 and zeros elsewhere, so the gather's
    reduce-scatter adds it once.

    Example::

        x_full = all_gather_varying(x_rows, "tp", 1)    # read by column-parallel q_proj ...
        k = replicated_use(x_full, "tp") @ w_k.T         # ... and by a whole k_proj
    """
    return _apply("replicated_use", x, axis, (), tag)


def use_persistent(shard: torch.Tensor, full: torch.Tensor, axis: str, dim: int,
                   tag: int | None = None) -> torch.Tensor:
    """ZeRO-2 parameter read: ``full`` (gathered after the last optimizer step) forward, and the
    gradient reduce-scattered onto ``shard`` backward.

    Example::

        w = use_persistent(w_shard, w_full, "dp", 0)   # grads arrive as w_shard-sized blocks
    """
    current("autoshard collective use_persistent").mesh.check_axis(axis)
    return _UsePersistent.apply(shard, full, axis, _dim(full, dim, "use_persistent"), tag)


def dispatch(rows: torch.Tensor, axis: str, send_splits, recv_splits, tag: int | None = None) -> torch.Tensor:
    """Expert parallelism's dispatch: rows ``[sum(send_splits), ...]`` of this rank, the first
    ``send_splits[0]`` to axis index 0, the next to index 1, ...; returns the rows received,
    ``recv_splits[j]`` from index j, in index order. Backward sends the gradient rows back
    (the same exchange with the splits swapped). Split sizes may be zero.

    Example::

        mine = dispatch(rows_by_expert, "ep", [3, 1], [3, 0])   # 4 rows out, 3 in
    """
    return _apply("dispatch", rows, axis, (_splits(rows, send_splits, "dispatch"), tuple(recv_splits)), tag)


def combine(rows: torch.Tensor, axis: str, send_splits, recv_splits, tag: int | None = None) -> torch.Tensor:
    """Expert parallelism's combine: the exchange of :func:`dispatch` run the other way (expert
    outputs back to the ranks of their tokens); its adjoint is again the reversed exchange.

    Example::

        back = combine(expert_out, "ep", [3, 0], [3, 1])        # the inverse of the dispatch above
    """
    return _apply("combine", rows, axis, (_splits(rows, send_splits, "combine"), tuple(recv_splits)), tag)


def _splits(rows: torch.Tensor, splits, op: str) -> tuple:
    splits = tuple(int(s) for s in splits)
    if rows.dim() == 0 or sum(splits) != rows.shape[0] or min(splits, default=0) < 0:
        raise ValueError(f"{op}: send splits {list(splits)} do not partition the {tuple(rows.shape)} rows")
    return splits
# ---- point to point: pipeline stage boundaries ----------------------------------------------

class _PointToPoint(torch.autograd.Function):
    """``send`` and ``recv`` as autograd functions: each one's backward is the other (ADJOINTS).

    A message is matched by (sender, receiver, message number): the forward message is
    ``2 * message`` and the gradient coming back ``2 * message + 1``, so both sides agree
    without any ordering assumption."""

    @staticmethod
    def forward(fctx, x, op, axis, peer, message, tag, template):
        fctx.rctx = current(f"autoshard {op}")
        fctx.op, fctx.axis, fctx.peer, fctx.message, fctx.tag = op, axis, peer, message, tag
        if op == "send":
            fctx.like = (x.shape, x.dtype, x.device)
            send_value(x, axis, peer, message, tag)
            return x.new_empty(0)  # a token: backward of it receives x's gradient
        return recv_value(template, axis, peer, message, tag)

    @staticmethod
    @once_differentiable
    def backward(fctx, grad):
        # the forward's context: autograd may run backward on a thread without one (GPU)
        with activate(fctx.rctx):
            if fctx.op == "send":
                dx = recv_gradient(template(*fctx.like), fctx.axis, fctx.peer, fctx.message, fctx.tag)
            else:
                send_gradient(grad, fctx.axis, fctx.peer, fctx.message, fctx.tag)
                dx = grad.new_zeros(0)
        return dx, None, None, None, None, None, None


def template(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """What a receive expects (shape, dtype, device), without allocating its memory: the
    backend allocates the received tensor (or has it already, from ``post_recv``). It is never
    written, so one may serve every receive of a shape (:func:`recv_value`, :func:`recv_gradient`)."""
    return torch.empty((), dtype=dtype, device=device).expand(tuple(shape))


def send(x: torch.Tensor, axis: str, peer: int, message: int, tag: int | None = None) -> torch.Tensor:
    """Send ``x`` to the rank at coordinate ``peer`` on ``axis`` (the other coordinates equal);
    returns an empty token. Backward of the token receives x's gradient from that peer, so
    ``torch.autograd.backward(token)`` runs this stage's backward once the next one sent it.

    Example (stage 0 of a 2-stage pipeline)::

        token = send(h, "pp", 1, message=mb)
        torch.autograd.backward(token, torch.empty(0))   # waits for dL/dh from stage 1
    """
    current("autoshard send").mesh.check_axis(axis)
    return _PointToPoint.apply(x, "send", axis, peer, message, tag, None)


def recv(token: torch.Tensor, axis: str, peer: int, message: int, shape, dtype: torch.dtype,
         tag: int | None = None) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` from coordinate ``peer`` on ``axis``. If
    ``token`` requires grad, backward sends the received value's gradient back to the peer.

    Example (stage 1 of a 2-stage pipeline)::

        h = recv(torch.empty(0, requires_grad=True), "pp", 0, message=mb, shape=(4, 8, 32), dtype=torch.float32)
    """
    current("autoshard recv").mesh.check_axis(axis)
    return _PointToPoint.apply(token, "recv", axis, peer, message, tag, template(shape, dtype, token.device))


def send_gradient(grad: torch.Tensor, axis: str, peer: int, message: int, tag: int | None = None) -> None:
    """Send what the backward of ``recv(..., message)`` sends, for a received value that
    backward never reached (the receiver's outputs do not depend on it): its zero gradient.

    Example::

        send_gradient(torch.zeros(shape), "pp", 0, message=mb)
    """
    _run(current("autoshard send_gradient"), "send", grad.detach(), axis, (peer, 2 * message + 1), "recv", tag,
         "backward")


def send_value(x: torch.Tensor, axis: str, peer: int, message: int, tag: int | None = None) -> None:
    """What ``send(x, ...)`` sends, without its autograd node: the caller differentiates the
    sent value itself, with the gradient :func:`recv_gradient` brings back (the pipeline
    runtime: one ``torch.autograd.backward`` per stage and microbatch, no node per message).

    Example::

        send_value(h, "pp", 1, message=mb)
        torch.autograd.backward([h], [recv_gradient(template, "pp", 1, message=mb)])
    """
    rctx = current("autoshard send")
    _run(rctx, "send", x.detach(), axis, (peer, 2 * message), "send", tag, _phase(rctx))


def recv_value(template: torch.Tensor, axis: str, peer: int, message: int, tag: int | None = None) -> torch.Tensor:
    """What ``recv(..., message)`` receives, shaped like ``template`` (see :func:`template`),
    as a plain tensor: the caller makes it a leaf and sends its ``.grad`` back with
    :func:`send_gradient`.

    Example::

        h = recv_value(template((4, 8, 32), torch.float32), "pp", 0, message=mb).requires_grad_()
    """
    rctx = current("autoshard recv")
    return _run(rctx, "recv", template, axis, (peer, 2 * message), "recv", tag, _phase(rctx))


def recv_gradient(template: torch.Tensor, axis: str, peer: int, message: int, tag: int | None = None) -> torch.Tensor:
    """The gradient of a value sent with :func:`send_value` (or ``send``), from the peer that
    received it: what the backward of ``send``'s token receives.

    Example::

        dh = recv_gradient(template(h.shape, h.dtype), "pp", 1, message=mb)
    """
    return _run(current("autoshard recv_gradient"), "recv", template, axis, (peer, 2 * message + 1), "send", tag,
                "backward")


def post_recv(axis: str, peer: int, message: int, shape, dtype: torch.dtype, device=None) -> None:
    """Start receiving what ``recv(..., message)`` will read, so the data can arrive while this
    rank still computes (a backend that cannot start early ignores it). Every posted message
    must then be read by that ``recv``.

    Example::

        post_recv("pp", 0, message=mb + 1, shape=(4, 8, 32), dtype=torch.float32)
        ...                                  # this microbatch's work
        h = recv(token, "pp", 0, message=mb + 1, shape=(4, 8, 32), dtype=torch.float32)
    """
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    current("autoshard post_recv").backend.post_recv(buffer, axis, peer, 2 * message)


def post_gradient_recv(x: torch.Tensor, axis: str, peer: int, message: int) -> None:
    """Start receiving the gradient that the backward of ``send(x, axis, peer, message)``
    reads (see :func:`post_recv`).

    Example::

        token = send(h, "pp", 1, message=mb)
        post_gradient_recv(h, "pp", 1, message=mb)
    """
    buffer = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    current("autoshard post_gradient_recv").backend.post_recv(buffer, axis, peer, 2 * message + 1)


# ---- resharding after forward (ZeRO-3 / FSDP) ------------------------------------------------

class _ParamSource:
    """One parameter gathered by ``all_gather_varying``: what resharding gathers again."""

    size = None  # not prefetched: single parameters are gathered when backward reads them

    def __init__(self, shard, axis, dims, tag):
        self.shard, self.axis, self.dims, self.tag = shard, axis, dims, tag

    def regather(self, rctx, pending=None) -> list:
        return [_run(rctx, "all_gather", self.shard, self.axis, self.dims, "all_gather_varying", self.tag, "backward")]


class _UnitSource:
    """A unit gathered by ``gather_unit``: regathered whole, and prefetchable."""

    def __init__(self, shards, axis, dims, tag):
        self.shards, self.axis, self.dims, self.tag = shards, axis, dims, tag
        self.shapes = [tuple(s.shape) for s in shards]
        self.size = sum(s.numel() for s in shards)  # elements of this rank's flat buffer

    def regather(self, rctx, pending=None) -> list:
        flat = pending.wait() if pending is not None else _run(
            rctx, "all_gather", units.pack_shards(self.shards), self.axis, (0,), "gather_unit", self.tag, "backward")
        return _unpack_unit(rctx, flat, self.shapes, self.dims, self.axis)

    def start(self, rctx):
        return _start_unit_gather(rctx, self.shards, self.axis, self.tag, "backward")


def _register_reshard(rctx: RankContext, full: torch.Tensor, source, index: int = 0) -> None:
    ptr = full.untyped_storage().data_ptr()
    rctx.reshard_live[ptr] = (source, index)
    # Once the full tensor dies (forward is done with it), its address may be reused.
    weakref.finalize(full, rctx.reshard_live.pop, ptr, None)


@contextlib.contextmanager
def reshard_after_forward():
    """While active, tensors that autograd saves from registered parameter gathers are
    replaced by a token; backward gathers the parameter again (once per parameter, shared by
    every saved view) instead of keeping it alive between forward and backward.

    Example::

        with rank_context(mesh, rank, backend) as ctx, reshard_after_forward():
            ctx.reshard_tags = frozenset(plan.program.reshard_tags)
            loss = program(*inputs); loss.backward()
    """
    rctx = current("reshard_after_forward")
    regathered: dict = {}  # tag -> [full tensors or None, saved views still to unpack, source]
    last_use: dict = {}  # tag -> order of its last saved view in forward
    clock = itertools.count()
    backward_order: list = []  # tags, in the order backward will first need them

    def pack(t):
        hit = rctx.reshard_live.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if hit is None:
            return t.detach()  # not t: a saved output would hold its own node (see SavedBytes.hooks)
        source, index = hit
        regathered.setdefault(source.tag, [None, 0, source])[1] += 1
        last_use[source.tag] = next(clock)
        return ("regather", source, index, t.size(), t.stride(), t.storage_offset())

    def prefetch_after(tag, size):
        # Backward runs forward in reverse: the next sources it needs are those whose last
        # saved views come just before this one's. Start their gathers now (units only), as
        # many as it takes to have as much in flight as this one holds: a small unit next (a
        # final norm) does not leave the big one after it to be gathered only when reached.
        if not backward_order:
            backward_order.extend(sorted(last_use, key=lambda k: -last_use[k]))
        i = backward_order.index(tag)
        ahead = 0
        for nxt in backward_order[i + 1:]:
            entry = regathered.get(nxt)
            if entry is None or entry[0] is not None or entry[2].size is None:
                continue
            if nxt not in rctx.prefetched:
                rctx.prefetched[nxt] = entry[2].start(rctx)
            ahead += entry[2].size
            if ahead >= size:
                return

    def unpack(obj):
        if not (isinstance(obj, tuple) and obj and obj[0] == "regather"):
            return obj
        _, source, index, size, stride, offset = obj
        tag = source.tag
        # A graph kept for a second backward (a zero-bubble weight-gradient pass) unpacks its
        # saved views again after the count ran out: gather once more.
        entry = regathered.setdefault(tag, [None, 0, source])
        if entry[0] is None:
            entry[0] = entry[2].regather(rctx, rctx.prefetched.pop(tag, None))
            prefetch_after(tag, entry[2].size or 0)
        full = entry[0][index]
        entry[1] -= 1
        if entry[1] <= 0:
            del regathered[tag]
        return full.as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# ---- ZeRO-3 / FSDP units: several parameters per collective ------------------------------------

class _GatherUnit(torch.autograd.Function):
    """Forward: one flat all-gather of a unit's shards (or the prefetched one), then the gather
    of the next unit is started. Backward (once every member's gradient is complete): one flat
    reduce-scatter; for leaf shards it is started asynchronously and lands in ``.grad`` when
    backward ends, so it runs under the rest of backward."""

    @staticmethod
    def forward(fctx, axis, dims, tag, prefetch, hold, *shards):
        rctx = current("autoshard collective gather_unit")
        phase = _phase(rctx)
        # Trainable leaves (a LocalModule's parameters) get their gradients from the landing.
        fctx.leaves = shards if all(s.is_leaf and s.requires_grad for s in shards) else None
        shards = tuple(s.detach() for s in shards)
        shapes = [tuple(s.shape) for s in shards]
        n = rctx.mesh.axis_size(axis)
        pending = rctx.prefetched.pop(tag, None) if tag is not None else None
        flat = pending.wait() if pending is not None else _run(
            rctx, "all_gather", units.pack_shards(shards), axis, (0,), "gather_unit", tag, phase)
        if prefetch is not None and phase == "forward":
            next_shards, _, next_tag = prefetch
            if next_tag not in rctx.prefetched:
                rctx.prefetched[next_tag] = _start_unit_gather(rctx, next_shards, axis, next_tag, phase)
        fulls = _unpack_unit(rctx, flat, shapes, dims, axis)
        if tag is not None and tag in rctx.reshard_tags:
            source = _UnitSource(shards, axis, dims, tag)
            for i, full in enumerate(fulls):
                _register_reshard(rctx, full, source, i)
        fctx.rctx, fctx.axis, fctx.dims, fctx.tag, fctx.shapes = rctx, axis, dims, tag, shapes
        fctx.hold = hold
        fctx.full_shapes = [tuple(f.shape) for f in fulls]
        fctx.dtypes = [f.dtype for f in fulls]
        return tuple(fulls)

    @staticmethod
    @once_differentiable
    def backward(fctx, *grads):
        rctx, axis, n = fctx.rctx, fctx.axis, fctx.rctx.mesh.axis_size(fctx.axis)
        leaves = fctx.leaves
        grads = [g.detach() if g is not None else torch.zeros(shape, dtype=dt)
                 for g, shape, dt in zip(grads, fctx.full_shapes, fctx.dtypes)]
        flat = units.pack_grads(grads, fctx.dims, n, dtype=reduce_dtype_for(rctx, grads[0]), empty=_buffers(rctx, axis))
        none = (None,) * 5
        key = ("gather_unit", fctx.tag, axis)
        if axis in rctx.defer_axes:
            # Sum(k microbatches) then reduce == reduce each then sum: send once, at the end.
            rctx.deferred[key] = rctx.deferred[key] + flat if key in rctx.deferred else flat
            if leaves:
                return none + (None,) * len(fctx.shapes)
            return none + tuple(torch.zeros(s, dtype=dt, device=flat.device) for s, dt in zip(fctx.shapes, fctx.dtypes))
        if key in rctx.deferred:
            flat = flat + rctx.deferred.pop(key)
        if leaves:
            if rctx.landing is None:
                rctx.landing = units.GradLanding()
            rctx.landing.add(leaves, fctx.shapes,
                             _Held(rctx, flat, axis, fctx.tag) if fctx.hold
                             else _start(rctx, "reduce_scatter", flat, axis, "gather_unit", fctx.tag, "backward"))
            return none + (None,) * len(fctx.shapes)
        out = _run(rctx, "reduce_scatter", flat, axis, (0,), "gather_unit", fctx.tag, "backward")
        return none + tuple(g.to(dt) for g, dt in zip(units.unpack_shards(out, fctx.shapes), fctx.dtypes))


def start_gather_unit(shards, axis: str, tag: int) -> None:
    """Start the flat all-gather that the ``gather_unit`` node tagged ``tag`` then waits for
    instead of sending (its forward prefetch), at a point of the program of its own: placed
    after the plain collectives that run between the previous unit's gather and this one's
    (``passes/zero_units.py``), so they are not queued behind this larger gather on the axis's
    group. Outside forward (a recompute in backward) it does nothing.

    Example::

        start_gather_unit((w1_shard, w2_shard), "dp", tag=5)   # after the last plain collective
        ...                                                   # compute
        w1, w2 = gather_unit((w1_shard, w2_shard), "dp", (0, 0), tag=5)   # waits for it
    """
    rctx = current("autoshard collective start_gather_unit")
    rctx.mesh.check_axis(axis)
    if _phase(rctx) != "forward" or tag in rctx.prefetched:
        return
    rctx.prefetched[tag] = _start_unit_gather(rctx, tuple(shards), axis, tag, "forward")


def gather_unit(shards, axis: str, dims, tag: int | None = None, prefetch=None, hold: bool = False) -> tuple:
    """ZeRO-3 / FSDP: every parameter of a unit, Shard(dims[i]) -> Replicate for varying use,
    in one flat all-gather; backward reduce-scatters their gradients in one flat buffer
    (:mod:`autoshard.runtime.primitives.zero_units`). ``prefetch=(next shards, next dims, next tag)`` starts the
    next unit's gather as soon as this one is done, so it overlaps this unit's compute.
    ``hold=True``: backward starts the reduce-scatter only once the next collective on ``axis``
    has run (a plain one the program runs between this unit's backward and the previous
    unit's, which would otherwise wait behind it).

    Trainable leaf shards (a ``LocalModule``'s parameters) get their gradients asynchronously:
    the reduce-scatter starts when the unit's last gradient is ready and is added into
    ``.grad`` when backward ends. Otherwise the gradients flow back through autograd.

    Example::

        wq, wk = gather_unit((wq_shard, wk_shard), "dp", (0, 0), tag=3)
    """
    shards = tuple(shards)
    if not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("gather_unit expects a non-empty tuple of tensors")
    current("autoshard collective gather_unit").mesh.check_axis(axis)
    dims = tuple(_dim(s, d, "gather_unit") for s, d in zip(shards, dims))
    return _GatherUnit.apply(axis, dims, tag, prefetch, hold, *shards)


COLLECTIVES = {
    "all_reduce": all_reduce,
    "mark_varying": mark_varying,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "all_gather_varying": all_gather_varying,
    "shard_slice": shard_slice,
    "all_to_all": all_to_all,
    "to_partial": to_partial,
    "replicated_use": replicated_use,
    "use_persistent": use_persistent,
    "gather_unit": gather_unit,
    "dispatch": dispatch,
    "combine": combine,
    "send": send,
    "recv": recv,
}
assert COLLECTIVES.keys() == ADJOINTS.keys()
# Functions a program calls that are not collectives of their own (no adjoint, no comment).
PROGRAM_HELPERS = (start_all_reduce, start_gather_unit)
