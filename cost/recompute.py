"""Activation checkpointing as a memory lever: what recomputing each repeated block in
backward saves in memory and costs in time (seed 003: checkpointing trades one more forward
of the blocks for their activations).

With every block checkpointed (``autoshard.passes.recompute``), a block keeps only its inputs
(``Segment.boundary_bytes``: activations made before it, each counted once) between forward
and backward; when backward reaches it the block runs forward again, so its own activations
live once more, one block at a time. So, per rank:

- activations = what the code outside the blocks saves + every block's inputs + the largest
  block's saved activations (the recompute's working set);
- time: each block's forward compute is paid again in backward, and its forward collectives
  (tensor-parallel all-reduces) run again there, blocking.

:func:`checkpoint_choice` is the search's decision: off if the plan fits ``memory_limit``
without it, on if only the checkpointed plan fits.

Example::

    segs = annotate_boundaries(program_events(program, mesh, cm, params), program.graph_module.graph, users)
    cost = simulate(checkpointed_segments(segs), mesh, cm, train=True, state=state)
"""
from __future__ import annotations

import copy

from autoshard.passes.recompute import boundary_bytes

from autoshard.cost.model import Comm, Segment, program_cost, program_events


def annotate_boundaries(segments: list, graph, user_names) -> list:
    """Set ``boundary_bytes`` on the segments of ``graph`` (the program they were made from):
    the first segment of each block gets the bytes its checkpointed region keeps."""
    by_block = boundary_bytes(graph, user_names)
    seen = set()
    for seg in segments:
        if seg.block is not None and seg.block not in seen:
            seen.add(seg.block)
            seg.boundary_bytes = by_block.get(seg.block, 0)
    return segments


def checkpointed_segments(segments: list) -> list:
    """The segments of the same program with every repeated block recomputed in backward:
    a block saves its inputs only, its forward compute and forward collectives are paid again
    in backward, and one extra segment holds the largest block's activations (the working set
    of the recompute running at the time)."""
    out, biggest = [], 0
    for seg in segments:
        if seg.block is None:
            out.append(seg)
            continue
        biggest = max(biggest, seg.saved_bytes)
        new = copy.copy(seg)
        new.saved_bytes = seg.boundary_bytes
        items = []
        for it in seg.items:
            if isinstance(it, tuple):
                items.append((it[0], it[1] + it[0]))
            elif isinstance(it, Comm) and it.fwd_kind is not None and not it.gathered_param_bytes:
                # an activation collective of the block: run again by the recompute, blocking
                items.append(it)
                items.append((0.0, it.fwd_s))
            else:
                items.append(it)
        new.items = items
        out.append(new)
    out.append(Segment(None, [], saved_bytes=biggest))
    return out


def has_blocks(segments: list) -> bool:
    return any(s.block is not None for s in segments)


def checkpoint_choice(plain, checkpointed, memory_limit, forced=None):
    """``(use checkpointing, its cost)`` given the plain and the checkpointed ``PlanCost`` (the
    latter may be a callable, evaluated only if needed): ``forced`` True / False decides;
    otherwise checkpointing is on only when the plain plan exceeds ``memory_limit`` and the
    checkpointed one fits."""
    if forced is False or (forced is None and plain.fits(memory_limit)):
        return False, plain
    ck = checkpointed() if callable(checkpointed) else checkpointed
    if forced or ck.fits(memory_limit):
        ck.checkpoint = True
        return True, ck
    return False, plain


def checkpointed_program_cost(program, inputs, vals, mesh, cm, **kw):
    """``cost.model.program_cost`` of ``program`` with every repeated block recomputed in
    backward (``kw`` as for ``program_cost``)."""
    params = {i.name for i in inputs if i.kind == "parameter" and i.trainable}
    segs = annotate_boundaries(program_events(program, mesh, cm, params, vals), program.graph_module.graph,
                               {i.name for i in inputs if i.kind == "user"})
    cost = program_cost(program, inputs, vals, mesh, cm, segments=checkpointed_segments(segs), **kw)
    cost.checkpoint = True
    return cost
