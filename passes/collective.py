"""The plan's record of one collective: what moves, on which mesh axes, in which phase, and why.

Every pass that puts a collective into a program records one (``spmd`` for placement changes,
``lowering.Lowering.record`` for lowerings, ``units`` / ``program`` / ``pipeline`` for ZeRO
units, gradient buckets and stage boundaries); the cost model and ``plan.collectives`` read them.

Example::

    >>> Collective("all_reduce", ("tp",), 4096, "forward", "layers.0.mlp.down_proj",
    ...            "partial sum; add needs it whole").kind
    'all_reduce'
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Collective:
    """One collective in the plan: what moves, where, and why."""

    kind: str  # one of runtime.collectives.COMM_KINDS (all_reduce, all_gather, reduce_scatter, ...)
    axes: tuple
    bytes: int  # payload of this rank's input buffer
    phase: str  # forward | backward | optimizer
    where: str  # module FQN of the op that needs the conversion
    why: str
    node: str = ""  # the value converted
    line: str = ""  # source line of the consumer
    tag: int = -1  # links runtime trace records to this entry
    op: str = ""  # runtime function inserted in the forward program
    params: tuple = ()  # parameters a grouped collective carries (ZeRO-3 units, gradient buckets)
