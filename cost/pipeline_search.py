"""Pipeline degree search: whether ``Mesh.auto(n, ("pp", ...))`` splits the layer sequence, and how.

Policy (pp > 1 only when the state does not fit otherwise): pipelining costs a bubble,
boundary transfers and activations held across microbatches, so the planner first searches the
meshes with ``pp = 1`` (:func:`autoshard.cost.search.plan_search`, every other axis and the
ZeRO stage open). Only when no such plan fits ``memory_limit`` does it try ``pp = 2, 4, ...``
(divisors of ``n`` up to the number of repeated blocks), in increasing order, and takes the
first degree with a plan that fits (a deeper pipeline only adds bubble and transfers), then the
fastest schedule and microbatch count at that degree.

For one degree ``pp`` the other axes are searched on ``n / pp`` devices, with the whole model
and batch (the per-rank program that the stage cut then splits), and the pipelined plan is
estimated from that plan's cost (first order, documented in docs/pipeline.md):

* a rank holds one stage: the state (parameters, gradients, optimizer) of the largest stage,
  ``stage_fraction`` of the whole (blocks split evenly, the embedding on the first stage and
  the head on the last; :func:`stage_fraction`);
* activations in flight: one stage's saved activations per microbatch times the most
  microbatch-chunks a rank holds at once under the schedule (counted on the schedule's own
  action lists: GPipe ``M``, 1F1B ``min(M, pp)``, interleaved more; :func:`in_flight`);
  communication buffers of one microbatch (``1 / M`` of the inner plan's), gathered ZeRO-3
  parameters as the inner plan holds them;
* step time: the schedule's predicted timeline (:func:`autoshard.cost.pipeline.schedule_timeline`)
  with per-microbatch stage times from the inner plan's forward / backward (compute and
  exposed communication) scaled by the stage fraction, boundary messages priced on the
  pipeline axis's link, then the optimizer phase of one stage.

Example::

    decision = choose_pipeline(graph, inputs, info, Mesh.auto(64, ("pp", "dp", "tp")), "pp",
                               batch=32, train=True, memory_limit=80e9, cost_model="h100")
    decision.pp, decision.schedule, decision.microbatches
    print(decision.explain())
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from autoshard.mesh import Mesh
from autoshard.runtime.execution.schedules import make_schedule

from .model import block_of_module, resolve_cost_model
from .pipeline import bubble, schedule_timeline
from .search import find_blocks, plan_search

__all__ = ["PipelineEstimate", "PipelineDecision", "choose_pipeline", "stage_fraction", "in_flight",
           "estimate_pipeline"]

SCHEDULE_ORDER = ("1f1b", "zero_bubble", "interleaved", "gpipe")  # ties: least activation memory first
SPLIT_BACKWARD = ("zero_bubble",)  # schedules whose backward runs as B (inputs) and W (weights) actions


@dataclass
class PipelineEstimate:
    """The predicted pipelined plan of one ``(pp, schedule, microbatches, virtual)``."""

    pp: int
    schedule: str
    microbatches: int
    virtual: int
    fraction: float  # the largest stage's share of the parameter bytes
    state: float  # persistent bytes per rank (one stage's parameters, gradients, optimizer state)
    activations: float  # saved activations in flight per rank, at the schedule's peak
    peak: float  # state + activations + gathers and buffers of the inner plan
    step_time: float
    bubble: float  # idle fraction of the predicted timeline
    transfer: float  # seconds of one boundary message
    inner: object = None  # the search's Evaluated plan on the n / pp devices of the other axes

    def describe(self) -> str:
        v = f", virtual {self.virtual}" if self.virtual > 1 else ""
        return (f"pp={self.pp} ({self.schedule}{v}, {self.microbatches} microbatches) x {self.inner.mesh}: step "
                f"{self.step_time * 1e3:.1f} ms (bubble {self.bubble:.1%}), peak {self.peak / 1e9:.1f} GB per rank "
                f"(state {self.state / 1e9:.1f} GB = {self.fraction:.1%} of the model's, activations in flight "
                f"{self.activations / 1e9:.1f} GB)")


@dataclass
class PipelineDecision:
    """What :func:`choose_pipeline` decided. ``chosen`` is None when no pipeline is needed
    (``flat`` is then the pp = 1 search result the plan uses)."""

    axis: str
    memory_limit: Optional[float]
    flat: object = None  # SearchResult on the pp = 1 meshes, or None when nothing fit
    flat_error: str = ""  # why no pp = 1 plan fits
    chosen: Optional[PipelineEstimate] = None
    tried: list = field(default_factory=list)  # (pp, best PipelineEstimate or a reason string)
    seconds: float = 0.0

    @property
    def pp(self) -> int:
        return self.chosen.pp if self.chosen is not None else 1

    def explain(self) -> str:
        """Why pp = 1 or pp > 1, with the numbers (appended to ``plan.explain()``)."""
        gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
        lim = f"memory_limit {gb(self.memory_limit)}" if self.memory_limit is not None else "no memory_limit"
        if self.chosen is None:
            best = self.flat.best
            return (f"Pipeline ({self.axis}): not used. The best plan without it fits {lim} (peak "
                    f"{gb(best.cost.memory['peak'])} per rank, state {gb(best.cost.memory['persistent'])}); a pipeline "
                    f"(bubble, boundary transfers) is considered only when nothing fits without it. Searched in "
                    f"{self.seconds:.2f} s.")
        c = self.chosen
        lines = [f"Pipeline ({self.axis}): {self.axis}={c.pp} because no plan without it fits {lim}: "
                 f"{self.flat_error}."]
        for pp, got in self.tried:
            if pp == c.pp:
                continue
            lines.append(f"  {self.axis}={pp}: " + (got if isinstance(got, str) else got.describe()))
        lines.append(f"Chosen: {c.describe()}. Searched in {self.seconds:.2f} s.")
        return "\n".join(lines)


def stage_fraction(inputs, vals: dict, pp: int, graph=None) -> float:
    """The largest stage's share of the parameter bytes when ``pp`` stages split the repeated
    blocks evenly (the first ``L % pp`` stages one more), parameters before the first block (the
    embedding) on the first stage and the others (final norm, head) on the last.

    >>> import torch
    >>> from types import SimpleNamespace as NS
    >>> ins = [NS(name=f"p{i}", target=t, kind="parameter") for i, t in
    ...        enumerate(["embed.weight", "layers.0.w", "layers.1.w", "head.weight"])]
    >>> vals = {"p0": torch.empty(2), "p1": torch.empty(4), "p2": torch.empty(4), "p3": torch.empty(2)}
    >>> stage_fraction(ins, vals, 2)      # (embed 2 + layers.0 4) of 12
    0.5
    """
    blocks, before, after = {}, 0.0, 0.0
    params = [i for i in inputs if i.kind == "parameter" and hasattr(vals.get(i.name), "numel")]
    fams: dict = {}
    for i in params:
        blk = block_of_module(i.target)
        if blk:
            fams[blk[0]] = fams.get(blk[0], 0) + 1
    fam = max(fams, key=fams.get) if fams else None
    seen_block = False
    for i in params:
        v = vals[i.name]
        nbytes = v.numel() * v.element_size()
        blk = block_of_module(i.target)
        if blk and blk[0] == fam:
            blocks[blk[1]] = blocks.get(blk[1], 0.0) + nbytes
            seen_block = True
        elif not seen_block:
            before += nbytes
        else:
            after += nbytes
    total = before + after + sum(blocks.values())
    if not total:
        return 1.0 / pp
    order = [blocks[k] for k in sorted(blocks)]
    per, extra = divmod(len(order), pp)
    out, at = [], 0
    for s in range(pp):
        n = per + (1 if s < extra else 0)
        out.append(sum(order[at:at + n]))
        at += n
    out[0] += before
    out[-1] += after
    return max(out) / total


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The most microbatches' stage activations one rank holds at once under ``schedule``, in
    units of one stage's activations for one microbatch (a chunk of an interleaved rank is
    ``1 / virtual`` of that): counted on the schedule's action lists, from a chunk's forward
    to its last backward (W where the backward is split).

    >>> in_flight("gpipe", 4, 8), in_flight("1f1b", 4, 8), in_flight("interleaved", 4, 8, 2)
    (8.0, 4.0, 5.5)
    """
    acts = make_schedule(schedule, pp, microbatches, virtual)
    split = any(a.kind == "W" for row in acts for a in row)
    most = 0
    for row in acts:
        live = 0
        for a in row:
            if a.kind == "F":
                live += 1
                most = max(most, live)
            elif a.kind == ("W" if split else "B"):
                live -= 1
    return most / virtual


def _blocks(graph, inputs) -> int:
    found = find_blocks(graph, inputs)
    return len(found[1]) if found else 1


def _boundary_bytes(graph, inputs) -> float:
    """Bytes of the residual stream between two blocks for the whole batch (the value a stage
    boundary sends): the largest tensor output of the first block read by the second."""
    found = find_blocks(graph, inputs)
    if not found:
        return 0.0
    first, second = set(found[1][0]), set(found[1][1])
    best = 0.0
    for n in second:
        for a in n.all_input_nodes:
            v = a.meta.get("val")
            if a in first and hasattr(v, "numel"):
                best = max(best, float(v.numel() * v.element_size()))
    return best


def estimate_pipeline(inner, full_mesh: dict, axis: str, cm, *, pp: int, schedule: str, microbatches: int,
                      virtual: int, fraction: float, boundary_bytes: float) -> PipelineEstimate:
    """The pipelined plan of the inner plan ``inner`` (an ``Evaluated`` of the search on the
    other axes) on ``pp`` stages (see the module docstring for the model).

    ``full_mesh``: the axis sizes with the pipeline axis (its link prices the boundary
    messages); ``boundary_bytes``: the residual stream's bytes for the whole batch."""
    cost = inner.cost
    mem = cost.memory
    M = microbatches
    exposed = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for (_, phase), secs in cost.exposed.items():
        exposed[phase if phase in exposed else "backward"] += secs
    fwd = (cost.compute_by_phase.get("forward", 0.0) + exposed["forward"]) * fraction / M
    bwd = (cost.compute_by_phase.get("backward", 0.0) + exposed["backward"]) * fraction / M
    opt = (cost.compute_by_phase.get("optimizer", 0.0) + exposed["optimizer"]) * fraction
    # chunk times: an interleaved rank runs ``virtual`` chunks of 1/virtual of its stage
    f, b = fwd / virtual, bwd / virtual
    # backward = input-gradient half + weight-gradient half (an unsplit B runs both)
    times = {"F": f, "B": b / 2, "W": b / 2}
    # the boundary message: one microbatch's residual stream on one rank (batch split by the
    # axes that shard it)
    batch_axes = inner.layout.get("batch") or ()
    div = math.prod(inner.mesh.axes[a] for a in batch_axes) * M
    link = cm.hardware.link_for_axes(full_mesh, (axis,))
    nbytes = boundary_bytes / div
    hop = link.latency + nbytes / link.effective_bandwidth if nbytes else 0.0
    acts = make_schedule(schedule, pp, M, virtual)
    tl = schedule_timeline(acts, times, hop)
    makespan = max(e for row in tl.values() for _, _, e in row) - min(s for row in tl.values() for _, s, _ in row)
    state = mem["persistent"] * fraction
    act = mem["activations"] * fraction / M * in_flight(schedule, pp, M, virtual)
    # a collective's buffer holds one microbatch's values (gradient buckets are small); gathered
    # ZeRO-3 parameters are kept as the inner plan holds them (one block at a time, or all)
    peak = state + act + mem.get("gathered_params", 0.0) + mem.get("comm_buffers", 0.0) / M
    return PipelineEstimate(pp, schedule, M, virtual, fraction, state, act, peak, makespan + opt, bubble(tl), hop, inner)


def _microbatch_options(batch: int, batch_split: int, pp: int) -> list:
    """Microbatch counts: multiples of ``pp`` (every schedule's steady state) whose microbatch
    still splits evenly over the data-parallel ranks, at most 8 per stage. A microbatch keeps
    at least 2 rows (a dim of size 1 loses its name in the captured program).

    >>> _microbatch_options(32, 4, 2)      # rows 16, 8, 4 split over 4 data ranks
    [2, 4, 8]
    """
    out = []
    for m in range(pp, 8 * pp + 1, pp):
        rows = batch // m
        if batch % m == 0 and rows % batch_split == 0 and rows >= 2:
            out.append(m)
    return out


def _best_estimate(inners, pp, axis, cm, frac, boundary, batch, schedules, microbatches, virtual, n_blocks,
                   memory_limit):
    """The fastest pipelined estimate within ``memory_limit`` over the inner plans, schedules and
    microbatch counts, and the leanest of those over it: ``(best or None, leanest or None)``."""
    best, leanest = None, None
    for inner in inners:
        split = math.prod(inner.mesh.axes[a] for a in (inner.layout.get("batch") or ()))
        ms = [microbatches] if microbatches else _microbatch_options(batch, split, pp)
        for sched in schedules:
            if inner.cost.checkpoint and sched in SPLIT_BACKWARD:
                continue  # a recomputed block differentiates its weights with its inputs: B and W not split
            for v in ([virtual or 2] if sched == "interleaved" else [1]):
                if sched == "interleaved" and pp * v > n_blocks:
                    continue
                for m in ms:
                    try:
                        est = estimate_pipeline(inner, {axis: pp, **inner.mesh.axes}, axis, cm, pp=pp, schedule=sched,
                                                microbatches=m, virtual=v, fraction=frac, boundary_bytes=boundary)
                    except ValueError:  # e.g. interleaved with microbatches not a multiple of pp
                        continue
                    if memory_limit is not None and est.peak > memory_limit:
                        if leanest is None or est.peak < leanest.peak:
                            leanest = est
                    elif best is None or est.step_time < best.step_time * (1 - 1e-9):
                        best = est
    return best, leanest


def choose_pipeline(graph, inputs, info, automesh, axis: str, *, batch: int, constraints=None, train: bool = True,
                    zero_stage=None, reshard_after_forward=None, memory_limit=None, cost_model=None,
                    bucket_mb: float = 25.0, units="block", checkpoint=None, schedule=None, microbatches=None,
                    virtual=None, verbose: bool = False, display=None) -> PipelineDecision:
    """Decide the pipeline degree of ``automesh`` (a ``Mesh.auto`` with axis ``axis``): the
    pp = 1 search first; pp > 1 only when nothing fits ``memory_limit`` (see the module
    docstring). ``batch``: the global batch (dim 0 of the inputs), split into microbatches.
    ``schedule`` / ``microbatches`` / ``virtual``: fixed by the user, else chosen here.
    Raises ValueError when no degree fits."""
    t0 = time.perf_counter()
    cm = resolve_cost_model(cost_model)
    by_pp: dict = {}
    for m in automesh.meshes():
        rest = {a: s for a, s in m.axes.items() if a != axis}
        subs = by_pp.setdefault(m.axes[axis], [])
        if rest not in [s.axes for s in subs]:
            subs.append(Mesh(rest))
    common = dict(constraints=constraints, train=train, zero_stage=zero_stage,
                  reshard_after_forward=reshard_after_forward, cost_model=cm, bucket_mb=bucket_mb,
                  verbose=verbose, display=display, units=units)
    decision = PipelineDecision(axis, memory_limit)
    try:
        decision.flat = plan_search(graph, inputs, info, by_pp.get(1, []), memory_limit=memory_limit,
                                    checkpoint=checkpoint, **common)
        decision.seconds = time.perf_counter() - t0
        return decision
    except ValueError as e:  # nothing fits memory_limit
        decision.flat_error = str(e)
    vals = {n.name: n.meta.get("val") for n in graph.nodes if n.op == "placeholder"}
    n_blocks = _blocks(graph, inputs)
    boundary = _boundary_bytes(graph, inputs)
    schedules = [schedule] if schedule else list(SCHEDULE_ORDER)
    for pp in sorted(p for p in by_pp if p > 1):
        if pp > n_blocks:
            decision.tried.append((pp, f"more stages than the {n_blocks} repeated blocks"))
            continue
        frac = stage_fraction(inputs, vals, pp)
        best, leanest, searched = None, None, False
        # The inner search keeps the plans whose whole-model memory fits limit / fraction x
        # relax: at 1 a stage's state and GPipe's activations (the most) then fit; a stage holds
        # less (1F1B's activations, one microbatch's buffers), so the bound is relaxed until an
        # estimate fits, last to the fastest few at any memory; each checked exactly.
        for relax in ((1, 2, 4, None) if memory_limit else (None,)):
            lim = memory_limit / frac * relax if relax else None
            try:
                # the inner plan may recompute activations (cost/recompute.py), priced per stage
                res = plan_search(graph, inputs, info, by_pp[pp], checkpoint=checkpoint, memory_limit=lim, **common)
            except ValueError:
                continue
            searched = True
            b, lean = _best_estimate([res.best] + list(res.alternatives), pp, axis, cm, frac, boundary, batch,
                                     schedules, microbatches, virtual, n_blocks, memory_limit)
            if lean is not None and (leanest is None or lean.peak < leanest.peak):
                leanest = lean
            if b is not None:
                best = b
                break
        decision.tried.append((pp, best if best is not None else
                               "no schedule and microbatch count fits" +
                               (f"; the leanest: {leanest.describe()}" if leanest is not None else
                                "" if searched else " (no plan on the other axes)")))
        if best is not None:
            decision.chosen = best
            break  # the first degree that fits: deeper pipelines only add bubble and transfers
    decision.seconds = time.perf_counter() - t0
    if decision.chosen is None:
        why = "; ".join(f"{axis}={p}: {g if isinstance(g, str) else g.describe()}" for p, g in decision.tried)
        raise ValueError(f"no plan fits memory_limit with or without a pipeline. Without: {decision.flat_error}. "
                         f"With: {why}")
    return decision
