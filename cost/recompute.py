"""Activation checkpointing as a memory lever: what recomputing each repeated block in
backward saves in memory and costs in time (checkpointing trades one more forward of the
blocks for their activations: Chen et al., 2016), by policy (``autoshard.passes.recompute.POLICIES``).

With every block checkpointed (``autoshard.passes.recompute``), a block keeps only its inputs
(``Segment.boundary_bytes``: activations made before it, each counted once) between forward
and backward; when backward reaches it the block runs forward again, so its own activations
live once more, one block at a time. So, per rank:

- activations: the peak over backward of what is kept (the code outside the blocks saves, every
  block its inputs) and, while block k is recomputed, what was kept up to block k (later values
  are freed by then) plus block k's saved activations (the recompute's working set);
- time: each block's forward compute is paid again in backward, and its forward collectives
  (tensor-parallel all-reduces) run again there, blocking.

With the selective policy a block keeps what ``passes.recompute.held_bytes`` counts (its
inputs and the outputs of the matmul / attention ops and collectives it keeps), the working set
is again the largest block's activations, and only the forward time of the ops it does not keep
is paid again in backward (no collective runs again: they are kept).

:func:`checkpoint_choice` is the search's decision: off if the plan fits ``memory_limit``
without it, else the faster of the selective and the whole-block policy among those that fit.

Example::

    segs = annotate_boundaries(program_events(program, mesh, cm, params), program.graph_module.graph, users)
    cost = simulate(checkpointed_segments(segs), mesh, cm, train=True, state=state)
"""
from __future__ import annotations

import copy

import operator

import torch

from autoshard.passes.recompute import block_regions, boundary_bytes, held_bytes, saved_by_selective

from autoshard.cost.model import Comm, Segment, op_seconds, program_cost, program_events


def _selective_stats(graph, user_names) -> dict:
    """{block key: (held bytes, [(target, args, kwargs, outs) of each recomputed op])} under the
    selective policy: what ``passes.recompute.held_bytes`` counts, and the ops backward runs
    again (those the policy does not keep)."""
    held = held_bytes(graph, user_names, "selective")
    out = {}
    for r in block_regions(graph, user_names):
        ops = []
        for node in r.nodes:
            if saved_by_selective(node) or node.target is operator.getitem:
                continue
            val = node.meta.get("val")
            outs = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
            ops.append((node.target, node.args, node.kwargs, outs))
        out[r.key] = (held.get(r.key, 0), ops)
    return out


def annotate_boundaries(segments: list, graph, user_names) -> list:
    """Set ``boundary_bytes`` (and ``selective``) on the segments of ``graph`` (the program they were made from):
    the first segment of each block gets the bytes its checkpointed region keeps."""
    by_block = boundary_bytes(graph, user_names)
    sel = _selective_stats(graph, user_names)
    seen = set()
    for seg in segments:
        if seg.block is not None and seg.block not in seen:
            seen.add(seg.block)
            seg.boundary_bytes = by_block.get(seg.block, 0)
            seg.selective = sel.get(seg.block)
    return segments


def checkpointed_segments(segments: list, policy: str = "block", cm=None) -> list:
    """The segments of the same program with every repeated block recomputed in backward:
    a block saves its inputs only, its forward compute and forward collectives are paid again
    in backward, and one extra segment holds the largest block's activations (the working set
    of the recompute running at the time). ``policy="selective"`` (needs the cost model ``cm``
    to price the recomputed ops): see the module docstring."""
    if policy == "selective":
        return _with_working_set(_selective_segments(segments, cm), segments)
    out = []
    for seg in segments:
        if seg.block is None:
            out.append(seg)
            continue
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
    return _with_working_set(out, segments)


def _with_working_set(out: list, plain: list) -> list:
    """``out`` (the recomputing segments, one per segment of ``plain``) plus one segment that
    brings their summed activations up to the peak: while block k is recomputed, what was
    kept up to and including it (what comes after it has been freed by backward already) plus
    what the block saves when run with autograd (its plain segments' bytes). A block is a run
    of segments of one key; a reduced program's repeated blocks are one segment object each."""
    kept_total = sum(s.saved_bytes for s in out)
    peak = kept_total
    prefix, working = 0, 0
    for k, (s, p) in enumerate(zip(out, plain)):
        prefix += s.saved_bytes
        if p.block is None:
            continue
        working = p.saved_bytes if k == 0 or plain[k - 1] is p or plain[k - 1].block != p.block \
            else working + p.saved_bytes
        nxt = plain[k + 1] if k + 1 < len(plain) else None
        if nxt is None or nxt is p or nxt.block != p.block:  # the block's last segment
            peak = max(peak, prefix + working)
    out.append(Segment(None, [], saved_bytes=peak - kept_total))
    return out


def _selective_segments(segments: list, cm) -> list:
    out, again_of = [], {}  # the repeated blocks of a reduced program are one segment object
    for seg in segments:
        if seg.block is None:
            out.append(seg)
            continue
        new = copy.copy(seg)
        new.saved_bytes = 0
        if seg.selective is not None:  # the block's first segment carries the block's figures
            held, ops = seg.selective
            new.saved_bytes = held
            if id(seg) not in again_of:
                again_of[id(seg)] = sum(op_seconds(cm, t, a, k, o) for t, a, k, o in ops)
            again = again_of[id(seg)]
            new.items = list(seg.items) + [(0.0, again)]
        out.append(new)
    return out


def has_blocks(segments: list) -> bool:
    return any(s.block is not None for s in segments)


def checkpoint_choice(plain, checkpointed, memory_limit, forced=None):
    """``(policy or False, its cost)`` given the plain ``PlanCost`` and ``checkpointed``:
    {policy: its ``PlanCost``, or a callable evaluated only if needed}. ``forced``: False, or a
    policy (True: ``"block"``), decides; None: no recompute when the plain plan fits
    ``memory_limit``, else the fastest policy whose plan fits (none fits: the plain one, which
    the search then rejects).

    Example::

        use, cost = checkpoint_choice(plain, {"selective": sel, "block": blk}, 80e9)
    """
    if not isinstance(checkpointed, dict):
        checkpointed = {"block": checkpointed}
    if forced is True:
        forced = "block"
    if forced is False or (forced is None and plain.fits(memory_limit)):
        return False, plain
    best = None
    for policy, ck in checkpointed.items():
        if forced is not None and policy != forced:
            continue
        ck = ck() if callable(ck) else ck
        if (forced is not None or ck.fits(memory_limit)) and (best is None or ck.step_time < best[1].step_time):
            best = (policy, ck)
    if best is None:
        return False, plain
    best[1].checkpoint = best[0]
    return best


def checkpointed_program_cost(program, inputs, vals, mesh, cm, policy: str = "block", **kw):
    """``cost.model.program_cost`` of ``program`` with every repeated block recomputed in
    backward by ``policy`` (``kw`` as for ``program_cost``)."""
    params = {i.name for i in inputs if i.kind == "parameter" and i.trainable}
    segs = annotate_boundaries(program_events(program, mesh, cm, params, vals), program.graph_module.graph,
                               {i.name for i in inputs if i.kind == "user"})
    cost = program_cost(program, inputs, vals, mesh, cm, segments=checkpointed_segments(segs, policy, cm), **kw)
    cost.checkpoint = policy
    return cost
