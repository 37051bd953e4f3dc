"""Decompositions: ops whose dims cannot be written as one set of letters, rewritten at capture
into ops that have rules.

A rule gives each tensor dim one letter; ``repeat_interleave`` makes a dim that is the input
dim *followed by* a new one (``[n] -> [n * r]``), which only a reshape can express. Such ops
are listed in ``rules.DECOMPOSITIONS`` (data: op -> a small function written with the
:class:`Builder`), and :func:`decompose` replaces each node by the ops that function emits.
The result computes the same values (the property tests in ``tests/test_op_rules.py`` check
each against the op itself).

Example::

    >>> import torch
    >>> from autoshard.passes.capture import capture
    >>> cap = capture(torch.nn.Module(), ())                                      # doctest: +SKIP
    >>> decompose(cap.graph)   # repeat_interleave -> unsqueeze, expand, reshape   # doctest: +SKIP
"""
from __future__ import annotations

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .rules import DECOMPOSITIONS

KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


class Builder:
    """Emits aten ops before ``anchor`` with the anchor's module and source line, and the
    ``val`` metadata (shape and dtype) computed on the meta device."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor

    @staticmethod
    def shape(x) -> list:
        return list(x.meta["val"].shape)

    @staticmethod
    def device(x) -> torch.device:
        """The device ``x`` is computed on (the nodes a Builder makes carry meta values: the
        nearest input captured with a real one says)."""
        todo, seen = [x], set()
        while todo:
            n = todo.pop(0)
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                return v.device
            seen.add(n)
            todo += [a for a in n.all_input_nodes if a not in seen]
        return torch.device("cpu")

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        meta_args, meta_kwargs = pytree.tree_map(_as_meta, (args, kwargs))
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        node.meta = {k: v for k, v in self.anchor.meta.items() if k in KEPT_META}
        node.meta["val"] = target(*meta_args, **meta_kwargs)
        return node


def _as_meta(x):
    if isinstance(x, fx.Node):
        v = x.meta["val"]
        return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
    return x


def decompose(graph: fx.Graph) -> int:
    """Replace every node whose op is in ``rules.DECOMPOSITIONS`` (a function returning None
    keeps that node); returns how many."""
    n = 0
    for node in list(graph.nodes):
        fn = DECOMPOSITIONS.get(node.target) if node.op == "call_function" else None
        if fn is None:
            continue
        new = fn(Builder(graph, node), *node.args, **node.kwargs)
        if new is None:  # this call of the op has a rule as it is
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        n += 1
    return n
