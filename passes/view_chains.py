"""View chains rewritten at capture so that no dim is merged with another only to be split again.

Code written for one device merges dims freely on the way to a kernel's layout:
``nn.MultiheadAttention`` views its ``[seq, batch, embed]`` projections as
``[seq, batch * heads, head_dim]``, transposes, and views them back as ``[batch, heads, seq,
head_dim]``; it flattens ``[seq, batch]`` into rows for its output projection and unflattens the
result. A merged dim is split only along its leading atom, so the batch (merged after seq) or the
heads (merged after batch) would be gathered whole there although the chain ends with every dim
apart again. Two rewrites compute the same values without the merge:

- :func:`compose_view_chains`: a chain of reshapes and transposes whose intermediate merges are
  undone by its end becomes one reshape into the finest dims, one permute, one reshape;
- :func:`unflatten_linears`: ``linear(x.reshape(m, e)).view(*lead, o)`` with ``m = prod(lead)``
  becomes ``linear(x.reshape(*lead, e))`` (a linear maps rows independently).

Example::

    >>> import torch
    >>> from autoshard.passes.capture import capture
    >>> mha = torch.nn.MultiheadAttention(8, 2)
    >>> cap = capture(mha, (torch.randn(3, 2, 8),) * 3)   # both rewrites run inside capture
    >>> sorted({tuple(n.meta["val"].shape) for n in cap.graph.nodes if n.target == torch.ops.aten.linear.default})
    [(3, 2, 8), (3, 2, 24)]
"""
from __future__ import annotations

import math

import torch
from torch import fx

from .decompose import Builder

aten = torch.ops.aten

# Reshapes that keep the element order: only the grouping of the dims changes.
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
            aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints, aten.unflatten.int}
PERMUTES = {aten.transpose.int, aten.permute.default}


def _shape(node) -> list:
    return [int(s) for s in node.meta["val"].shape]


def _order(node) -> list:
    """The permutation a transpose / permute node applies to its input's dims."""
    n = len(_shape(node.args[0]))
    if node.target == aten.transpose.int:
        a, b = node.args[1] % n, node.args[2] % n
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
        return order
    return [d % n for d in node.args[1]]


class _Fine:
    """The finest axes a chain's tensors are made of; each tensor dim is a run of them."""

    def __init__(self, shape):
        self.size: dict = {}
        self.kids: dict = {}
        self.first = [self.new(s) for s in shape if s != 1]
        it = iter(self.first)
        self.dims = [[next(it)] if s != 1 else [] for s in shape]

    def new(self, size) -> int:
        self.size[len(self.size)] = size
        return len(self.size) - 1

    def leaves(self, ids) -> list:
        out = []
        for i in ids:
            out += self.leaves(self.kids[i]) if i in self.kids else [i]
        return out

    def reshape(self, shape) -> bool:
        seq = self.leaves([i for d in self.dims for i in d])
        dims = []
        for n in shape:
            group, prod = [], 1
            while prod < n:
                if not seq:
                    return False
                i = seq.pop(0)
                if prod * self.size[i] <= n:
                    group.append(i)
                    prod *= self.size[i]
                    continue
                rest = n // prod
                if n % prod or self.size[i] % rest:
                    return False  # the dim cuts a fine axis unevenly: not a regrouping
                major, minor = self.new(rest), self.new(self.size[i] // rest)
                self.kids[i] = [major, minor]
                group.append(major)
                seq.insert(0, minor)
                prod *= rest
            if prod != n:
                return False
            dims.append(group)
        if seq:
            return False
        self.dims = dims
        return True


def compose_view_chains(graph: fx.Graph) -> int:
    """Rewrite each chain of reshapes and transposes that merges dims it later splits apart again
    (its nodes past the first read by the next one alone); returns how many chains."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in RESHAPES | PERMUTES:
            continue
        src = node.args[0]
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target in RESHAPES | PERMUTES \
                and len(src.users) == 1:
            continue  # not the chain's first node
        chain = [node]
        while len(chain[-1].users) == 1:
            nxt = next(iter(chain[-1].users))
            if nxt.op != "call_function" or nxt.target not in RESHAPES | PERMUTES or nxt.args[0] is not chain[-1]:
                break
            chain.append(nxt)
        if len(chain) > 1 and any(c.target in PERMUTES for c in chain) and _rewrite_chain(graph, chain):
            n += 1
    return n


def _rewrite_chain(graph: fx.Graph, chain: list) -> bool:
    x = chain[0].args[0]
    if not isinstance(x.meta.get("val"), torch.Tensor):
        return False
    fine = _Fine(_shape(x))
    seen = []  # every intermediate tensor's dims
    for c in chain:
        if c.target in PERMUTES:
            fine.dims = [fine.dims[d] for d in _order(c)]
        elif not fine.reshape(_shape(c)):
            return False
        seen.append([list(d) for d in fine.dims])
    out = [fine.leaves(d) for d in fine.dims]
    runs = {tuple(d) for d in out}
    merged_then_split = any(len(fine.leaves(d)) > 1 and tuple(fine.leaves(d)) not in runs
                            for dims in seen[:-1] for d in dims)
    if not merged_then_split:
        return False
    first = fine.leaves(fine.first)
    order = [first.index(i) for d in out for i in d]
    b = Builder(graph, chain[-1])
    y = b(aten.reshape.default, x, [fine.size[i] for i in first])
    if order != list(range(len(order))):
        y = b(aten.permute.default, y, order)
    final = _shape(chain[-1])
    if _shape(y) != final:
        y = b(aten.reshape.default, y, final)
    chain[-1].replace_all_uses_with(y)
    for c in reversed(chain):
        graph.erase_node(c)
    return True


def unflatten_linears(graph: fx.Graph) -> int:
    """``linear(x.reshape(m, e), w, b).view(*lead, o)`` -> ``linear(x.reshape(*lead, e), w, b)``;
    returns how many."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.linear.default or len(node.users) != 1:
            continue
        flat, after = node.args[0], next(iter(node.users))
        if not (isinstance(flat, fx.Node) and flat.op == "call_function" and flat.target in RESHAPES
                and after.op == "call_function" and after.target in RESHAPES and after.args[0] is node):
            continue
        m, e = (_shape(flat) + [0, 0])[:2] if len(_shape(flat)) == 2 else (None, None)
        lead = _shape(after)[:-1]
        if m is None or not lead or math.prod(lead) != m or _shape(after)[-1] != _shape(node)[-1]:
            continue
        b = Builder(graph, node)
        rows = b(aten.reshape.default, flat.args[0], lead + [e])
        new = b(aten.linear.default, rows, *node.args[1:], **node.kwargs)
        after.replace_all_uses_with(new)
        graph.erase_node(after)
        graph.erase_node(node)
        if not flat.users:
            graph.erase_node(flat)
        n += 1
    return n
