"""Pipeline bubble: fill/drain idle time of GPipe, 1F1B and interleaved schedules.

First-order model (balanced stages, equal micro-batch times, free transfers). Seed 000 asks
to keep two quantities apart:

* :func:`bubble_fraction` - idle fraction of *elapsed* capacity,
  ``(p-1) / (v*m + p-1)`` (seed 003, eq. 13.1 with ``v=1``);
* :func:`bubble_overhead` - idle time *relative to useful work*, ``(p-1) / (v*m)``
  (the form Megatron-LM's interleaving paper reports).

GPipe and 1F1B have the same bubble (1F1B only shortens activation lifetimes). Interleaving
``v`` virtual chunks per rank shrinks each fill/drain step to ``1/v`` of a stage's work.

Example::

    >>> bubble_fraction(4, 8), bubble_fraction(4, 32)
    (0.2727272727272727, 0.08571428571428572)
"""
from __future__ import annotations

__all__ = ["bubble_fraction", "bubble_overhead"]


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
