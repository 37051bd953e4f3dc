"""A point of the layout search's space: the names each mesh axis shards, and the state
sharding level.

Example::

    >>> c = Candidate((("dp", frozenset({"batch"})), ("tp", frozenset({"heads", "seq?"}))), zero_stage=1)
    >>> c.describe()
    'dp: batch, tp: heads+seq?; zero 1'
    >>> c.layout(["batch", "heads", "seq", "ffn"], {})
    {'batch': ('dp',), 'heads': ('tp',), 'seq': 'tp?', 'ffn': None}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autoshard.passes.soft import SOFT_MARK, soft_layout_value


@dataclass(frozen=True)
class Candidate:
    """One point of the search space: per mesh axis the names it shards, and the state
    sharding level (``zero_stage``; ``reshard`` for stage 3)."""

    axes: tuple  # ((axis, frozenset(names)), ...) in mesh order
    zero_stage: int = 0
    reshard: Optional[bool] = None

    def layout(self, names, extra: dict) -> dict:
        """A complete layout: every name -> its axes in mesh order (``None`` when whole),
        plus the user's constraint entries that are not names (globs, inferred names)."""
        out = {}
        for n in names:
            axes = tuple(a for a, s in self.axes if n in s)
            soft = tuple(a for a, s in self.axes if n + SOFT_MARK in s)  # "seq?": a soft entry
            out[n] = axes or (soft_layout_value(soft) if soft else None)
        out.update(extra)
        return out

    def describe(self) -> str:
        parts = []
        for a, s in self.axes:
            parts.append(f"{a}: {'+'.join(sorted(s)) if s else '-'}")
        z = f"; zero {self.zero_stage}" + ("" if self.reshard is None else f" reshard={self.reshard}")
        return ", ".join(parts) + (z if self.zero_stage else "")
