"""Pipeline bubble: fill/drain idle time of GPipe, 1F1B and interleaved schedules.

First-order model (balanced stages, equal micro-batch times, free transfers). Two quantities are
kept apart:

* :func:`bubble_fraction` - idle fraction of *elapsed* capacity,
  ``(p-1) / (v*m + p-1)`` (GPipe's bubble, Huang et al., 2019, with ``v=1``);
* :func:`bubble_overhead` - idle time *relative to useful work*, ``(p-1) / (v*m)``
  (the form Megatron-LM's interleaving paper reports).

GPipe and 1F1B have the same bubble (1F1B only shortens activation lifetimes). Interleaving
``v`` virtual chunks per rank shrinks each fill/drain step to ``1/v`` of a stage's work.

Example::

    >>> bubble_fraction(4, 8), bubble_fraction(4, 32)
    (0.2727272727272727, 0.08571428571428572)
"""
from __future__ import annotations

import math

from autoshard.runtime.execution.schedules import Action, dependencies, stage_rank
from autoshard.runtime.execution.timeline import chrome_trace  # noqa: F401 - the trace format, re-exported

from .model import op_seconds

__all__ = ["bubble_fraction", "bubble_overhead", "schedule_timeline", "bubble", "stage_seconds", "chrome_trace",
           "unit_seconds", "choose_cuts", "cut_key"]


def _check(stages, microbatches, virtual) -> None:
    for name, v in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of elapsed pipeline time: ``(p-1) / (v*m + p-1)``.

    ``stages`` = p physical stages (ranks), ``microbatches`` = m per step, ``virtual`` = v
    chunks per rank (1 for GPipe / 1F1B).

    >>> bubble_fraction(2, 16)          # 1/17
    0.058823529411764705
    """
    _check(stages, microbatches, virtual)
    return (stages - 1) / (virtual * microbatches + stages - 1)


def bubble_overhead(stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle time relative to useful compute: ``(p-1) / (v*m)``; step time = ideal x (1 + this).

    >>> bubble_overhead(4, 8), bubble_overhead(4, 8, virtual=2)
    (0.375, 0.1875)
    """
    _check(stages, microbatches, virtual)
    return (stages - 1) / (virtual * microbatches)


# ---------------------------------------------------------------------------- schedule timeline

def schedule_timeline(actions: list, times, transfer=0.0) -> dict:
    """Predicted start and end of every action of a schedule: each rank runs its list in
    order, an action starts when its rank is free and its dependencies (the previous stage's
    forward, the next stage's backward, its own forward / input-gradient backward) have ended
    plus ``transfer`` seconds when they ran on another rank.

    ``actions``: per pipeline rank, the ordered ``Action`` lists of
    :mod:`autoshard.runtime.execution.schedules`; ``times(action) -> seconds`` (or a dict {"F": s, "B": s,
    "W": s} for equal stages); ``transfer``: seconds per boundary message, a number or
    ``transfer(stage) -> seconds`` for the boundary after ``stage``.
    Returns ``{rank: [(action, start, end)]}``.

    >>> from autoshard.runtime.execution.schedules import make_schedule
    >>> tl = schedule_timeline(make_schedule("gpipe", 4, 8), {"F": 1.0, "B": 2.0})
    >>> round(bubble(tl), 4)      # (K-1)/(M+K-1) = 3/11
    0.2727
    """
    pp = len(actions)
    stages = 1 + max(a.stage for acts in actions for a in acts)
    split = any(a.kind == "W" for acts in actions for a in acts)
    cost = times if callable(times) else (lambda a: times.get(a.kind, 0.0))
    hop = transfer if callable(transfer) else (lambda stage: transfer)
    if not split:
        # an unsplit backward also computes the weight gradients
        base = cost
        cost = lambda a: base(a) + (base(Action("W", a.mb, a.stage)) if a.kind == "B" else 0.0)  # noqa: E731
    end: dict = {}
    out = {r: [] for r in range(pp)}
    pos, clock = [0] * pp, [0.0] * pp
    while any(pos[r] < len(actions[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                deps = dependencies(a, stages, split)
                if any(d not in end for d in deps):
                    break
                start = clock[r]
                for d in deps:
                    far = stage_rank(d.stage, pp) != r
                    start = max(start, end[d] + (hop(min(d.stage, a.stage)) if far else 0.0))
                end[a] = start + cost(a)
                clock[r] = end[a]
                out[r].append((a, start, end[a]))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("schedule deadlocks; check it with autoshard.runtime.execution.schedules.check_schedule")
    return out


def bubble(timeline: dict) -> float:
    """Idle fraction of a timeline: ``1 - busy / (ranks * makespan)``, the makespan measured
    from the earliest start to the latest end over all ranks."""
    rows = [row for row in timeline.values() if row]
    t0 = min(s for row in rows for _, s, _ in row)
    t1 = max(e for row in rows for _, _, e in row)
    busy = sum(e - s for row in rows for _, s, e in row)
    return 1.0 - busy / (len(rows) * (t1 - t0)) if t1 > t0 else 0.0


def stage_seconds(stage_graph, cm) -> float:
    """Predicted forward seconds of one stage program (an ``fx.GraphModule`` whose nodes carry
    ``meta['val']``): the sum of the cost model's op times."""
    total = 0.0
    for n in stage_graph.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "__module__", "") == "autoshard.runtime.primitives.collectives":
            continue
        val = n.meta.get("val")
        outs = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if hasattr(v, "shape")]
        total += op_seconds(cm, n.target, n.args, n.kwargs, outs)
    return total


# ---------------------------------------------------------------------------- cut search

def unit_seconds(profile, cm) -> list:
    """Predicted forward seconds of each unit of a :class:`autoshard.passes.pipeline.CutProfile`
    (the cost model's op times; exactly rounded sums)."""
    def secs(n):
        if getattr(n.target, "__module__", "") == "autoshard.runtime.primitives.collectives":
            return 0.0
        val = n.meta.get("val")
        outs = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if hasattr(v, "shape")]
        return op_seconds(cm, n.target, n.args, n.kwargs, outs)

    return [math.fsum(secs(n) for n in unit) for unit in profile.units]


def cut_key(cuts, units, bytes_) -> tuple:
    """The objective of cutting before candidates ``cuts`` (indices, increasing): first the
    slowest stage's predicted compute per microbatch (forward + backward = 3 forwards: it sets
    the steady-state pace of every schedule), then the total boundary bytes per microbatch
    (each cut sends one message per microbatch each way; the count of cuts is fixed, so their
    latency is too), then the earliest cuts. Sums are exactly rounded (``math.fsum``).

    >>> cut_key([1], [1.0, 2.0, 1.0], [8, 4])
    (9.0, 4, (1,))
    """
    edges = [0] + [c + 1 for c in cuts] + [len(units)]
    return (max(3 * math.fsum(units[a:b]) for a, b in zip(edges, edges[1:])),
            sum(bytes_[c] for c in cuts), tuple(cuts))


def choose_cuts(units: list, bytes_: list, allowed: list, stages: int) -> list:
    """Candidate indices where stages 1..``stages-1`` begin, minimizing :func:`cut_key`:
    a dynamic program for the smallest slowest stage, then one for the fewest boundary bytes
    (earliest cuts on ties) among the cuts that keep every stage within it.

    ``units``: forward seconds of the ``len(candidates) + 1`` units (unit 0 precedes candidate
    0; cutting at candidate j separates unit j from unit j + 1); ``bytes_``/``allowed``: per
    candidate.

    >>> choose_cuts([1, 1, 1, 1], [8, 8, 8], [True] * 3, 2)
    [1]
    >>> choose_cuts([1, 1, 1, 1], [8, 4, 2], [True] * 3, 3)   # [0, 1] ties [1, 2] on time; fewer bytes
    [1, 2]
    """
    n = len(bytes_)
    ok = [j for j in range(n) if allowed[j]]
    if stages - 1 > len(ok):
        raise ValueError(f"{stages} stages need {stages - 1} cut points; the program has {len(ok)}")
    ends = len(units)

    def stage_time(a, b):  # units a..b-1
        return 3 * math.fsum(units[a:b])

    def targets(k):
        return [ends] if k == stages else [j + 1 for j in ok]

    # best[b]: smallest slowest stage of units 0..b-1 in k stages (b - 1 a cut, or b = ends)
    best = {0: 0.0}
    for k in range(1, stages + 1):
        best = {b: min((max(v, stage_time(a, b)) for a, v in best.items() if a < b), default=math.inf)
                for b in targets(k)}
    limit = best[ends]
    # among splits whose every stage is within limit: fewest bytes, then earliest cuts
    prev = {0: (0, ())}
    for k in range(1, stages + 1):
        row = {}
        for b in targets(k):
            options = [(v[0] + (bytes_[b - 1] if b < ends else 0), v[1] + ((b - 1,) if b < ends else ()))
                       for a, v in prev.items() if a < b and stage_time(a, b) <= limit]
            if options:
                row[b] = min(options)
        prev = row
    return list(prev[ends][1])
