"""Mesh axes a plan leaves idle, and what using them would change.

An axis is *idle* when every rank along it computes the same thing: no value of the program is
split, a pending sum or owned by one index on it, no parameter state is sharded on it (ZeRO),
and it is not the pipeline's axis. Such a plan is often right for a small model (splitting the
batch saves less compute than the collectives it adds cost), but the user should know why
devices repeat each other's work: :func:`idle_axes_explained` prices the plan with the batch dim
(the first input's dim 0) also split on each idle axis, by the plan's cost model.

Example::

    >>> plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}))   # doctest: +SKIP
    >>> idle_axes(plan)                                                          # doctest: +SKIP
    ['dp']
    >>> print(idle_axes_explained(plan)[0])                                      # doctest: +SKIP
    dp is idle (its 2 ranks repeat the same work): splitting batch on dp would save 0.020 ms of
    compute per rank and cost 0.050 ms of communication on dp (all_reduce x 3) at this size.
"""
from __future__ import annotations

from autoshard.ownership import Replicate
from autoshard.passes.spmd import LayoutError

from .plan_cost import layout_cost, plan_cost

__all__ = ["IdleAxisWarning", "idle_axes", "idle_axes_explained"]


class IdleAxisWarning(UserWarning):
    """The plan leaves a mesh axis with nothing to split: its ranks repeat each other's work."""


def idle_axes(plan) -> list:
    """The mesh axes (of more than one rank) on which the plan splits nothing, holds no pending
    sum and shards no state, other than the pipeline's axis."""
    mesh, prog = plan.mesh, plan.program
    pipeline_axis = plan.axis if hasattr(plan, "pipe") else None
    places = list(prog.input_placements) + [p for ps in prog.placements.values() for p in ps]
    out = []
    for i, axis in enumerate(mesh.names):
        if mesh.axes[axis] == 1 or axis == pipeline_axis:
            continue
        if any(st.axis == axis for st in prog.storage.values()):
            continue  # ZeRO state sharded on it: used
        if any(p is not None and not isinstance(p[i], Replicate) for p in places):
            continue
        out.append(axis)
    return out


def _batch_name(plan):
    """The name of the first tensor input's dim 0 (the batch), or None."""
    users = {i.name for i in plan.captured.inputs if i.kind == "user"}
    for node in plan.captured.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in users and getattr(val, "dim", lambda: 0)() > 0:
            return plan.info.dim_name(plan.info.of(node)[0])
    return None


def idle_axes_explained(plan) -> list:
    """One sentence per idle axis: the compute splitting the batch there would save and the
    communication it would add (milliseconds per rank, from the plan's cost model), or why the
    batch cannot be split there. Computed once per plan."""
    if "idle" in plan.derived:
        return plan.derived["idle"]
    out = []
    mesh, name = plan.mesh, _batch_name(plan)
    for axis in idle_axes(plan):
        n = mesh.axes[axis]
        head = f"{axis} is idle (its {n} ranks repeat the same work)"
        if name is None:
            out.append(f"{head}: the plan has no batch dim to split on it.")
            continue
        layout = dict(plan.layout)
        axes = tuple(layout.get(name) or ())
        if any(a.endswith("?") for a in axes):
            axes = ()
        layout[name] = tuple(sorted(set(axes) | {axis}, key=mesh.names.index))
        try:
            alt = layout_cost(plan, layout, plan.zero_stage)
        except LayoutError as e:
            out.append(f"{head}: {name} cannot be split on it ({str(e).split(';')[0]}).")
            continue
        cost = plan_cost(plan)
        saved = cost.compute - alt.compute
        comm = sum(t for (a, _), t in alt.comm_total.items() if a == axis)
        by_kind: dict = {}
        for (a, _, k), c in alt.counts.items():
            if a == axis and c:
                by_kind[k] = by_kind.get(k, 0) + c
        kinds = ", ".join(f"{k} x{c}" for k, c in sorted(by_kind.items()))
        out.append(f"{head}: splitting {name} on {axis} would save {_time(saved)} of compute per rank and cost "
                   f"{_time(comm)} of communication on {axis}" + (f" ({kinds})" if kinds else "") + " at this size.")
    plan.derived["idle"] = out
    return out


def _time(seconds: float) -> str:
    """Milliseconds, or microseconds below 10 us (a small model's ops take less than 0.001 ms)."""
    return f"{seconds * 1e3:.3f} ms" if abs(seconds) >= 1e-5 else f"{seconds * 1e6:.3f} us"
