"""Activation checkpointing of the per-rank program: code of each repeated block (``layers.3``)
becomes calls of ``autoshard.runtime.primitives.recompute.Recomputed``, which keep only their inputs for
backward and recompute the rest there. Two policies (:data:`POLICIES`):

- ``"block"``: the whole block is one recomputed region; it keeps the block's inputs only.
- ``"selective"``: as PyTorch's selective activation checkpointing, the block is one region
  that keeps its inputs and the outputs of the ops of :func:`saved_by_selective` (matmuls,
  linears, attention, collectives), which run through ``runtime.primitives.recompute.keep`` and are not
  run again; backward recomputes the rest (pointwise ops, norms, rotary embeddings, softmax).

A block's *region* is the code of that block that depends on a user input (its activations);
code that reads only parameters (a transpose of a weight, a ZeRO-3 gather and its pieces) stays
outside, so a recompute never gathers a parameter again: gathered parameters reach the block
as inputs, and ZeRO-3 resharding (release after forward, regather for backward) applies to them
as to any saved tensor. A block is cut out only if the program uses its results after its last
op (true for the blocks of a sequential model); others are left as they are and listed.

Example::

    >>> from autoshard.passes.recompute import checkpoint_blocks            # doctest: +SKIP
    >>> gm, done, skipped = checkpoint_blocks(plan.graph_module, user_names={"x"})
    >>> done
    ['layers.0', 'layers.1']
    >>> gm, done, _ = checkpoint_blocks(plan.graph_module, {"x"}, policy="selective")  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from autoshard.runtime.primitives.recompute import Recomputed, keep, keepable_name

POLICIES = ("block", "selective")
aten = torch.ops.aten
# what the selective policy keeps (runs as in the program): matrix products and attention, whose
# recompute is the expensive part; everything else of a block is recomputed
SELECTIVE_SAVES = {aten.linear.default, aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default,
                   aten.baddbmm.default, aten.einsum.default, aten.convolution.default, aten.conv1d.default,
                   aten.conv2d.default, aten.scaled_dot_product_attention.default,
                   aten._scaled_dot_product_flash_attention_for_cpu.default,
                   aten._scaled_dot_product_efficient_attention.default,
                   aten._scaled_dot_product_flash_attention.default}


def check_policy(policy) -> str:
    """The recompute policy ``policy`` names (True: ``"block"``), or a ValueError listing them.

    Example::

        check_policy(True)          # 'block'
    """
    if policy is True:
        return "block"
    if policy not in POLICIES:
        raise ValueError(f"checkpoint={policy!r}: use True / 'block' (whole blocks), 'selective' (keep matmul and "
                         f"attention outputs, recompute the rest), False or None (the search decides)")
    return policy


def saved_by_selective(node: fx.Node) -> bool:
    """Whether the selective policy keeps ``node`` (its output is kept, it is not run again): a
    matmul, linear, convolution or attention op, a collective, an overlapped linear or ring
    attention (``runtime.primitives.recompute.keepable_name``)."""
    t = node.target
    return node.op == "call_function" and (t in SELECTIVE_SAVES or keepable_name(t) is not None)


def _is_view(node: fx.Node) -> bool:
    return getattr(node.target, "is_view", False) or node.target is operator.getitem


def block_of(node: fx.Node) -> Optional[tuple]:
    """The repeated block a node of the rewritten program belongs to, ``("layers", 3)``, or
    None: the module the rewrite recorded for it (``meta["autoshard"]["where"]``) or, for
    ops of the captured model, its innermost module; a block is the path up to the first
    numeric component (the cost model's segments use the same rule)."""
    meta = node.meta.get("autoshard")
    if meta is not None:
        fqn = meta.get("where", "") or ""
    else:
        stack = node.meta.get("nn_module_stack") or {}
        fqn = list(stack.values())[-1][0] if stack else ""
    parts = fqn.split(".") if fqn else []
    for i, p in enumerate(parts):
        if p.isdigit() and i > 0:
            return (".".join(parts[:i]), int(p))
    return None


def block_name(key: tuple) -> str:
    return f"{key[0]}.{key[1]}"


@dataclass
class Region:
    """One block's activation code in the program: ``nodes`` in program order, ``inputs``
    (values made outside it, in first-use order), ``outputs`` (its values read outside it);
    ``why_not``: the reason it cannot be cut out, or ''."""

    key: tuple
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    why_not: str = ""


def activation_nodes(graph: fx.Graph, user_names) -> set:
    """Nodes whose value depends on a user input (a placeholder named in ``user_names``)."""
    out = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in user_names:
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _finish(r: Region, order: dict) -> Region:
    """Fill ``r``'s inputs, outputs and why_not from its nodes."""
    inside = set(r.nodes)
    last = order[r.nodes[-1]]
    for node in r.nodes:
        for a in node.all_input_nodes:
            if a not in inside and a not in r.inputs:
                r.inputs.append(a)
        outside = [u for u in node.users if u not in inside]
        if outside:
            r.outputs.append(node)
            early = [u for u in outside if order[u] < last]
            if early and not r.why_not:
                r.why_not = (f"{early[0].name} (outside the block) reads {node.name} before the block's "
                             f"last op")
    return r


def block_regions(graph: fx.Graph, user_names) -> list:
    """The regions of every repeated block, in program order (see the module docstring)."""
    acts = activation_nodes(graph, user_names)
    order = {n: k for k, n in enumerate(graph.nodes)}
    regions: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or node not in acts:
            continue
        key = block_of(node)
        if key is not None:
            regions.setdefault(key, Region(key)).nodes.append(node)
    return [_finish(r, order) for r in regions.values()]


def _kept_bytes(graph: fx.Graph, user_names, values, storage=lambda n: n) -> dict:
    """{block key: bytes of the activations among ``values(region)``}, each ``storage(value)``
    counted once, at the first block that keeps it: the walk of :func:`boundary_bytes` and
    :func:`held_bytes`."""
    acts = activation_nodes(graph, user_names)
    seen: set = set()
    out: dict = {}
    for r in block_regions(graph, user_names):
        total = 0
        for a in values(r):
            b = storage(a)
            val = b.meta.get("val")
            if a in acts and b not in seen and isinstance(val, torch.Tensor):
                total += val.numel() * val.element_size()
            seen.add(b)
        out[r.key] = total
    return out


def boundary_bytes(graph: fx.Graph, user_names) -> dict:
    """{block key: bytes of the activations a checkpointed block keeps for backward}: its
    tensor inputs that depend on a user input, each value counted at the first block that
    reads it (a rotary table read by every block is kept once)."""
    return _kept_bytes(graph, user_names, lambda r: r.inputs)


def held_bytes(graph: fx.Graph, user_names, policy: str = "block") -> dict:
    """{block key: bytes of activations the block keeps between its forward and its backward
    under ``policy``}: its tensor inputs, and for the selective policy the outputs of the ops it
    keeps; each storage counted once (a view counts as its base; a value read by several blocks
    is counted at the first)."""
    def base(n):
        while n.op == "call_function" and _is_view(n) and n.all_input_nodes:
            n = n.all_input_nodes[0]
        return n

    def values(r):
        return list(r.inputs) + ([n for n in r.nodes if saved_by_selective(n)] if policy == "selective" else [])

    return _kept_bytes(graph, user_names, values, base)


def checkpoint_blocks(gm: fx.GraphModule, user_names, blocks=None, policy: str = "block"):
    """A copy of the program ``gm`` in which each repeated block (those named in ``blocks``,
    ``"layers.3"``; None: all) is recomputed by ``policy`` (:data:`POLICIES`): its regions run
    through ``Recomputed``. Returns ``(graph module, names of the blocks checkpointed, {name:
    why a block was left as it is})``."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    done, skipped = [], {}
    replaced: dict = {}  # an output of a region cut out earlier -> the getitem that stands for it
    selective = check_policy(policy) == "selective"
    for r in block_regions(graph, user_names):
        name = block_name(r.key)
        if blocks is not None and name not in blocks:
            continue
        if r.why_not:
            skipped[name] = r.why_not
            continue
        sub = fx.Graph()
        env = {}
        inputs = []
        for a in r.inputs:
            ph = sub.placeholder(a.name)
            ph.meta = dict(a.meta)
            now = replaced.get(a, a)  # block nodes read the stand-in of an earlier block's output
            env[a] = env[now] = ph
            inputs.append(now)
        for node in r.nodes:
            if selective and saved_by_selective(node):
                # kept, not recomputed: the op runs through keep(), named if it is the runtime's
                op = node.target if isinstance(node.target, torch._ops.OpOverload) else keepable_name(node.target)
                env[node] = sub.call_function(keep, (op, *fx.node.map_arg(node.args, lambda a: env[a])),
                                              fx.node.map_arg(node.kwargs, lambda a: env[a]))
                env[node].meta = dict(node.meta)
            else:
                env[node] = sub.node_copy(node, lambda a: env[a])
        sub.output(tuple(env[o] for o in r.outputs))
        attr = "recompute_" + name.replace(".", "_")
        gm.add_submodule(attr, Recomputed(fx.GraphModule(gm, sub), name, selective))
        with graph.inserting_after(r.nodes[-1]):
            call = graph.call_module(attr, tuple(inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in r.outputs)
        call.meta["autoshard_checkpoint"] = name
        prev, inside = call, set(r.nodes)
        for i, o in enumerate(r.outputs):
            with graph.inserting_after(prev):
                got = graph.call_function(operator.getitem, (call, i))
            got.meta = dict(o.meta)
            prev = got
            replaced[o] = got
            o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
        for node in reversed(r.nodes):
            graph.erase_node(node)
        done.append(name)
    graph.lint()
    gm.recompile()
    return gm, done, skipped
