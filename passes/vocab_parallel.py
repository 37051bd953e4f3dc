"""Vocab-parallel cross-entropy: a loss over logits whose class dim is split on a mesh axis.

``cross_entropy_loss``'s rule keeps the class dim whole (softmax needs every class), so logits
split by vocab (a column-parallel output head, ``layout={"vocab": "tp"}``) would be all-gathered
before the loss: ``N*C`` values to every rank, and the whole softmax on each. When the logits
arrive split on exactly one axis by their class dim, this lowering writes the node as
:func:`autoshard.runtime.primitives.vocab_parallel.vocab_parallel_cross_entropy` instead: each rank works
on its columns and only the softmax statistics travel (a gather of the row maxima, one sum of
``[sum exp, target logit]``: ``3N`` values per rank, none in backward).

Which nodes: ``reduction='none'`` (capture rewrites a mean into ``sum(none) / count``), class-
index targets, no class weights, no label smoothing, 2-D fp32/fp64 logits. Anything else, or
logits that arrive whole, keeps the rule (``spmd.visit_einsum``). Other axes compose as for the
rule: rows split on a data axis stay split.

Example::

    >>> plan = autoshard.autoshard(model, (tokens, labels), mesh=Mesh({"tp": 2}), dims=dims,
    ...                            layout={"heads": "tp", "ffn": "tp", "vocab": "tp"}, train=True)  # doctest: +SKIP
    >>> [c.why for c in plan.collectives if c.op == "vocab_parallel_cross_entropy"]          # doctest: +SKIP
    ['... row maxima of logits split by vocab on tp ...', '... sum of exp and target logits ...']
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.ownership import Partial, R, Shard
from autoshard.runtime.primitives.vocab_parallel import vocab_parallel_cross_entropy

from .dims import module_of, source_line
from .lowering import decides_locally
from .rules import arg, shape_of

aten = torch.ops.aten
CE = aten.cross_entropy_loss.default
_FLOATS = (torch.float32, torch.float64)


def eligible(node: fx.Node) -> bool:
    """A per-row, unweighted, unsmoothed cross-entropy of 2-D float logits and class indices."""
    if node.op != "call_function" or node.target is not CE:
        return False
    x, target = node.args[0], node.args[1]
    xv, tv = x.meta.get("val"), target.meta.get("val") if isinstance(target, fx.Node) else None
    return (isinstance(xv, torch.Tensor) and isinstance(tv, torch.Tensor) and xv.dim() == 2 and tv.dim() == 1
            and xv.dtype in _FLOATS and not tv.dtype.is_floating_point
            and arg(node, 2, "weight") is None and arg(node, 3, "reduction", 1) == 0
            and not arg(node, 5, "label_smoothing", 0.0))


def lowerings(graph: fx.Graph) -> dict:
    """{cross_entropy_loss node: visitor} for ``spmd.rewrite(regions=...)``."""
    return {node: _visit for node in graph.nodes if eligible(node)}


def _vocab_axis(lw, node):
    """The one axis that splits the logits' class dim, or None (whole, split on several axes,
    a pending sum, a reordered axis: the rule's gather handles those)."""
    place = lw.placement(node.args[0])
    if any(isinstance(o, Partial) for o in place):
        return None
    split = [a for o, a in zip(place, lw.axes) if isinstance(o, Shard) and o.dim == 1]
    if len(split) != 1 or split[0] in getattr(lw.layout, "orders", {}):
        return None
    return split[0]


@decides_locally
def _visit(lw, node: fx.Node):
    """Lower one eligible cross-entropy node (``lw``: the rewrite's :class:`~.lowering.Lowering`)."""
    ix = lw.info.indexing[node]
    axis = _vocab_axis(lw, node)
    if axis is None:
        return lw.visit_rule(node)
    x, target = node.args[0], node.args[1]
    modes = lw.choose_modes(node, ix)
    rows = ix.inputs[0][1][0]  # the rows' letter: the one other axes may split
    x_place, t_place, out_place, varying = [], [], [], {axis}
    for (kind, letter), a in zip(modes, lw.axes):
        if a == axis:
            x_place.append(Shard(1)), t_place.append(R), out_place.append(R)
        elif kind == "shard" and letter == rows and letter is not None:
            varying.add(a)
            x_place.append(Shard(0)), t_place.append(Shard(0)), out_place.append(Shard(0))
        else:
            x_place.append(R), t_place.append(R), out_place.append(R)
    n = lw.mesh.axes[axis]
    reason = f"{lw.dim_label(x, 0, 1)} sharded on {axis} (vocab-parallel cross-entropy)"
    lx = lw.convert(x, x_place, varying, node, reason)
    lt = lw.convert(target, t_place, varying, node, reason)
    tag = lw.new_tags(2)  # the max gather and the sum
    ignore = arg(node, 4, "ignore_index", -100)
    place = tuple(out_place)
    new = lw.call(vocab_parallel_cross_entropy, (lx, lt, axis, ignore), {"tag": tag}, like=node, place=place)
    rows_local = shape_of(lx)[0] if shape_of(lx) else 0
    es = x.meta["val"].element_size()
    vocab = lw.dim_label(x, 0, 1)
    why_max = (f"cross-entropy over logits split by {vocab} on {axis} ({n} ranks): the row maxima are gathered "
               f"instead of the logits")
    why_sum = (f"cross-entropy over logits split by {vocab} on {axis}: each rank's sum of exp and target logit, "
               f"summed (backward: none, each rank keeps its columns' gradient)")
    op = vocab_parallel_cross_entropy.__name__
    # the logits' name, at the cross-entropy's module and line
    lw.record("all_gather", axis, nbytes=rows_local * es, phase="forward", node=x, where=module_of(node),
              line=source_line(node), tag=tag, op=op, why=why_max)
    lw.record("all_reduce", axis, nbytes=2 * rows_local * es, phase="forward", node=x, where=module_of(node),
              line=source_line(node), tag=tag + 1, op=op, why=why_sum)
    new.meta["autoshard"] = {"where": module_of(node), "why": why_sum, "tag": tag, "vocab_parallel": axis}
    lw.bind(node, new, place)
