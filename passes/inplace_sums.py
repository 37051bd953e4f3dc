"""Forward sums written into their input where nothing else reads it.

A forward ``all_reduce`` (the partial sums after a row-parallel linear, Megatron's g) copies its
input first, so that the sum does not change a tensor something else may read. After a linear
nothing does: the linear's result is read only by the sum, and a linear's backward reads its
inputs, never its result. This pass marks such ``all_reduce`` nodes ``consume=True``; the
runtime then sums into the input itself where the backend can (one 4 MiB copy and allocation
fewer per sum on the benchmark's 2 x 512 model) and tells autograd it wrote into it
(``mark_dirty``), so a tensor autograd saved after all would fail loudly in backward, not
silently. Values are the same sums bit for bit.

Marked: a forward ``all_reduce`` (not returned pending, see ``output_sums``) whose input is made
by an op in :data:`RESULT_NOT_SAVED`, possibly through ops in :data:`PASS_THROUGH` (which may
return their input itself), where every tensor of that chain is read by the next op only.

Example::

    tags = consume_sum_inputs(program.graph_module.graph)   # the all-reduces that sum in place
    program.graph_module.recompile()
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.runtime.primitives import collectives as C

from .marks import mark

aten = torch.ops.aten

# Ops whose result is new memory that their own backward does not read (they save their inputs).
RESULT_NOT_SAVED = frozenset({
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.matmul.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
})
# Ops that may return their input itself (dropout with p=0 or outside training): the tensor
# they return is then the one before them, which must satisfy the same conditions.
PASS_THROUGH = frozenset({aten.dropout.default})

IN_PLACE = "; summed into its input, which nothing else reads"


def _consumable(node) -> bool:
    """``node``'s tensor is new memory that only its one user reads, and no backward needs."""
    while isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1:
        if node.target in RESULT_NOT_SAVED:
            return True
        if node.target not in PASS_THROUGH:
            return False
        node = node.args[0]
    return False


def consume_sum_inputs(graph: fx.Graph) -> list:
    """Mark forward ``all_reduce`` nodes whose input nothing else reads ``consume=True``
    (module docstring); returns their tags (their reasons end with :data:`IN_PLACE`)."""
    marked = []
    for node in graph.nodes:
        if node.target is not C.all_reduce or node.kwargs.get("tag") is None or node.kwargs.get("lazy"):
            continue
        if not _consumable(node.args[0]):
            continue
        marked.append(mark(node, "consume", IN_PLACE))
    return marked
