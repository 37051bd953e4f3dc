"""Forward sums that only the program's outputs read are returned before they arrive.

A data-parallel loss ends in an all-reduce of every rank's partial sum (then, for a mean, a
division by the token count). Backward never reads that sum (the all-reduce's backward is the
identity), only whoever reads the loss does. Waiting for it at the end of forward makes every
rank wait for the slowest once more per step; this pass marks such an ``all_reduce`` node
``lazy=True`` instead, so the program starts the sum and returns a
:class:`~autoshard.runtime.primitives.pending_value.PendingValue`, which waits when its data is first
read (``loss.item()``, printing it) and otherwise at the end of backward. Values are unchanged
bit for bit: the same sum of the same partials, waited for later.

Marked: scalar forward all-reduces of values with a gradient (losses) outside recomputed blocks
whose value reaches only the program's outputs, through pointwise ops and views (the ops a
pending value replays once it arrives). Anything else that reads the sum would wait for it at
once, and gains nothing; so would a sum without a gradient such as a mean's token count, which
backward reads as the divisor.

Example::

    tags = defer_output_sums(program.graph_module.graph)   # the all-reduces returned pending
    program.graph_module.recompile()
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.runtime.primitives import collectives as C
from autoshard.runtime.primitives.pending_value import replayable

from autoshard.passes.recompute import block_of
from .marks import mark

LAZY = "; returned before it arrives: reading the value waits for it, backward does not"


def _reaches_outputs_only(node: fx.Node) -> bool:
    """Every path from ``node`` goes through replayable ops to the program's output."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output":
            continue
        if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload) \
                or not replayable(user.target):
            return False
        stack.extend(user.users)
    return True


def defer_output_sums(graph: fx.Graph) -> list:
    """Mark forward ``all_reduce`` nodes that only outputs read ``lazy=True`` (module docstring);
    returns their tags (their reasons end with :data:`LAZY`)."""
    deferred = []
    for node in graph.nodes:
        if node.target is not C.all_reduce or node.kwargs.get("tag") is None or block_of(node) is not None:
            continue
        if not node.meta.get("autoshard", {}).get("grad", False):
            continue  # no gradient: a token count, which backward reads (a mean's divisor)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 0 or not _reaches_outputs_only(node):
            continue
        deferred.append(mark(node, "lazy", LAZY))
    return deferred
