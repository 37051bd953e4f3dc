"""ZeRO storage in the SPMD rewrite: parameters stored sharded on a data axis (``ParamStorage``)
and read whole where the layout uses them.

- ZeRO-3: a stored parameter is gathered for use (``all_gather``); the gathers of parameters
  that reshard after forward are listed (``reshard_tags``), and their reads by replicated work
  noted (``stored_reads``, for ``grad_regions.sum_regions_in_storage``).
- ZeRO-2: a parameter's full copy, gathered after each optimizer step, is a placeholder of its
  own in the use placement (``full_copies``); reads take it (``use_persistent``) instead of
  gathering the stored piece, the storage axis first.

The rewrite keeps one :class:`ZeroStorage` per program; the changes are hooks of the
placement-change table (``passes/conversions.py``).

Example::

    >>> plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"},
    ...                            train=True, zero_stage=2)                              # doctest: +SKIP
    >>> sorted({c.op for c in plan.collectives if c.op == "use_persistent"})              # doctest: +SKIP
    ['use_persistent']
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.ownership import R
from autoshard.runtime.primitives import collectives as C

from .conversions import register_axis_order, register_change, register_gather_observer


@dataclass
class ZeroStorage:
    """What one rewrite knows and learns of sharded parameter storage."""

    storage: dict  # placeholder name -> ParamStorage (state sharding on a data axis)
    full_copies: dict = field(default_factory=dict)  # placeholder name -> its persistent full copy's placeholder
    reshard_tags: set = field(default_factory=set)  # tags of parameter gathers released after forward
    stored_reads: dict = field(default_factory=dict)  # stored parameter -> its reads by replicated work

    def add_full_copy(self, rw, node, index: int, placeholders: list) -> None:
        """Give ZeRO-2 parameter ``node`` (placeholder ``index``) its full copy's placeholder."""
        full = rw.g.placeholder(node.name + "_full")
        full.meta = dict(node.meta, val=rw.meta_local(node.meta["val"], rw.desired(node)))
        self.full_copies[node.name] = full
        placeholders.append((full.name, "full", index))

    def is_full_copy_read(self, src, axis) -> bool:
        return src.name in self.full_copies and axis == self.storage[src.name].axis


def _storage_axis_first(rw, src, order):
    # ZeRO-2's full copy is held in the use placement (other axes' shards kept): read it first,
    # then gather the other axes from it, not from the stored piece.
    zero = rw.zero
    if src.name not in zero.full_copies:
        return order
    i = rw.axes.index(zero.storage[src.name].axis)
    order = [j for j in order]
    order.remove(i)
    return [i] + order


def _read_full_copy(step, node):
    # ZeRO-2: read the full copy gathered after the last optimizer step.
    zero = step.rw.zero
    node = step.emit(C.use_persistent, node, (step.s.dim,), extra_inputs=(zero.full_copies[step.src.name],))
    if step.needs_grad and step.axis not in step.varying:
        # Read by replicated work, the gradient comes back whole on every rank: the
        # reduce-scatter must add it once, not once per rank.
        node = step.emit(C.replicated_use, node, s=R)
        zero.stored_reads.setdefault(step.src.name, []).append(node)
    return node


def _stored_gather(step, fn, node):
    st = step.rw.zero.storage.get(step.src.name)
    if st is None or step.axis != st.axis:
        return
    if fn is C.all_gather and step.needs_grad:
        step.rw.zero.stored_reads.setdefault(step.src.name, []).append(node)
    if st.reshard:
        step.rw.zero.reshard_tags.add(node.meta["autoshard"]["tag"])


register_axis_order(_storage_axis_first)
register_change("gather", "S", "R", applies=lambda step: step.rw.zero.is_full_copy_read(step.src, step.axis),
                handler=_read_full_copy, priority=10)
register_gather_observer(_stored_gather)
