"""Expert parallelism: recognise Mixture-of-Experts layers and write their per-rank program.

An MoE layer routes every token to a few experts and sums their outputs, weighted by the
router. Its code cannot be sharded op by op: it sorts the tokens of the whole batch by expert,
counts rows per expert and indexes by those counts. Instead this pass recognises the layer as a
*region* with a known meaning and writes a per-rank program for it (the runtime pieces are in
``autoshard.runtime.primitives.experts``):

    this rank's tokens -> (token, expert) pairs grouped by expert -> [count exchange, dispatch
    all-to-all on the experts' axis] -> the experts' own code on the rows of this rank's experts
    -> [combine all-to-all] -> sum over each token's experts, weighted

The experts' own code (the *body*) is copied from the captured graph; everything around it is
the region's meaning, so the user's routing code (sort, histc, cumsum, inverse permutation) is
replaced, not sharded. Three shapes of MoE code are recognised:

- **grouped** (sparse dispatch, Hugging Face's Mixtral / Qwen2-MoE / OLMoE experts, whose default
  ``experts_implementation`` is ``"grouped_mm"``): a module
  ``forward(hidden [T, h], top_k_index [T, k], top_k_weights [T, k])`` holding experts stacked
  in ``[experts, ...]`` parameters, whose code gathers token rows (``hidden[...]``), runs them
  through grouped matmuls (``autoshard.runtime.grouped_mm``, ``transformers::grouped_mm_fallback``)
  and multiplies the result by the routing weights. Meaning: ``out[t] = sum_j w[t, j] *
  expert_{idx[t, j]}(hidden[t])``. The experts dim is the stacked parameters' leading dim.
  Per-expert biases (GPT-OSS) are selected per row by the sorted expert ids.
- **batched** (Hugging Face's ``experts_implementation="batched_mm"``): the same module
  signature, each token row repeated k times (``hidden.repeat_interleave(k, 0)``), each pair's
  expert weights selected (``w[top_k_index.reshape(-1)]``) and applied by ``bmm``, the rows
  weighted and summed over each token's k pairs. Same meaning as grouped; on each rank the body
  runs on the rows of its experts, selecting weights by the rows' local expert ids
  (``autoshard.runtime.primitives.experts.expert_ids``). The experts dim is the selected weights' leading dim
  (one logical dim for all of them: the same ids select from each).
- **looped** (dense experts): a ``ModuleList`` of identical expert modules, each applied to the
  same tokens ``x``, its output multiplied by a per-token weight ``w_e`` (zero for tokens that
  did not choose it) and summed: ``out = sum_e expert_e(x) * w_e``. Token t is routed to e where
  ``w_e[t] != 0`` (exact when a zero weight means "not chosen", as with top-k masks: a token's
  gradient to ``w_e`` is then masked anyway). The experts dim is the list index.

Layout: the experts dim is named ``experts`` (unless the user named it), so
``layout={"experts": "ep"}`` places experts in contiguous blocks on ``ep``; the region's tokens
are split over every axis that splits the batch, and over ``ep`` too (a local slice, gathered
back at the layer's output) when the batch is whole there. Only the region's own parameters are
split along the experts dim: the router's experts dim (found back from the top-k that routes
the region; the user may name it ``experts`` too) stays whole on ``ep``, where each rank scores
every expert for its own tokens (:func:`regional_layout`). Expert parameters are then
``Shard(experts)`` (stacked) or ``Owned(i)`` (one ``ModuleList`` entry, on the index that owns
it) on ``ep`` and replicated elsewhere, so their gradients are summed only over the replicas of
the same expert.

Example::

    >>> regions = find_expert_regions(captured.graph, info)      # doctest: +SKIP
    >>> [(r.module, r.form, r.num_experts) for r in regions]      # doctest: +SKIP
    [('layers.0.mlp.experts', 'grouped', 4), ...]
"""
from __future__ import annotations

import math
import operator
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import fx

from autoshard.ownership import Owned, R, Shard
from autoshard.runtime.primitives import experts as X

from .dims import DimInfo, module_of, source_line
from .lowering import decides_locally
from .rules import grouped_matmul_rule, rule_for
from .spmd import EXPERTS, LayoutError

aten = torch.ops.aten

TOPK_FORMS = ("grouped", "batched")  # forms whose experts module reads (hidden, top_k_index, top_k_weights)

# Ops a body may not contain: they write sizes, which differ per rank after dispatch.
SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
         aten.arange.default, aten.arange.start, aten.zeros.default, aten.ones.default, aten.full.default,
         aten.empty.memory_format, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
         aten.new_empty.default, aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class NotRecognised(Exception):
    """Internal: a candidate is not an MoE region of a known shape (the message says why)."""


class NotCandidate(NotRecognised):
    """Internal: not even shaped like an MoE layer (no warning)."""


class MoEWarning(UserWarning):
    """A module that looks like a Mixture-of-Experts layer could not be planned as one."""


@dataclass
class ExpertRegion:
    """One recognised MoE layer of the captured graph."""

    module: str  # the experts module (grouped) or the ModuleList (looped)
    form: str  # "grouped" | "batched" | "looped"
    nodes: frozenset  # nodes the region's program replaces
    output: fx.Node  # the node whose value the region computes ([T, h])
    hidden: fx.Node  # the token rows the experts read ([T, h])
    num_experts: int
    experts_atoms: tuple  # leaf atoms of the experts dim
    body: list  # nodes copied per rank (grouped: param preparation and the row program)
    body_out: fx.Node  # the body's result rows
    rows: Optional[fx.Node] = None  # grouped: the original gather of token rows (body input)
    offsets: Optional[fx.Node] = None  # grouped: the original per-expert row offsets
    expert_ids: Optional[fx.Node] = None  # the original per-row expert ids (selecting weights, biases)
    top_k_index: Optional[fx.Node] = None
    top_k_weights: Optional[fx.Node] = None
    params: list = field(default_factory=list)  # grouped: stacked expert parameters
    weights: list = field(default_factory=list)  # looped: per-expert weight nodes
    expert_params: list = field(default_factory=list)  # looped: per expert, its parameters in body order
    init: Optional[fx.Node] = None  # looped: the accumulator's start (zeros), if any
    capacity_factor: Optional[float] = None
    router_dims: tuple = ()  # leaf tuples of the router's experts dim (the dim its top-k chooses along)

    @property
    def every_param(self) -> list:
        """Every expert parameter of the region (stacked, or each looped expert's)."""
        return list(self.params) + [q for ps in self.expert_params for q in ps]

    @property
    def top_k(self) -> int:
        return int(self.top_k_index.meta["val"].shape[1]) if self.top_k_index is not None else 0


def find_expert_regions(graph: fx.Graph, info: DimInfo, capacity_factor: Optional[float] = None,
                        warn: bool = True) -> list:
    """The MoE regions of ``graph`` (kept in ``info.recognised``). Names each region's experts dim
    ``experts`` unless the user named it; a ``ModuleList`` gets a new logical dim of size E.
    ``capacity_factor``: the expert capacity policy of ``autoshard.runtime.primitives.experts`` (None:
    dropless). A module that looks like an MoE layer but cannot be recognised is reported with
    a :class:`MoEWarning` and left to the generic rules."""
    regions = info.recognised.get(EXPERTS)
    if regions is None:
        regions = []
        for finder in (_grouped_regions, _batched_regions, _looped_regions):
            for candidate, attempt in finder(graph, info):
                try:
                    regions.append(attempt())
                except NotCandidate:
                    continue
                except NotRecognised as e:
                    if warn:
                        warnings.warn(f"autoshard: {candidate} looks like a Mixture-of-Experts layer but is not planned "
                                      f"as one ({e}); it runs with the generic op rules", MoEWarning, stacklevel=3)
        for r in regions:
            lv = tuple(r.experts_atoms)
            info.names.setdefault(lv, EXPERTS)
            r.router_dims = _router_dims(info, r)
        info.recognised[EXPERTS] = regions
    if capacity_factor is not None:
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor!r}")
        for r in regions:
            r.capacity_factor = float(capacity_factor)
    return regions


def _paths(node: fx.Node) -> list:
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]


def _calls(graph):
    return [n for n in graph.nodes if n.op == "call_function"]


def _closure(starts, region: set, forward: bool = True, stop=()) -> set:
    """Nodes of ``region`` reachable from ``starts`` (users, or inputs when not ``forward``),
    not expanding past the nodes in ``stop``."""
    seen, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n in stop:
            continue
        for m in (n.users if forward else n.all_input_nodes):
            if m in region and m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _tensor(n) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _outputs(region: set) -> list:
    return [n for n in region if any(u not in region for u in n.users)]


# ---- grouped: stacked experts and grouped matmuls ------------------------------------------------

def _grouped_regions(graph, info):
    by_module = defaultdict(list)
    for n in _calls(graph):
        if rule_for(n.target) is grouped_matmul_rule:
            by_module[module_of(n)].append(n)
    for mod, gops in by_module.items():
        yield f"module '{mod}'", (lambda mod=mod, gops=gops: _grouped(graph, info, mod, gops))


def _interface(graph, mod):
    """(region nodes, parameters, token rows, top_k_index, top_k_weights, output) of an experts
    module ``forward(hidden [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]``."""
    region = {n for n in _calls(graph) if mod in _paths(n)}
    ext = {a for n in region for a in n.all_input_nodes if a not in region}
    params = {a for a in ext if a.op == "placeholder"}
    data = [a for a in ext - params if _tensor(a) is not None]
    idx = [a for a in data if not _tensor(a).is_floating_point() and _tensor(a).dim() == 2]
    if len(idx) != 1:
        raise NotRecognised(f"it reads {len(data)} tensors from outside; expected token rows [T, h], "
                            f"top_k_index [T, k] and top_k_weights [T, k]")
    idx = idx[0]
    T, k = _tensor(idx).shape
    wts = [a for a in data if a is not idx and _tensor(a).is_floating_point() and tuple(_tensor(a).shape) == (T, k)]
    hid = [a for a in data if a is not idx and a not in wts and _tensor(a).dim() == 2 and _tensor(a).shape[0] == T]
    if len(wts) != 1 or len(hid) != 1 or len(data) != 3:
        raise NotRecognised("its inputs are not (token rows [T, h], top_k_index [T, k], top_k_weights [T, k])")
    wts, hid = wts[0], hid[0]
    outs = _outputs(region)
    if len(outs) != 1 or _tensor(outs[0]) is None or tuple(_tensor(outs[0]).shape) != tuple(_tensor(hid).shape):
        raise NotRecognised("it does not return one [T, h] tensor")
    return region, params, hid, idx, wts, outs[0]


def _param_only(graph, region, params) -> set:
    """Nodes of ``region`` computed from expert parameters alone (their preparation)."""
    out = set()
    for n in _calls(graph):
        if n in region and n.all_input_nodes and all(a in params or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _body(graph, region, params, body_out, rows, index: tuple, gathers=()) -> list:
    """The experts' own computation: the nodes from the token ``rows`` to ``body_out``, in graph
    order, each row by row (dim 0: one row per (token, expert) pair) and writing no sizes, so
    that it runs on any number of rows; parameter preparation included. ``index``: what tells
    the rows' experts apart (the grouped form's offsets, the batched form's expert ids);
    ``gathers``: per-row selections of expert weights or biases (``w[expert_ids]``), which
    index but write no sizes."""
    anc = _closure([body_out], region, forward=False, stop={rows, *index}) | {body_out}
    param_only = _param_only(graph, region, params)
    from_rows = _closure([rows, *gathers], region) | set(gathers)
    S = _tensor(rows).shape[0]
    body = []
    for n in _calls(graph):
        if n not in anc or n is rows or n in index:
            continue
        if n in param_only:
            body.append(n)
            continue
        if n not in from_rows:
            raise NotRecognised(f"the experts' computation reads {n.name} ({n.target}), which is neither a token "
                                f"row, an expert parameter nor the per-expert offsets or ids")
        if n.target in SIZED and n not in gathers:
            raise NotRecognised(f"the experts' computation contains {n.target} ({n.name}), which writes sizes")
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else [vals]
        if any(isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != S) for v in vals):
            raise NotRecognised(f"{n.name} ({n.target}) in the experts' computation is not row by row")
        for a in n.all_input_nodes:
            if a not in anc and a is not rows and a not in index and a not in params:
                raise NotRecognised(f"{n.name} reads {a.name}, computed outside the experts")
        body.append(n)
    return body


def _meets_weights(region, wts, starts) -> fx.Node:
    """The one node where the experts' output rows (computed from ``starts``) meet the routing
    weights: the body's output."""
    weighted = _closure([wts], region)
    from_rows = _closure(list(starts), region) - weighted
    ends = [n for n in from_rows if any(u in weighted for u in n.users)]
    if len(ends) != 1:
        raise NotRecognised("its expert outputs do not meet the routing weights in one place")
    return ends[0]


def _grouped(graph, info, mod, gops) -> ExpertRegion:
    region, params, hid, idx, wts, out = _interface(graph, mod)
    gathers = [n for n in region if n.target == aten.index.Tensor and n.args[0] is hid]
    if len(gathers) != 1:
        raise NotRecognised("it does not gather token rows with one hidden[...] index")
    rows = gathers[0]
    offsets = {g.args[2] if len(g.args) > 2 else g.kwargs.get("offs") for g in gops}
    if len(offsets) != 1:
        raise NotRecognised("its grouped matmuls do not share one offsets tensor")
    offsets = offsets.pop()
    # Per-row selections (expert biases, ``b[expert_ids_sorted]``) by the sorted expert ids of
    # the sort whose permutation gathered the rows (``hidden[perm // k]``): each row's expert.
    src = rows.args[1][0] if len(rows.args[1]) == 1 else None
    ids = None
    if src is not None and src.target == aten.floor_divide.default and src.args[0].target is operator.getitem:
        ids = next((u for u in src.args[0].args[0].users if u.target is operator.getitem and u.args[1] == 0), None)
    gathers = [n for n in _calls(graph) if n in region and ids is not None and _selects(n, ids)]
    body_out = _meets_weights(region, wts, [rows, *gathers])
    body = _body(graph, region, params, body_out, rows, (offsets, ids), gathers)
    atoms = {info.leaves(info.of(g.args[1])[0]) for g in gops}
    if len(atoms) != 1:
        raise NotRecognised("its grouped matmuls do not share one experts dim")
    atoms = _unify_experts(info, mod, [gops[0].args[1], *(g.args[0] for g in gathers if g in body)],
                           [info.of(gops[0].args[1])[0]] + [info.of(g.args[0])[0] for g in gathers if g in body])
    E = math.prod(info.table.size[a] for a in atoms)
    used = sorted((p for p in params if any(p in b.all_input_nodes for b in body)), key=lambda p: p.name)
    return ExpertRegion(mod, "grouped", frozenset(region), out, hid, E, atoms, body, body_out, rows=rows,
                        offsets=offsets, expert_ids=ids if any(g in body for g in gathers) else None,
                        top_k_index=idx, top_k_weights=wts, params=used)


# ---- batched: stacked experts selected per row, batched matmuls ---------------------------------

VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints}
CASTS = {aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.clone.default, aten.contiguous.default}


def _weight_gather(n) -> bool:
    """``w[ids]`` on a stacked expert weight (``[experts, ...]``, rank 3 or more: a per-expert
    matrix) with one 1-d integer index: the batched form's selection of each row's expert."""
    if n.target != aten.index.Tensor or len(n.args) < 2 or len(n.args[1]) != 1:
        return False
    w, ids = _tensor(n.args[0]), _tensor(n.args[1][0])
    return w is not None and w.dim() >= 3 and ids is not None and ids.dim() == 1 and not ids.is_floating_point()


def _batched_regions(graph, info):
    by_module = defaultdict(list)
    for n in _calls(graph):
        if _weight_gather(n):
            by_module[module_of(n)].append(n)
    grouped = {module_of(n) for n in _calls(graph) if rule_for(n.target) is grouped_matmul_rule}
    for mod, gathers in by_module.items():
        if mod not in grouped and any(n.target == aten.bmm.default and module_of(n) == mod for n in _calls(graph)):
            yield f"module '{mod}'", (lambda mod=mod, gathers=gathers: _batched(graph, info, mod, gathers))


def _through(node, ops, to) -> fx.Node:
    """``node`` followed back through single-input ops of ``ops`` until ``to``."""
    while node is not to and node.op == "call_function" and node.target in ops and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _batched(graph, info, mod, gathers) -> ExpertRegion:
    """Hugging Face's ``experts_implementation="batched_mm"``: every token repeated k times
    (``hidden.repeat_interleave(k, 0)``, pair s = token s // k), each pair's expert weights
    selected (``w[top_k_index.reshape(-1)]``) and applied by ``bmm``; the rows weighted by
    ``top_k_weights.reshape(-1)`` and summed over each token's k pairs. Same meaning as the
    grouped form; its body runs on the rows of this rank's experts with their local expert ids."""
    region, params, hid, idx, wts, out = _interface(graph, mod)
    T, k = _tensor(idx).shape
    ids = {g.args[1][0] for g in gathers}
    if len(ids) != 1:
        raise NotRecognised("its expert weights are not all selected by one per-row expert id tensor")
    ids = ids.pop()
    if _through(ids, VIEWS | CASTS, idx) is not idx or tuple(_tensor(ids).shape) != (T * k,):
        raise NotRecognised("the ids selecting its expert weights are not top_k_index flattened (token-major)")
    rows = [n for n in region if n.target in VIEWS and tuple(_tensor(n).shape) == (T * k, _tensor(hid).shape[1])
            and _repeats(n.args[0], hid, T, k)]
    if len(rows) != 1:
        raise NotRecognised("it does not repeat each token row top_k times (hidden.repeat_interleave(top_k, 0))")
    rows = rows[0]
    gathers = [n for n in _calls(graph) if n in region and _selects(n, ids)]  # weights and biases
    param_only = _param_only(graph, region, params)
    for g in gathers:
        if g.args[0] not in params and g.args[0] not in param_only:
            raise NotRecognised(f"{g.name} selects rows of {g.args[0].name}, which is not an expert parameter")
    body_out = _meets_weights(region, wts, [rows, *gathers])
    _check_weighted_sum(region, body_out, wts, out, T, k)
    body = _body(graph, region, params, body_out, rows, (ids,), gathers)
    # The selected tensors' experts dims are one logical dim: the same ids select from each.
    atoms = _unify_experts(info, mod, [g.args[0] for g in gathers], [info.of(g.args[0])[0] for g in gathers])
    E = math.prod(info.table.size[a] for a in atoms)
    used = sorted((p for p in params if any(p in b.all_input_nodes for b in body)), key=lambda p: p.name)
    return ExpertRegion(mod, "batched", frozenset(region), out, hid, E, atoms, body, body_out, rows=rows,
                        expert_ids=ids, top_k_index=idx, top_k_weights=wts, params=used)


def _selects(n, ids) -> bool:
    """``n`` is ``t[ids]``: rows of a per-expert tensor selected by per-row expert ids."""
    return n.target == aten.index.Tensor and len(n.args[1]) == 1 and n.args[1][0] is ids


def _unify_experts(info, mod, tensors, dims) -> tuple:
    """Make the experts dims ``dims`` of ``tensors`` (stacked per-expert weights and biases of one
    MoE layer) one logical dim; its leaf atoms."""
    sizes = {_tensor(t).shape[0] for t in tensors}
    if len(sizes) != 1:
        raise NotRecognised(f"its per-expert tensors do not have one number of experts ({sorted(sizes)})")
    for t, d in zip(tensors[1:], dims[1:]):
        for a, b in info.unify(dims[0], d):
            raise LayoutError(f"the experts dims of {tensors[0].name} and {t.name} in '{mod}' are named {a!r} and "
                              f"{b!r}, but they are one dim (each row's expert selects from both): use one name")
    return info.leaves(dims[0])


def _repeats(node, hid, T, k) -> bool:
    """``node`` is ``hid.unsqueeze(1).expand(T, k, h)`` (repeat_interleave as captured)."""
    if node.target != aten.expand.default or tuple(_tensor(node).shape) != (T, k, _tensor(hid).shape[1]):
        return False
    u = node.args[0]
    return u.target == aten.unsqueeze.default and u.args[0] is hid and u.args[1] == 1


def _check_weighted_sum(region, body_out, wts, out, T, k) -> None:
    """The region's output is ``sum_j rows[t*k + j] * w[t, j]``: the body's rows times the
    flattened weights, viewed [T, k, ...] and summed over k (casts allowed)."""
    users = list(body_out.users)
    if len(users) != 1 or users[0].target != aten.mul.Tensor:
        raise NotRecognised("its expert output rows are not multiplied by the routing weights")
    mul = users[0]
    w = mul.args[1] if mul.args[0] is body_out else mul.args[0]
    if not isinstance(w, fx.Node) or _through(w, VIEWS | CASTS | {aten.unsqueeze.default}, wts) is not wts:
        raise NotRecognised("its expert output rows are not multiplied by the flattened routing weights")
    n, summed = mul, 0
    while n is not out:
        users = [u for u in n.users if u in region]
        if len(users) != 1:
            raise NotRecognised("its weighted rows are not summed over each token's choices")
        n = users[0]
        if n.target in VIEWS and not summed:
            if tuple(_tensor(n).shape[:2]) != (T, k):
                raise NotRecognised("its weighted rows are not viewed as [tokens, top_k, ...] before the sum")
        elif n.target == aten.sum.dim_IntList and not summed:
            if list(n.args[1]) not in ([1], [1 - _tensor(n.args[0]).dim()]) or (len(n.args) > 2 and n.args[2]) \
                    or tuple(_tensor(n.args[0]).shape[:2]) != (T, k):
                raise NotRecognised("its weighted rows are not summed over each token's choices")
            summed += 1
        elif n.target not in CASTS:
            raise NotRecognised(f"{n.name} ({n.target}) comes between the weighted rows and the output")
    if not summed:
        raise NotRecognised("its weighted rows are not summed over each token's choices")


# ---- looped: a ModuleList of expert modules ------------------------------------------------------

def _looped_regions(graph, info):
    kids = defaultdict(lambda: defaultdict(list))
    for n in _calls(graph):
        for path in _paths(n):
            m = re.fullmatch(r"(.+)\.(\d+)", path)
            if m:
                kids[m.group(1)][int(m.group(2))].append(n)
    for parent, members in kids.items():
        if len(members) >= 2 and sorted(members) == list(range(len(members))):
            yield f"ModuleList '{parent}'", (lambda parent=parent, members=members: _looped(graph, info, parent, members))


def _looped(graph, info, parent, members) -> ExpertRegion:
    E = len(members)
    experts, xs, ys, params = [], set(), [], []
    for e in range(E):
        nodes = members[e]
        own = set(nodes)
        ext = [a for n in nodes for a in n.all_input_nodes if a not in own]
        ps = list(dict.fromkeys(a for a in ext if a.op == "placeholder"))
        xs.update(a for a in ext if a.op != "placeholder")
        experts.append(nodes)
        ys.append(_outputs(own))
        params.append(ps)
    # first whether it is a candidate at all: a stack of blocks (each reading the one before)
    # is an ordinary ModuleList, not a set of experts, and is passed over without a warning
    if len(xs) != 1:
        raise NotCandidate("its members do not all read the same one input")
    for e, outs in enumerate(ys):
        if len(outs) != 1:
            raise NotRecognised(f"expert {e} has {len(outs)} outputs")
    ys = [outs[0] for outs in ys]
    x = xs.pop()
    xv = _tensor(x)
    if xv is None or xv.dim() != 2:
        raise NotRecognised("its experts' input is not token rows [T, h]")
    T = xv.shape[0]
    shape0 = [(n.target, tuple(_tensor(n).shape) if _tensor(n) is not None else None) for n in experts[0]]
    for e in range(1, E):
        if [(n.target, tuple(_tensor(n).shape) if _tensor(n) is not None else None) for n in experts[e]] != shape0 or \
                [tuple(_tensor(p).shape) for p in params[e]] != [tuple(_tensor(p).shape) for p in params[0]]:
            raise NotRecognised(f"expert {e} is not computed like expert 0")
    weights, muls = [], []
    for e, y in enumerate(ys):
        m, w = _only_user(y, aten.mul.Tensor, f"expert {e}'s output is not multiplied by one weight")
        wv = _tensor(w)
        if wv is None or wv.shape[0] != T or wv.numel() != T:
            raise NotRecognised(f"expert {e}'s output is not weighted per token")
        weights.append(w)
        muls.append(m)
    # the products are summed in expert order: acc = init + m_0 + m_1 + ...
    adds, acc, init = [], None, None
    for e, m in enumerate(muls):
        a, other = _only_user(m, aten.add.Tensor, f"expert {e}'s weighted output is not summed with the others")
        if e == 0:
            init = other
        elif other is not acc and not (e == 1 and a is acc):
            raise NotRecognised("the weighted outputs are not summed one expert after the other")
        if not (e == 1 and a is acc):
            adds.append(a)
        acc = a
    nodes = {n for ex in experts for n in ex} | set(muls) | set(adds)
    if init is muls[1] if len(muls) > 1 else False:
        init = None  # acc = m_0 + m_1 + ...
    elif init is not None and init.target in (aten.zeros_like.default,) and len(init.users) == 1:
        nodes.add(init)
    elif init is not None and init.op != "placeholder":
        raise NotRecognised("the sum of the weighted outputs does not start from zeros")
    out = acc
    atom = info.table.new(E, f"{parent}:{EXPERTS}")
    return ExpertRegion(parent, "looped", frozenset(nodes), out, x, E, (atom,), list(experts[0]), ys[0],
                        weights=weights, expert_params=params, init=init)


def _only_user(node, target, why):
    """(the one user of ``node``, which must call ``target`` on two operands; its other operand)."""
    users = list(node.users)
    if len(users) != 1 or users[0].target != target:
        raise NotRecognised(why)
    u = users[0]
    return u, (u.args[1] if u.args[0] is node else u.args[0])


# ---- the router ---------------------------------------------------------------------------------

def _router_dims(info, r: ExpertRegion) -> tuple:
    """Leaf tuples of the router's experts dim: the dim of size E along which the top-k that
    routes ``r`` chooses (found back from the region's routing inputs, within its MoE layer)."""
    layer = r.module.rsplit(".", 1)[0]
    inside = lambda n: any(p == layer or p.startswith(layer + ".") for p in _paths(n))  # noqa: E731
    todo = [r.top_k_index] if r.top_k_index is not None else list(r.weights)
    seen, out = set(), []
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or not inside(n):
            continue
        seen.add(n)
        if n.target == aten.topk.default:
            src = _tensor(n.args[0])
            d = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)) % src.dim()
            lv = info.leaves(info.of(n.args[0])[d])
            if src.shape[d] == r.num_experts and lv and lv not in out:
                out.append(lv)
            continue
        todo.extend(n.all_input_nodes)
    return tuple(out)


# ---- placements ---------------------------------------------------------------------------------

def experts_axis(region: ExpertRegion, layout, mesh) -> Optional[str]:
    """The mesh axis that places ``region``'s experts (None: every rank has every expert)."""
    axes = [a for a in mesh.names if any(region.experts_atoms[:len(u)] == u for u in layout.units[a])]
    if len(axes) > 1:
        raise LayoutError(f"the experts of '{region.module}' are split on mesh axes {axes}; place them on one axis")
    return axes[0] if axes else None


def owned_placements(regions, places: dict, layout, mesh) -> dict:
    """{placeholder name: placement} of every looped expert's parameters: ``Owned(i)`` on the
    experts' axis (i: the index holding that expert), the layout's placement elsewhere."""
    out = {}
    for r in regions:
        ep = experts_axis(r, layout, mesh) if r.form == "looped" else None
        if ep is None:
            continue
        per = r.num_experts // mesh.axes[ep]
        for e, ps in enumerate(r.expert_params):
            for p in ps:
                out[p.name] = tuple(Owned(e // per) if a == ep else o for o, a in zip(places[p.name], mesh.names))
    return out


def stacked_placements(regions, places: dict) -> dict:
    """{placeholder name: placement} of every stacked expert parameter (grouped and batched
    forms): the layout's placement (its experts dim split on the experts' axis), fixed before
    :func:`regional_layout` keeps the experts dim whole everywhere else."""
    return {p.name: places[p.name] for r in regions if r.form in TOPK_FORMS for p in r.params}


def regional_layout(regions, layout, mesh):
    """``layout`` with the units of the experts dims on their axes marked regional
    (``Layout.regional``): only the MoE regions' own parameters are split along them (their
    placements fixed by :func:`stacked_placements` / :func:`owned_placements`). Everything
    else that carries an experts dim, the router's scores above all (named ``experts`` too when
    the router's weight is, ``"*.mlp.gate.weight": "experts hidden"``), keeps it whole on that
    axis: each rank scores every expert for its own tokens, which may be split on the same axis.
    """
    regional = {}
    for r in regions:
        ep = experts_axis(r, layout, mesh)
        if ep is None:
            continue
        for lv in (tuple(r.experts_atoms), *r.router_dims):
            regional.setdefault(ep, set()).update(u for u in layout.units[ep] if lv[:len(u)] == u)
    if not regional:
        return layout
    return replace(layout, regional={a: frozenset(u) for a, u in regional.items()})


def region_nodes(regions) -> dict:
    """{node: region} for every node a region replaces."""
    return {n: r for r in regions for n in r.nodes}


# ---- the per-rank program of a region -----------------------------------------------------------

@dataclass
class RegionPlan:
    """How a region runs on the mesh (for the plan, the cost model and tests)."""

    region: ExpertRegion
    experts_axis: Optional[str]  # None: every rank computes every expert (replicated experts)
    token_axes: tuple  # mesh axes splitting the region's tokens, in mesh order
    tokens: int  # tokens per rank
    pairs: int  # expected (token, expert) pairs per rank: tokens x choices per token
    local_experts: int
    row_bytes: int  # bytes of one token row
    tags: dict = field(default_factory=dict)  # "route" | "dispatch" | "combine" | "capacity" -> tag
    # ("tokens": the tags of the gathers of the layer's output where only the layer split its tokens)


def lowerings(regions, plans: list) -> dict:
    """{node: visitor} for the rewriter (``spmd.rewrite(regions=...)``): the nodes of each
    region are replaced by its per-rank program, written when the rewriter reaches the region's
    output; ``plans`` receives each region's :class:`RegionPlan`."""
    out = {}
    for r in regions:
        @decides_locally  # (the experts' axis from their units, which reach the router before the region)
        def visit(lw, node, r=r):
            if node is r.output:
                plans.append(_lower(lw, r))
        out.update({n: visit for n in r.nodes})
    return out


def _pairs_per_token(r: ExpertRegion) -> int:
    if r.form in TOPK_FORMS:
        return r.top_k
    for n in _closure([r.weights[0]], {m for m in r.weights[0].graph.nodes}, forward=False):
        if n.target == aten.topk.default:
            return int(n.args[1])
    return 1


def _lower(lw, r: ExpertRegion) -> RegionPlan:
    """Write region ``r``'s per-rank program (``lw``: the rewrite's :class:`~.lowering.Lowering`)."""
    mesh, axes = lw.mesh, lw.axes
    ep = experts_axis(r, lw.layout, mesh)
    hidden_place = lw.placement(r.hidden)
    token_axes = [a for a, o in zip(axes, hidden_place) if isinstance(o, Shard) and o.dim == 0]
    if ep is not None and ep not in token_axes:
        token_axes.append(ep)  # the batch is whole on ep: each index takes a slice of the tokens
    token_axes = tuple(sorted(token_axes, key=axes.index))
    T, h = _tensor(r.hidden).shape
    degree = math.prod(mesh.axes[a] for a in token_axes)
    if T % degree:
        raise LayoutError(f"MoE layer '{r.module}' has {T} tokens, which mesh axes {list(token_axes)} (together "
                          f"{degree} ranks) cannot split evenly")
    tok = tuple(Shard(0) if a in token_axes else R for a in axes)
    El = r.num_experts // (mesh.axes[ep] if ep else 1)
    Tl = T // degree
    plan = RegionPlan(r, ep, token_axes, Tl, Tl * _pairs_per_token(r), El,
                      h * _tensor(r.hidden).element_size())
    why_tokens = (f"MoE layer '{r.module}' routes each rank's own tokens"
                  + (f" (split on {', '.join(token_axes)})" if token_axes else ""))
    stack = r.output.meta.get("nn_module_stack")
    trace = r.output.meta.get("stack_trace")

    def call(fn, *args, val=None, tag=None, **kwargs):
        n = lw.call(fn, args, kwargs)
        n.meta.update(val=val, nn_module_stack=stack, stack_trace=trace)
        if tag is not None:  # its collectives are recorded under this tag (_records): the cost model's
            n.meta["autoshard"] = {"where": r.module, "tag": tag, "moe": True}
        return n

    def new_tag(name):
        plan.tags[name] = lw.new_tags(1)
        return plan.tags[name]

    def meta(shape, like):
        return torch.empty(shape, dtype=like.dtype, device="meta")

    for p in r.every_param:
        _check_whole_experts(lw, r, p, lw.fixed(p.name) or lw.desired(p), ep)
    x = lw.convert(r.hidden, tok, (), r.output, why_tokens)
    cap = r.capacity_factor
    t_cap = new_tag("capacity") if cap is not None and token_axes else None
    if r.form in TOPK_FORMS:
        idx = lw.convert(r.top_k_index, tok, (), r.output, why_tokens)
        weights = lw.convert(r.top_k_weights, tok, (), r.output, why_tokens)
        pairs = call(X.assign_topk, idx, r.num_experts, cap, token_axes, t_cap, tag=t_cap)
    else:
        weights = [lw.convert(w, tuple(Shard(0) if a in token_axes else R for a in axes), (), r.output, why_tokens)
                   for w in r.weights]
        pairs = call(X.assign_dense, weights, cap, token_axes, t_cap, tag=t_cap)
    hv = _tensor(r.hidden)
    rows = call(X.pair_rows, x, pairs, val=meta((plan.pairs, h), hv))
    t_route = new_tag("route")
    route = call(X.exchange_counts, pairs, ep, t_route, tag=t_route)
    t_dispatch = new_tag("dispatch")
    mine = call(X.dispatch_rows, rows, route, t_dispatch, val=meta((plan.pairs, h), hv), tag=t_dispatch)
    if r.form in TOPK_FORMS:
        env = {r.rows: mine}
        if r.offsets is not None:
            env[r.offsets] = call(X.expert_offsets, route, _tensor(r.offsets).dtype, val=meta((El,), _tensor(r.offsets)))
        if r.expert_ids is not None:
            env[r.expert_ids] = call(X.expert_ids, route, _tensor(r.expert_ids).dtype,
                                     val=meta((plan.pairs,), _tensor(r.expert_ids)))
        for p in r.params:
            target = lw.fixed(p.name) or lw.desired(p)
            varying = {a for a, o in zip(axes, target) if a in token_axes and not isinstance(o, Shard)}
            env[p] = lw.convert(p, target, varying, r.output, why_tokens)
        out_rows = _copy_body(lw, r, r.body, env, plan.pairs, El)
    else:
        segments = call(X.expert_segments, mine, route)
        per_slot = []
        for j in range(El):
            env = {r.hidden: call(operator.getitem, segments, j, val=meta((max(plan.pairs // El, 0), h), hv))}
            for k, p0 in enumerate(r.expert_params[0]):
                group = [r.expert_params[e][k] for e in range(r.num_experts)]
                env[p0] = _slot_param(lw, r, group, ep, j, token_axes, call, why_tokens)
            per_slot.append(_copy_body(lw, r, r.body, env, plan.pairs // El, El))
        out_rows = call(aten.cat.default, per_slot, 0, val=meta((plan.pairs,) + tuple(_tensor(r.body_out).shape[1:]),
                                                               _tensor(r.body_out)))
    t_combine = new_tag("combine")
    back = call(X.combine_rows, out_rows, route, t_combine, val=meta((plan.pairs, h), hv), tag=t_combine)
    out_val = meta((Tl,) + tuple(_tensor(r.output).shape[1:]), _tensor(r.output))
    if r.form in TOPK_FORMS:
        out = call(X.combine_topk, back, pairs, weights, val=out_val)
        if _tensor(r.body_out).dtype != out_val.dtype:  # the module casts its sum (HF: to the input's dtype)
            out = call(aten._to_copy.default, out, dtype=out_val.dtype, val=out_val)
    else:
        if r.init is None:
            init = call(aten.zeros_like.default, x, val=out_val)
        elif r.init in r.nodes:
            init = call(r.init.target, x, *r.init.args[1:], val=out_val, **r.init.kwargs)
        else:
            init = lw.convert(r.init, tok, (), r.output, why_tokens)
        out = call(X.combine_dense, back, pairs, weights, init, val=out_val)
    lw.bind(r.output, out, tok)
    sliced = [a for a, o in zip(axes, hidden_place) if a in token_axes and not (isinstance(o, Shard) and o.dim == 0)]
    if sliced:
        # The batch is whole on these axes (ep on its own axis): each index computed a slice of
        # the tokens, and the layer returns them as it got them. The gather is the plan's own,
        # like the dispatch (``plan.unsharded`` does not list it; strict accepts it).
        first = lw.next_tag
        whole = tuple(R if a in sliced else o for o, a in zip(tok, axes))
        gathered = lw.convert(
            r.output, whole, (), r.output,
            f"MoE layer '{r.module}' computed a slice of its tokens on each index of {', '.join(sliced)}, where "
            f"the batch is whole; it returns them whole")
        lw.bind(r.output, gathered, whole)
        plan.tags["tokens"] = tuple(range(first, lw.next_tag))
    _records(lw, plan)
    return plan


def _slot_param(lw, r, group, ep, slot, token_axes, call, why):
    """The parameter of this rank's ``slot``-th expert (one per expert in ``group``)."""
    p = group[slot]
    if ep is None:
        target = lw.desired(p)
        varying = {a for a in token_axes}
        return lw.convert(p, target, varying, r.output, why)
    q = call(X.owned, tuple(lw.local(g) for g in group), ep, slot, val=lw.local(p).meta.get("val"))
    for a in token_axes:
        if a == ep:
            continue
        why_q = (f"this rank's expert {slot} of '{r.module}' (like {lw.display(p.name)}) feeds per-rank "
                 f"work on {a}: backward sums its gradient over the replicas of that expert")
        q = lw.mark_varying(q, a, p, r.output, why_q)
    return q


def _check_whole_experts(lw, r, p, place: tuple, ep) -> None:
    """Refuse a layout that splits a dim of expert parameter ``p`` other than its experts dim
    (``place``: where it is used): the body is copied as the model wrote it and runs each expert whole, so
    a weight split along its hidden or ffn dim would be computed with as if it were whole (a
    part of each sum, never summed)."""
    for a, o in zip(lw.axes, place):
        if isinstance(o, Shard) and a != ep:
            raise LayoutError(
                f"mesh axis {a!r} splits dim {lw.dim_label(p, 0, o.dim)!r} of expert parameter {lw.display(p.name)} of "
                f"MoE layer '{r.module}': autoshard runs each expert's own code whole on the rank that holds it "
                f"(tensor parallelism inside the experts is not supported); split the experts (the 'experts' dim) "
                f"on an axis, and leave the experts' other dims whole")


def _copy_body(lw, r, body, env, rows: int, local_experts: int):
    """Copy ``body`` into the per-rank graph reading ``env``; returns the copy of the body's output.
    Meta values get this rank's shapes: ``rows`` token rows, ``local_experts`` experts."""
    row_nodes = set()
    for n in body:
        new = lw.copy_node(n, lambda a: env[a])
        is_row = r.form == "looped" or any(a is r.rows or a is r.expert_ids or a in row_nodes
                                           for a in n.all_input_nodes)
        if is_row:
            row_nodes.add(n)
        new.meta = dict(n.meta)
        new.meta["val"] = _local_val(lw.info, r, n, rows if is_row else None, local_experts)
        env[n] = new
    return env[r.body_out]


def _local_val(info, r, n, rows, local_experts):
    """Meta value of a copied body node on one rank: ``rows`` token rows in dim 0 (row nodes),
    the experts dim cut to ``local_experts`` (parameter-side nodes)."""
    def one(v, k):
        if not isinstance(v, torch.Tensor):
            return v
        shape = list(v.shape)
        if rows is not None and shape:
            shape[0] = rows
        elif n in info.dims and k < len(info.dims[n]):
            for d, atoms in enumerate(info.dims[n][k]):
                if atoms and info.leaves(atoms)[:len(r.experts_atoms)] == r.experts_atoms:
                    shape[d] = shape[d] * local_experts // r.num_experts
        return torch.empty(shape, dtype=v.dtype, device="meta")
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        return type(val)(one(v, k) for k, v in enumerate(val))
    return one(val, 0)


def _records(lw, plan: RegionPlan) -> None:
    """The region's collectives, with the bytes of a balanced routing (``pairs`` rows per rank)."""
    r, ep = plan.region, plan.experts_axis
    where, line, node = r.module, source_line(r.output), r.output
    count_bytes = r.num_experts * 8
    if plan.tags.get("capacity") is not None:
        for a in plan.token_axes:
            lw.record("all_gather", a, nbytes=count_bytes, phase="forward", node=node, where=where, line=line,
                      tag=plan.tags["capacity"], op="assign",
                      why=f"capacity of MoE layer '{r.module}': rows per expert of the ranks holding earlier tokens, "
                          f"so every rank drops the same pairs as one device would")
    if ep is None:
        return
    n = lw.mesh.axes[ep]
    rows = plan.pairs * plan.row_bytes
    per_expert = plan.pairs * n / r.num_experts
    lw.record("all_to_all", ep, nbytes=count_bytes, phase="forward", node=node, where=where, line=line,
              tag=plan.tags["route"], op="exchange_counts",
              why=f"count exchange of MoE layer '{r.module}': rows each rank sends to each expert on {ep}, so every "
                  f"rank knows how many rows it receives")
    dispatch = (f"dispatch of MoE layer '{r.module}': token rows to the ranks of their experts on {ep} "
                f"({plan.local_experts} experts per rank; balanced routing: {per_expert:g} rows per expert)")
    combine = f"combine of MoE layer '{r.module}': expert outputs back to the ranks of their tokens on {ep}"
    for phase, prefix in (("forward", ""), ("backward", "adjoint: ")):
        lw.record("all_to_all", ep, nbytes=rows, phase=phase, node=node, where=where, line=line,
                  tag=plan.tags["dispatch"], op="dispatch_rows", why=prefix + dispatch)
        lw.record("all_to_all", ep, nbytes=rows, phase=phase, node=node, where=where, line=line,
                  tag=plan.tags["combine"], op="combine_rows", why=prefix + combine)
