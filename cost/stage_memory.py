"""Predicted memory of each pipeline rank of a pipelined plan: its stages' state, and their
activations as the schedule holds them (a microbatch's activations of a stage are kept from
its forward to its backward), with activation recompute priced per stage as in
``cost/recompute.py``. This is what ``run.py --memory`` compares each rank's measurement with.

Example::

    per_rank = stage_memory(plan)        # [{"state": ..., "activations": ..., "peak": ...}, ...]
"""
from __future__ import annotations

from types import SimpleNamespace

from autoshard.cost.recompute import annotate_boundaries, checkpointed_segments
from autoshard.cost.model import program_events, resolve_cost_model


def _stage_activations(plan, gm, slots, cm) -> tuple:
    """(bytes one microbatch of the stage program ``gm`` keeps for backward, the recompute's
    extra working bytes) under the plan's recompute policy."""
    params = {n.name for n in gm.graph.nodes if n.op == "placeholder" and slots.get(n.name) is not None
              and slots[n.name].kind == "parameter" and slots[n.name].trainable}
    prog = SimpleNamespace(graph_module=gm, collectives=plan.program.collectives,
                           reshard_tags=plan.program.reshard_tags, bucketed=[])
    segs = program_events(prog, plan.mesh, cm, params)
    if not getattr(plan, "checkpoint", None):
        return sum(s.saved_bytes for s in segs), 0
    users = {n.name for n in gm.graph.nodes if n.op == "placeholder"
             and (n.name.startswith("recv_") or (slots.get(n.name) is not None and slots[n.name].kind == "user"))}
    segs = checkpointed_segments(annotate_boundaries(segs, gm.graph, users), plan.checkpoint_policy, cm)
    return sum(s.saved_bytes for s in segs[:-1]), segs[-1].saved_bytes


def stage_memory(plan, cost_model=None) -> list:
    """Per pipeline rank (its coordinate on the pipeline axis): ``state`` (parameters, gradients
    and optimizer state of its stages: the plan's per-rank state in proportion to the bytes
    of parameters its stages hold), ``activations`` (the schedule's worst moment, plus one
    recompute's working set) and their sum ``peak``, in bytes."""
    cm = resolve_cost_model(cost_model or getattr(plan, "cost_model", None))
    slots = {s.name: s for s in plan.rank_spec().slots}
    forwards = getattr(plan, "plain_stage_forwards", None) or [st.forward for st in plan.pipe.stages]
    acts = [_stage_activations(plan, gm, slots, cm) for gm in forwards]
    info = plan.stages
    total_params = sum(s.param_bytes for s in info) or 1
    mem = plan.cost["memory"]
    state_all = mem["params"] + mem["grads"] + mem["optimizer"]
    pp = plan.mesh.axes[plan.axis]
    out = []
    for r in range(pp):
        live: dict = {}
        worst = 0
        for a in plan.action_lists[r]:
            if a.kind == "F":
                live[a.stage] = live.get(a.stage, 0) + 1
            elif a.kind == "B":
                live[a.stage] -= 1
            worst = max(worst, sum(n * acts[s][0] for s, n in live.items()))
        mine = [s for s in info if s.rank == r]
        state = state_all * sum(s.param_bytes for s in mine) / total_params
        working = max([acts[s.index][1] for s in mine] + [0])
        out.append({"state": state, "activations": worst + working, "peak": state + worst + working})
    return out
