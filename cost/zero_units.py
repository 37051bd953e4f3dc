"""The ZeRO-3 unit policy (FSDP's "wrapping") chosen by cost.

Bigger units pay the collective latency fewer times but hold more gathered parameters at once
(two units while the next one is prefetched) and start their gradient reduce-scatter later in
backward. :func:`choose_units` builds the program under each policy and keeps the fastest one
that fits ``memory_limit``; :func:`least_unit_latency` is the least collective latency the units
of a policy pay (the search's bounds).

Example::

    policy, program = choose_units(lambda u: build_program(..., units=u), cost_of, memory_limit=None)
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

from autoshard.passes.zero_units import unit_of

CANDIDATES = ("block", "model", "param")


def choose_units(build: Callable, cost_of: Callable, memory_limit: Optional[float] = None,
                 candidates=CANDIDATES):
    """``(policy, built, cost)`` of the fastest unit policy within ``memory_limit``:
    ``build(policy)`` returns a program (or a tuple whose first item is one) and
    ``cost_of(built)`` its ``PlanCost``. Ties go to the earlier candidate; if none fits, the
    one with the lowest peak memory."""
    tried = []
    for policy in candidates:
        built = build(policy)
        tried.append((policy, built, cost_of(built)))
    fits = [t for t in tried if memory_limit is None or t[2].memory["peak"] <= memory_limit]
    if fits:
        return min(fits, key=lambda t: t[2].step_time)
    return min(tried, key=lambda t: t[2].memory["peak"])


def least_unit_latency(fqns, policy, gather: float, scatter: float) -> float:
    """The least latency ZeRO-3's gathers of parameters ``fqns`` pay on the communication
    stream under ``policy``, given one all-gather's (``gather``) and one reduce-scatter's
    (``scatter``) latency. ``passes.zero_units.group_units`` forms one unit per distinct unit
    name (the parameters outside every named unit: one unit at least; ``"block"`` makes them
    two where they occur before and after the blocks); a unit is one all-gather in forward and
    one reduce-scatter in backward, but a parameter read by work not split on the axis is
    gathered on its own, outside any unit. So a unit of one parameter pays one gather at least,
    a unit of more either a gather and a reduce-scatter or two gathers.

    Example::

        least_unit_latency(["layers.0.wq", "layers.0.wk", "norm.weight"], "block", 3e-6, 3e-6)  # 9e-6
    """
    sizes = Counter(unit_of(f, policy) for f in fqns)
    return sum(gather + (min(gather, scatter) if n > 1 else 0.0) for n in sizes.values())
