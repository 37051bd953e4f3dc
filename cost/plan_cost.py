"""The cost model applied to a plan: its own program (``plan_cost``, cached on the plan) and the
same model under another layout (``layout_cost``), for ``plan.cost``, ``plan.explain()`` and the
idle-axis sentences.

Example::

    >>> plan_cost(plan).step_time                                   # doctest: +SKIP
    >>> layout_cost(plan, {**plan.layout, "batch": ("dp",)}, 0)     # doctest: +SKIP
"""
from __future__ import annotations

from autoshard.passes.program import build_program
from autoshard.passes.spmd import resolve_layout

from autoshard.cost.recompute import checkpointed_program_cost
from .model import PlanCost, program_cost, resolve_cost_model

__all__ = ["plan_cost", "layout_cost"]


def _cost_model(plan):
    return plan.cost_model if plan.cost_model is not None else resolve_cost_model(None)


def plan_cost(plan) -> PlanCost:
    """The cost model applied to the plan's rewritten program and its collectives (cached on
    the plan)."""
    if "cost" not in plan.derived:
        plan.derived["cost"] = _program_cost(plan, plan.program, plan.zero_stage, plan.data_axes)
    return plan.derived["cost"]


def layout_cost(plan, layout: dict, zero_stage: int) -> PlanCost:
    """The cost of ``plan``'s model under another ``layout`` (and ZeRO stage), with the plan's
    other options; LayoutError where that layout is invalid."""
    cap = plan.captured
    program, axes = build_program(cap.graph, cap.inputs, plan.info, resolve_layout(plan.info, layout, plan.mesh),
                                  plan.mesh, train=plan.train, zero_stage=zero_stage, reshard=True,
                                  bucket_mb=plan.bucket_mb,
                                  display={i.name: i.target for i in cap.inputs},
                                  units=plan.units or "block", context={})
    return _program_cost(plan, program, zero_stage, axes)


def _program_cost(plan, program, zero_stage: int, data_axes) -> PlanCost:
    cap = plan.captured
    vals = {n.name: n.meta.get("val") for n in cap.graph.nodes if n.op == "placeholder"}
    bucket_mb = plan.bucket_mb
    kw = {}
    if plan.checkpoint:  # recomputed blocks, by the plan's policy
        fn, kw = checkpointed_program_cost, {"policy": plan.checkpoint_policy}
    else:
        fn = program_cost
    return fn(program, cap.inputs, vals, plan.mesh, _cost_model(plan), train=plan.train, zero_stage=zero_stage,
              data_axes=data_axes, bucket_bytes=int(bucket_mb * 2 ** 20) if bucket_mb else 0, **kw)
