"""The layout search's space taken lazily: combinations of axis options, least bound first.

The space is a product, one option (a set of names) per mesh axis, and on small models with
only the inputs named the product runs to tens of thousands of combinations (dozens of
projection names, each open on every axis). Most of them are bounded out by the same fact: the
collectives one axis's option cannot avoid cost more than the best plans found. This module
turns that into a lower bound per option that holds whatever the other axes pick, so the
combinations can be taken cheapest first (:class:`~autoshard.cost.lazy_product.LazyProduct`)
and the rest are never enumerated.

The bound of a combination is ``compute floor + optimizer floor + sum over axes of the option's
floor``:

- **compute floor**: every op split by every axis that has some option touching it (the
  search's compute bound is monotone in the axes splitting an op, so this is at most any
  candidate's);
- **optimizer floor** (training): one step kernel per trainable parameter tensor, the
  ``n * op_overhead`` term of the optimizer phase, whatever the placement or ZeRO stage;
- **option floor** on axis ``a``: the blocking collectives of the option's one-axis rewrite (the
  records behind the communication bound, ``SearchSpace._axis_records``), each moving its bytes
  divided by every other axis. A candidate whose units on ``a`` are the option's own has at
  least these collectives on ``a``, each at least that large (``SearchSpace._comm_bound``).
  The units differ only where a name of the option is also on another axis and gets other
  units there (query heads split first by one axis, then inside by another): such an option's
  floor is 0 in the order, and a combination taken whose other axes hold none of those names
  counts it again (:meth:`LazyCandidates.combination_bound`). A parameter's own conversions are
  left out where the option may be the data axis of a ZeRO 2/3 candidate (its parameters are
  stored sharded there).

Each term is at most the matching term of the search's own bound (compute + optimizer +
communication), so the combinations never taken have a bound at least the cost of the
``keep``-th plan found: the result is the exhaustive optimum, as with the whole product.

Example::

    space = SearchSpace(graph, inputs, info, Mesh({"dp": 2, "tp": 2}), cm, train=True)
    lazy = LazyCandidates(space)        # one-axis records of every option, then sorted
    bound, combo = lazy.pop()           # the combination with the least bound
    cand, key, count = space.combination(combo)
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

from autoshard.ownership import Shard
from autoshard.passes.soft import SOFT_MARK

from .candidate import Candidate
from .lazy_product import LazyProduct
from .model import _state_inputs, collective_seconds
from .prefix_records import reaches

# A space whose product of axis options is at most this is enumerated whole: the lazy order
# needs every option's one-axis rewrite first, which costs more than bounding a few hundred
# combinations.
LAZY_ABOVE = 1000
# About how many combinations the whole enumeration bounds in the time of one one-axis rewrite
# (tens of microseconds a combination, tens of milliseconds a rewrite of a cut-down graph). On a
# compute-bound model the rewrites behind the option floors run whole, and the whole product's
# bounds prune well: there the lazy order pays only for products larger than this many
# combinations per option (the 70B Mesh.auto search's dp=8 x tp=8, 1,225 combinations of 70
# options, is faster enumerated whole).
PAIRS_PER_REWRITE = 300


def latency_bound(space) -> bool:
    """Whether the model's compute, split only as the constraints fix (the least-sharding
    candidate, the most compute of any), is worth at most ten collective latencies: a small
    model, whose best plans shard least and whose one-axis rewrites stop after a collective or
    two once those plans' costs are known."""
    latency = min((collective_seconds(space.cm, space.mesh, "all_reduce", (a,), 0.0)
                   for a, n in space.mesh.axes.items() if n > 1), default=0.0)
    least = tuple(min(opts, key=lambda o: o.count).pair for opts in space.per_axis_options())
    return space.compute_bound(Candidate(least)) <= 10 * latency


def use_lazy(space, lazy: Optional[bool] = None) -> bool:
    """Whether to take ``space``'s combinations lazily: ``lazy`` if given, else when the
    product of its axis options is over :data:`LAZY_ABOVE` and the model is latency-bound
    (:func:`latency_bound`), or the product is over :data:`PAIRS_PER_REWRITE` times the number
    of options. Never with glob constraints (their units are resolved per whole layout)."""
    if space.extra:
        return False
    if lazy is not None:
        return lazy
    opts = space.per_axis_options()
    n = math.prod(len(o) for o in opts)
    return n > LAZY_ABOVE and (latency_bound(space) or n > PAIRS_PER_REWRITE * sum(len(o) for o in opts))


def product_size(space) -> int:
    """Combinations of axis options times state sharding levels (before the validity and
    duplicate checks)."""
    return math.prod(len(o) for o in space.per_axis_options()) * len(space._stage_options)


def floors(space) -> tuple:
    """(compute floor, optimizer floor): at most any candidate's compute bound and optimizer
    phase (see the module's docstring)."""
    every = {a: {n.rstrip(SOFT_MARK) for o in opts for n in o.pair[1]}
             for a, opts in zip(space.mesh.names, space.per_axis_options())}
    compute = 0.0
    for touch, table in space._groups.items():
        s = frozenset(a for a, names in every.items() if names & touch and space.mesh.axes[a] > 1)
        compute += table[s][0]
    opt = 0.0
    if space.train:  # optimizer_phase's tensor count: the same inputs whatever their placements
        n = sum(cnt for *_, cnt in _state_inputs(space._st_inputs, space.vals, [None] * len(space._st_inputs), {},
                                                 space._st_counts))
        opt = n * space.cm.hardware.device.op_overhead
    return compute, opt


def _fragile(space, name, axis) -> bool:
    """Whether ``name`` gets other units on ``axis`` when it is on other axes too."""
    key = ("fragile", name, axis)
    if key not in space._nu:
        alone = sorted(space._name_units(axis).get(name) or ())
        out = False
        for sub in (s for k in range(2, len(space.mesh.names) + 1)
                    for s in itertools.combinations(space.mesh.names, k) if axis in s):
            try:
                out = sorted(space._units({name: sub}).units[axis]) != alone
            except space._LayoutError:
                continue
            if out:
                break
        space._nu[key] = out
    return space._nu[key]


def _may_be_data_axis(space, opt) -> bool:
    """Whether the option's hard units split a user input (the batch)."""
    users = {i.name for i in space._st_inputs if i.kind == "user"}
    try:
        places = space._axis_placements(opt.key[1])
    except space._LayoutError:
        return True
    return any(isinstance(p, Shard) for n, p in places.items() if n in users)


def fragile_names(space, axis, opt) -> frozenset:
    """The hard names of ``opt`` that get other units on ``axis`` when on other axes too."""
    return frozenset(n for n in opt.pair[1] if not n.endswith(SOFT_MARK) and _fragile(space, n, axis))


def option_floor(space, axis, opt, zero_sharded: bool) -> float:
    """Seconds of blocking communication on ``axis`` every candidate holding ``opt`` there pays
    at least (see the module's docstring), where no other axis holds a fragile name of ``opt``
    (:func:`fragile_names`: elsewhere such an option's floor is 0). ``zero_sharded``: ZeRO 2/3
    is in the space."""
    names = opt.pair[1]
    if space.mesh.axes[axis] == 1 or not names:
        return 0.0
    got = space._axis_records(axis, names)
    if got is None:
        return 0.0
    skip_param = zero_sharded and _may_be_data_axis(space, opt)
    others = math.prod(n for b, n in space.mesh.axes.items() if b != axis)
    total = 0.0
    for (kind, nbytes, _touch, is_param), mult in got[1].items():
        if is_param and skip_param:
            continue
        total += mult * collective_seconds(space.cm, space.mesh, kind, (axis,), nbytes / others)
    return total


class LazyCandidates:
    """The combinations of ``space``'s axis options, least bound first (see the module's
    docstring). Makes every option's one-axis records first (with the space's
    ``records_budget``, so set that first where known).

    An option with a fragile name has floor 0 in that order (the product's terms are one per
    axis); :meth:`combination_bound` gives it its own floor where the combination puts none of
    its names on another axis."""

    def __init__(self, space, base: Optional[float] = None):
        self._space = space
        self._zero_sharded = any(z >= 2 for z, _ in space._stage_options)
        self.options, values = [], []
        self.floor: dict = {}  # (axis, names) -> that option's floor
        self._fragile: dict = {}  # (axis, names) -> (its fragile names, the option), where it has any
        self._alone: dict = {}  # (axis, names) -> its floor where its names are on no other axis
        for axis, opts in zip(space.mesh.names, space.per_axis_options()):
            got = {}
            # (in the order that shares and resumes the most one-axis rewrites: reach_order)
            for i in (reach_order(space, axis, opts) if space.mesh.axes[axis] > 1 else range(len(opts))):
                frag = fragile_names(space, axis, opts[i]) if space.mesh.axes[axis] > 1 else frozenset()
                if frag:
                    self._fragile[opts[i].pair] = (frag, opts[i])
                got[i] = 0.0 if frag else option_floor(space, axis, opts[i], self._zero_sharded)
            scored = sorted((x, i) for i, x in got.items())
            self.options.append([opts[i] for _, i in scored])
            values.append([x for x, _ in scored])
            self.floor.update((opts[i].pair, x) for x, i in scored)
        self.base = sum(floors(space)) if base is None else base  # ``base``: that sum, if known
        self._product = LazyProduct(values)
        self.taken = 0

    def bound(self, cand) -> float:
        """The bound of ``cand``'s combination (what :meth:`pop` returns with it)."""
        return self.base + sum(self.floor[pair] for pair in cand.axes)

    def combination_bound(self, pairs) -> float:
        """The bound of the combination of axis options ``pairs`` ((axis, names) per axis), at
        least :meth:`bound`: an option with a fragile name none of which the others hold counts
        its own floor."""
        total = self.base
        for pair in pairs:
            frag, opt = self._fragile.get(pair, (None, None))
            if frag is None or any(frag & q[1] for q in pairs if q is not pair):
                total += self.floor[pair]
                continue
            if pair not in self._alone:
                self._alone[pair] = option_floor(self._space, pair[0], opt, self._zero_sharded)
            total += self._alone[pair]
        return total

    def peek(self) -> Optional[float]:
        """The bound of the next combination (None when none is left)."""
        s = self._product.peek()
        return None if s is None else self.base + s

    def pop(self) -> tuple:
        """(bound, combination: one option per axis) of the next combination."""
        s, idx = self._product.pop()
        self.taken += 1
        return self.base + s, tuple(opts[i] for opts, i in zip(self.options, idx))


def by_count(opts) -> list:
    """Indices of axis options ``opts``, fewest names first."""
    return sorted(range(len(opts)), key=lambda i: opts[i].count)


def warm_records(space, pairs=None) -> None:
    """Every axis option's one-axis records at the space's current budget (or those of the
    options ``pairs``, (axis, names) each), in the order of the nodes where the option's units
    start to decide (:func:`reach_order`)."""
    for axis, opts in zip(space.mesh.names, space.per_axis_options()):
        if pairs is not None:
            opts = [o for o in opts if o.pair in pairs]
        if space.mesh.axes[axis] > 1:
            for i in reach_order(space, axis, opts):
                space._axis_records(axis, opts[i].pair[1])


def reach_order(space, axis, opts) -> list:
    """Indices of axis options ``opts`` of ``axis``, in the order of the (node, unit) sequences
    at which their units start to decide (``cost.prefix_records.reaches``; fewest names first
    among the rest). Taken so, an option's budgeted records are often those of one before it
    that it extends by a unit deciding later (``cost/prefix_records.py``), and otherwise its
    rewrite resumes from the longest prefix it shares with the one before
    (``passes/rewrite_state.py``); the search's own order (least compute first: most names
    first) would rewrite each whole."""
    first = space._resume_path(space.mesh.axes[axis]).first

    def key(i):
        units = space.option_units(axis, opts[i].pair[1])
        return (0, [(p, repr(u)) for p, u in reaches(first, units)]) if units is not None else (1, opts[i].count)
    return sorted(range(len(opts)), key=key)


def seed_combinations(space) -> list:
    """Combinations naming the fewest dims (at most one more than the least per axis), fewest
    first: on a latency-bound model the likely best, evaluated before the lazy order starts so
    that the one-axis rewrites can stop early."""
    small = []
    for opts in space.per_axis_options():
        low = min(o.count for o in opts)
        small.append([o for o in opts if o.count <= low + 1])
    return sorted(itertools.product(*small), key=lambda c: sum(o.count for o in c))


def most_named(space, cand):
    """``cand`` with, per axis, the options giving the same program and naming the most dims
    (what the whole enumeration keeps of candidates with the same units; the lazy order keeps
    the first it meets)."""
    groups, start = [], []
    for (axis, names), opts in zip(cand.axes, space.per_axis_options()):
        own = next(o for o in opts if o.pair == (axis, names))
        start.append(own)
        groups.append([o for o in opts if o.key == own.key])
    invalid = space.invalid
    try:
        got = space.combination(tuple(start))
        if got is None:
            return cand
        key, best, most = got[1], cand.axes, got[2]
        for combo in itertools.product(*groups):
            r = space.combination(combo)
            if r is not None and r[1] == key and r[2] > most:
                best, most = r[0].axes, r[2]
    finally:
        space.invalid = invalid
    return Candidate(best, cand.zero_stage, cand.reshard)
