"""What autograd keeps for backward, op by op: the activation-memory model of training.

An op's backward needs some of its inputs or its output, not every value it makes: a linear
keeps its input (for the weight's gradient), a product keeps each factor the other's gradient
needs, a residual add or a cast keeps nothing, a softmax its output, attention its q, k, v,
output and log-sum-exp. :data:`SAVES` lists them, as data; an op it does not list is counted
as keeping its output (the old, conservative rule). Each saved value is counted once, as the
storage it lives in (a view counts as its base), and only if it is an activation made by the
program: parameters and buffers are state, counted apart, and so are values made only from
parameters (a weight's transpose, a ZeRO-3 gather, whose release the state model prices).

This is what ``runtime.primitives.recompute.SavedBytes`` measures at run time (distinct storages held for
backward), so a plan's predicted activations can be compared with it (``run.py --memory``).

Example::

    counter = SavedCounter(graph, rg)             # rg: values that require grad
    for node in graph.nodes:
        seg.saved_bytes += counter.add(node)      # bytes first kept by this node's backward
"""
from __future__ import annotations

import operator

import torch

from autoshard.runtime.primitives.overlap_linear import varying_linears

aten = torch.ops.aten
ATTENTION = (("in!", 0), ("in!", 1), ("in!", 2), "out", "lse")  # q, k, v, output, log-sum-exp

# which values an op's backward keeps: "out" (its output), ("in", i): input i if some *other*
# input needs a gradient, ("in!", i): input i whenever the op is differentiated, () nothing
_BILINEAR = (("in", 0), ("in", 1))
SAVES = {
    # nothing: sums, casts, copies, joins, reductions whose gradient is a broadcast
    **{op: () for op in (aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.cat.default, aten.sum.default,
                         aten.sum.dim_IntList, aten.mean.dim, aten.mean.default, aten.clone.default,
                         aten.to.dtype, aten._to_copy.default, aten.contiguous.default, aten.add.Scalar,
                         aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.stack.default,
                         aten.masked_fill.Scalar, aten.where.self, aten.pad.default, aten.constant_pad_nd.default,
                         aten.zeros_like.default, aten.ones_like.default, aten.fill.Scalar, aten.copy.default,
                         aten.index_select.default, aten.gather.default, aten.repeat.default,
                         aten.repeat_interleave.self_int, aten.roll.default)},
    aten.mul.Tensor: _BILINEAR,
    aten.div.Tensor: (("in", 1), ("in!", 1), ("in", 0)),
    aten.linear.default: (("in", 0),),  # its weight is state (or a gather, priced apart)
    aten.matmul.default: _BILINEAR,
    aten.mm.default: _BILINEAR,
    aten.bmm.default: _BILINEAR,
    aten.addmm.default: (("in", 1), ("in", 2)),
    aten.einsum.default: (("in!", 1),),
    aten.pow.Tensor_Scalar: (("in!", 0),),
    aten.silu.default: (("in!", 0),),
    aten.gelu.default: (("in!", 0),),
    aten.sin.default: (("in!", 0),),
    aten.cos.default: (("in!", 0),),
    aten.log.default: (("in!", 0),),
    aten.relu.default: ("out",),
    aten.rsqrt.default: ("out",),
    aten.sqrt.default: ("out",),
    aten.exp.default: ("out",),
    aten.tanh.default: ("out",),
    aten.sigmoid.default: ("out",),
    aten.softmax.int: ("out",),
    aten._softmax.default: ("out",),
    aten.log_softmax.int: ("out",),
    aten._log_softmax.default: ("out",),
    aten.embedding.default: (("in!", 1),),  # the indices
    aten.scaled_dot_product_attention.default: ATTENTION,
    varying_linears: (("in!", 0),),  # the shared input of its linears
    aten.layer_norm.default: (("in!", 0), "stats"),
    aten.native_layer_norm.default: (("in!", 0), "stats"),
    aten.cross_entropy_loss.default: ("logits",),  # its log-softmax, the size of the logits
    aten.dropout.default: ("mask",),  # one byte per element
    aten.native_dropout.default: ("mask",),
}


# torch.export names the placeholders of parameters, buffers and constants p_*, b_*, c_*; the
# rest are the user's inputs (activations: token ids kept by an embedding are counted)
STATE_PREFIXES = ("p_", "b_", "c_")


def _is_view(node) -> bool:
    return getattr(node.target, "is_view", False) or node.target is operator.getitem


class SavedCounter:
    """Counts, over a program's nodes in order, the bytes autograd first keeps for each
    node's backward (see the module docstring). ``rg``: the nodes that require grad."""
    rules = SAVES  # op -> what its backward keeps; a subclass may count by another table

    def __init__(self, graph, rg: set):
        self.rg = rg
        self.seen: set = set()
        self.state: set = set()  # parameters, buffers and values made from them alone
        for node in graph.nodes:
            if (node.op == "placeholder" and node.name.startswith(STATE_PREFIXES)) or (
                    node.op == "call_function" and node.all_input_nodes
                    and all(a in self.state for a in node.all_input_nodes)):
                self.state.add(node)

    def _base(self, node):
        while node.op == "call_function" and _is_view(node) and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    def _bytes(self, node) -> int:
        """Bytes of ``node``'s storage if not counted yet and an activation, else 0."""
        b = self._base(node)
        if b in self.seen or b in self.state:
            return 0
        self.seen.add(b)
        v = b.meta.get("val")
        vals = v if isinstance(v, (tuple, list)) else [v]
        return sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))

    def add(self, node, out_bytes: int = 0) -> int:
        """Bytes newly kept for ``node``'s backward (0 if it is not differentiated)."""
        if node not in self.rg or _is_view(node):
            return 0
        rule = self.rules.get(node.target)
        if rule is None:
            return self._bytes(node) if out_bytes else 0
        return self.add_rule(node, rule)

    def add_rule(self, node, rule) -> int:
        """Bytes newly kept for ``node``'s backward under ``rule`` (an entry of :data:`SAVES`)."""
        total = 0
        for item in rule:
            if item == "out":
                total += self._bytes(node)
            elif item in ("lse", "stats"):  # per row of the first input: float32
                q = node.args[0].meta.get("val")
                total += q[..., 0].numel() * 4 * (2 if item == "stats" else 1)
            elif item == "mask":
                v = node.meta.get("val")
                v = v[0] if isinstance(v, (tuple, list)) else v
                total += v.numel() if isinstance(v, torch.Tensor) else 0
            elif item == "logits":
                v = node.args[0].meta.get("val")
                total += v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
            else:
                kind, i = item
                if i >= len(node.args) or not isinstance(node.args[i], torch.fx.Node):
                    continue
                others = [a for j, a in enumerate(node.args) if j != i and isinstance(a, torch.fx.Node)]
                if kind == "in!" or any(a in self.rg for a in others):
                    total += self._bytes(node.args[i])
        return total
