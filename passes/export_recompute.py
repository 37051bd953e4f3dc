"""Activation recompute in an exported program: each region the checkpointing pass cut out
(``passes/recompute.py``: a ``call_module`` of ``runtime.primitives.recompute.Recomputed``) is written as
a function of its own in program.py, and ``forward`` calls it through the runtime's
``recompute`` (whole block) or ``recompute_selective`` (the region's ``keep(...)`` ops kept),
so run.py trains with the recompute the plan was priced with, and a reader sees it::

    def recompute_layers_0(add, linear, ...):      # the block's activation code
        ...
    def forward(...):
        ...
        recompute_layers_0_1 = recompute(recompute_layers_0, add, linear, ...)

Example::

    >>> regions = region_calls(gm, graph_copy, literal)        # doctest: +SKIP
    >>> [name for name, _ in regions]
    ['recompute_layers_0', 'recompute_layers_1']
"""
from __future__ import annotations

from torch import fx

from autoshard.runtime.primitives.recompute import Recomputed, keep, recompute, recompute_selective

RUNTIME_FUNCTIONS = (keep, recompute, recompute_selective)  # imported by program.py under their names


def region_calls(gm, graph: fx.Graph, literal) -> list:
    """Replace, in ``graph`` (a copy of ``gm``'s graph), every call of a ``Recomputed``
    submodule of ``gm`` by ``recompute(<name>, *args)`` (``recompute_selective`` for a
    selective region), where ``literal(name)`` prints as the bare function name. Returns
    ``[(name, region GraphModule)]`` in program order: the functions to write."""
    out = []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if not isinstance(mod, Recomputed):
            continue
        name = node.target.replace(".", "_")
        fn = recompute_selective if mod.selective else recompute
        with graph.inserting_before(node):
            call = graph.call_function(fn, (literal(name), *node.args), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        out.append((name, mod.block))
    return out
