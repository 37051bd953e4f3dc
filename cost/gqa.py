"""Grouped-query attention on an axis with more ranks than kv heads: which variant won, and why.

With 2 kv heads on tp=4 the query heads ``[kv_heads, rep]`` still split 4 ways but the kv heads
do not, so attention can be tensor-parallel in two ways besides staying whole:

- *kv replicated* (``heads`` on the axis, ``kv_heads`` whole): k/v projections run whole on every
  rank and each rank slices the kv head its query heads read (the unit ``[kv_heads, rep]``); no
  forward collective inside attention, the k/v projections' compute is not split, and their input
  gradient is summed over the axis in backward;
- *kv split* (``kv_heads`` on the axis too): the k/v projections are split inside a kv head
  (the unit ``[kv_heads, head_dim part]``) and gathered before attention;
- *attention whole*: neither name on the axis.

All three are candidates of the search (``cost/search.py``: a name whose units the axis divides
goes on it or not); each is priced as every candidate is, by the rewrite and the cost model.
:func:`gqa_explanation` prices the plan's layout in the three variants (the rest of the layout
as it is) and says which won by how much, in compute saved against communication paid. Example::

    >>> plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, hardware="h100")  # doctest: +SKIP
    >>> gqa_explanation(plan)                                                                       # doctest: +SKIP
    ['Attention with 2 kv heads on tp (4 ranks): kv replicated (...) won, ...']
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.passes.spmd import LayoutError

from .plan_cost import layout_cost

__all__ = ["GQAGroup", "gqa_groups", "gqa_variants", "gqa_explanation"]

VARIANTS = ("kv replicated", "kv split", "attention whole")
WHAT = {
    "kv replicated": "query heads split, k/v projections whole on every rank, each slicing its kv head",
    "kv split": "query heads split, k/v projections split inside a kv head and gathered before attention",
    "attention whole": "attention not split on this axis",
}


@dataclass(frozen=True)
class GQAGroup:
    """Names of one attention's query heads and kv heads (they share the leading kv-heads atom)
    on a mesh axis of ``ranks`` that does not divide ``kv_heads``."""

    axis: str
    ranks: int
    kv_heads: int
    query: tuple  # names whose dims are [kv_heads, rep, ...] (q_proj out, o_proj in)
    kv: tuple  # names whose dims are [kv_heads, head_dim, ...] (k_proj / v_proj out)


def gqa_groups(info, mesh) -> list:
    """Per mesh axis (size > 1), the GQA groups whose query heads the axis divides and whose kv
    heads it does not. Query names are the longest leaf lists among the names starting with one
    atom (``[kv, rep, head_dim]`` against ``[kv, head_dim]``). Example::

        >>> gqa_groups(plan.info, plan.mesh)  # doctest: +SKIP
        [GQAGroup(axis='tp', ranks=4, kv_heads=2, query=('heads',), kv=('kv_heads',))]
    """
    size = info.table.size
    user = set(info.names.values())
    by_first: dict = {}
    for name, lvs in info.all_names().items():
        lvs = [lv for lv in lvs if lv]
        firsts = frozenset(lv[0] for lv in lvs)  # one kv-heads atom per block
        if not firsts or name not in user or len({size[a] for a in firsts}) != 1:
            continue
        lengths = {len(lv) for lv in lvs}
        if len(lengths) != 1:
            continue
        prods = {math.prod(size[a] for a in lv) for lv in lvs}
        by_first.setdefault(firsts, []).append((name, lengths.pop(), prods.pop()))
    out = []
    for axis in mesh.names:
        r = mesh.axes[axis]
        if r == 1:
            continue
        for atom, names in by_first.items():
            longest = max(n for _, n, _ in names)
            query = tuple(sorted(n for n, ln, p in names if ln == longest and p % r == 0))
            kv = tuple(sorted(n for n, ln, _ in names if ln < longest))
            heads = size[next(iter(atom))]
            if query and kv and heads % r:
                out.append(GQAGroup(axis, r, heads, query, kv))
    return out


def _variant_layout(layout: dict, group: GQAGroup, variant: str) -> dict:
    def with_axis(name, on):
        axes = tuple(a for a in (layout.get(name) or ()) if a != group.axis)
        return axes + (group.axis,) if on else axes

    q_on = variant != "attention whole"
    kv_on = variant == "kv split"
    out = dict(layout)
    out.update({n: with_axis(n, q_on) or None for n in group.query})
    out.update({n: with_axis(n, kv_on) or None for n in group.kv})
    return out


def variant_of(layout: dict, group: GQAGroup) -> str:
    """Which of :data:`VARIANTS` ``layout`` is for ``group``."""
    q = any(group.axis in (layout.get(n) or ()) for n in group.query)
    kv = any(group.axis in (layout.get(n) or ()) for n in group.kv)
    return "attention whole" if not q else "kv split" if kv else "kv replicated"


def gqa_variants(plan, group: GQAGroup) -> dict:
    """{variant: PlanCost} of ``plan``'s layout in each GQA variant on ``group.axis`` (the rest
    of the layout, the ZeRO stage and options as the plan's), rewritten and costed; a variant
    the rewrite refuses is left out. Example::

        >>> costs = gqa_variants(plan, gqa_groups(plan.info, plan.mesh)[0])  # doctest: +SKIP
        >>> min(costs, key=lambda v: costs[v].step_time)                     # doctest: +SKIP
        'kv replicated'
    """
    out = {}
    for v in VARIANTS:
        try:
            out[v] = layout_cost(plan, _variant_layout(dict(plan.layout), group, v), plan.zero_stage)
        except LayoutError:
            continue
    return out


def gqa_explanation(plan, fixed=()) -> list:
    """explain()'s sentences on grouped-query attention: for every GQA group on an axis that
    splits some parameter (a tensor-parallel axis), the three variants' predicted step times and
    why the plan's variant beats the next one (compute saved against communication paid).
    Groups with a name in ``fixed`` (the search's constraints: the user chose) are left out."""
    layout = dict(plan.layout)
    used = {a for axes in layout.values() for a in (axes or ()) if not a.endswith("?")}
    params = _param_names(plan)
    lines = []
    ms = lambda s: f"{s * 1e3:.3f} ms"
    for g in gqa_groups(plan.info, plan.mesh):
        if g.axis not in used or not any(g.axis in (layout.get(n) or ()) for n in params):
            continue
        if any(n in fixed for n in g.query + g.kv):
            continue
        costs = gqa_variants(plan, g)
        chosen = variant_of(layout, g)
        if chosen not in costs or len(costs) < 2:
            continue
        c = costs[chosen]
        rest = sorted((v for v in costs if v != chosen), key=lambda v: costs[v].step_time)
        nxt = rest[0]
        o = costs[nxt]
        comm = lambda k: sum(t for (axis, _), t in k.exposed.items())
        dc, dm = o.compute - c.compute, comm(o) - comm(c)
        why = []
        if abs(dc) > 1e-12:
            why.append(f"{ms(abs(dc))} {'less' if dc > 0 else 'more'} compute per rank")
        if abs(dm) > 1e-12:
            why.append(f"{ms(abs(dm))} {'less' if dm > 0 else 'more'} exposed communication")
        others = ", ".join(f"{v} {ms(costs[v].step_time)}" for v in rest)
        lines.append(
            f"Attention with {g.kv_heads} kv heads on {g.axis} ({g.ranks} ranks): {chosen} "
            f"({WHAT[chosen]}) predicted {ms(c.step_time)}, against {others} (each the plan's layout with only "
            f"{'/'.join(g.query + g.kv)} changed on {g.axis}). Against {nxt}: "
            + (" and ".join(why) if why else "the same compute and communication") + ".")
    return lines


def _param_names(plan) -> set:
    """Names carried by a trainable parameter's dims (what makes an axis tensor-parallel)."""
    info = plan.info
    params = {i.name for i in plan.captured.inputs if i.kind == "parameter"}
    out = set()
    for node in plan.captured.graph.nodes:
        if node.op == "placeholder" and node.name in params and node in info.dims:
            for d in info.of(node):
                n = info.names.get(info.leaves(d)) if d else None
                if n:
                    out.add(n)
    return out
