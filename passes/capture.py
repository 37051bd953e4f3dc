"""Capture: torch.export (non-strict) to an FX graph with named inputs and clean ops.

Keeps parameter/buffer FQNs, ``nn_module_stack`` and ``stack_trace``; drops export-only nodes
(``_assert_tensor_metadata`` and friends); rewrites mean-reduced cross-entropy into a sum over
tokens divided by a count of valid tokens, so that a loss over a split batch is reduced globally
(no hidden averaging). The user's module is never modified. Features a plan would not reproduce
exactly are refused or warned about here (``passes/guards.py``).

Example::

    >>> import torch
    >>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    >>> [i.kind for i in cap.inputs]
    ['parameter', 'parameter', 'user']
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from .decompose import decompose
from .view_chains import compose_view_chains, unflatten_linears
from .export_errors import CaptureError, export_program  # noqa: F401 - CaptureError is re-exported
from .guards import refuse_autograd_functions, refuse_state_mutation, warn_dropout, watch_autograd_functions

aten = torch.ops.aten

EXPORT_ONLY = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
    aten._assert_async.msg,
}


@dataclass
class Input:
    """One placeholder of the captured graph."""

    name: str  # placeholder name
    kind: str  # parameter | buffer | constant | user
    target: str  # parameter/buffer FQN, constant name, or user argument path ("input_ids", "args[1]")
    trainable: bool = False


@dataclass
class Captured:
    graph: fx.Graph
    inputs: list  # Input, in placeholder order
    state: dict  # target -> tensor (parameters, buffers, constants), shared with the model
    in_spec: object  # pytree spec of (args, kwargs)
    out_spec: object
    seconds: float
    arg_names: list  # positional parameter names of forward, for dims given as a list
    aliases: dict  # tied parameter FQN -> the FQN kept in the graph

    @property
    def user_inputs(self):
        return [i for i in self.inputs if i.kind == "user"]

    def flatten_args(self, args, kwargs) -> list:
        """Leaves of (args, kwargs) in the order of the user placeholders."""
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        if spec != self.in_spec:
            raise ValueError(f"arguments do not match the captured call: expected {self.in_spec}, got {spec}")
        return flat


def _user_input_paths(args, kwargs, arg_names) -> list[str]:
    paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs or {})))
    out = []
    for path, _leaf in paths:
        top, rest = path[0].idx, path[1:]
        if top == 0:
            i = rest[0].idx
            name = arg_names[i] if i < len(arg_names) else f"args[{i}]"
            rest = rest[1:]
        else:
            name = rest[0].key
            rest = rest[1:]
        out.append(name + "".join(str(k) for k in rest))
    return out


def capture(model: torch.nn.Module, args, kwargs=None) -> Captured:
    """Export ``model(*args, **kwargs)`` and return a cleaned graph plus input metadata."""
    kwargs = dict(kwargs or {})
    t0 = time.perf_counter()
    with watch_autograd_functions() as functions:
        ep = export_program(model, args, kwargs)  # CaptureError: one line naming the cause and source line
    refuse_autograd_functions(functions)  # their backward is not in the graph
    seconds = time.perf_counter() - t0
    graph = ep.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in EXPORT_ONLY and not node.users:
            graph.erase_node(node)
    try:
        sig = inspect.signature(model.forward)
        arg_names = [p.name for p in sig.parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        arg_names = []
    user_paths = iter(_user_input_paths(args, kwargs, arg_names))
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    inputs, state = [], {}
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            inputs.append(Input(name, "parameter", spec.target, params[spec.target].requires_grad))
            state[spec.target] = params[spec.target]
        elif spec.kind == InputKind.BUFFER:
            inputs.append(Input(name, "buffer", spec.target))
            state[spec.target] = buffers[spec.target] if spec.target in buffers else ep.constants[spec.target]
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            inputs.append(Input(name, "constant", spec.target))
            state[spec.target] = ep.constants[spec.target]
        else:
            inputs.append(Input(name, "user", next(user_paths, name)))
    refuse_state_mutation(graph, inputs)  # each rank would update only its own copy
    warn_dropout(graph)
    aliases = _merge_tied(graph, inputs, state)
    aliases.update(_unlisted_aliases(params, buffers, inputs, state))
    decompose(graph)
    unflatten_linears(graph)  # before composing: the rows it unflattens may end a chain
    compose_view_chains(graph)
    _rewrite_reduced_cross_entropy(graph)
    graph.eliminate_dead_code()
    graph.lint()
    return Captured(graph, inputs, state, ep.call_spec.in_spec, ep.call_spec.out_spec, seconds, arg_names, aliases)


def _merge_tied(graph: fx.Graph, inputs: list, state: dict) -> dict:
    """Tied parameters (one tensor under two FQNs) become one placeholder, so their gradient
    is one sum and their owner one decision. Returns {alias FQN: kept FQN}."""
    first: dict = {}
    aliases = {}
    nodes = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    keep = []
    for inp in inputs:
        if inp.kind in ("parameter", "buffer"):
            key = id(state[inp.target])
            if key in first:
                kept = first[key]
                nodes[inp.name].replace_all_uses_with(nodes[kept.name])
                graph.erase_node(nodes[inp.name])
                aliases[inp.target] = kept.target
                continue
            first[key] = inp
        keep.append(inp)
    inputs[:] = keep
    return aliases


def _unlisted_aliases(params: dict, buffers: dict, inputs: list, state: dict) -> dict:
    """Tied names torch.export left out of the signature (it lists one FQN per tensor):
    {alias FQN: the FQN in the graph}, so users may name, and read gradients by, either."""
    kept = {id(state[i.target]): i.target for i in inputs if i.kind in ("parameter", "buffer")}
    return {name: kept[id(t)] for name, t in {**params, **buffers}.items()
            if id(t) in kept and kept[id(t)] != name}


def _rewrite_reduced_cross_entropy(graph: fx.Graph) -> None:
    """cross_entropy(mean) -> sum(cross_entropy(none)) / count; cross_entropy(sum) ->
    sum(cross_entropy(none)).

    The count is torch's divisor: the targets ``!= ignore_index`` for class-index targets, and
    every position (``input.numel() / C``, one per row) for probability targets (a float target
    shaped like the input), where ``ignore_index`` does not apply. Equal to torch's mean for
    unweighted losses; written out so a batch split across ranks sums numerator and count
    globally instead of averaging per-rank means. A sum is written out so the sharding rule sees
    the per-position losses (a batch split across ranks then sums them; a scalar output would
    have the logits gathered whole)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.cross_entropy_loss.default:
            continue
        a = list(node.args) + [None] * (6 - len(node.args))
        x, target, weight = a[0], a[1], node.kwargs.get("weight", a[2])
        reduction = node.kwargs.get("reduction", a[3] if a[3] is not None else 1)
        ignore = node.kwargs.get("ignore_index", a[4] if a[4] is not None else -100)
        smoothing = node.kwargs.get("label_smoothing", a[5] if a[5] is not None else 0.0)
        val = node.meta["val"]
        if reduction == 2:  # a sum: the per-position losses' sum, weighted or not
            with graph.inserting_before(node):
                per = graph.call_function(aten.cross_entropy_loss.default, (x, target, weight, 0, ignore, smoothing))
                per.meta = dict(node.meta, val=torch.empty(_position_shape(x), dtype=val.dtype, device=val.device))
                loss = graph.call_function(aten.sum.default, (per,))
                loss.meta = dict(node.meta)
            node.replace_all_uses_with(loss)
            graph.erase_node(node)
            continue
        if reduction != 1 or weight is not None:
            continue  # "none" is already per position; weighted means fall back
        xval, tval = x.meta["val"], target.meta["val"]
        probs = tval.is_floating_point() and tval.dim() == xval.dim()
        pshape = _position_shape(x)
        with graph.inserting_before(node):
            per = graph.call_function(aten.cross_entropy_loss.default, (x, target, None, 0, ignore, smoothing))
            per.meta = dict(node.meta, val=torch.empty(pshape, dtype=val.dtype, device=val.device))
            total = graph.call_function(aten.sum.default, (per,))
            total.meta = dict(node.meta, val=torch.empty((), dtype=val.dtype, device=val.device))
            if probs:
                valid = graph.call_function(aten.ones_like.default, (per,), {"dtype": torch.int64})
                valid.meta = dict(node.meta, val=torch.empty(pshape, dtype=torch.int64, device=val.device))
            else:
                valid = graph.call_function(aten.ne.Scalar, (target, ignore))
                valid.meta = dict(node.meta, val=torch.empty(tval.shape, dtype=torch.bool, device=val.device))
            count = graph.call_function(aten.sum.default, (valid,))
            count.meta = dict(node.meta, val=torch.empty((), dtype=torch.int64, device=val.device))
            loss = graph.call_function(aten.div.Tensor, (total, count))
            loss.meta = dict(node.meta, val=torch.empty((), dtype=val.dtype, device=val.device))
        node.replace_all_uses_with(loss)
        graph.erase_node(node)


def _position_shape(x: fx.Node) -> tuple:
    """The per-position loss's shape: the input's without its class dim (dim 1, or 0 if 1-D)."""
    shape = x.meta["val"].shape
    return tuple(shape[:1]) + tuple(shape[2:]) if len(shape) > 1 else ()
