"""What the SPMD rewrite notes for the data-parallel gradient sync while it converts values,
and what it decides from that at the end.

- Gradient buckets: a parameter whose every read is per-rank work on the bucket axis loses its
  ``mark_varying`` there; ``GradBuckets`` sums its gradient instead (overlapped with backward).
- Replicated regions computed from parameters (``passes/grad_regions.py``) send their gradient
  sum on the data axis to the parameters: into the buckets, or, without buckets (ZeRO-2/3),
  into the stored parameters' reduce-scatters.

The rewrite keeps one :class:`GradSync` per program: it tells it of every read of a value
(:meth:`GradSync.note_use`) and of every ``mark_varying`` (:meth:`GradSync.note_mark`), then asks
for the bucketed parameters (:meth:`GradSync.take_bucketed`) and the moved region sums
(:meth:`GradSync.sum_in_storage`).

Example::

    sync = GradSync(bucket_axis="dp", bucket_candidates=["p_w"], region_axis=None)
    # ... the rewrite converts values, calling sync.note_use / sync.note_mark ...
    bucketed = sync.take_bucketed(rw)            # ["p_w"]: its gradient goes into a bucket
"""
from __future__ import annotations

from autoshard.ownership import R

from .grad_regions import bucketable_region, drop_marks, sum_regions_in_storage, use_kind


class GradSync:
    """Gradient-sync bookkeeping of one rewrite (see the module docstring)."""

    def __init__(self, bucket_axis=None, bucket_candidates=(), region_axis=None):
        self.bucket_axis = bucket_axis
        self.bucket_uses: dict = {name: set() for name in (bucket_candidates or ())}
        # with buckets, regions sum into them on the bucket axis; else (ZeRO-2/3) on region_axis
        self.region_axis = bucket_axis if bucket_axis is not None else region_axis
        self.bucket_marks: dict = {}  # value name -> its mark_varying nodes on region_axis
        self.grad_uses: dict = {}  # gradient-carrying node -> [(reader, kind on region_axis)] (grad_regions)

    def note_use(self, rw, src, cur, target, varying, consumer) -> None:
        """A read of ``src`` (placement ``cur`` -> ``target``, per-rank work on ``varying``):
        whether a bucket candidate is read by per-rank work on the bucket axis only, and how
        each gradient-carrying value is read on the region axis."""
        if src.name in self.bucket_uses:
            self.bucket_uses[src.name].add(self.bucket_axis in varying)
        if src in rw.rg and self.region_axis is not None:
            i, a = rw.axes.index(self.region_axis), self.region_axis
            st = rw.zero.storage.get(src.name)
            # a parameter stored sharded on the axis is read from its gathered (or full) copy
            whole = R if st is not None and st.axis == a else cur[i]
            self.grad_uses.setdefault(src, []).append((consumer, use_kind(whole, target[i], a in varying)))

    def note_mark(self, src, axis, node) -> None:
        """A ``mark_varying`` of ``src`` on ``axis`` was emitted as ``node``."""
        if axis == self.region_axis:
            self.bucket_marks.setdefault(src.name, []).append(node)

    def take_bucketed(self, rw) -> list:
        """Drop the data-axis mark_varying of parameters used only by per-rank work there, and
        of replicated regions computed from parameters alone (passes/grad_regions.py); the
        parameters are synchronized by gradient buckets. Returns them in the order their
        gradients become ready (reverse order of first use)."""
        first_use = {}
        for i, node in enumerate(rw.g0.nodes):
            for a in node.all_input_nodes:
                first_use.setdefault(a.name, i)
        names = [n for n, uses in self.bucket_uses.items() if uses == {True} and n in self.bucket_marks]
        region = bucketable_region(rw.g0, rw.rg, rw.place, self.grad_uses, rw.axes.index(self.bucket_axis),
                                   self.bucket_uses) if self.bucket_axis is not None else set()
        names += [n for n in self.bucket_uses if n in region and n not in names]
        dropped = drop_marks(sorted(set(names) | region), self.bucket_marks, rw.g)
        rw.collectives = [c for c in rw.collectives if c.tag not in dropped]
        return sorted(names, key=lambda n: -first_use.get(n, 0))

    def sum_in_storage(self, rw) -> None:
        """Without buckets, move the region sums into the stored parameters' reduce-scatters."""
        zero = rw.zero
        if self.bucket_axis is None and self.region_axis is not None and zero.stored_reads:
            rw.collectives = sum_regions_in_storage(
                rw.g0, rw.g, rw.rg, rw.place, self.grad_uses, self.region_axis, rw.axes, zero.storage,
                zero.stored_reads, self.bucket_marks, rw.collectives)
