"""Placement changes: how the SPMD rewrite turns a value's placement into the one a consumer
needs, one mesh axis at a time, as a table.

A conversion walks the mesh axes twice: first the gathers and reductions, innermost axis first;
then the slices, outermost first (so a dim split on several axes is taken apart and put back in
mesh order). On each axis the change from the value's placement there to the consumer's is
looked up in :data:`CHANGES` by ``(phase, from, to)`` (``"gather"`` / ``"slice"``; ``"S"``
Shard, ``"R"`` Replicate, ``"P"`` Partial)::

    gather  P -> R   all_reduce        (once per value and axis, whichever consumers need it)
    gather  P -> S   reduce_scatter
    gather  S -> S   all_to_all        (another dim)
    gather  S -> R   all_gather        (all_gather_varying when per-rank work reads it)
    gather  S -> P   all_gather, then to_partial
    slice   R -> S   shard_slice
    slice   R -> P   to_partial

Other passes register *hooks* from their own modules, consulted before the table's row:

- :func:`register_change` ``(phase, from, to, applies)``: a handler that replaces the row when
  ``applies(step)`` (ZeRO-2's persistent full copies, ``passes/zero_storage.py``; the one
  gather of a soft-sharded activation, ``passes/soft.py``);
- :func:`register_reorder`: a permutation of a whole dim before it is split and after it is
  gathered (zigzag context parallelism, ``passes/zigzag.py``);
- :func:`register_gather_observer`: told of every gather (ZeRO-3 storage notes the gathers of
  stored parameters, ``passes/zero_storage.py``);
- :func:`register_axis_order`: which axis a conversion changes first (a full copy is read
  before the other axes are gathered from it).

Example (a handler for a new change, registered from its module)::

    from autoshard.passes.conversions import register_change

    def _gather_twice(step, node):
        return step.emit(my_gather, node, (step.s.dim,))

    register_change("gather", "S", "R", applies=lambda step: step.axis == "fast", handler=_gather_twice)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from autoshard.ownership import Owned, Partial, R, Replicate, Shard
from autoshard.runtime.primitives import collectives as C

from .layout_error import LayoutError

PHASES = ("gather", "slice")


def kind(p) -> str:
    """``"S"``, ``"R"`` or ``"P"``: the row/column of a placement in :data:`CHANGES`."""
    if isinstance(p, Shard):
        return "S"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    return type(p).__name__


@dataclass
class Step:
    """One axis's change within one conversion, as a handler sees it: the value ``src``
    (output ``out``), the placement ``s`` it has on ``axis`` and ``t`` the consumer needs,
    the placements of every axis so far (``state``), the axes where the consumer's work is
    per-rank (``varying``), and whether ``src`` carries a gradient (``needs_grad``)."""

    rw: object  # the rewriter (handlers use the methods below)
    src: object
    out: int
    consumer: object
    reason: object  # str, or a function wording it (called only when a collective is emitted)
    axis: str
    index: int
    s: object
    t: object
    state: list
    varying: frozenset
    needs_grad: bool

    def emit(self, fn, node, extra=(), s=None, t=None, extra_inputs=(), kwargs=None):
        """Add collective ``fn`` (``runtime.collectives``) on this axis; record it in the plan."""
        return self.rw.emit(fn, node, self.axis, tuple(extra), self.src, self.consumer, self.reason,
                            self.s if s is None else s, self.t if t is None else t, extra_inputs=extra_inputs,
                            kwargs=kwargs)

    def reorder(self, node, dim: int, inverse: bool):
        """``node`` with its whole ``dim`` permuted as the registered reorders ask (before a
        split: ``inverse=False``; after a gather: ``inverse=True``)."""
        for fn in REORDERS:
            node = fn(self.rw, node, self.src, self.out, self.axis, dim, inverse)
        return node

    def check_nesting(self, dim: int) -> None:
        """Axes sharding one dim nest in mesh order; only the innermost may change alone."""
        check_nesting(self.rw, self.state, self.axis, dim, self.src, self.consumer)

    def undeferred(self) -> Optional[dict]:
        """The keyword arguments of a gradient sum on this axis (see :func:`undeferred`)."""
        return undeferred(self.rw, self.src, self.axis)

    def memo(self, name: str) -> dict:
        """A dict kept for the whole rewrite under ``name`` (a hook's cache)."""
        return self.rw.hook_state.setdefault(name, {})

    def gathered(self, fn, node) -> None:
        """Tell the gather observers of a gather just emitted."""
        for obs in GATHER_OBSERVERS:
            obs(self, fn, node)


Handler = Callable[[Step, object], Optional[object]]  # (step, local node) -> new node, or None: no change

CHANGES: dict = {}  # (phase, from kind, to kind) -> Handler
HOOKS: dict = {}  # (phase, from kind, to kind) -> [(priority, applies, Handler)], lowest priority first
REORDERS: list = []  # fn(rw, node, src, out, axis, dim, inverse) -> node
GATHER_OBSERVERS: list = []  # fn(step, gather function, new node)
AXIS_ORDERS: list = []  # fn(rw, src, order) -> order (axis indices, gathers first)


def register_change(phase: str, frm: str, to: str, applies: Callable[[Step], bool], handler: Handler,
                    priority: int = 50) -> None:
    """Have ``handler`` make the ``frm -> to`` change of ``phase`` where ``applies(step)``
    (before the table's own row; hooks of lower ``priority`` are asked first)."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    hooks = HOOKS.setdefault((phase, frm, to), [])
    hooks.append((priority, applies, handler))
    hooks.sort(key=lambda h: h[0])


def register_reorder(fn) -> None:
    """Add a permutation applied around splits and gathers (see :meth:`Step.reorder`)."""
    REORDERS.append(fn)


def register_gather_observer(fn) -> None:
    """Have ``fn(step, gather_fn, node)`` told of every forward gather a conversion emits."""
    GATHER_OBSERVERS.append(fn)


def register_axis_order(fn) -> None:
    """Have ``fn(rw, src, order)`` reorder the axes of a conversion of ``src``."""
    AXIS_ORDERS.append(fn)


def change(phase: str, frm: str, to: str):
    """Decorator: the table's row for ``frm -> to`` in ``phase``."""
    def put(handler):
        CHANGES[(phase, frm, to)] = handler
        return handler
    return put


# ---- the table ----------------------------------------------------------------------------------

@change("gather", "P", "R")
def _all_reduce(step, node):
    # a pending sum is summed once, whichever consumers need it whole (their other changes may differ)
    rw, key = step.rw, (node, step.axis)
    if key not in rw.all_reduced:
        rw.all_reduced[key] = step.emit(C.all_reduce, node)
    rw.summed.add((step.src, step.axis))
    return rw.all_reduced[key]


def _into_shard(fn):
    """The change that makes the value a shard on the target's dim with the collective ``fn``
    (its dim reordered first, as any split of a whole dim)."""
    def handler(step, node):
        step.check_nesting(step.t.dim)
        node = step.reorder(node, step.t.dim, False)
        return step.emit(fn, node, (step.t.dim,))
    return handler


CHANGES[("gather", "P", "S")] = _into_shard(C.reduce_scatter)


@change("gather", "S", "S")
def _all_to_all(step, node):
    s, t = step.s, step.t
    if s.dim == t.dim:
        return None
    step.check_nesting(s.dim)
    step.check_nesting(t.dim)
    node = step.reorder(node, t.dim, False)
    node = step.emit(C.all_to_all, node, (t.dim, s.dim))
    return step.reorder(node, s.dim, True)


def _all_gather(step, node):
    step.check_nesting(step.s.dim)
    fn = C.all_gather_varying if step.axis in step.varying and isinstance(step.t, Replicate) else C.all_gather
    node = step.emit(fn, node, (step.s.dim,), kwargs=step.undeferred() if fn is C.all_gather_varying else None)
    step.gathered(fn, node)
    node = step.reorder(node, step.s.dim, True)
    if isinstance(step.t, Partial):
        node = step.emit(C.to_partial, node, s=R)
    return node


CHANGES[("gather", "S", "R")] = CHANGES[("gather", "S", "P")] = _all_gather
# (a block read as one expert's whole value is gathered first, as any other whole read)
CHANGES[("gather", "S", "Owned")] = _all_gather


CHANGES[("slice", "R", "S")] = _into_shard(C.shard_slice)


@change("slice", "R", "P")
def _to_partial(step, node):
    return step.emit(C.to_partial, node)


# ---- a conversion -------------------------------------------------------------------------------

def convert(rw, src, out: int, target: tuple, varying: set, consumer, reason):
    """Local node holding ``src`` (output ``out``) with placement ``target`` (cached per value,
    target and varying axes). ``varying``: axes on which the consumer's work differs per rank
    (so gradients must be summed). ``reason``: why the consumer needs it so, or a function
    wording it (called only when a collective is emitted)."""
    axes = rw.axes
    cur = rw.place[src][out]
    for o, t, a in zip(cur, target, axes):
        if isinstance(o, Owned) and o != t:
            raise LayoutError(f"{rw.display.get(src.name, src.name)} exists only on index {o.index} of mesh "
                                  f"axis {a!r} (one expert), but {rw.where(consumer)} reads it outside its MoE layer")
    node = rw.local[src] if out is None or not isinstance(rw.local[src], list) else rw.local[src][out]
    needs_grad = src in rw.rg
    varying = frozenset(varying) if needs_grad else frozenset()
    rw.grad_sync.note_use(rw, src, cur, target, varying, consumer)  # (bookkeeping of the gradient sync)
    key = (src, out, target, varying)
    if key in rw.cache:
        return rw.cache[key]
    order = list(reversed(range(len(axes)))) + list(range(len(axes)))
    for fn in AXIS_ORDERS:
        order = fn(rw, src, order)
    state = list(cur)
    for phase_ix, i in enumerate(order):
        phase = PHASES[0] if phase_ix < len(axes) else PHASES[1]
        s, t = state[i], target[i]
        if s == t:  # (the common case: nothing to change on this axis)
            continue
        row = (phase, kind(s), kind(t))
        hooks, handler = HOOKS.get(row), CHANGES.get(row)
        new = None
        if hooks or handler is not None:
            step = Step(rw, src, out, consumer, reason, axes[i], i, s, t, state, varying, needs_grad)
            handler = next((h for _, applies, h in hooks or () if applies(step)), handler)
            new = handler(step, node) if handler is not None else None
        if new is not None:  # (None: nothing to change on this axis in this phase)
            node = new
            state[i] = t
        elif phase == "slice":
            state[i] = t
    for i, a in enumerate(axes):
        # A whole value read by per-rank work: identity forward, gradient sum backward (a
        # gathered one is already an all_gather_varying).
        if a in varying and isinstance(target[i], Replicate) and not isinstance(cur[i], Shard):
            node = rw.emit(C.mark_varying, node, a, (), src, consumer, reason, R, R, kwargs=undeferred(rw, src, a))
    rw.cache[key] = node
    return node


def check_nesting(rw, state, axis, dim, src, consumer):
    """Axes sharding one dim nest in mesh order; only the innermost may change alone."""
    inner = [a for o, a in zip(state, rw.axes) if isinstance(o, Shard) and o.dim == dim]
    later = [a for a in inner if rw.axes.index(a) > rw.axes.index(axis)]
    if later:
        raise LayoutError(
            f"dim {dim} of {src.name} is split on axes {inner}; changing its ownership on {axis!r} alone "
            f"would reorder blocks (needed by {rw.where(consumer)}); list the mesh axes of a dim in "
            f"mesh order {list(rw.axes)} and keep them together")


def undeferred(rw, src, axis) -> Optional[dict]:
    """``defer=False`` for a gradient sum on a data axis of a value computed from the batch:
    gradient accumulation must send it in its own microbatch (see ``runtime.collectives``)."""
    return {"defer": False} if axis in rw.data_axes and src in rw.from_user else None


# How each runtime function changes its input's local shape on an axis of n ranks: per dim
# argument, "grow" (x n) or "shrink" (/ n); the others keep the shape.
SHAPE_CHANGES = {
    "all_gather": ("grow",), "all_gather_varying": ("grow",), "use_persistent": ("grow",),
    "reduce_scatter": ("shrink",), "shard_slice": ("shrink",),
    "all_to_all": ("shrink", "grow"),  # (split dim, concatenated dim)
}


def converted_val(mesh, val, fn: str, axis: str, extra: tuple):
    """The meta value of runtime function ``fn``'s output for an input ``val`` on ``axis``."""
    n = mesh.axes[axis]
    shape = list(val.shape)
    for d, how in zip(extra, SHAPE_CHANGES.get(fn, ())):
        shape[d] = shape[d] * n if how == "grow" else shape[d] // n
    return torch.empty(shape, dtype=val.dtype, device="meta")
