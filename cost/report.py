"""What a plan costs and why it was chosen: ``plan.cost``, ``plan.alternatives``, ``plan.explain()``.

Example::

    >>> plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, hardware="h100")  # doctest: +SKIP
    >>> plan.cost["step_time"], plan.cost["memory"]["peak"]                              # doctest: +SKIP
    >>> print(plan.explain())                                                            # doctest: +SKIP
"""
from __future__ import annotations

import torch

from autoshard.ownership import local_shape
from autoshard.passes.spmd import LayoutError

from autoshard.cost.context_parallel import context_explanation
from .gqa import gqa_explanation
from .idle import idle_axes_explained
from .model import formula_text
from .plan_cost import _cost_model, layout_cost, plan_cost

__all__ = ["CostReport", "plan_cost", "cost_report", "explain", "alternatives", "describe_layout"]


class CostReport(dict):
    """``plan.cost``: a dict (JSON-friendly keys and values) that prints as a short table.

    Keys: ``step_time`` (s), ``compute`` (s), ``compute_by_phase``, ``comm_exposed``
    ({(axis, phase): s} the compute stream waits), ``comm_total`` ({(axis, phase): s} of
    communication, hidden or not), ``memory`` (bytes per rank: params, grads, optimizer,
    persistent, activations, gathered_params, comm_buffers, peak), ``zero_stage``,
    ``hardware``; and, unchanged from before the cost model, ``comm_bytes``
    ({(phase, axis): bytes of the listed collectives' input buffers}) and
    ``state_bytes_per_rank``; ``activations_by_module`` ({module FQN: activation bytes saved for
    backward per rank}, e.g. a norm's at 1/tp under sequence parallelism)."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:.3f} ms"
        lines = [f"predicted step time {ms(self['step_time'])} on {self['hardware']}: compute {ms(self['compute'])}"]
        for (axis, phase), t in sorted(self["comm_exposed"].items()):
            hidden = self["comm_total"].get((axis, phase), 0.0) - t
            lines.append(f"  exposed communication on {axis} in {phase}: {ms(t)}"
                         + (f" ({ms(hidden)} hidden under compute)" if hidden > 1e-12 else ""))
        m = self["memory"]
        gb = lambda b: f"{b / 1e9:.3f} GB"
        lines.append(f"memory per rank: persistent {gb(m['persistent'])} (params {gb(m['params'])}, grads "
                     f"{gb(m['grads'])}, optimizer {gb(m['optimizer'])}), peak {gb(m['peak'])}")
        return "\n".join(lines)

    __repr__ = __str__


def cost_report(plan) -> CostReport:
    c = plan_cost(plan)
    comm: dict = {}
    for rec in plan.program.collectives:
        key = (rec.phase, rec.axes[0])
        comm[key] = comm.get(key, 0) + rec.bytes
    state = 0
    for inp, place in zip(plan.captured.inputs, plan.program.input_placements):
        if inp.kind != "user":
            t = plan.captured.state[inp.target]
            if isinstance(t, torch.Tensor):
                state += torch.Size(local_shape(t.shape, place, plan.mesh)).numel() * t.element_size()
    return CostReport(step_time=c.step_time, compute=c.compute, compute_by_phase=dict(c.compute_by_phase),
                      comm_exposed=dict(c.exposed), comm_total=dict(c.comm_total), memory=dict(c.memory),
                      zero_stage=c.zero_stage, hardware=_cost_model(plan).hardware.name, comm_bytes=comm,
                      state_bytes_per_rank=state, activations_by_module=dict(c.activations_by_module))


def describe_layout(layout: dict, mesh) -> str:
    """``dp: batch; tp: ffn+heads`` from a {name: axes} layout."""
    per = {a: [] for a in mesh.names}
    for name, axes in layout.items():
        for a in (() if axes is None else (axes,) if isinstance(axes, str) else axes):
            if a in per:
                per[a].append(name)
            elif a.endswith("?") and a[:-1] in per:  # soft: where the axis is free
                per[a[:-1]].append(name + "?")
    return "; ".join(f"{a}: {'+'.join(sorted(v)) if v else 'nothing'}" for a, v in per.items())


def alternatives(plan) -> list:
    """The best other candidates the search found, cheapest first: dicts with ``mesh``,
    ``layout``, ``zero_stage``, ``reshard_after_forward``, ``step_time`` and ``cost``
    (a :class:`~autoshard.cost.model.PlanCost`)."""
    res = plan.search
    if res is None:
        return []
    return [{"mesh": e.mesh if hasattr(e, "mesh") else res.mesh, "layout": e.layout, "zero_stage": e.candidate.zero_stage,
             "reshard_after_forward": e.candidate.reshard, "step_time": e.cost.step_time, "cost": e.cost}
            for e in res.alternatives]


def _mb(b: float) -> str:
    return f"{b / 1e6:.3f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def _mesh_of(e, res):
    return getattr(e, "mesh", None) or res.mesh


def _context_lines(plan, res, cost) -> list:
    """explain()'s sentences on context-parallel attention (cost/context_parallel.py), with the
    search's fastest candidate that keeps the sequence whole when it was over memory_limit."""
    ctx = getattr(plan.program, "context", None)
    if not ctx:
        return []
    info, seq_names = plan.info, {}
    nodes = {n.name: n for n in plan.captured.graph.nodes}
    for at in ctx.attention:
        q = nodes[at.node].args[0] if at.node in nodes else None
        if q is not None and q in info.dims:
            seq_names.setdefault(at.axis, info.names.get(info.leaves(info.of(q)[-2])))
    limit = getattr(res, "memory_limit", None) if res is not None else None
    return context_explanation(plan.program, plan.mesh, _cost_model(plan), step_time=cost.step_time,
                               memory_limit=limit, whole=_sequence_whole(plan, seq_names), seq_names=seq_names,
                               train=plan.train)


def _sequence_whole(plan, seq_names):
    """(layout description, step seconds, peak bytes) of ``plan`` with its context-parallel
    sequence kept whole (the rest of the layout as it is), or None if that plan is invalid."""
    layout = {**plan.layout, **{n: None for n in seq_names.values() if n}}
    for stage in dict.fromkeys((plan.zero_stage, 0)):  # ZeRO needs a data axis the split may have been
        try:
            c = layout_cost(plan, layout, stage)
        except LayoutError:
            continue
        desc = describe_layout(layout, plan.mesh) + (f"; ZeRO stage {stage}" if stage else "")
        return desc, c.step_time, c.memory["peak"]
    return None


def explain(plan) -> str:
    """In words: what the plan is, what it costs, and why it beats the runner-up."""
    res = plan.search
    cost = plan_cost(plan)
    ms = lambda s: f"{s * 1e3:.3f} ms"
    gb = lambda b: f"{b / 1e9:.3f} GB"
    head = (f"Plan on {plan.mesh}: {describe_layout(plan.layout, plan.mesh)}"
            + (f"; ZeRO stage {plan.zero_stage} on {plan.data_axes[0]}" if plan.zero_stage else "")
            + f". Predicted step {ms(cost.step_time)} (compute {ms(cost.compute)}, exposed communication "
            + f"{ms(cost.comm_exposed)}), peak memory {gb(cost.memory['peak'])} per rank.")
    soft = sorted(n for n, axes in plan.layout.items() if any(a.endswith("?") for a in axes or ()))
    if soft:
        head += "".join(
            f" {n}? is soft: {n} is split on {', '.join(a[:-1] for a in plan.layout[n])} only in the activations no "
            f"hard entry of that axis claims (between the regions the hard names split: norms, residual adds), "
            f"converted by reduce-scatters and all-gathers where the regions meet." for n in soft)
    lapses = list(plan.unsharded)
    if lapses:
        head += (f" Not sharded as the layout asks: {len(lapses)} forward gather(s), "
                 f"{sum(u.bytes for u in lapses)} bytes/rank, e.g. {lapses[0]} (strict=True refuses this plan).")
    head += "".join(" " + sentence for sentence in idle_axes_explained(plan))
    ctx = _context_lines(plan, res, cost)
    if res is None:
        return "\n".join([head + " The layout was given, not searched: there is no runner-up to compare with."]
                         + ctx)
    lines = [head] + ctx
    taken = (f", took {res.taken} combinations of axis options in the order of their bounds (the rest bounded "
             f"out without being enumerated)" if res.taken is not None else "")
    lines.append(f"The search looked at {res.space_size} candidates on {len(res.meshes)} "
                 f"mesh shape(s){taken}, evaluated {res.evaluated} exactly ({res.rewrites} rewrites"
                 + (", repeated blocks solved once" if res.reduced else "")
                 + f") and ruled out the rest by lower bounds, in {res.seconds:.2f} s.")
    lines += gqa_explanation(plan, fixed=res.constraints)
    if res.memory_limit is not None and res.infeasible:
        lines.append(f"{res.infeasible} candidates exceed memory_limit {gb(res.memory_limit)} per rank (their state "
                     f"and activations alone, or their evaluated peak).")
    elif res.memory_limit is not None:  # every candidate over it was ruled out by its bound first
        lines.append(f"This plan peaks at {gb(cost.memory['peak'])} per rank, within memory_limit "
                     f"{gb(res.memory_limit)}.")
    if getattr(res, "best_infeasible", None) is not None and res.memory_limit is not None:
        bi = res.best_infeasible
        lines.append(f"The fastest of those evaluated ({describe_layout(bi.layout, _mesh_of(bi, res))}"
                     f"{', ZeRO ' + str(bi.candidate.zero_stage) if bi.candidate.zero_stage else ''}, "
                     f"{ms(bi.cost.step_time)}) needs {gb(bi.cost.memory['peak'])} per rank, over memory_limit "
                     f"{gb(res.memory_limit)}.")
    if not res.alternatives:
        lines.append("No other candidate was valid" + (" within memory_limit." if res.memory_limit else "."))
        return "\n".join(lines)
    ties = [e for e in res.alternatives if e.cost.step_time <= cost.step_time * (1 + 1e-9)]
    others = [e for e in res.alternatives if e not in ties]
    if ties:
        lines.append(f"{len(ties)} other candidate(s) tie at the same predicted step time, e.g. "
                     f"{describe_layout(ties[0].layout, _mesh_of(ties[0], res))}"
                     + (f"; ZeRO stage {ties[0].candidate.zero_stage}" if ties[0].candidate.zero_stage else "")
                     + (f" on {_mesh_of(ties[0], res)}" if _mesh_of(ties[0], res) != plan.mesh else "")
                     + " (the tie is broken by lower peak memory, then by search order).")
    if not others:
        return "\n".join(lines)
    ru = others[0]
    rc = ru.cost
    lines.append(f"Runner-up: {describe_layout(ru.layout, _mesh_of(ru, res))}"
                 + (f"; ZeRO stage {ru.candidate.zero_stage}" if ru.candidate.zero_stage else "")
                 + (f" on {_mesh_of(ru, res)}" if _mesh_of(ru, res) != plan.mesh else "")
                 + f", predicted {ms(rc.step_time)} ({ms(rc.step_time - cost.step_time)} slower).")
    reasons = []
    dc = rc.compute - cost.compute
    if abs(dc) > 1e-12:
        reasons.append((abs(dc), f"it computes {ms(abs(dc))} {'more' if dc > 0 else 'less'} per rank "
                                 f"({'its ops are split fewer ways' if dc > 0 else 'its ops are split more ways'})"))
    keys = set(rc.exposed) | set(cost.exposed)
    for key in keys:
        d = rc.exposed.get(key, 0.0) - cost.exposed.get(key, 0.0)
        if abs(d) <= 1e-12:
            continue
        axis, phase = key
        kinds = sorted({k[2] for k in list(rc.counts) + list(cost.counts) if k[:2] == key})
        detail = ", ".join(f"{k} x{rc.counts.get(key + (k,), 0)} (chosen x{cost.counts.get(key + (k,), 0)}) sending "
                           f"{_mb(rc.volume.get(key + (k,), 0.0))} (chosen {_mb(cost.volume.get(key + (k,), 0.0))}) "
                           f"per rank, each {formula_text(k)}" for k in kinds)
        reasons.append((abs(d), f"it waits {ms(abs(d))} {'more' if d > 0 else 'less'} on {axis} collectives in "
                                f"{phase}: {detail}"))
    reasons.sort(key=lambda r: -r[0])
    if reasons:
        lines.append("Why it is slower: " + "; ".join(r for _, r in reasons[:4]) + ".")
    dm = rc.memory["peak"] - cost.memory["peak"]
    if abs(dm) > 0:
        lines.append(f"Memory: the runner-up peaks at {gb(rc.memory['peak'])} per rank "
                     f"({'more' if dm > 0 else 'less'} than the chosen {gb(cost.memory['peak'])}).")
    return "\n".join(lines)
