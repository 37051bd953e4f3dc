"""Gradient sums of parameters read nowhere else are added into ``.grad`` after backward.

A replicated parameter read by per-rank work goes through ``mark_varying``, whose backward
all-reduces the parameter's gradient and, run synchronously, blocks backward until it arrives
(under sequence parallelism: every norm's weight and bias on token rows, on tp). When the
``mark_varying`` is the parameter's only use, backward never reads that sum (only the
optimizer does, after backward). This pass marks such a node ``later=True``: backward starts
the all-reduce, goes on, and the sum is added into ``.grad`` when backward ends
(:mod:`autoshard.runtime.primitives.param_sums`; the same values bit for bit).

Marked: ``mark_varying`` nodes whose input is a trainable parameter as the program receives it
(a placeholder, so not a ZeRO gather nor a persistent copy) with no other user, except
parameters in ``skip``: those of gradient buckets, whose hook must see the summed gradient (the
runtime leaves any parameter with gradient hooks synchronous as well).

Example::

    tags = sum_param_grads_later(program.graph_module.graph, trainable, skip=program.bucketed)
    program.graph_module.recompile()
"""
from __future__ import annotations

from torch import fx

from autoshard.runtime.primitives import collectives as C

from .marks import mark

LATER = "; backward starts it and goes on: the sum is added into the parameter's .grad when backward ends"


def sum_param_grads_later(graph: fx.Graph, params, skip=()) -> list:
    """Mark each ``mark_varying`` that is the only use of a parameter placeholder named in
    ``params`` (and not in ``skip``) ``later=True`` (module docstring); returns their tags
    (their reasons end with :data:`LATER`)."""
    params, skip = set(params), set(skip)
    marked = []
    for node in graph.nodes:
        if node.target is not C.mark_varying or node.kwargs.get("tag") is None or node.kwargs.get("later"):
            continue
        x = node.args[0]
        if not (isinstance(x, fx.Node) and x.op == "placeholder" and x.name in params and x.name not in skip
                and len(x.users) == 1):
            continue
        marked.append(mark(node, "later", LATER))
    return marked
