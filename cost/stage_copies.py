"""Values a stage program makes afresh in every microbatch's forward from state alone, and
that autograd keeps until that microbatch's backward: per microbatch in flight, memory that
``cost/saved.py`` counts as state (made from parameters and buffers) but that the runtime holds
once per forward.

Two kinds, both new storages at run time:

- the local copies of a parameter made by a collective whose forward moves nothing
  (``mark_varying``'s identity, a ``use_persistent``: ``runtime.primitives.collectives`` clones
  there, since an output aliasing a custom Function's input could not be written in place). A
  pipelined plan's data-axis sums are deferred to the step's last backward, so every replicated
  weight the stage reads goes through one, and a linear keeps that copy (its input's gradient
  needs the weight) as a checkpointed block keeps it among its inputs;
- tables computed from buffers and constants alone (a rotary embedding's cos / sin), kept by
  the product that reads them, or by the checkpointed block they enter.

ZeRO-3 gathers released after forward (``reshard_tags``) are not held, so not counted.

Example::

    segs = program_events(prog, mesh, cm, params, counter=copy_counter(prog.reshard_tags))
    sum(s.saved_bytes for s in segs)         # bytes of such copies one microbatch keeps
    region_copy_inputs(gm.graph, users)      # {block key: the copies a checkpointed block keeps}
"""
from __future__ import annotations

import torch

from autoshard.passes.recompute import activation_nodes, block_regions

from autoshard.cost.saved import SAVES, SavedCounter, _is_view

aten = torch.ops.aten

# a linear's backward keeps its weight too (for its input's gradient): counted here, where the
# weight is a per-microbatch copy (cost/saved.py counts the input only: the weight is state)
COPY_SAVES = {**SAVES, aten.linear.default: (("in", 0), ("in", 1))}


def _aliases(node) -> bool:
    """Whether ``node``'s value is its first input's storage at run time: a view, or a cast to
    the dtype it already has (``aten.to.dtype`` returns its input then)."""
    if _is_view(node):
        return True
    if node.target is aten.to.dtype and node.args and isinstance(node.args[0], torch.fx.Node):
        src, out = node.args[0].meta.get("val"), node.meta.get("val")
        return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
    return False


def _base(node):
    while node.op == "call_function" and _aliases(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _released(node, reshard_tags) -> bool:
    return bool(reshard_tags) and node.op == "call_function" and node.kwargs.get("tag") in reshard_tags \
        and getattr(node.target, "__module__", "") == "autoshard.runtime.primitives.collectives"


def fresh_state_values(graph, user_names, reshard_tags=()) -> set:
    """Nodes of ``graph`` computed from state and constants alone (no user input, no received
    value) whose value is a storage of its own at run time (see the module docstring)."""
    acts = activation_nodes(graph, user_names)
    return {n for n in graph.nodes if n.op == "call_function" and n not in acts and _base(n) is n
            and not _released(n, reshard_tags)}


def copy_counter(reshard_tags=(), user_names=None):
    """A ``SavedCounter`` factory for ``cost.model.program_events(counter=...)`` whose counts
    are the bytes of per-microbatch copies (:func:`fresh_state_values`) autograd keeps, op by
    op; ``user_names``: the placeholders that are activations (default: those not named as
    state, ``cost.saved.STATE_PREFIXES``, nor made by the pipeline's receives)."""

    class CopyCounter(SavedCounter):
        rules = COPY_SAVES

        def __init__(self, graph, rg):
            super().__init__(graph, rg)
            users = user_names if user_names is not None else {
                n.name for n in graph.nodes if n.op == "placeholder" and n not in self.state}
            self.copies = fresh_state_values(graph, users, reshard_tags)

        def _bytes(self, node) -> int:
            b = _base(node)
            if b in self.seen or b not in self.copies:
                return 0
            self.seen.add(b)
            return _nbytes(b)

    return CopyCounter


def _nbytes(node) -> int:
    v = node.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))


def region_copy_inputs(graph, user_names, reshard_tags=()) -> dict:
    """{block key: bytes of per-microbatch copies among a checkpointed block's tensor inputs}
    (a recompute keeps every tensor input; each storage counted at the first block reading it)."""
    fresh = fresh_state_values(graph, user_names, reshard_tags)
    seen: set = set()
    out = {}
    for r in block_regions(graph, user_names):
        total = 0
        for a in r.inputs:
            b = _base(a)
            if b in fresh and b not in seen:
                total += _nbytes(b)
            seen.add(b)
        out[r.key] = total
    return out
