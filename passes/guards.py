"""Capture-time guards: model features a plan cannot reproduce exactly are refused (or warned
about) when the model is captured, instead of giving silently different results.

- a custom ``torch.autograd.Function`` applied to values that need gradients: non-strict
  torch.export keeps only the ops of its ``forward``, so its ``backward`` would be dropped
  -> :class:`UnsupportedModelError` naming the Function and the line that applies it;
- an in-place write into a parameter in forward, or of a random value into a buffer (each rank
  would draw its own) -> :class:`UnsupportedModelError` naming it and the line; other buffer
  updates (a counter ``add_``, BatchNorm running statistics) run on every rank's piece and are
  listed, so the runtime can hand the new values back;
- dropout in training mode: each rank draws its own mask, so results are not reproducible
  against the unsharded model -> :class:`DropoutWarning`.

Example::

    >>> import torch
    >>> with watch_autograd_functions() as found:
    ...     _ = torch.nn.Linear(2, 2)(torch.randn(1, 2))
    >>> found
    []
"""
from __future__ import annotations

import contextlib
import os
import traceback
import warnings

import torch
from torch import fx

from .dims import module_of, source_line
from .rules import _is_view

aten = torch.ops.aten


class UnsupportedModelError(ValueError):
    """The model uses a feature whose effect a plan would not reproduce (a custom autograd
    Function's backward, an in-place buffer update); raised at capture."""


class DropoutWarning(UserWarning):
    """The plan runs dropout in training mode: every rank draws its own mask, so outputs and
    gradients are not reproducible against the unsharded model (``model.eval()`` to compare)."""


# frames in these directories are torch's or the planner's, not the user's
_SKIP_DIRS = tuple(os.path.join(d, "") for d in (
    os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "autoshard")))


def _user_frame() -> str:
    """'file.py:line' of the innermost frame outside torch and autoshard (the user's call)."""
    for fr in reversed(traceback.extract_stack()):
        path = os.path.abspath(fr.filename)
        if not path.startswith(_SKIP_DIRS) and "<" not in fr.filename:
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return "?"


def user_line(node: fx.Node) -> str:
    """'file.py:line' of the innermost frame of a node's stack trace outside torch and the
    planner (the user's line that led to the op), else the innermost frame."""
    frames = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip().startswith("File ")]
    for ln in reversed(frames):
        path = ln.split('"')[1] if ln.count('"') >= 2 else ""
        if path and not os.path.abspath(path).startswith(_SKIP_DIRS):
            return f"{os.path.basename(path)}:{ln.split('line')[-1].split(',')[0].strip()}"
    return source_line(node)


@contextlib.contextmanager
def watch_autograd_functions():
    """Within the block, record each custom ``torch.autograd.Function`` applied (with grad mode
    on) to a tensor that requires grad: yields a list of ``(Function name, 'file:line')``."""
    found: list = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        # torch.library custom ops with register_autograd dispatch through a generated Function;
        # the op itself is one node of the graph, and its autograd formula stays with it
        if not cls.__module__.startswith("torch._library") and torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in list(args) + list(kwargs.values())):
            found.append((cls.__qualname__, _user_frame()))
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield found
    finally:
        torch.autograd.Function.apply = original


def refuse_autograd_functions(found: list) -> None:
    """Raise :class:`UnsupportedModelError` for the first Function ``watch_autograd_functions`` saw."""
    if found:
        name, where = found[0]
        raise UnsupportedModelError(
            f"the model applies the custom autograd Function {name} (at {where}) to values that need "
            f"gradients; torch.export keeps only its forward ops, so its backward would be dropped "
            f"(hint: write it with torch ops, or as a torch.library custom op with register_autograd)")


# op -> (index of the `training` argument, indices of the running statistics it updates)
RUNNING_STATS = {
    aten.batch_norm.default: (5, (3, 4)),
    aten._native_batch_norm_legit.default: (5, (3, 4)),
    aten._native_batch_norm_legit_functional.default: (5, (3, 4)),
    aten.native_batch_norm.default: (5, (3, 4)),
    aten.instance_norm.default: (5, (3, 4)),
}

DROPOUT = {aten.dropout.default: (1, 2), aten.feature_dropout.default: (1, 2),
           aten.alpha_dropout.default: (1, 2), aten.feature_alpha_dropout.default: (1, 2),
           aten.native_dropout.default: (1, 2)}  # op -> (index of p, index of train)


def written_arguments(node: fx.Node) -> list:
    """The arguments an op writes into: those its schema marks ``(a!)``, and the running
    statistics of a normalization in training mode."""
    out = []
    schema = getattr(node.target, "_schema", None)
    for k, arg in enumerate(schema.arguments if schema is not None else []):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(node.args[k] if k < len(node.args) else node.kwargs.get(arg.name))
    if node.target in RUNNING_STATS:
        train, stats = RUNNING_STATS[node.target]
        if len(node.args) > train and node.args[train] is True:
            out.extend(node.args[k] for k in stats if k < len(node.args))
    return out


def _root(v):
    while isinstance(v, fx.Node) and _is_view(v):
        v = v.args[0]
    return v


def _random(node: fx.Node) -> bool:
    """Whether an op draws random numbers (an inactive dropout does not)."""
    if node.target in DROPOUT:
        p, train = DROPOUT[node.target]
        a = list(node.args)
        if (len(a) > train and a[train] is False) or (len(a) > p and a[p] == 0):
            return False
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def refuse_state_mutation(graph: fx.Graph, inputs: list) -> list:
    """Raise :class:`UnsupportedModelError` if forward writes in place into a parameter, or
    into a buffer a value drawn at random (each rank would draw its own, so the copies would
    differ). Returns the buffers forward updates (their FQNs, in graph order): each rank's
    program writes its piece of them (BatchNorm's running statistics, a counter), and the
    runtime hands the new values back (``Plan.simulate``). ``inputs``: the capture's
    placeholder descriptions."""
    state = {i.name: i for i in inputs if i.kind in ("buffer", "parameter")}
    random, mutated = set(), []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _random(node) or any(a in random for a in node.all_input_nodes):
            random.add(node)
        for v in written_arguments(node):
            root = _root(v)
            if not (isinstance(root, fx.Node) and root.op == "placeholder" and root.name in state):
                continue
            inp = state[root.name]
            op = getattr(node.target, "__name__", str(node.target))
            where = f"{op} in module {module_of(node) or '<root>'}" + (" at " + user_line(node) if user_line(node) else "")
            if inp.kind == "parameter":
                raise UnsupportedModelError(
                    f"forward updates the parameter {inp.target} in place ({where}); a plan would not carry the "
                    f"update back to the model (hint: keep such state in a buffer, or outside the model)")
            if node in random:
                raise UnsupportedModelError(
                    f"forward writes a random value into the buffer {inp.target} ({where}); every rank would draw "
                    f"its own, so the copies of the buffer would differ (hint: draw it outside the model)")
            if inp.target not in mutated:
                mutated.append(inp.target)
    return mutated


def warn_dropout(graph: fx.Graph) -> None:
    """Warn (:class:`DropoutWarning`) once if the graph has dropout in training mode."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in DROPOUT:
            p, train = DROPOUT[node.target]
            a = list(node.args)
            if len(a) > train and a[train] is not False and len(a) > p and a[p] != 0:
                where = " at " + user_line(node) if user_line(node) else ""
                warnings.warn(
                    f"dropout in training mode (module {module_of(node) or '<root>'}{where}): every rank draws "
                    f"its own mask, so outputs and gradients will not match the unsharded model "
                    f"(call model.eval() to compare)", DropoutWarning, stacklevel=4)  # the autoshard() call
                return
