"""Zigzag sequence order (context parallelism): a whole sequence dim is permuted before it is
split on its axis and after it is gathered, so each rank's block holds chunks i and 2R-1-i
(``runtime.ring_attention.zigzag_permute``; the order is ``Layout.orders``, chosen by
``passes/context_parallel.py``). Registered as a reorder of the placement-change table
(``passes/conversions.py``).

Example::

    >>> plan = autoshard.autoshard(model, args, mesh=Mesh({"cp": 2}), dims=dims, layout={"seq": "cp"},
    ...                            context={"order": "zigzag"})                             # doctest: +SKIP
    >>> "zigzag_permute" in plan.graph_module.code                                          # doctest: +SKIP
    True
"""
from __future__ import annotations

from autoshard.ownership import Shard
from autoshard.runtime.primitives.ring_attention import zigzag_permute

from .conversions import register_reorder


def _zigzag_unit(rw, axis):
    order = rw.layout.orders.get(axis)
    return order[0] if order is not None and order[1] == "zigzag" else None


def reorder(rw, node, src, out, axis, dim, inverse):
    """``node`` (a value of ``src``) with its whole ``dim`` put in zigzag order before a split on
    ``axis`` (``inverse=False``), or back in natural order after a gather (``inverse=True``),
    when that dim is the axis's zigzag-ordered sequence; else ``node`` itself."""
    unit = _zigzag_unit(rw, axis)
    if unit is None or rw.unit_of(rw.info.of(src, out or 0)[dim], axis) != unit:
        return node
    new = rw.g.call_function(zigzag_permute, (node, dim, rw.mesh.axes[axis], inverse))
    val = rw.local_val(node)
    if val is not None:
        new.meta["val"] = val
    return new


def zigzag_dim(rw, node, place, axis_ix) -> bool:
    """Whether ``place`` splits ``node`` along a zigzag-ordered sequence on that axis (such a
    value is gathered in natural order before the program returns it)."""
    a = rw.axes[axis_ix]
    unit = _zigzag_unit(rw, a)
    o = place[axis_ix]
    return unit is not None and isinstance(o, Shard) and rw.unit_of(rw.info.of(node)[o.dim], a) == unit


register_reorder(reorder)
