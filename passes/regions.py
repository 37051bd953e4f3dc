"""Higher-order regions of a captured program: grad-mode regions inlined, the others refused.

torch.export keeps a ``with torch.no_grad():`` or ``torch.set_grad_enabled(flag)`` block in
forward as a ``wrap_with_set_grad_enabled`` higher-order op calling a submodule (a ``get_attr``
node). :func:`inline_regions` copies each such submodule's nodes into the main graph where the
op was, tags every copied node with the grad mode it runs in (``meta["grad_enabled"]``, the
innermost block's), and puts an ``aten.detach`` on every value computed with grad disabled that
is read where grad is enabled: the program computes the same values, and gradients stop where
eager autograd stops them (a ``set_grad_enabled(True)`` block nested in ``no_grad`` carries its
gradients out, as in eager). :func:`no_grad_node` tells the rewriter which values carry no
gradient. An autocast block that is disabled is inlined the same way (it changes no dtype).
:func:`refuse_no_grad_writes` refuses an in-place write made under ``no_grad`` into a value
that needs gradients (eager passes the gradient through the overwritten elements).

The other higher-order ops torch.export can emit -- ``cond``, ``while_loop``, ``map``,
``invoke_subgraph``, an enabled autocast block (its casts are applied at dispatch, so the
exported ops inside it are not the ones eager runs), ... -- are refused with a one-line
:class:`~autoshard.passes.export_errors.CaptureError` naming the op, the module and the source
line.

Example::

    >>> import torch
    >>> class Routed(torch.nn.Module):
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             w = x.softmax(-1)
    ...         return (x * w).sum()
    >>> ep = torch.export.export(Routed(), (torch.randn(2, 3),), strict=False)
    >>> inline_regions(ep.graph_module)
    1
    >>> [n.target.__name__ for n in ep.graph.nodes if n.op == "call_function"]
    ['softmax.int', 'detach.default', 'mul.Tensor', 'sum.default']
"""
from __future__ import annotations

import operator
import os
import re

import torch
from torch import fx

from .dims import module_of
from .export_errors import CaptureError
from .rules import _is_view, is_inplace

aten = torch.ops.aten
hop = torch.ops.higher_order

GRAD_MODE = "grad_enabled"  # node.meta key: False for a node computed with grad disabled


def no_grad_node(node: fx.Node) -> bool:
    """Whether ``node``'s value carries no gradient whatever its inputs (computed with grad
    disabled, or a detach)."""
    return node.meta.get(GRAD_MODE) is False or (node.op == "call_function" and node.target == aten.detach.default)


def inline_regions(gm: fx.GraphModule) -> int:
    """Inline every grad-mode region of ``gm``'s graph (nested ones too) and detach what they
    compute without grad where grad-enabled code reads it; refuse any other higher-order op.
    Returns how many regions were inlined."""
    n = _inline(gm, None)
    if n:
        _detach_no_grad_reads(gm.graph)
        for node in list(gm.graph.nodes):  # the get_attr nodes of the inlined submodules
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.recompile()
    return n


def _inline(gm: fx.GraphModule, mode) -> int:
    """Inline the regions of ``gm`` whose nodes run in grad mode ``mode`` (None: the caller's)."""
    graph, n = gm.graph, 0
    for node in list(graph.nodes):
        if node.op == "call_function" and mode is not None and GRAD_MODE not in node.meta:
            node.meta[GRAD_MODE] = mode
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        if node.target is hop.wrap_with_set_grad_enabled:
            inner_mode, sub_node, operands = bool(node.args[0]), node.args[1], node.args[2:]
        elif node.target is hop.wrap_with_autocast and node.args[2] is False:
            inner_mode, sub_node, operands = mode, node.args[4], node.args[5:]  # disabled: no casts
        else:
            raise CaptureError(_refusal(gm, node))
        sub = getattr(gm, sub_node.target)
        n += 1 + _inline(sub, inner_mode)
        _splice(gm, node, sub, operands)
    return n


def _splice(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, operands) -> None:
    """Copy ``sub``'s nodes before ``node`` (its placeholders bound to ``operands``) and make
    ``node``'s ``getitem`` users read the copied outputs."""
    graph, env = gm.graph, {}
    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
    env.update(zip(placeholders, operands))
    outputs = ()
    with graph.inserting_before(node):
        for s in sub.graph.nodes:
            if s.op == "placeholder":
                continue
            if s.op == "output":
                outputs = s.args[0]
                continue
            if s.op == "get_attr" and not s.users:  # a nested region's submodule, inlined into ``sub``
                continue
            if s.op == "get_attr":
                raise CaptureError(f"a {node.target.name()} region reads attribute {s.target!r} at "
                                   f"{_where(node, gm)}, which capture does not inline")
            env[s] = graph.node_copy(s, lambda a: env[a])
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(env.get(outputs[user.args[1]], outputs[user.args[1]]))
            graph.erase_node(user)
        else:
            raise CaptureError(f"{node.target.name()}'s result is read whole by {user.name} at {_where(node, gm)}")
    graph.erase_node(node)


def _detach_no_grad_reads(graph: fx.Graph) -> None:
    """One ``aten.detach`` per floating value computed with grad disabled and read where grad
    is enabled (or returned): the place where eager autograd cuts its graph."""
    for node in list(graph.nodes):
        if node.meta.get(GRAD_MODE) is not False:
            continue
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dtype.is_floating_point):
            continue  # integer and bool values carry no gradient
        readers = [u for u in node.users if u.op == "output" or u.meta.get(GRAD_MODE) is not False]
        if not readers:
            continue
        with graph.inserting_after(node):
            cut = graph.call_function(aten.detach.default, (node,))
        cut.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "val")}
        cut.meta[GRAD_MODE] = False
        for u in readers:
            u.replace_input_with(node, cut)


def refuse_no_grad_writes(graph: fx.Graph, grad_values: set) -> None:
    """Refuse an in-place write made with grad disabled into a value that needs gradients (or a
    view of one): eager autograd does not see the write and passes the gradient through the
    overwritten elements as if it never happened, which no functional program computes exactly.
    ``grad_values``: the nodes whose values need gradients (``spmd.requires_grad_nodes``)."""
    for node in graph.nodes:
        if node.meta.get(GRAD_MODE) is not False or node.op != "call_function" or not is_inplace(node.target):
            continue
        dst = node.args[0] if node.args else None
        while isinstance(dst, fx.Node) and dst not in grad_values and _is_view(dst):
            dst = dst.args[0]
        if isinstance(dst, fx.Node) and dst in grad_values:
            raise CaptureError(
                f"{node.target} under torch.no_grad() writes into {dst.name}, which needs gradients, at "
                f"{_where(node, None)}: eager autograd passes the gradient through the overwritten elements "
                f"(hint: write outside the no_grad block, or into a detached copy: y = y.detach().clone())")


_TORCH_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")


def _where(node: fx.Node, gm: fx.GraphModule) -> str:
    """'node N in module M at file.py:L' for a higher-order op: its module, and the line of the
    model's code it runs (torch.export records no stack trace on some of these nodes; then the
    first traced node inside its submodules tells, by its innermost frame outside torch)."""
    traced = [node] + [s for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"
                       for s in getattr(getattr(gm, a.target, None), "graph", fx.Graph()).nodes]
    line = ""
    for t in traced:
        frames = re.findall(r'File "([^"]+)", line (\d+)', t.meta.get("stack_trace") or "")
        frames = [(p, n) for p, n in frames if not p.startswith((_TORCH_DIR, "<"))]
        if frames:
            line = f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}"
            break
    return f"node {node.name} in module '{module_of(node) or '<root>'}'" + (f" at {line}" if line else "")


_HINTS = {
    "cond": "compute both branches and pick with torch.where, or take the branch outside the model",
    "while_loop": "unroll the loop to a fixed count in Python",
    "map_impl": "loop over the leading dim in Python",
    "wrap_with_autocast": "cast explicitly (.to(dtype)) or plan with precision={'param': dtype}",
}


def _refusal(gm: fx.GraphModule, node: fx.Node) -> str:
    name = node.target.name()
    if node.target is hop.wrap_with_autocast:
        what = f"an enabled autocast region ({node.args[0]}, {str(node.args[1]).replace('torch.', '')})"
    else:
        what = f"higher-order op torch.ops.higher_order.{name}"
    hint = _HINTS.get(name, "a plan is one fixed program of aten ops")
    return f"capture does not support {what} at {_where(node, gm)} (hint: {hint})"
