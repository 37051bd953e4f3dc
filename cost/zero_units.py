"""The ZeRO-3 unit policy (FSDP's "wrapping") chosen by cost.

Bigger units pay the collective latency fewer times but hold more gathered parameters at once
(two units while the next one is prefetched) and start their gradient reduce-scatter later in
backward. :func:`choose_units` builds the program under each policy and keeps the fastest one
that fits ``memory_limit``.

Example::

    policy, program = choose_units(lambda u: build_program(..., units=u), cost_of, memory_limit=None)
"""
from __future__ import annotations

from typing import Callable, Optional

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
