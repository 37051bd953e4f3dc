"""Predicted memory of each pipeline rank of a pipelined plan: its stages' state, and their
activations as the schedule holds them (a microbatch's activations of a stage are kept from
its forward to its backward), with activation recompute priced per stage as in
``cost/recompute.py``. This is what ``run.py --memory`` compares each rank's measurement with.

Example::

    per_rank = stage_memory(plan)        # [{"state": ..., "activations": ..., "peak": ...}, ...]
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from autoshard.cost.recompute import annotate_boundaries, checkpointed_segments
from autoshard.cost.model import program_events, resolve_cost_model
from autoshard.cost.stage_copies import copy_counter, region_copy_inputs


def _stage_activations(plan, gm, slots, cm) -> tuple:
    """(bytes one microbatch of the stage program ``gm`` keeps for backward, the recompute's
    extra working bytes) under the plan's recompute policy: the activations autograd keeps and
    the values the stage makes afresh from state in every forward and keeps as well (weight
    copies, rotary tables: ``cost/stage_copies.py``), each where the program keeps it, so the
    recompute's working set sees those of the blocks before it only."""
    params = {n.name for n in gm.graph.nodes if n.op == "placeholder" and slots.get(n.name) is not None
              and slots[n.name].kind == "parameter" and slots[n.name].trainable}
    reshard = plan.program.reshard_tags
    prog = SimpleNamespace(graph_module=gm, collectives=plan.program.collectives,
                           reshard_tags=reshard, bucketed=[])
    users = {n.name for n in gm.graph.nodes if n.op == "placeholder"
             and (n.name.startswith("recv_") or (slots.get(n.name) is not None and slots[n.name].kind == "user"))}
    segs = program_events(prog, plan.mesh, cm, params)
    copies = program_events(prog, plan.mesh, cm, params, counter=copy_counter(reshard, users))
    if not getattr(plan, "checkpoint", None):
        return sum(s.saved_bytes + c.saved_bytes for s, c in zip(segs, copies)), 0
    for s, c in zip(segs, copies):
        if s.block is None:  # a checkpointed block keeps its inputs instead (below)
            s.saved_bytes += c.saved_bytes
    if reshard:  # ZeRO-3: a block's recompute gathers its weights again and keeps them in its working set
        gathered = program_events(prog, plan.mesh, cm, params, counter=copy_counter((), users))
        for s, c, g in zip(segs, copies, gathered):
            if s.block is not None:
                s.saved_bytes += g.saved_bytes - c.saved_bytes
    segs = annotate_boundaries(segs, gm.graph, users)
    held = region_copy_inputs(gm.graph, users, reshard)
    seen = set()
    for s in segs:
        if s.block is not None and s.block not in seen:
            seen.add(s.block)
            s.boundary_bytes += held.get(s.block, 0)
            if s.selective is not None:
                s.selective = (s.selective[0] + held.get(s.block, 0), s.selective[1])
    segs = checkpointed_segments(segs, plan.checkpoint_policy, cm)
    return sum(s.saved_bytes for s in segs[:-1]), segs[-1].saved_bytes


def stage_memory(plan, cost_model=None) -> list:
    """Per pipeline rank (its coordinate on the pipeline axis): ``state`` (parameters, gradients
    and optimizer state of its stages: the plan's per-rank state in proportion to the bytes
    of parameters its stages hold), ``activations`` (the schedule's worst moment: the
    microbatches in flight, and during a backward the recompute's working set) and their sum ``peak``, in bytes."""
    cm = resolve_cost_model(cost_model or getattr(plan, "cost_model", None))
    slots = {s.name: s for s in plan.rank_spec().slots}
    forwards = getattr(plan, "plain_stage_forwards", None) or [st.forward for st in plan.pipe.stages]
    acts = [_stage_activations(plan, gm, slots, cm) for gm in forwards]
    # what the runtime keeps from a microbatch's F to its B besides autograd's saved tensors
    acts = [(kept + _held_roots(st, gm, plan.pipe.loss_index), working)
            for (kept, working), st, gm in zip(acts, plan.pipe.stages, forwards)]
    info = plan.stages
    total_params = sum(s.param_bytes for s in info) or 1
    mem = plan.cost["memory"]
    state_all = mem["params"] + mem["grads"] + mem["optimizer"]
    pp = plan.mesh.axes[plan.axis]
    out = []
    for r in range(pp):
        out.append(_rank_memory(plan.action_lists[r], acts, state_all * sum(
            s.param_bytes for s in info if s.rank == r) / total_params))
    return out


def _held_roots(st, gm, loss_index) -> int:
    """Bytes of the values stage ``st``'s forward keeps for its backward to start from
    (``runtime/execution/pipeline.py``): the sent values whose gradient comes back, on the last
    stage the loss (``gm``: the stage program, whose outputs are the program's there)."""
    if st.send:
        return sum(math.prod(b.shape) * b.dtype.itemsize for b in st.send if b.requires_grad)
    if loss_index is None:
        return 0
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    v = out[loss_index].meta.get("val") if isinstance(out[loss_index], torch.fx.Node) else None
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _rank_memory(actions, acts, state) -> dict:
    """One pipeline rank's prediction from its schedule ``actions``: after each ``F`` the kept
    bytes of every microbatch in flight on its stages; during each ``B`` those plus the stage's
    recompute working set (the microbatch in backward is still in flight). A microbatch stays
    in flight until its ``W`` where the schedule splits its backward (the weight gradients need
    the saved values), else until its ``B``."""
    split = {(a.stage, a.mb) for a in actions if a.kind == "W"}
    live: dict = {}
    worst = 0
    for a in actions:
        if a.kind == "F":
            live[a.stage] = live.get(a.stage, 0) + 1
        held = sum(n * acts[s][0] for s, n in live.items())
        if a.kind == "B":
            held += acts[a.stage][1]
        worst = max(worst, held)
        if (a.kind == "B" and (a.stage, a.mb) not in split) or a.kind == "W":
            live[a.stage] -= 1
    return {"state": state, "activations": worst, "peak": state + worst}
