"""Column-parallel linears get their input-gradient all-reduce overlapped with their weight gradients.

Tensor parallelism reads a replicated activation in column-parallel linears through
``mark_varying``, whose backward all-reduces the activation's gradient. Autograd computes each
linear's input and weight gradients in one node, so that all-reduce starts only once every
weight gradient is done and then blocks. This pass replaces ``mark_varying`` and the linears
reading it by one :func:`~autoshard.runtime.primitives.overlap_linear.varying_linears` call (and a getitem
per linear), whose backward starts the all-reduce as soon as the input gradient exists and
computes the weight gradients while it runs. Values are unchanged bit for bit (the runtime
function's docstring says why); ``plan.collectives`` keeps the one all-reduce, under its tag.

Sequence parallelism gathers token rows for the same linears with ``all_gather_varying``
(backward: a reduce-scatter of the gradient); such a gather of an activation is fused the same
way (``gather_dim``), its reduce-scatter overlapped with the weight gradients.

Fused only where it is the same computation: every user of the ``mark_varying`` is an
``aten.linear`` reading it as its input (never as a weight or bias); the weights (2-D) and
biases are parameters as the program receives them (not ZeRO gathers: backward reads the
saved copies twice, and a released gather would be gathered twice), each read once in the group
and by nothing else between the ``mark_varying`` and the last linear (so every gradient buffer
autograd fills receives its parts in the same order); all of it is in one repeated block (a checkpointed block keeps its
ops together). The fused call takes the ``mark_varying``'s place in the program, so autograd
reaches it at the same point. A ``mark_varying`` with any other user is left alone.

Example::

    tags = overlap_linear_sums(program.graph_module.graph)   # the mark_varyings fused
    program.graph_module.recompile()
"""
from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from autoshard.runtime.primitives import collectives as C
from autoshard.runtime.primitives.overlap_linear import varying_linears

from autoshard.passes.recompute import block_of
from .guards import written_arguments

aten = torch.ops.aten

SUM = "overlap_linear"  # meta key of a varying_linears node: the metadata of the mark_varying it absorbed
OVERLAP = "; backward starts it once the input gradient exists and computes the weight gradients while it runs"


def _group(mv: fx.Node, order: dict):
    """The linears reading ``mv``, in program order, with their weights and biases; None if
    the fusion might not be the same computation (module docstring)."""
    linears = sorted(mv.users, key=order.__getitem__)
    x = mv.meta.get("val")
    if not linears or not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    span = range(order[mv] + 1, order[linears[-1]])
    weights, biases = [], []
    for lin in linears:
        if (lin.target is not aten.linear.default or lin.kwargs or len(lin.args) not in (2, 3) or lin.args[0] is not mv
                or block_of(lin) != block_of(mv)):
            return None
        w, b = (list(lin.args[1:]) + [None])[:2]
        for t in (w, b):
            # a parameter as the program receives it: not a ZeRO gather, whose saved copy is
            # released after forward and gathered again on each of the two reads backward makes;
            # read by nothing else between the mark_varying and the last linear (autograd
            # would add its gradients in another order)
            if t is not None and not (isinstance(t, fx.Node) and t.op == "placeholder"
                                      and all(u in linears or order[u] not in span for u in t.users)):
                return None
        wv = w.meta.get("val")
        if not (isinstance(wv, torch.Tensor) and wv.dim() == 2 and wv.shape[1] == x.shape[-1]):
            return None
        weights.append(w)
        biases.append(b)
    params = weights + [b for b in biases if b is not None]
    if len(set(params)) != len(params):
        return None  # a tensor twice: its two gradients would be summed in another order
    return linears, weights, biases


def _gather_dim(mv: fx.Node):
    """The gathered dim of an ``all_gather_varying`` of token rows (an activation, not a ZeRO
    parameter gather), None for a ``mark_varying``; False for any other node."""
    if mv.target is C.mark_varying:
        return None
    if mv.target is C.all_gather_varying and isinstance(mv.args[0], fx.Node) and mv.args[0].op == "call_function":
        return mv.args[2] if len(mv.args) > 2 else mv.kwargs["dim"]
    return False


def overlap_linear_sums(graph: fx.Graph) -> list:
    """Fuse each ``mark_varying`` (or token-row ``all_gather_varying``) read only by linears
    into one ``varying_linears`` node in its place, and a getitem in each linear's (module
    docstring); returns the tags of the fused collectives (their reasons end with :data:`OVERLAP`)."""
    mutating = None
    fused = []
    order = {n: k for k, n in enumerate(graph.nodes)}  # new nodes are never looked up: theirs do not matter
    for mv in list(graph.nodes):
        gather_dim = _gather_dim(mv) if mv.op == "call_function" else False
        if gather_dim is False or mv.kwargs.get("tag") is None or mv.kwargs.get("defer") is False:
            continue  # (a batch value's sum on a data axis: the fused call would defer it)
        group = _group(mv, order)
        if group is None:
            continue
        linears, weights, biases = group
        x, axis = mv.args[0], mv.args[1]
        if mutating is None:
            mutating = any(written_arguments(n) for n in graph.nodes if n.op == "call_function")
        # mark_varying's copy of x is needed only if something could write into x before
        # backward (a gather makes a new tensor anyway)
        keep_copy = gather_dim is None and (mutating or not isinstance(x, fx.Node) or x.op != "call_function")
        options = {"tag": mv.kwargs["tag"], "copy": keep_copy}
        if gather_dim is not None:
            options["gather_dim"] = gather_dim
        with graph.inserting_before(mv):  # its place in the program, so autograd visits it in the same turn
            node = graph.call_function(varying_linears, (x, axis, tuple(weights), tuple(biases)), options)
            # an op of the linears' module (their block, for checkpointing), carrying the
            # collective it absorbed: the export comments it, the cost model prices it
            node.meta = {k: v for k, v in linears[0].meta.items() if k != "autoshard"}
            node.meta["val"] = tuple(lin.meta.get("val") for lin in linears)
            info = mv.meta["autoshard"]
            node.meta[SUM] = {**mv.meta, "autoshard": {**info, "why": info["why"] + OVERLAP}}
        for i, lin in enumerate(linears):
            with graph.inserting_before(lin):
                out = graph.call_function(operator.getitem, (node, i))
            out.meta = copy.copy(lin.meta)
            lin.replace_all_uses_with(out)
            order[out] = order[lin]
        order[node] = order[mv]
        for lin in linears:
            graph.erase_node(lin)
        graph.erase_node(mv)
        fused.append(mv.kwargs["tag"])
    return fused


def unfused(graph: fx.Graph) -> fx.Graph:
    """``graph`` itself, or a copy with every ``varying_linears`` node expanded back into the
    ``mark_varying`` and linears it replaced (same tags and metadata): the program the cost
    model prices (the overlap is not modelled, so a plan costs what its layout search found).

    Example::

        segments = program_events_of(unfused(program.graph_module.graph))
    """
    if not any(n.target is varying_linears for n in graph.nodes):
        return graph
    out = fx.Graph()
    out.output(out.graph_copy(graph, {}))
    for node in list(out.nodes):
        if node.target is not varying_linears:
            continue
        x, axis, weights, biases = node.args
        dim = node.kwargs.get("gather_dim")
        with out.inserting_before(node):
            mv = (out.call_function(C.mark_varying, (x, axis), {"tag": node.kwargs["tag"]}) if dim is None else
                  out.call_function(C.all_gather_varying, (x, axis, dim), {"tag": node.kwargs["tag"]}))
        mv.meta = dict(node.meta[SUM])
        for use in list(node.users):  # the getitems, each replaced by its linear
            w, b = weights[use.args[1]], biases[use.args[1]]
            with out.inserting_before(use):
                lin = out.call_function(aten.linear.default, (mv, w) if b is None else (mv, w, b))
            lin.meta = copy.copy(use.meta)
            use.replace_all_uses_with(lin)
            out.erase_node(use)
        out.erase_node(node)
    return out
