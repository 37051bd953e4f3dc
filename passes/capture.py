"""Capture: torch.export (non-strict) to an FX graph with named inputs and clean ops.

Keeps parameter/buffer FQNs, ``nn_module_stack`` and ``stack_trace``; drops export-only nodes
(``_assert_tensor_metadata`` and friends); rewrites mean-reduced cross-entropy into a sum over
tokens divided by a count of valid tokens, so that a loss over a split batch is reduced globally
(no hidden averaging); makes in-place writes functional (``passes/functionalize.py``). The
user's module is never modified. Features a plan would not reproduce exactly are refused or
warned about here (``passes/guards.py``); grad-mode regions (``torch.no_grad()`` in forward)
are inlined, other higher-order ops refused (``passes/regions.py``).

Example::

    >>> import torch
    >>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    >>> [i.kind for i in cap.inputs]
    ['parameter', 'parameter', 'user']
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from autoshard.runtime.execution.inputs import InputMismatchError

from .decompose import decompose
from .dims import module_of
from .view_chains import compose_view_chains, unflatten_linears
from .export_errors import CaptureError, export_program  # noqa: F401 - CaptureError is re-exported
from .functionalize import functionalize
from .regions import inline_regions, refuse_no_grad_writes
from .spmd import requires_grad_nodes
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
    mutated: list = field(default_factory=list)  # buffer FQNs forward updates in place, in graph order
    batch_statistics: list = field(default_factory=list)  # modules normalizing with the batch's statistics

    @property
    def user_inputs(self):
        return [i for i in self.inputs if i.kind == "user"]

    def loss_output(self) -> int:
        """Which flat output is the loss: the output itself, its first element, or ``.loss``."""
        n = len(self.graph.output_node().args[0])
        tree = pytree.tree_unflatten(list(range(n)), self.out_spec)
        if isinstance(tree, int):
            return tree
        if hasattr(tree, "loss") and isinstance(getattr(tree, "loss"), int):
            return tree.loss
        if isinstance(tree, dict):
            return tree["loss"] if "loss" in tree else next(iter(tree.values()))
        return pytree.tree_leaves(tree[0])[0]

    def require_scalar_loss(self, why: str) -> None:
        """Refuse, as ``loss.backward()`` does, a loss output that is not a scalar (one element):
        training on it would train on the gradients of its sum. ``why``: what wants to train.

        Example::

            cap.require_scalar_loss("train=True")  # ValueError for a loss of shape [4]
        """
        k = self.loss_output()
        node = self.graph.output_node().args[0][k]
        val = node.meta.get("val") if isinstance(node, fx.Node) else node
        if isinstance(val, torch.Tensor) and val.numel() == 1:
            return
        n = len(self.graph.output_node().args[0])
        paths = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(n)), self.out_spec))[0]
        name = f"output{pytree.keystr(paths[k][0])}" if paths[k][0] else "the model's output"
        what = f"has shape {list(val.shape)}" if isinstance(val, torch.Tensor) else f"is {val!r}"
        raise ValueError(f"{why}: the loss, {name}, {what}: grad can be implicitly created only for scalar "
                         f"outputs (torch's loss.backward() refuses it; a plan would train on its sum) (hint: "
                         f"reduce it in forward, e.g. .sum() or .mean(), or return the scalar loss first or as .loss)")

    def flatten_args(self, args, kwargs) -> list:
        """Leaves of (args, kwargs) in the order of the user placeholders."""
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        if spec != self.in_spec:
            raise InputMismatchError(call_mismatch(self.in_spec, spec, self.arg_names))
        return flat


def call_mismatch(planned, given, arg_names=()) -> str:
    """One line saying how a call's (args, kwargs) structure differs from the planned one: the
    positional arguments' count, the keyword inputs missing or unexpected, or the first argument
    whose nesting differs.

    >>> from torch.utils import _pytree as pytree
    >>> spec = lambda *a, **k: pytree.tree_flatten((a, k))[1]
    >>> print(call_mismatch(spec(1, mask=2), spec(1)))
    keyword input mask is missing: the plan was made for keyword inputs ['mask'], got none (plan again for these inputs)
    """
    (p_args, p_kw), (g_args, g_kw) = planned.children(), given.children()
    hint = "(plan again for these inputs)"
    if p_args.num_children != g_args.num_children:
        return (f"the call has {g_args.num_children} positional argument(s); the plan was made for "
                f"{p_args.num_children} {hint}")
    p_keys, g_keys = list(p_kw.context or []), list(g_kw.context or [])
    missing = [k for k in p_keys if k not in g_keys]
    extra = [k for k in g_keys if k not in p_keys]
    if missing or extra:
        parts = ([f"keyword input{'s' * (len(missing) > 1)} {', '.join(missing)} "
                  f"{'are' if len(missing) > 1 else 'is'} missing"] if missing else []) + \
                ([f"keyword input{'s' * (len(extra) > 1)} {', '.join(extra)} not planned"] if extra else [])
        return f"{'; '.join(parts)}: the plan was made for keyword inputs {p_keys}, got {g_keys or 'none'} {hint}"
    for i in range(p_args.num_children):
        if p_args.child(i) != g_args.child(i):
            name = arg_names[i] if i < len(arg_names) else f"args[{i}]"
            return (f"argument {name} is nested as {_one_line(g_args.child(i))}; the plan was made for "
                    f"{_one_line(p_args.child(i))} {hint}")
    for k in p_keys:
        if p_kw.child(p_keys.index(k)) != g_kw.child(g_keys.index(k)):
            return f"keyword input {k} is nested differently than in the planned call {hint}"
    return f"the call's arguments are ordered or nested differently than the planned call's {hint}"


def _one_line(spec) -> str:
    return " ".join(str(spec).split())


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
    # no_grad / set_grad_enabled blocks become plain nodes, their values detached where grad-enabled
    # code reads them; cond, while_loop, enabled autocast, ...: CaptureError naming op and line
    # (first: torch.cond runs as an autograd Function, which the next line would name instead)
    inline_regions(ep.graph_module)
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
    aliases = _merge_tied(graph, inputs, state)
    aliases.update(_unlisted_aliases(params, buffers, inputs, state))
    batch_statistics = [module_of(n) or "<root>" for n in graph.nodes if _batch_statistics(n)]
    mutated = refuse_state_mutation(graph, inputs)  # parameters; buffers get random values
    refuse_no_grad_writes(graph, requires_grad_nodes(graph, {i.name for i in inputs if i.trainable}))
    warn_dropout(graph)
    # in-place writes -> functional ops (a buffer's last value copied back into it)
    functionalize(graph, {i.name for i in inputs if i.kind == "buffer"})
    decompose(graph)  # BatchNorm in training mode becomes sums and in-place running-stat updates
    unflatten_linears(graph)  # before composing: the rows it unflattens may end a chain
    compose_view_chains(graph)
    _rewrite_reduced_cross_entropy(graph)
    graph.eliminate_dead_code()
    graph.lint()
    return Captured(graph, inputs, state, ep.call_spec.in_spec, ep.call_spec.out_spec, seconds, arg_names, aliases,
                    mutated, batch_statistics)


def _batch_statistics(node: fx.Node) -> bool:
    """A normalization over the batch's own statistics (BatchNorm in training mode)."""
    return node.op == "call_function" and node.target == aten.batch_norm.default and bool(
        node.args[5] if len(node.args) > 5 else node.kwargs.get("training"))


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
