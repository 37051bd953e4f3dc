"""Pipeline schedules as data: per pipeline rank, the ordered list of actions it runs in one step.

An action is ``F(mb, stage)`` (forward of one microbatch through one stage), ``B(mb, stage)``
(its backward; only the input gradient when the schedule also has ``W(mb, stage)``, the weight
gradient, split off to run later). Stage ``k`` of ``K = pp * virtual`` runs on pipeline rank
``k % pp``. One function per schedule builds the lists; the runtime
(:mod:`autoshard.runtime.execution.pipeline`) executes any list that respects the dependencies, and
:func:`check_schedule` proves that a list does (every action once, and a run with unit times
finishes without waiting forever).

================= ====================================================================
``gpipe``         all forwards, then all backwards (microbatch order); holds M in flight
``1f1b``          ``pp - r - 1`` warm-up forwards on rank r, then one forward / one
                  backward alternating; at most ``pp - r`` microbatches in flight
``interleaved``   Megatron's interleaved 1F1B: ``virtual`` chunks per rank, microbatches
                  in groups of ``pp``; the fill/drain shrinks to about ``1/virtual``
``zero_bubble``   ZB-H1: 1F1B with the backward split into B (input gradient, on the
                  critical path) and W (weight gradient), W run where the rank would wait
================= ====================================================================

Example::

    >>> [str(a) for a in one_f_one_b(2, 3)[0]]
    ['F(mb=0, stage=0)', 'F(mb=1, stage=0)', 'B(mb=0, stage=0)', 'F(mb=2, stage=0)', 'B(mb=1, stage=0)', 'B(mb=2, stage=0)']
"""
from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" | "B" | "W"
    mb: int
    stage: int

    def __str__(self):
        return f"{self.kind}(mb={self.mb}, stage={self.stage})"

    __repr__ = __str__


def F(mb: int, stage: int) -> Action:
    return Action("F", mb, stage)


def B(mb: int, stage: int) -> Action:
    return Action("B", mb, stage)


def W(mb: int, stage: int) -> Action:
    return Action("W", mb, stage)


def gpipe(pp: int, microbatches: int, virtual: int = 1) -> list:
    """GPipe: every forward, then every backward (in microbatch order, as torch's ScheduleGPipe)."""
    _one_chunk("gpipe", virtual)
    return [[F(m, r) for m in range(microbatches)] + [B(m, r) for m in range(microbatches)] for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int, virtual: int = 1) -> list:
    """1F1B (PipeDream-flush): warm-up forwards, then alternate, then drain the backwards."""
    _one_chunk("1f1b", virtual)
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        acts = [F(m, r) for m in range(warm)]
        for i in range(microbatches - warm):
            acts += [F(warm + i, r), B(i, r)]
        out.append(acts + [B(m, r) for m in range(microbatches - warm, microbatches)])
    return out


def interleaved(pp: int, microbatches: int, virtual: int = 2) -> list:
    """Megatron-LM's interleaved 1F1B: rank r holds stages r, r + pp, ... (``virtual`` chunks);
    forwards go through the chunks in groups of ``pp`` microbatches, backwards in reverse chunk
    order. Needs ``microbatches`` divisible by ``pp``."""
    if microbatches % pp:
        raise ValueError(f"the interleaved schedule runs microbatches in groups of pp={pp}: "
                         f"microbatches={microbatches} must be a multiple of it")
    total = microbatches * virtual

    def nth(k: int, r: int, backward: bool) -> tuple:
        group, within = divmod(k, pp * virtual)
        chunk = within // pp
        if backward:
            chunk = virtual - 1 - chunk
        return group * pp + within % pp, chunk * pp + r

    out = []
    for r in range(pp):
        warm = total if microbatches == pp else min((pp - r - 1) * 2 + (virtual - 1) * pp, total)
        acts = [F(*nth(k, r, False)) for k in range(warm)]
        for i in range(total - warm):
            acts += [F(*nth(warm + i, r, False)), B(*nth(i, r, True))]
        out.append(acts + [B(*nth(k, r, True)) for k in range(total - warm, total)])
    return out


def zero_bubble(pp: int, microbatches: int, virtual: int = 1) -> list:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the forwards and input-gradient
    backwards in 1F1B order, each weight gradient W deferred to where its rank would otherwise
    wait, computed by list scheduling with unit times. At most ``pp - r`` microbatches hold
    their full activations on rank r, as in 1F1B; deferred W's hold only what weight
    gradients read."""
    _one_chunk("zero_bubble", virtual)
    order = one_f_one_b(pp, microbatches)
    done: dict = {}  # action -> end time
    nxt = [0] * pp
    clock = [0] * pp
    pending: list = [[] for _ in range(pp)]  # W's whose B is done, oldest first
    out: list = [[] for _ in range(pp)]
    last = pp - 1

    def held(r: int) -> int:  # microbatches with a forward done and a W still to run on rank r
        return sum(1 for a in out[r] if a.kind == "F") - sum(1 for a in out[r] if a.kind == "W")

    def ready_at(a: Action):
        deps = [F(a.mb, a.stage - 1)] if a.kind == "F" and a.stage > 0 else []
        if a.kind == "B":
            deps = [F(a.mb, a.stage)] + ([B(a.mb, a.stage + 1)] if a.stage < last else [])
        ends = [done.get(d) for d in deps]
        return None if None in ends else max(ends, default=0)

    while any(nxt[r] < len(order[r]) or pending[r] for r in range(pp)):
        # The rank that can start something earliest goes next: a ready F/B, else a pending W.
        best = None
        for r in range(pp):
            t = None
            if nxt[r] < len(order[r]):
                ready = ready_at(order[r][nxt[r]])
                if ready is not None:
                    t = max(clock[r], ready)
            if pending[r] and (t is None or t > clock[r] or held(r) >= pp):
                t = clock[r]
            if t is not None and (best is None or (t, r) < best[:2]):
                best = (t, r)
        if best is None:
            raise RuntimeError("zero_bubble: list scheduling found no runnable action")  # pragma: no cover
        t, r = best
        a = order[r][nxt[r]] if nxt[r] < len(order[r]) else None
        if (a is None or ready_at(a) is None or max(clock[r], ready_at(a)) > t
                or (a.kind == "F" and held(r) >= pp and pending[r])):
            a = pending[r].pop(0)
        else:
            nxt[r] += 1
            if a.kind == "B":
                pending[r].append(W(a.mb, a.stage))
        out[r].append(a)
        done[a] = t + 1
        clock[r] = t + 1
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zero_bubble": zero_bubble}


def _one_chunk(name: str, virtual: int) -> None:
    if virtual != 1:
        raise ValueError(f"schedule {name!r} runs one stage per pipeline rank; virtual={virtual} needs 'interleaved'")


def make_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> list:
    """The per-rank action lists of schedule ``name`` (checked with :func:`check_schedule`).

    >>> [len(acts) for acts in make_schedule("zero_bubble", 4, 8)]
    [24, 24, 24, 24]
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    for what, v in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    sched = SCHEDULES[name](pp, microbatches, virtual)
    check_schedule(sched, pp * virtual, microbatches)
    return sched


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank that runs ``stage``."""
    return stage % pp


def dependencies(a: Action, stages: int, split: bool) -> list:
    """Actions that must finish before ``a`` starts (on any rank)."""
    if a.kind == "F":
        return [F(a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "B":
        return [F(a.mb, a.stage)] + ([B(a.mb, a.stage + 1)] if a.stage < stages - 1 else [])
    return [B(a.mb, a.stage)]


def check_schedule(schedule: list, stages: int, microbatches: int) -> None:
    """Raise ValueError unless every rank runs exactly its stages' F and B (and W, for all
    or none of them) for every microbatch, and running the lists in order with unit times
    completes (no rank waits for an action that can never happen)."""
    pp = len(schedule)
    split = any(a.kind == "W" for acts in schedule for a in acts)
    kinds = "FBW" if split else "FB"
    for r, acts in enumerate(schedule):
        want = sorted(Action(k, m, s) for k in kinds for m in range(microbatches) for s in range(stages)
                      if stage_rank(s, pp) == r)
        if sorted(acts) != want:
            missing = sorted(set(want) - set(acts))[:3]
            extra = sorted(set(acts) - set(want))[:3]
            raise ValueError(f"schedule for pipeline rank {r} is incomplete or has extra actions "
                             f"(missing {missing}, unexpected {extra})")
    done: set = set()
    pos = [0] * pp
    while True:
        progressed = False
        for r in range(pp):
            while pos[r] < len(schedule[r]) and all(d in done for d in dependencies(schedule[r][pos[r]], stages, split)):
                done.add(schedule[r][pos[r]])
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(schedule[r]) for r in range(pp)):
            return
        if not progressed:
            stuck = {r: str(schedule[r][pos[r]]) for r in range(pp) if pos[r] < len(schedule[r])}
            raise ValueError(f"schedule deadlocks: ranks wait forever at {stuck}")
