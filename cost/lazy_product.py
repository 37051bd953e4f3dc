"""The combinations of one item per list, taken lazily in order of the sum of their values.

The layout search's space is a product: one option per mesh axis. Where each option carries a
lower bound of its own that holds whatever the other axes pick, the sum of those bounds bounds
every combination, and the combinations can be visited cheapest first without enumerating the
product: the search stops taking them once the next sum reaches the cost of the plans already
found (``cost/search.py``).

Each combination is reached exactly once, from the one it differs from in its last increased
position (the "parent": that position one lower), so a heap holds at most one entry per
combination taken plus one per list.

Example::

    >>> p = LazyProduct([[0.0, 1.0, 5.0], [0.0, 2.0]])
    >>> [(s, idx) for s, idx in p]
    [(0.0, (0, 0)), (1.0, (1, 0)), (2.0, (0, 1)), (3.0, (1, 1)), (5.0, (2, 0)), (7.0, (2, 1))]
"""
import heapq
from typing import Iterator, Optional, Sequence


class LazyProduct:
    """Index tuples ``idx`` (one index per list) in non-decreasing order of
    ``sum(values[k][idx[k]])``; each list's values must be sorted ascending. Ties come in the
    order of the index tuples."""

    def __init__(self, values: Sequence[Sequence[float]]):
        self.values = [list(v) for v in values]
        for v in self.values:
            if any(b < a for a, b in zip(v, v[1:])):
                raise ValueError("LazyProduct: each list's values must be sorted ascending")
        self._heap: list = []
        if self.values and all(self.values):
            start = (0,) * len(self.values)
            self._heap.append((self._sum(start), start))

    def _sum(self, idx) -> float:
        return sum(v[i] for v, i in zip(self.values, idx))

    def peek(self) -> Optional[float]:
        """The sum of the next combination (None when none is left)."""
        return self._heap[0][0] if self._heap else None

    def pop(self) -> tuple:
        """(sum, index tuple) of the next combination."""
        s, idx = heapq.heappop(self._heap)
        # children: one position raised, at or after the last position above 0 (so each tuple
        # has one parent: itself with its last raised position lowered by one)
        last = max((k for k, i in enumerate(idx) if i), default=0)
        for k in range(last, len(idx)):
            if idx[k] + 1 < len(self.values[k]):
                child = idx[:k] + (idx[k] + 1,) + idx[k + 1:]
                heapq.heappush(self._heap, (self._sum(child), child))
        return s, idx

    def __iter__(self) -> Iterator[tuple]:
        while self._heap:
            yield self.pop()
