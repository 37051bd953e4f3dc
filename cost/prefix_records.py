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

import math
from typing import Optional

from torch import fx

from autoshard.passes.rewrite_state import Checkpoints
from autoshard.passes.untouched import first_reads, reach


def deciding(first: dict, units, stop: int) -> tuple:
    """The units of ``units`` ((hard, soft), in order) that can split a dim of the nodes up to
    node ``stop`` (``first``: ``passes.untouched.first_reads``)."""
    hard, soft = units
    soft = tuple(u for u in soft if reach(first, u, False) <= stop)
    return tuple(u for u in hard if reach(first, u, bool(soft)) <= stop), soft


def reaches(first: dict, units) -> list:
    """The nodes at which ``units`` ((hard, soft)) start to decide, with the unit, in order."""
    hard, soft = units
    return sorted([(reach(first, u, bool(soft)), u) for u in hard] + [(reach(first, u, False), u) for u in soft])


class PrefixRecords:
    """Budgeted one-axis records of one search space, by the units that decide them (see the
    module's docstring). ``units``: ``(hard units, soft units)`` of the one-axis layout, in
    order (``passes.untouched.prefix_units``)."""

    def __init__(self, graph: fx.Graph, info):
        self.first = first_reads(graph, info)
        self._by_stop: dict = {}  # stop node index -> {units deciding up to it: (budget, records)}

    def find(self, units, budget: float) -> Optional[tuple]:
        """(records, budget they reached) of an option whose rewrite stopped at a node up to which
        ``units`` decide the same, at a budget at least ``budget``; None if none is known."""
        for stop, table in self._by_stop.items():
            got = table.get(deciding(self.first, units, stop))
            if got is not None and got[0] >= budget:
                return got[1], got[0]
        return None

    def add(self, units, stop: int, budget: float, records) -> None:
        """The rewrite of ``units`` stopped at node ``stop`` once its collectives reached ``budget``."""
        table = self._by_stop.setdefault(stop, {})
        key = deciding(self.first, units, stop)
        if key not in table or table[key][0] < budget:
            table[key] = (budget, records)


class ResumePath:
    """Saved states of the latest one-axis rewrites of one search space and axis size, at the
    nodes where some axis option's units start to decide (``positions``), for the next rewrite
    to start from the latest one its units decide alike before (``passes/rewrite_state.py``).

    The saved states form one path: each is a state of the rewrite that saved the next. A
    rewrite resumed from one keeps the path up to it and saves its own after it, so taking the
    options in the order of the nodes where their units start to decide (:func:`reaches`)
    resumes each from the longest prefix it shares with the one before.

    Example::

        path = ResumePath(first_reads(graph, info), positions)
        state, marks = path.start(units, cost, budget)  # state: None, or where to resume
        rewrite(..., resume=state, checkpoints=marks)
    """

    def __init__(self, first: dict, positions):
        self.first = first
        self.positions = frozenset(p for p in positions if math.isfinite(p))
        self._path: list = []  # [(position, units deciding before it, RewriteState)], by position

    def start(self, units, cost=None, budget: float = math.inf) -> tuple:
        """(the saved state to resume a rewrite of ``units`` from, or None; the Checkpoints
        for that rewrite). A state qualifies where ``units`` decide alike before its node, after
        the node where they first decide, and (for a rewrite that stops at a budget) its
        collectives cost (by ``cost(collectives)``) less than ``budget``: a rewrite with
        ``units`` would not have stopped before it."""
        begin = min((p for p, _ in reaches(self.first, units)), default=math.inf)
        agree = 0
        while agree < len(self._path) and self._path[agree][1] == deciding(self.first, units, self._path[agree][0] - 1):
            agree += 1
        use = next((i for i in range(agree - 1, -1, -1)
                    if self._path[i][0] > begin and (cost is None or cost(self._path[i][2].collectives) < budget)), None)
        del self._path[(use + 1 if use is not None else agree):]
        state = self._path[use][2] if use is not None else None

        def take(saved):
            while self._path and self._path[-1][0] >= saved.position:  # (states of a rewrite before this one)
                self._path.pop()
            self._path.append((saved.position, deciding(self.first, units, saved.position - 1), saved))
        return state, Checkpoints(self.positions, take)
