"""What a rewrite building no graph has decided before a node: saved, and resumed by another layout.

The layout search rewrites one captured graph hundreds of times, one axis option at a time and
without building a graph (``collectives_only``: ``SearchSpace._axis_records``). Two options
whose units decide alike up to a node (``cost/prefix_records.py``: the same units, in the same
order, can split a dim of the nodes before it) make the same decisions on every node before it:
the same placements, conversions and collectives. So a rewrite of the second may start at that
node from the first one's state there, instead of visiting the nodes before it again.

The state is the rewriter's tables (placements, local values, conversion caches, pending sums,
collectives emitted) and its inputs' placements. Only the inputs read before the node carry
over: each input read at or after it is placed again by the resuming layout (the inputs are
placed where they appear, at the top of the graph, but a layout decides their placement only
where they are read: ``passes/untouched.py``). Only layouts whose nodes decide from the units of
their own values are saved or resumed (``untouched.units_if_local``: no sharded state, no
gradient buckets, no input placed by another pass, and only lowerings marked
``lowering.decides_locally``).

Example::

    taken = []
    marks = Checkpoints({120, 154}, taken.append)
    rewrite(graph, info, layout_a, mesh, grad, collectives_only=True, checkpoints=marks)
    # taken[0].position == 120; if layout_b's units decide as layout_a's before node 120:
    rewrite(graph, info, layout_b, mesh, grad, collectives_only=True, resume=taken[0])
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

# the rewriter's tables a node visit may add to (each copied on save and again on resume: the
# saved state serves every resume from it)
TABLES = ("local", "place", "cache", "all_reduced", "summed", "fallbacks", "partial_why", "joined", "copies")


@dataclass(frozen=True)
class RewriteState:
    """The state of a collectives-only rewrite before node ``position`` (of ``graph.nodes``)."""

    position: int
    tables: dict  # TABLES -> a copy
    hook_state: dict  # conversions.Step.memo tables: {hook: {key: value}}
    collectives: tuple  # emitted so far, in program order
    tag: int  # the next collective tag
    inputs: tuple  # (placements as stored, placeholders, placements where used) of the inputs placed


@dataclass(frozen=True)
class Checkpoints:
    """Where to save a rewrite's state (node indices) and what to give each saved state to."""

    positions: frozenset
    take: Callable


def save(rw, inputs) -> RewriteState:
    """``rw``'s state before the node it is at (``rw.position``); ``inputs``: its run's
    ``_Inputs``."""
    return RewriteState(rw.position, {k: copy.copy(getattr(rw, k)) for k in TABLES},
                        {k: dict(v) for k, v in rw.hook_state.items()}, tuple(rw.collectives), rw.tag,
                        (list(inputs.places), list(inputs.placeholders), dict(inputs.use)))


def restore(rw, state: RewriteState) -> tuple:
    """Set ``rw``'s tables to (copies of) ``state``'s; the inputs' (places, placeholders, use)
    copied."""
    for k in TABLES:
        setattr(rw, k, copy.copy(state.tables[k]))
    rw.hook_state = {k: dict(v) for k, v in state.hook_state.items()}
    rw.collectives.extend(state.collectives)  # (in place: it may be the caller's budgeted list)
    rw.tag = state.tag
    places, placeholders, use = state.inputs
    return list(places), list(placeholders), dict(use)
