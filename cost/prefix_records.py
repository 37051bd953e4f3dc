"""Budgeted one-axis records shared by the axis options that agree up to where a rewrite stopped.

The layout search bounds each axis option by the collectives of its one-axis rewrite
(``SearchSpace._axis_records``), and once good plans are known the rewrite stops at the node
where the collectives it has emitted already cost the budget. Up to that node the rewrite has
decided every placement from the captured graph and from which unit of the layout splits each
dim of the values the nodes read and write (``_Rewriter.unit_of``); a placeholder's placement
counts where it is read. Another option whose units agree on every dim of those nodes makes the
same decisions there, so it emits the same collectives up to the same node: its budgeted
records are the first option's, with no rewrite. On small models most options are a few names
from different layers: ``{batch, decoder ffn}`` stops at the first encoder op as ``{batch}``
did, and ``{encoder heads, decoder ffn}`` inside the encoder's attention as
``{encoder heads}`` did.

"Agree" is checked per unit: a unit (a prefix of a dim's leaf atoms) can split a dim only at or
after the first node reading or writing a dim that it is a prefix of
(``passes/untouched.py``). Two
options agree up to node ``j`` when their units that can split a dim there are the same, in the
same order (the rewrite gives a dim the first unit of the layout that is a prefix of its
leaves; with soft entries, a hard unit reaches from its leading atom on, since a soft split
applies where no hard unit's leading atom claims a value). Layouts that the rewrite reads as a
whole are never shared: context-parallel attention (planned for the whole layout), regional
units of expert layers (``passes.untouched.prefix_units``); the caller checks those.

Example::

    shared = PrefixRecords(graph, info)
    got = shared.find(units, budget)               # (records, budget they reached) or None
    if got is None:
        ...                                        # rewrite; on stopping at node ``j``:
        shared.add(units, j, budget, records)
"""
from __future__ import annotations

from typing import Optional

from torch import fx

from autoshard.passes.untouched import first_reads, reach


class PrefixRecords:
    """Budgeted one-axis records of one search space, by the units that decide them (see the
    module's docstring). ``units``: ``(hard units, soft units)`` of the one-axis layout, in
    order (``passes.untouched.prefix_units``)."""

    def __init__(self, graph: fx.Graph, info):
        self.first = first_reads(graph, info)
        self._by_stop: dict = {}  # stop node index -> {units deciding up to it: (budget, records)}

    def _deciding(self, units, stop: int) -> tuple:
        hard, soft = units
        soft = tuple(u for u in soft if reach(self.first, u, False) <= stop)
        return tuple(u for u in hard if reach(self.first, u, bool(soft)) <= stop), soft

    def find(self, units, budget: float) -> Optional[tuple]:
        """(records, budget they reached) of an option whose rewrite stopped at a node up to which
        ``units`` decide the same, at a budget at least ``budget``; None if none is known."""
        for stop, table in self._by_stop.items():
            got = table.get(self._deciding(units, stop))
            if got is not None and got[0] >= budget:
                return got[1], got[0]
        return None

    def add(self, units, stop: int, budget: float, records) -> None:
        """The rewrite of ``units`` stopped at node ``stop`` once its collectives reached ``budget``."""
        table = self._by_stop.setdefault(stop, {})
        key = self._deciding(units, stop)
        if key not in table or table[key][0] < budget:
            table[key] = (budget, records)
