"""Forward sums without a gradient, started as soon as their inputs exist.

A mean loss over a batch split on a data axis divides by the number of counted tokens over
every rank: ``sum(labels != ignore_index)`` is a pending sum, all-reduced where the division
reads it, at the very end of forward, where it waits for the slowest rank. The count depends
on the labels alone and carries no gradient, so its all-reduce can start before the model
runs: this pass copies the (cheap) ops computing such a value to just after their inputs and
puts a ``start_all_reduce`` right behind the copy; the ``all_reduce`` node and the ops feeding
it stay where they were (so ``plan.collectives``, the program and its cost read as before: the
cost model skips the copies) and the node only waits for the sum already made. Values are
unchanged bit for bit: the same all-reduce of the same deterministic value, started earlier.

Only deterministic, non-mutating ops outside repeated blocks are copied (a checkpointed block keeps
its ops together), and only if nothing in the program writes into a tensor they read.

Example::

    tags = start_sums_early(program.graph_module.graph)   # the all-reduces started early
    program.graph_module.recompile()
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.runtime.primitives import collectives as C

from autoshard.passes.recompute import block_of
from .rules import is_inplace


def _roots(node: fx.Node, memo: dict) -> frozenset:
    """The placeholders and constants ``node`` reads, through any number of ops."""
    if node not in memo:
        if node.op != "call_function":
            memo[node] = frozenset([node])
        else:
            memo[node] = frozenset().union(*(_roots(a, memo) for a in node.all_input_nodes))
    return memo[node]


def _movable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or is_inplace(node.target):
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:
        return False  # random ops draw from the generator in program order
    return block_of(node) is None


def _cone(x: fx.Node) -> list | None:
    """The ops computing ``x`` from the program's inputs, in program order; None if one of
    them may not move."""
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        if n in seen or n.op in ("placeholder", "get_attr"):
            continue
        if not _movable(n):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    order = {n: k for k, n in enumerate(x.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


EARLY_COPY = "early_sum"  # meta key of the copied ops and the start (the cost model skips them)
EARLY = "; started as soon as its inputs exist, so it runs under the forward in between"


def start_sums_early(graph: fx.Graph) -> list:
    """Start each forward ``all_reduce`` of a value without gradient right after the value's
    inputs exist (see the module docstring); returns the tags of those started early (their
    reasons end with :data:`EARLY`)."""
    memo: dict = {}
    written = [_roots(n.args[0], memo) for n in graph.nodes
               if n.op == "call_function" and is_inplace(n.target) and isinstance(n.args[0], fx.Node)]
    last_input = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")][-1:]
    moved = []
    for node in list(graph.nodes):
        if node.target is not C.all_reduce or node.meta.get("autoshard", {}).get("grad", True):
            continue
        x, axis = node.args[0], node.args[1]
        cone = _cone(x)
        if cone is None or any(r & _roots(x, memo) for r in written):
            continue
        copies: dict = {}
        for n in cone:
            order = {m: k for k, m in enumerate(graph.nodes)}
            # after the program's inputs (placeholders come first) and the copy's own inputs
            anchor = max([copies.get(a, a) for a in n.all_input_nodes] + last_input, key=order.__getitem__,
                         default=None)
            with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(n):
                copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
            copies[n].meta[EARLY_COPY] = True
        with graph.inserting_after(copies.get(x, x)):
            start = graph.call_function(C.start_all_reduce, (copies.get(x, x), axis), {"tag": node.kwargs["tag"]})
        start.meta[EARLY_COPY] = True
        node.meta["autoshard"]["why"] += EARLY
        moved.append(node.kwargs["tag"])
    return moved
