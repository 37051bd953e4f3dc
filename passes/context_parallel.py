"""Context parallelism: attention whose query sequence is split on a mesh axis.

When a layout puts the sequence dim of an attention's queries on a mesh axis
(``layout={"seq": "cp"}``), ``F.scaled_dot_product_attention`` cannot run on the local block:
every query needs every (visible) key. This pass rewrites each such SDPA node into
``autoshard.runtime.primitives.ring_attention.ring_attention`` (K/V blocks circulate, online softmax) or
``allgather_attention`` (K/V gathered once), chosen per node by a cost function the caller
passes (``autoshard.cost.context_parallel.choose_variant``), or fixed by ``context={"variant": ...}``.

The sequence order is a property of the axis (every value split along the sequence on it
shares it): ``zigzag`` (rank i holds chunks i and 2R-1-i; the default when any attention on the
axis is causal or masked, since it balances causal work) or ``contiguous``
(``context={"order": "contiguous"}``). Under zigzag the rewrite reorders a whole sequence before
splitting it and after gathering it (``Layout.orders``), user inputs that carry the sequence are
taken whole on that axis and split in the program, and outputs are gathered in natural order.
Positions never move: RoPE tables and masks are indexed by global positions.

Other axes compose as for any op: heads on tp, batch on dp, ZeRO storage. With GQA written as
``repeat_kv`` (expand + reshape of K/V), the kv heads before the repeat are what travels.

Example::

    >>> plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "cp": 2}), dims=dims,
    ...                            layout={"batch": "dp", "seq": "cp"}, train=True)   # doctest: +SKIP
    >>> plan.program.context.attention[0].variant                                        # doctest: +SKIP
    'ring'
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import fx

from autoshard.ownership import R, Shard
from autoshard.runtime.primitives.ring_attention import ORDERS, allgather_attention, ring_attention

from autoshard.passes.dims import DimInfo, module_of, source_line
from autoshard.passes.rules import arg, is_tensor_node, shape_of
from autoshard.passes.spmd import Collective, LayoutError

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
VARIANTS = {"ring": ring_attention, "allgather": allgather_attention}
# ops repeat_kv is written with (x[:, :, None].expand(...).reshape(...)) that keep the values
_REPEAT_OPS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.expand.default,
               aten.unsqueeze.default, aten.clone.default, aten.alias.default, aten.slice.Tensor,
               aten.contiguous.default if hasattr(aten, "contiguous") else aten.clone.default}


@dataclass
class Attention:
    """One SDPA node planned as context-parallel attention."""

    node: str
    axis: str
    order: str
    variant: str
    causal: bool
    masked: bool
    kv_source: Optional[str] = None  # the pre-repeat K node when the kv heads travel (GQA)
    where: str = ""


@dataclass
class ContextPlan:
    """Context-parallel attention of one program: ``orders`` (axis -> (unit, order)) and the
    SDPA nodes it rewrites."""

    orders: dict = field(default_factory=dict)
    attention: list = field(default_factory=list)
    nodes: dict = field(default_factory=dict)  # fx node -> Attention

    def __bool__(self):
        return bool(self.attention)


def _unit(info: DimInfo, resolved, atoms, axis):
    lv = info.leaves(atoms)
    for u in resolved.units.get(axis, ()):
        if lv[: len(u)] == u:
            return u
    return None


def _where(node):
    line = source_line(node)
    return f"node {node.name} in module '{module_of(node) or '<root>'}'" + (f" at {line}" if line else "")


def plan_context(graph: fx.Graph, info: DimInfo, resolved, mesh, options: Optional[dict] = None) -> ContextPlan:
    """Find the SDPA nodes whose query sequence the layout splits, fix each axis's sequence
    order and each node's variant, and record the orders in ``resolved.orders``.

    ``options``: ``{"order": "zigzag" | "contiguous", "variant": "ring" | "allgather" |
    callable}``; a callable gets ``(axis, local q shape, local kv shape, dtype bytes, causal,
    order)`` and returns a variant name."""
    options = dict(options or {})
    unknown = set(options) - {"order", "variant"}
    if unknown:
        raise ValueError(f"context= takes 'order' and 'variant', not {sorted(unknown)}")
    order_opt, variant_opt = options.get("order"), options.get("variant")
    if order_opt is not None and order_opt not in ORDERS:
        raise ValueError(f"context order must be one of {ORDERS}, not {order_opt!r}")
    if variant_opt is not None and not callable(variant_opt) and variant_opt not in VARIANTS:
        raise ValueError(f"context variant must be one of {sorted(VARIANTS)} or a function, not {variant_opt!r}")
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        q = node.args[0]
        s_atoms = info.of(q)[-2]
        for a in mesh.names:
            u = _unit(info, resolved, s_atoms, a)
            if u is not None:
                found.append((node, a, u))
                break
    ctx = ContextPlan()
    for node, a, u in found:
        causal = bool(arg(node, 5, "is_causal", False))
        masked = is_tensor_node(arg(node, 3, "attn_mask"))
        prev = ctx.orders.get(a)
        if prev is not None and prev[0] != u:
            raise LayoutError(f"mesh axis {a!r} splits the query sequences of two attentions by different units "
                              f"({_where(node)}); context parallelism needs one sequence per axis")
        want = order_opt or ("zigzag" if causal or masked else "contiguous")
        if prev is not None and order_opt is None and prev[1] != want:
            want = "zigzag"
        ctx.orders[a] = (u, want)
    for node, a, u in found:
        order = ctx.orders[a][1]
        n = mesh.axes[a]
        S = shape_of(node.args[0])[-2]
        if order == "zigzag" and S % (2 * n):
            raise LayoutError(f"zigzag context parallelism on {a!r} ({n} ranks) splits the sequence of {_where(node)} "
                              f"into {2 * n} chunks, but it has {S} positions; use a multiple of {2 * n} or "
                              f"context={{'order': 'contiguous'}}")
        dropout = arg(node, 4, "dropout_p", 0.0)
        if dropout:
            raise LayoutError(f"context-parallel attention at {_where(node)} has dropout_p={dropout}: dropout inside "
                              f"ring attention is not supported; set attention dropout to 0")
        causal = bool(arg(node, 5, "is_causal", False))
        masked = is_tensor_node(arg(node, 3, "attn_mask"))
        src = repeat_source(node.args[1]) if shape_of(node.args[1])[-3] == shape_of(node.args[0])[-3] else None
        if src is not None and repeat_source(node.args[2]) is None:
            src = None
        at = Attention(node.name, a, order, "ring", causal, masked, src.name if src is not None else None,
                       _where(node))
        at._variant_opt = variant_opt
        ctx.attention.append(at)
        ctx.nodes[node] = at
    resolved.orders = {**getattr(resolved, "orders", {}), **ctx.orders}
    return ctx


def repeat_source(node) -> Optional[fx.Node]:
    """The K/V before ``repeat_kv`` (``x[:, :, None].expand(b, g, rep, s, d).reshape(b, g*rep, s, d)``):
    a node with fewer heads whose values the repeat copies, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    shp = shape_of(node)
    cur, saw_expand = node, False
    for _ in range(8):
        if not isinstance(cur, fx.Node) or cur.op != "call_function" or cur.target not in _REPEAT_OPS:
            break
        saw_expand |= cur.target is aten.expand.default
        cur = cur.args[0]
        if not isinstance(cur, fx.Node):
            return None
        cs = shape_of(cur)
        if (saw_expand and len(cs) == len(shp) and cs[-3] < shp[-3] and shp[-3] % cs[-3] == 0
                and tuple(cs[:-3]) == tuple(shp[:-3]) and tuple(cs[-2:]) == tuple(shp[-2:])):
            # the expand inserted the repeat right after the kv head dim: [.., g, rep, s, d]
            return cur
    return None


def lowerings(ctx: ContextPlan) -> dict:
    """{SDPA node: visitor} for ``spmd.rewrite(regions=...)``."""
    return {node: (lambda rw, n, at=at: _visit(rw, n, at)) for node, at in ctx.nodes.items()}


def fixed_inputs(ctx: ContextPlan, graph: fx.Graph, places: dict, info: DimInfo, resolved, mesh) -> dict:
    """Placements of user inputs under zigzag: whole on the axis (the program splits them in
    zigzag order), {placeholder name: placement}."""
    out = {}
    for node in graph.nodes:
        if node.op != "placeholder" or node.name not in places:
            continue
        place = list(places[node.name])
        changed = False
        for i, a in enumerate(mesh.names):
            o = ctx.orders.get(a)
            if o is None or o[1] != "zigzag" or not isinstance(place[i], Shard):
                continue
            if _unit(info, resolved, info.of(node)[place[i].dim], a) == o[0]:
                place[i], changed = R, True
        if changed:
            out[node.name] = tuple(place)
    return out


def _visit(rw, node: fx.Node, at: Attention):
    """Write the per-rank program of one context-parallel SDPA node."""
    ix = rw.info.indexing[node]
    modes = rw.choose_modes(node, ix)
    cp = rw.axes.index(at.axis)
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    letters = {}
    for path, ls in ix.inputs:
        letters[path[0] if path[0] != "kw" else 3] = ls
    k_src = v_src = None
    if at.kv_source is not None:
        k_src, v_src = repeat_source(k), repeat_source(v)
    operands = [(0, q, letters[0]), (1, k_src or k, None if k_src is not None else letters[1]),
                (2, v_src or v, None if v_src is not None else letters[2])]
    if is_tensor_node(mask):
        operands.append((3, mask, letters.get(3)))
    varying = {at.axis}
    targets = {j: [None] * len(rw.axes) for j, _, _ in operands}
    out_place = [R] * len(rw.axes)
    for i, a in enumerate(rw.axes):
        kind, letter = modes[i]
        for j, src, ls in operands:
            if ls is None:  # a pre-repeat K/V: the letters of K/V with kv heads in place of heads
                ls = [("kvh" if l in ("h", "kvh") else l) for l in letters[j]]
            if i == cp:
                want = {0: "s", 1: "t", 2: "t", 3: "s"}[j]
                targets[j][i] = Shard(ls.index(want)) if want in ls else R
            elif kind == "shard" and letter in ls:
                targets[j][i] = Shard(ls.index(letter))
            elif kind == "shard" and letter == "h" and "kvh" in ls and j in (1, 2):
                targets[j][i] = Shard(ls.index("kvh"))  # kv heads split with their query heads
            else:
                targets[j][i] = R
        if i == cp:
            out_place[i] = Shard(len(shape_of(node)) - 2)
        elif kind == "shard":
            varying.add(a)
            out_place[i] = Shard(ix.outputs[0].index(letter))
    if k_src is not None:
        # the pre-repeat K/V must split on every axis like the query heads do, else use the repeat
        for j, src in ((1, k_src), (2, v_src)):
            for i, a in enumerate(rw.axes):
                t = targets[j][i]
                if isinstance(t, Shard) and i != cp and rw.unit_of(rw.info.of(src)[t.dim], a) is None:
                    return _visit(rw, node, _without_source(at))
            if any(isinstance(targets[0][i], Shard) and modes[i][1] == "h" and not isinstance(targets[j][i], Shard)
                   for i in range(len(rw.axes))):
                return _visit(rw, node, _without_source(at))
    reason = f"{rw.dim_label(node, 0, len(shape_of(node)) - 2)} sharded on {at.axis} (context-parallel attention)"
    local = {}
    for j, src, _ in operands:
        local[j] = rw.convert(src, 0, tuple(targets[j]), varying, node, reason)
    fn = VARIANTS[at.variant]
    variant = at._variant_opt
    if variant is not None:
        if callable(variant):
            qv, kv = local[0].meta.get("val"), local[1].meta.get("val")
            variant = variant(at.axis, tuple(qv.shape), tuple(kv.shape), qv.element_size(), at.causal, at.order)
        at.variant = variant
        fn = VARIANTS[variant]
    tag = rw.tag
    rw.tag += 1
    scale = node.kwargs.get("scale")
    new = rw.g.call_function(fn, (local[0], local[1], local[2], local.get(3), at.axis, at.causal, at.order,
                                  scale), {"tag": tag})
    new.meta = {k_: v_ for k_, v_ in node.meta.items() if k_ != "val"}
    place = tuple(out_place)
    new.meta["val"] = rw.meta_local(node.meta["val"], place)
    n = rw.mesh.axes[at.axis]
    where = module_of(node)
    kv_val = local[1].meta.get("val")
    kv_bytes = 2 * kv_val.numel() * kv_val.element_size() if kv_val is not None else 0
    if at.variant == "ring":
        why = (f"ring attention on {at.axis} ({at.order} order, {n} ranks): each rank keeps its queries; K/V blocks "
               f"hop rank i -> i+1, {n - 1} hops merged by online softmax")
        rw.collectives.append(Collective("send", (at.axis,), kv_bytes * (n - 1), "forward", where, why, node.name,
                                         source_line(node), tag, fn.__name__))
        if node in rw.rg:
            rw.collectives.append(Collective(
                "send", (at.axis,), kv_bytes * (n - 1) + kv_bytes * n, "backward", where,
                f"adjoint: ring attention backward on {at.axis}: K/V travel again ({n - 1} hops) with their "
                f"dK/dV ({n} hops, home to their owner)", node.name, source_line(node), tag, fn.__name__))
    else:
        why = (f"all-gather attention on {at.axis} ({at.order} order): K/V gathered once for this rank's queries "
               f"(short sequence: one collective beats {n - 1} ring hops)")
        rw.collectives.append(Collective("all_gather", (at.axis,), kv_bytes, "forward", where, why, node.name,
                                         source_line(node), tag, fn.__name__))
        if node in rw.rg:
            rw.collectives.append(Collective("reduce_scatter", (at.axis,), kv_bytes * n, "backward", where,
                                             "adjoint: " + why, node.name, source_line(node), tag, fn.__name__))
    new.meta["autoshard"] = {"where": where, "why": why, "tag": tag, "context": at}
    rw.local[node] = new
    rw.place[node] = [place]


def _without_source(at: Attention) -> Attention:
    b = Attention(at.node, at.axis, at.order, at.variant, at.causal, at.masked, None, at.where)
    b._variant_opt = at._variant_opt
    return b
