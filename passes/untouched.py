"""Where a layout first touches a captured graph: the nodes before it compute whole.

The rewrite gives a dim a unit of the layout only where the unit is a prefix of the dim's leaf
atoms (``_Rewriter.unit_of``). :func:`first_reads` tabulates, for every such prefix, the first
node (not a placeholder: a placeholder's placement matters where it is read) that reads or
writes a value with a dim it is a prefix of (with soft entries, a hard unit reaches as far as
its leading atom: :func:`reach`). Before the first node a layout's units reach, every
value read or written has no dim split by the layout and every operand is whole on every rank
(induction over the nodes), so each op is computed whole: no conversion, no collective, no
error. A rewrite that builds no graph (``collectives_only``: the layout search's one-axis
programs, which the search rewrites hundreds of times and stops early) records those nodes as
whole without deciding each (:func:`untouched_prefix`).

Example::

    >>> first = first_reads(graph, info)                  # doctest: +SKIP
    >>> untouched_prefix(rewriter, first)                 # doctest: +SKIP
    112
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import fx

from .lowering import is_local
from .rules import GETITEM, is_tensor_node


def first_reads(graph: fx.Graph, info) -> dict:
    """{unit: index in ``graph.nodes`` of the first node (not a placeholder) that reads or
    writes a value with a dim whose leaf atoms start with that unit}, for every prefix of
    every dim's leaf atoms.

    Example::

        >>> first_reads(graph, info)[(3,)]                # doctest: +SKIP
        117
    """
    first: dict = {}
    for i, node in enumerate(graph.nodes):
        if node.op == "placeholder":
            continue
        for v in (node, *node.all_input_nodes):
            for u in _leaf_prefixes(info, v):
                first.setdefault(u, i)
    # An MoE layer's experts units decide from the first node reading its router's experts dim:
    # whether that dim is split there depends on whether the experts are on the axis
    # (passes/experts.regional_layout), which their own units say (read later, in the layer).
    # (The regions are those found on this DimInfo before: passes/experts.find_expert_regions.)
    for r in getattr(info, "recognised", {}).get("experts") or ():
        start = min((first.get(lv[:1], math.inf) for lv in r.router_dims), default=math.inf)
        experts = tuple(r.experts_atoms)
        for k in range(1, len(experts) + 1):
            if min(first.get(experts[:k], math.inf), start) < math.inf:
                first[experts[:k]] = min(first.get(experts[:k], math.inf), start)
    return first


def _leaf_prefixes(info, value):
    """Every prefix of the leaf atoms of every dim of ``value``'s results."""
    for dims in info.dims.get(value, ()):
        for atoms in dims:
            if atoms:
                lv = tuple(info.leaves(atoms))
                yield from (lv[:k] for k in range(1, len(lv) + 1))


def input_prefixes(graph: fx.Graph, info) -> dict:
    """{tensor placeholder: every prefix of its dims' leaf atoms}: a layout none of whose units
    is among them leaves the input whole (a soft entry never splits an input)."""
    out = {}
    for node in graph.nodes:
        if node.op == "placeholder" and node in info.dims and is_tensor_node(node):
            out[node] = frozenset(_leaf_prefixes(info, node))
    return out


def result_prefixes(graph: fx.Graph, info) -> dict:
    """{call_function node: every prefix of the leaf atoms of its tensor results' dims}: a layout
    (with no soft entry) none of whose units is among them splits none of its results."""
    out = {}
    for node in graph.nodes:
        if node.op == "call_function":
            vals = node.meta.get("val")
            vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
            out[node] = frozenset(lv[:k] for i, v in enumerate(vals) if isinstance(v, torch.Tensor)
                                  for atoms in info.of(node, i) if atoms
                                  for lv in (tuple(info.leaves(atoms)),) for k in range(1, len(lv) + 1))
    return out


def input_reads(graph: fx.Graph, info=None) -> dict:
    """{placeholder: index in ``graph.nodes`` of the first node reading it} (unread ones absent):
    where a layout decides an input's placement (see :func:`first_reads`)."""
    out: dict = {}
    for i, node in enumerate(graph.nodes):
        for a in node.all_input_nodes:
            if a.op == "placeholder":
                out.setdefault(a, i)
    return out


def units_if_local(rw) -> Optional[tuple]:
    """``rw``'s layout's :func:`prefix_units`, where each node's decisions depend only on the
    units of its own values; None for layouts read as a whole, inputs placed by another pass
    other than as the layout's units place them where they are read (``rw.fixed_local``: an MoE
    layer's stacked expert parameters), and rewrites that note every read (sharded state,
    gradient buckets and regions)."""
    if ((rw.fixed and not rw.fixed_local) or rw.zero.storage or rw.grad_sync.bucket_uses
            or rw.grad_sync.region_axis is not None):
        return None
    return prefix_units(rw.layout)


def whole_inputs(rw, prefixes: dict) -> frozenset:
    """The tensor placeholders that ``rw``'s layout leaves whole on every axis (no unit of it is a
    prefix of their dims' leaves: :func:`input_prefixes`), where the rewrite records them whole
    without placing each (as :func:`untouched_prefix`: empty where that is 0 for the layout)."""
    units = units_if_local(rw)
    if units is None:
        return frozenset()
    hard = frozenset(units[0])
    return frozenset(n for n, pre in prefixes.items() if pre.isdisjoint(hard))


def reach(first: dict, unit: tuple, soft: bool) -> float:
    """Index of the first node at which ``unit`` of a layout can decide anything (``math.inf``:
    none). A hard unit of an axis that also has soft entries decides from the first node with a
    dim starting with the unit's leading atom: a soft entry splits only values that no hard
    unit's leading atom claims (``passes/soft.py``)."""
    return first.get(unit[:1] if soft else unit, math.inf)


def prefix_units(layout) -> Optional[tuple]:
    """``(hard units, soft units)`` of ``layout``'s axes in order, where the nodes before their
    reach (:func:`reach`) compute whole; None where the layout is read as a whole
    (context-parallel orders) or a unit is matched by scanning (not an atom prefix). Regional
    units (an MoE layer's experts dims: passes/experts.py) are among them; an experts unit
    reaches from its router's experts dim (:func:`first_reads`), whose split it decides."""
    if layout.orders:
        return None
    hard = tuple(u for units in layout.units.values() for u in units)
    soft = tuple(u for units in layout.soft.values() for u in units)
    if not all(isinstance(u, tuple) and u for u in hard + soft):
        return None
    return hard, soft


def untouched_prefix(rw, first: dict) -> int:
    """How many of ``rw``'s graph nodes come before the first one its layout may touch: the
    least reach of a unit of the layout (:func:`reach`), and no later than the first node that
    another pass lowers (unless its lowering decides locally: ``lowering.decides_locally``) or
    that has no sharding rule (its fallback is recorded). 0 for layouts
    read as a whole (:func:`prefix_units`; inputs placed by another pass) and rewrites that
    note every read (sharded state, gradient buckets and regions)."""
    units = units_if_local(rw)
    if units is None:
        return 0
    hard, soft = units
    stop = len(rw.g0.nodes)
    for u in hard:
        stop = min(stop, reach(first, u, bool(soft)))
    for u in soft:
        stop = min(stop, reach(first, u, False))
    for i, node in enumerate(rw.g0.nodes):
        if i >= stop:
            break
        if node.op == "call_function" and (
                (node in rw.regions and not is_local(rw.regions[node]))
                or (node not in rw.regions and node.target is not GETITEM and rw.info.indexing.get(node) is None)):
            return i
    return stop
