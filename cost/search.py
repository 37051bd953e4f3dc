"""Layout search: which logical dims each mesh axis shards, and the state sharding level.

The search space (:func:`SearchSpace.candidates`):

- for each mesh axis (size > 1), a set of user-named logical dims it shards. Names in one set
  never meet in one tensor (heads and ffn both on tp: yes; batch and hidden: no), every name's
  size divides the axis, and candidates giving the rewrite the same units are one candidate.
  A name in the sets of several axes is split by all of them, in mesh order (batch on dp and
  tp = 64-way data parallelism on dp=8 x tp=8). Names are region-specific where the model's
  regions are (``heads`` only in attention, ``ffn`` only in the MLP, ``vocab`` only in the
  embedding and head), so "which region shards what" is part of a candidate, and the rewrite
  inserts the ownership changes between regions; a logical dim that flows through every
  region (the residual stream's batch / seq / hidden) has one owner everywhere;
- ``layout=`` entries are constraints: a name given ``None`` stays whole, a name given axes
  keeps exactly those axes; the other names are open;
- the state sharding level on the data axis (the lead's ``zero_stage`` 0-3, and for 3 whether
  parameters are released after forward) when training with a data axis.

Evaluation is exact and fast: the captured graph is cut down to the code outside the repeated
blocks plus the first three blocks (identical ``layers.N`` blocks are solved once); the real
SPMD rewrite runs on that, and the cost model (``cost.model``) is applied to the rewritten
program with the last block's events repeated for the blocks cut away. Equal to the cost of
the plan rewritten from the whole graph (checked: the steady-state block must repeat exactly,
else the whole graph is used). Candidates are visited best lower bound first (compute time
with every op split by the axes that can touch it, plus the exact optimizer time and the
communication it cannot avoid; in training at least the communication stream's busy time plus
the optimizer; and persistent memory against ``memory_limit``), and the search stops when
the bound exceeds the cost of the best few found: the winner is the exhaustive minimum.

Example::

    >>> import torch, autoshard                                               # doctest: +SKIP
    >>> plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 4}), dims=dims,
    ...                            layout={"batch": None})                      # doctest: +SKIP
    >>> plan.layout["heads"], plan.layout["ffn"]                               # doctest: +SKIP
    (('tp',), ('tp',))
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import gc
import heapq
import itertools
import math
import operator
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from autoshard.mesh import Mesh, factorizations
from autoshard.ownership import R, Replicate, data_axes
from autoshard.passes.dims import infer_dims, module_of
from autoshard.passes.program import build_program, choose_storage, lowered
from autoshard.passes.soft import SOFT_MARK, SoftLayoutError, is_soft, split_soft
from autoshard.passes.spmd import (Layout, LayoutError, UnsupportedOpWarning, _resolve_entry, input_placements,
                                  lazy_programs, requires_grad_nodes, resolve_layout, rewrite, unchanged_graphs)
from autoshard.passes.untouched import prefix_units
from autoshard.passes.experts import find_expert_regions

from autoshard.cost.recompute import annotate_boundaries, checkpoint_choice, checkpointed_segments, has_blocks
from .compute import roofline_time
from .candidate import Candidate
from .prefix_records import PrefixRecords, ResumePath, reaches
from autoshard.runtime.primitives.vocab_parallel import vocab_parallel_cross_entropy
from .zero_units import least_unit_latency
from .lazy_search import (LazyCandidates, floors, latency_bound, most_named, product_size, seed_combinations,
                          use_lazy, warm_records)
from autoshard.cost.context_parallel import ContextSearch
from .model import (VIEW_OPS, Comm, CostModel, PlanCost, _dtype_of, _local_numel, _tensors, block_of_module,
                    collective_seconds, op_work, optimizer_phase, program_events, resolve_cost_model, simulate,
                    state_memory)

VOCAB_PARALLEL = vocab_parallel_cross_entropy.__name__  # the op of a vocab-parallel loss's collectives

__all__ = ["SearchSpace", "SearchResult", "Candidate", "search_layout", "factorizations", "reduce_graph"]


# =========================================================================== repeated blocks


@dataclass
class Reduced:
    """The captured graph cut to the non-block code plus the first ``kept`` blocks."""

    graph: fx.Graph
    inputs: list  # captured Inputs of the kept placeholders, in order
    info: object  # DimInfo of the reduced graph, names transferred
    family: str  # e.g. "layers"
    n_blocks: int
    kept: int
    input_map: dict = field(default_factory=dict)  # whole-graph placeholder -> reduced placeholder


def _node_sig(node, pos: dict, block_of: dict, j: int, param_key) -> tuple:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    shapes = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(type(v)) for v in vals)
    ctx = (pos, block_of, j, param_key)
    return (str(node.target), shapes, _arg_sig(node.args, ctx), _arg_sig(node.kwargs, ctx))


def _arg_sig(a, ctx):
    # (a module-level function: a nested recursive one is a reference cycle per call)
    pos, block_of, j, param_key = ctx
    if isinstance(a, fx.Node):
        if a.op == "placeholder":
            return ("ph", param_key(a))
        b = block_of.get(a)
        if b == j:
            return ("in", pos[a])
        if b is not None and b == j - 1:
            return ("prev", pos[a])
        if b is not None:
            return ("other", b, pos[a])
        return ("ext", a.name)
    if isinstance(a, (list, tuple)):
        return tuple(_arg_sig(x, ctx) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _arg_sig(v, ctx)) for k, v in a.items()))
    return ("lit", repr(a))


def find_blocks(graph: fx.Graph, inputs, info=None) -> Optional[tuple]:
    """(family, [nodes of block 0], [block 1], ...) when the graph is prefix, L identical
    contiguous blocks, suffix (blocks = ``<family>.<i>`` modules); else None."""

    target_of = {i.name: i.target for i in inputs}
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    label = {n: block_of_module(module_of(n)) for n in nodes}
    fams: dict = {}
    for n in nodes:
        if label[n] is not None:
            fams[label[n][0]] = fams.get(label[n][0], 0) + 1
    if not fams:
        return None
    fam = max(fams, key=fams.get)
    seq = [label[n][1] if label[n] is not None and label[n][0] == fam else None for n in nodes]
    # contiguity: None* 0+ 1+ ... (L-1)+ None*
    idx = [i for i, b in enumerate(seq) if b is not None]
    first, last = idx[0], idx[-1]
    if any(b is None for b in seq[first:last + 1]):
        return None
    blocks: list = []
    for i in range(first, last + 1):
        b = seq[i]
        if b == len(blocks) - 1:
            blocks[-1].append(nodes[i])
        elif b == len(blocks):
            blocks.append([nodes[i]])
        else:
            return None
    if len(blocks) < 2:
        return None
    block_of = {n: j for j, bl in enumerate(blocks) for n in bl}
    pos = {n: k for bl in blocks for k, n in enumerate(bl)}

    def param_key(ph):
        t = target_of.get(ph.name, ph.name)
        parts = t.split(".")
        prefix = fam.split(".")
        if parts[:len(prefix)] == prefix and len(parts) > len(prefix) and parts[len(prefix)].isdigit():
            parts[len(prefix)] = "#"
            v = ph.meta.get("val")
            names = tuple(info.dim_name(a) if a else "1" for a in info.of(ph)) if info is not None and ph in info.dims else None
            return (".".join(parts), tuple(v.shape) if isinstance(v, torch.Tensor) else None, names)
        return t

    sigs = [[_node_sig(n, pos, block_of, j, param_key) for n in bl] for j, bl in enumerate(blocks)]
    for j in range(2, len(blocks)):
        if sigs[j] != sigs[1]:
            return None
    # block 0 must match block 1 except for where its inputs come from
    strip = lambda s: [(t, sh) for t, sh, _, _ in s]
    if strip(sigs[0]) != strip(sigs[1]):
        return None
    # the suffix may read the last block only
    last_set = set(blocks[-1])
    for n in nodes[last + 1:]:
        for a in n.all_input_nodes:
            if a in block_of and a not in last_set:
                return None
    # blocks may not be read by the prefix (trivially) nor placeholders of other blocks read
    # by the suffix
    return (fam, blocks, param_key)


def reduce_graph(graph: fx.Graph, inputs, info, kept: int = 3) -> Optional[Reduced]:
    """The graph with only the first ``kept`` blocks (the suffix reads the last kept block
    where it read the last block), its inputs and its named dims; None when the graph has no
    identical repeated blocks or is not longer than that."""

    found = find_blocks(graph, inputs, info)
    if found is None:
        return None
    fam, blocks, param_key = found
    L = len(blocks)
    if L <= kept:
        return None
    dropped = {n for bl in blocks[kept:] for n in bl}
    remap = {n: blocks[kept - 1][k] for k, n in enumerate(blocks[-1])}
    used = set()
    for n in graph.nodes:
        if n.op == "placeholder" or n in dropped:
            continue
        for a in n.all_input_nodes:
            used.add(a if a not in remap else remap[a])
    new = fx.Graph()
    env: dict = {}
    kept_inputs = []
    by_name = {i.name: i for i in inputs}
    for n in graph.nodes:
        if n.op == "placeholder":
            inp = by_name.get(n.name)
            if n not in used and inp is not None and inp.kind in ("parameter", "buffer", "constant"):
                continue
            env[n] = new.placeholder(n.name)
            env[n].meta = dict(n.meta)
            if inp is not None:
                kept_inputs.append(inp)
            continue
        if n in dropped:
            continue
        env[n] = new.node_copy(n, lambda a: env[remap.get(a, a)])
    # infer dims on the reduced graph and carry the user's names over, dim by dim
    red_info = infer_dims(new, {i.name: i.target for i in kept_inputs})
    full_ph = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for n in new.nodes:
        if n.op != "placeholder" or n not in red_info.dims:
            continue
        src = full_ph[n.name]
        if src not in info.dims:
            continue
        for d, atoms in enumerate(info.of(src)):
            lv = info.leaves(atoms)
            if lv in info.names:
                rl = red_info.leaves(red_info.of(n)[d])
                if rl:
                    red_info.names[rl] = info.names[lv]
    if set(red_info.names.values()) != set(info.names.values()):
        return None
    # every placeholder of the whole graph -> the reduced one that stands for it
    kept_names = {i.name for i in kept_inputs}
    by_key = {}
    for n in new.nodes:
        if n.op == "placeholder":
            by_key.setdefault(param_key(full_ph[n.name]), n.name)
    input_map = {}
    for i in inputs:
        if i.name in kept_names:
            input_map[i.name] = i.name
        elif i.name in full_ph and param_key(full_ph[i.name]) in by_key:
            input_map[i.name] = by_key[param_key(full_ph[i.name])]
    return Reduced(new, kept_inputs, red_info, fam, L, kept, input_map)


def expand_segments(segments, family: str, n_blocks: int, kept: int) -> Optional[list]:
    """Segments of the whole model from those of the reduced program: the last kept block
    stands for every block after it. None if the kept blocks do not reach a steady state
    (the last two kept blocks must cost exactly the same)."""
    idx = {}
    for k, s in enumerate(segments):
        if s.block is not None and s.block[0] == family:
            if s.block[1] in idx:
                return None  # a block split into several runs: not contiguous after rewrite
            idx[s.block[1]] = k
    if sorted(idx) != list(range(kept)):
        return None
    ks = [idx[j] for j in range(kept)]
    if ks != list(range(ks[0], ks[0] + kept)):
        return None
    a, b = segments[ks[-2]], segments[ks[-1]]
    if a.key() != b.key():
        return None
    last = segments[ks[-1]]
    return segments[:ks[-1]] + [last] * (n_blocks - kept + 1) + segments[ks[-1] + 1:]


# =========================================================================== the space


@dataclass
class Evaluated:
    candidate: Candidate
    layout: dict
    cost: PlanCost
    bound: float = 0.0
    mesh: object = None


@dataclass
class SearchResult:
    """What the search found: ``best`` (an :class:`Evaluated`: candidate, layout, cost),
    ``alternatives`` (the next best, cheapest first), and statistics."""

    best: Optional[Evaluated]
    alternatives: list
    mesh: object
    space_size: int
    evaluated: int
    rewrites: int
    seconds: float
    reduced: bool
    memory_limit: Optional[float] = None
    infeasible: int = 0
    invalid: int = 0
    notes: list = field(default_factory=list)
    best_infeasible: Optional[Evaluated] = None  # the fastest candidate over memory_limit, if faster
    meshes: list = field(default_factory=list)
    constraints: dict = field(default_factory=dict)  # the layout entries the search kept fixed
    taken: Optional[int] = None  # combinations taken in bound order, where the space was taken lazily

    @property
    def layout(self) -> dict:
        return self.best.layout

    @property
    def zero_stage(self) -> int:
        return self.best.candidate.zero_stage

    @property
    def reshard_after_forward(self) -> Optional[bool]:
        return self.best.candidate.reshard

    @property
    def cost(self) -> PlanCost:
        return self.best.cost

    @property
    def checkpoint(self):
        """The recompute policy of the best plan (``"block"``, ``"selective"``), or False."""
        return self.best.cost.checkpoint or False


class SearchSpace:
    """The captured program, its named dims, the mesh, the cost model and the constraints;
    enumerates and evaluates candidates.

    Example::

        space = SearchSpace(cap.graph, cap.inputs, info, mesh, CostModel(load_hardware("h100")),
                            train=True)
        for cand in space.candidates(): print(cand.describe(), space.evaluate(cand).step_time)
    """

    def __init__(self, graph, inputs, info, mesh, cm: CostModel, *, train: bool = False, constraints=None,
                 memory_limit=None, zero_stage=None, reshard_after_forward=None, kept_blocks: int = 3,
                 reduce: bool = True, display=None, bucket_mb: float = 25.0, shared: Optional[dict] = None,
                 units="block", checkpoint: Optional[bool] = None, soft: Optional[bool] = None):

        self.graph, self.inputs, self.info, self.mesh, self.cm = graph, list(inputs), info, mesh, cm
        self.train = train
        self.memory_limit = memory_limit
        # Soft entries (sequence parallelism, token rows where an axis is free) are explored by
        # default; soft=False restricts the space to hard entries (docs/search.md).
        self.soft_search = True if soft is None else bool(soft)
        self.bucket_bytes = int(bucket_mb * 2 ** 20) if bucket_mb else 0
        self.units = units  # ZeRO-3 unit policy (autoshard.passes.zero_units)
        # activation checkpointing of the repeated blocks: True / False forced, None: on only
        # when the plan needs it to fit memory_limit (cost/recompute.py)
        self.checkpoint = checkpoint
        self.display = display or {i.name: i.target for i in self.inputs}
        self.names = sorted(set(info.names.values()))
        constraints = dict(constraints or {})
        self.fixed: dict = {}
        self.extra: dict = {}
        self.fixed_soft: dict = {}  # name -> axes of a soft constraint ("seq": "tp?")
        for key, axes in constraints.items():
            if is_soft(axes) and key in self.names:
                self.fixed_soft[key] = tuple(a[:-1] for a in ((axes,) if isinstance(axes, str) else axes))
                continue
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            if key in self.names:
                self.fixed[key] = axes
            else:
                self.extra[key] = axes or None
        # validate the user's constraints as given (unknown names, axes, divisibility)
        resolve_layout(info, {k: (v or None) for k, v in constraints.items()}, mesh)
        self.open = [n for n in self.names if n not in self.fixed and n not in self.fixed_soft]
        self.vals = {n.name: n.meta.get("val") for n in graph.nodes if n.op == "placeholder"}
        self.grad_inputs = {i.name for i in self.inputs if i.kind == "parameter" and i.trainable}
        self._LayoutError = LayoutError
        # context parallelism: which names may split attention's queries (cost/context_parallel.py)
        self.context = ContextSearch(graph, info, cm)
        # Constraints on inferred names or globs may name dims of the blocks cut away: whole graph.
        # ``shared``: state reusable across meshes of one search (the cut graph, one-axis records)
        self._shared = shared if shared is not None else {}
        if reduce and not self.extra:
            key = ("reduced", kept_blocks)
            if key not in self._shared:
                self._shared[key] = reduce_graph(graph, self.inputs, info, kept_blocks)
            self.reduced = self._shared[key]
        else:
            self.reduced = None
        self._segments: dict = {}
        self._lb_cache: dict = {}
        self._places: dict = {}
        self._state: dict = {}
        self._nu: dict = {}
        self._cands = None
        self._per_axis = None  # per_axis_options()
        self._overlapping: list = []
        self._cb_cache: dict = {}
        self._ob_cache: dict = {}
        self._uo_cache: dict = {}  # units of one axis -> whether they split two dims of a tensor
        self._resolved: dict = {}  # (full graph?, layout items) -> resolved Layout or its LayoutError
        self._full_states: dict = {}  # candidate -> :meth:`_full_state`
        self._entries: dict = {}  # (name, layout value) -> its units per axis (:meth:`_cand_units`)
        self.invalid = 0
        self.rewrites = 0
        self._stage_options = self._stages(zero_stage, reshard_after_forward)
        # name lookups (resolve_layout) against fixed names: cached
        self._named_full = _CachedNames(info)
        self._named_red = _CachedNames(self.reduced.info) if self.reduced is not None else self._named_full
        # State is computed on the reduced graph's inputs, each standing for its copies.
        if self.reduced is not None:
            cnt: dict = {}
            for full, red in self.reduced.input_map.items():
                cnt[red] = cnt.get(red, 0) + 1
            self._st_inputs = list(self.reduced.inputs)
            self._st_counts = [cnt.get(i.name, 1) for i in self._st_inputs]
        else:
            self._st_inputs, self._st_counts = list(self.inputs), [1] * len(self.inputs)
        self._st_grad = {i.name for i in self._st_inputs if i.kind == "parameter" and i.trainable}
        # what the state and optimizer bounds read of a candidate (_held_key), and their results by it
        self._held_names = [i.name for i in self._st_inputs if i.kind in ("parameter", "buffer", "constant")]
        self._mb_state: dict = {}
        self._ob_shared: dict = {}
        self._state_terms: dict = {}  # state_memory's per-input shares, by placement
        self._opt_terms: dict = {}  # optimizer_phase's, likewise
        self._storage_memo: dict = {}  # choose_storage's per-parameter storage, by use placement
        self._held_ids: dict = {}  # candidate axes -> number of its held placements (by value)
        self._held_places: dict = {}  # held placements -> that number
        self._unit_latencies: dict = {}  # _held_key -> _unit_latency
        self._gatherable: Optional[list] = None  # (name, display name) of the parameters ZeRO-3 may gather
        # seconds of blocking communication that bound a candidate out (set by the search):
        # one-axis rewrites stop there (:meth:`_axis_records`); None: rewrite them whole
        self.records_budget: Optional[float] = None
        self._prefix: Optional[PrefixRecords] = None  # budgeted records by the units deciding them
        self._paths: dict = {}  # axis size -> ResumePath of its one-axis rewrites
        self._prepare_bounds()

    # ------------------------------------------------------------------ enumeration
    def _stages(self, zero_stage, reshard):
        if not self.train:
            return [(0, None)]
        if zero_stage is not None:
            return [(zero_stage, (True if reshard is None else reshard) if zero_stage == 3 else None)]
        out = [(0, None), (1, None), (2, None)]
        out += [(3, True), (3, False)] if reshard is None else [(3, reshard)]
        return out

    def _units(self, layout, full: bool = False):
        """Resolved layout on the reduced graph's dims (the one the checks and dedup use), or
        on the whole graph's with ``full``. Cached by the layout (enumeration, placements and
        bounds resolve one candidate's layout several times); callers only read the result."""
        full = full or self.reduced is None
        return self._memo(self._resolved, (full, tuple(layout.items())), lambda: resolve_layout(
            self._named_full if full else self._named_red, layout, self.mesh))

    def _cand_units(self, cand: Candidate):
        """:meth:`_units` of the candidate's complete layout, assembled entry by entry:
        ``resolve_layout`` resolves each entry on its own and collects the units per axis in
        entry order (first appearance), so one entry's resolution (cached by name and value) is
        shared by every candidate giving that name the same axes; the enumeration and the bounds
        ask for tens of thousands of layouts made of a few hundred entries. With glob entries
        (``extra``), the whole layout is resolved. Raises LayoutError as ``resolve_layout``."""
        if self.extra:
            return self._units(cand.layout(self.names, self.extra))
        return self._memo(self._resolved, ("candidate", cand.axes), lambda: self._assemble(cand))

    def _assemble(self, cand: Candidate) -> "_Resolved":
        units = {a: [] for a in self.mesh.names}
        soft = {a: [] for a in self.mesh.names}
        for n, value in cand.layout(self.names, {}).items():
            if value is None:
                continue  # kept whole: no units (the name exists, its lookup cannot fail)
            hard1, soft1 = self._memo(self._entries, (n, value), lambda: self._entry(n, value))
            for out, got in ((units, hard1), (soft, soft1)):
                for a, us in got.items():
                    for u in us:
                        if u not in out[a]:
                            out[a].append(u)
        return _Resolved(units, {a: u for a, u in soft.items() if u})

    def _entry(self, name, value) -> tuple:
        """(hard units, soft units) per axis of the one layout entry ``name: value``."""
        info = self._named_red if self.reduced is not None else self._named_full
        try:
            hard, soft = split_soft({name: value})
        except SoftLayoutError as e:
            raise LayoutError(str(e)) from None
        out = []
        for entries in (hard, soft):
            units = {a: [] for a in self.mesh.names}
            for key, axes in entries.items():
                _resolve_entry(info, self.mesh, key, axes, {}, units, {})
            out.append({a: us for a, us in units.items() if us})
        return tuple(out)

    def _memo(self, cache: dict, key, compute):
        """``compute()``, cached in ``cache`` under ``key``; a LayoutError it raises is cached and
        raised again (with a fresh traceback, so it does not grow per raise)."""
        if key not in cache:
            try:
                cache[key] = compute()
            except self._LayoutError as e:
                cache[key] = e
        got = cache[key]
        if isinstance(got, Exception):
            raise got.with_traceback(None)
        return got

    def _tensor_dims(self) -> list:
        """Distinct tensors' dims as leaf tuples (for the one-axis-one-dim check)."""
        if hasattr(self, "_tdims"):
            return self._tdims
        info = self.reduced.info if self.reduced is not None else self.info
        seen = set()
        for outs in info.dims.values():
            for dims in outs:
                key = tuple(info.leaves(a) for a in dims if a)
                if len(key) > 1:
                    seen.add(key)
        self._tdims = [(k, info) for k in seen]
        return self._tdims

    def _name_units(self, axis) -> dict:
        """{name: its units on ``axis`` alone} (None where the axis cannot split it)."""
        if axis not in self._nu:
            units = {}
            for n in self.names:
                try:
                    units[n] = tuple(self._units({n: axis}).units[axis])
                except self._LayoutError:
                    units[n] = None
            self._nu[axis] = units
        return self._nu[axis]

    def _cut_graph(self) -> tuple:
        """(graph, DimInfo) the bounds and one-axis programs read: the reduced ones where
        repeated blocks were cut away."""
        r = self.reduced
        return (r.graph, r.info) if r is not None else (self.graph, self.info)

    def _expert_inner_names(self, axis) -> frozenset:
        """Names whose units on ``axis`` split a dim of an MoE layer's expert parameters other
        than the experts dim: every layout holding one is refused (passes/experts.py runs each
        expert whole), so no option holds one."""
        graph, info = self._cut_graph()
        inner = set()
        for region in find_expert_regions(graph, info, warn=False):
            experts = tuple(region.experts_atoms)
            for p in region.every_param:
                for atoms in (info.of(p) if p in info.dims else ()):
                    lv = tuple(info.leaves(atoms)) if atoms else ()
                    if lv and (region.form == "looped" or lv[:len(experts)] != experts):
                        inner.update(n for n, us in self._name_units(axis).items()
                                     if us and any(lv[:len(u)] == u for u in us))
        return frozenset(inner)

    def _conflicts(self, axis) -> tuple:
        """Names that would shard two dims of one tensor on ``axis``: (pairs, names alone)."""
        units = self._name_units(axis)
        pairs, selfc = set(), set()
        for key, info in self._tensor_dims():
            hits = []
            for lv in key:
                hits.append({n for n, us in units.items() if us and any(lv[:len(u)] == u for u in us)})
            for i in range(len(hits)):
                for j in range(i + 1, len(hits)):
                    for a in hits[i]:
                        for b in hits[j]:
                            if a == b:
                                selfc.add(a)
                            else:
                                pairs.add(frozenset((a, b)))
        return pairs, selfc

    def axis_options(self, axis) -> list:
        """Sets of names ``axis`` may shard (fixed names included)."""
        size = self.mesh.axes[axis]
        fixed_here = frozenset(n for n, axes in self.fixed.items() if axis in axes)
        if size == 1:
            return [fixed_here]
        pairs, selfc = self._conflicts(axis)
        units = self._name_units(axis)
        # a name meeting itself in one tensor ([b, 1, s, s] masks) only as context parallelism
        inner = self._expert_inner_names(axis)
        ok = [n for n in self.open if units.get(n) and (n not in selfc or n in self.context.names) and n not in inner]
        soft_fixed = frozenset(n + SOFT_MARK for n, axes in self.fixed_soft.items() if axis in axes)
        # one soft name per axis: the longest residual-stream dim it divides (seq in training
        # shapes; token rows by batch where batch is the longer), which keeps the space small
        soft_ok = sorted((n for n in self._soft_names() if units.get(n)), key=lambda n: -self._soft_size[n])[:1]
        stream = set(self._soft_names(every=True))
        opts = []
        for k in range(len(ok) + 1):
            for combo in itertools.combinations(self._name_classes(ok, pairs), k):
                s = frozenset(n for cls in combo for n in cls) | fixed_here
                if any(frozenset(p) in pairs for p in itertools.combinations(sorted(s), 2)):
                    continue
                if soft_fixed:
                    opts.append(s | soft_fixed)
                    continue
                opts.append(s)
                if s and self.soft_search and not s & stream:
                    # a soft entry where the axis is free (sequence parallelism between the
                    # regions the hard names claim): one residual-stream name at a time. None
                    # next to a hard residual-stream name (batch): that claims the axis in (almost)
                    # every activation, so the soft entry would change nothing but the name.
                    opts += [s | {n + SOFT_MARK} for n in soft_ok if n not in s]
        return opts

    def _name_classes(self, ok: list, pairs: set) -> list:
        """``ok`` grouped into classes of names that are one choice: the same units on every
        mesh axis (so the same leading atoms), the same standing as context parallelism and soft
        entry, and no conflict among them. Such names go on an axis together or not at all
        without losing a program: a set holding part of a class gives the rewrite the same units
        as the set holding all of it (the candidate the enumeration kept anyway, naming the most
        dims), and two names sharing leading atoms must go on the same axes. A Llama's
        ``q_proj.out``, ``k_proj.out``, ``v_proj.out`` and ``o_proj.in`` (all split at the heads
        atom) are one class: 37 axis options instead of 261."""
        stream = set(self._soft_names(every=True))
        by_key: dict = {}
        for n in ok:
            key = (self._multi_axis_units(n), n in self.context.names, n in stream)
            by_key.setdefault(key, []).append(n)
        classes = []
        for names in by_key.values():
            if any(frozenset(p) in pairs for p in itertools.combinations(names, 2)):
                classes += [(n,) for n in names]  # members conflict: each its own choice
            else:
                classes.append(tuple(names))
        return sorted(classes, key=lambda c: ok.index(c[0]))

    def _multi_axis_units(self, name) -> tuple:
        """The units ``name`` gets on every set of mesh axes (size > 1) splitting it, in mesh
        order: one axis alone, and several at once (where a dim's atoms are split across them,
        two names with the same one-axis units may differ)."""
        key = ("multi-axis-units", name)
        if key not in self._nu:
            axes = [a for a in self.mesh.names if self.mesh.axes[a] > 1]
            out = []
            for k in range(1, len(axes) + 1):
                for sub in itertools.combinations(axes, k):
                    try:
                        r = self._units({name: sub})
                        out.append(tuple(tuple(sorted(r.units[a])) for a in sub))
                    except self._LayoutError:
                        out.append(None)
            self._nu[key] = tuple(out)
        return self._nu[key]

    def _soft_names(self, every: bool = False) -> list:
        """Open names a soft entry may shard: dims of the residual stream, carried by
        activations and by no trainable parameter (batch, seq); with ``every``, fixed ones too."""
        if not hasattr(self, "_soft_cache"):
            info = self.reduced.info if self.reduced is not None else self.info
            graph = self.reduced.graph if self.reduced is not None else self.graph
            grads = {i.name for i in (self.reduced.inputs if self.reduced is not None else self.inputs)
                     if i.kind == "parameter" and i.trainable}
            param_leaves = set()
            for n in graph.nodes:
                if n.op == "placeholder" and n.name in grads and n in info.dims:
                    param_leaves |= {info.leaves(a)[:1] for a in info.of(n) if a}
            out = []
            self._soft_size = {}
            for n in self.names:
                lvs = [lv for lvs in info.lookup(n).values() for lv in lvs if lv]
                firsts = {lv[:1] for lv in lvs}
                if firsts and not firsts & param_leaves:
                    out.append(n)
                    self._soft_size[n] = max(math.prod(info.table.size[a] for a in lv) for lv in lvs)
            self._soft_cache = out
        return self._soft_cache if every else [n for n in self._soft_cache if n in self.open]

    def candidates(self) -> list:
        """Every candidate layout (zero stage 0), invalid ones (the rewrite would refuse them)
        and duplicates (same units) removed. Cached."""
        if self._cands is not None:
            return self._cands
        seen = {}
        self.invalid = 0
        for combo in itertools.product(*self.per_axis_options()):
            got = self.combination(combo)
            if got is None:
                continue
            cand, key, count = got
            prev = seen.get(key)
            # Same units, same program: keep the one naming the most dims (it says what is split).
            if prev is None or count > prev[1]:
                seen[key] = (cand, count)
        self._cands = [c for c, _ in seen.values()]
        return self._cands

    def per_axis_options(self) -> list:
        """Per mesh axis (in mesh order), its options as the enumeration reads them
        (:meth:`_option`). Cached."""
        if self._per_axis is None:
            self._overlapping = self._overlapping_names()
            self._per_axis = [[self._option(a, s, self._overlapping) for s in self.axis_options(a)]
                              for a in self.mesh.names]
        return self._per_axis

    def combination(self, combo) -> Optional[tuple]:
        """(candidate at zero stage 0, units key, names it holds) of one option per axis
        (:meth:`per_axis_options`), or None where the space refuses the combination (counted
        in ``invalid`` where the rewrite would refuse it). Candidates with the same key give
        the rewrite the same units: the same program."""
        cand = Candidate(tuple(o.pair for o in combo))
        if any(o.softs for o in combo):
            softs = [n for o in combo for n in o.softs]
            if (len(set(softs)) < len(softs) or len(set(softs) - set(self.fixed_soft)) > 1
                    or set(softs) & {n for o in combo for n in o.pair[1]}):
                return None  # a name soft on two axes, or soft on one and hard on another; one searched soft name
        if self._overlapping:
            has1 = has2 = differ = 0
            for o in combo:
                has1 |= o.first
                has2 |= o.second
                differ |= o.first ^ o.second
            if has1 & has2 & differ:
                # two names splitting the same leading atoms on different axes would split one
                # dim by both in no nesting the rewrite knows (the heads on dp, kv heads on tp)
                self.invalid += 1
                return None
        count = sum(o.count for o in combo)
        multi = len(frozenset().union(*(o.pair[1] for o in combo))) < count
        if multi or self.extra:
            # a name on several axes (its units depend on all of them), or glob entries
            try:
                resolved = self._cand_units(cand)
            except self._LayoutError:
                self.invalid += 1
                return None
            units = resolved.units
            if not self._units_ok(units):
                self.invalid += 1
                return None
            key = tuple((a, tuple(sorted(units[a])), tuple(sorted(resolved.soft.get(a, ()))))
                        for a in self.mesh.names)
        else:
            # one axis per name: the units are the names' own, checked per axis already
            key = tuple(o.key for o in combo)
        return cand, key, count

    def _option(self, axis, names: frozenset, overlapping: list) -> "_AxisOption":
        """What the enumeration reads of one axis option, computed once per option rather than
        once per combination: its soft names, its units key when no name is on another axis too,
        and which of each overlapping pair of names it holds (bit i: pair i)."""
        big = self.mesh.axes[axis] > 1
        nu = self._name_units(axis) if big else {}
        key = ((axis, tuple(sorted({u for n in names if not n.endswith(SOFT_MARK) for u in nu.get(n) or ()})),
                tuple(sorted({u for n in names if n.endswith(SOFT_MARK) for u in nu.get(n[:-1]) or ()})))
               if big else (axis, ()))
        first = second = 0
        if big:
            for i, (n1, n2) in enumerate(overlapping):
                first |= (n1 in names) << i
                second |= (n2 in names) << i
        softs = tuple(n[:-1] for n in names if n.endswith(SOFT_MARK))
        return _AxisOption((axis, names), len(names), softs, key, first, second)

    def _overlapping_names(self) -> list:
        """Pairs of names whose dims start with the same atom (e.g. heads and kv_heads)."""
        info = self.reduced.info if self.reduced is not None else self.info
        firsts = {}
        for n in self.names:
            firsts[n] = {lv[0] for lvs in info.lookup(n).values() for lv in lvs if lv}
        return [(a, b) for a, b in itertools.combinations(self.names, 2) if firsts[a] & firsts[b]]

    def _units_ok(self, units) -> bool:
        """No axis shards two dims of one tensor. The check is per axis, on that axis's units
        alone: cached by the units (the enumeration meets the same ones many times)."""
        cache = self._uo_cache
        for us in units.values():
            k = frozenset(us)
            if k not in cache:
                cache[k] = self._axis_units_ok(us)
            if not cache[k]:
                return False
        return True

    def _axis_units_ok(self, us) -> bool:
        for key, _ in self._tensor_dims():
            hits = 0
            for lv in key:
                if any(lv[:len(u)] == u for u in us):
                    hits += 1
            if hits > 1:
                return False
        return True

    def space(self) -> list:
        """Every (candidate, stage) pair."""
        return [Candidate(c.axes, z, r) for c in self.candidates() for z, r in self._stage_options]

    # ------------------------------------------------------------------ building programs
    def _build(self, graph, inputs, info, layout, stage, reshard):
        """The per-rank program, built exactly as ``autoshard.autoshard`` builds it."""

        self.rewrites += 1
        with lazy_programs():  # only the graph is read: no Python code generated
            return build_program(graph, inputs, info, resolve_layout(info, layout, self.mesh), self.mesh,
                                 train=self.train, zero_stage=stage, reshard=bool(reshard),
                                 bucket_mb=self.bucket_bytes / 2 ** 20, display=self.display, units=self.units,
                                 context=self.context.options(self.mesh))

    def _bucketing(self, stage, axes) -> bool:
        return bool(self.train and stage < 2 and axes and self.bucket_bytes)

    def _placed(self, cand: Candidate):
        """(input placements, data axes) of the candidate's layout. Cached by its axes."""
        if cand.axes not in self._places:
            # identical blocks: a cut-away block's parameters are placed as the last kept one's
            resolved = self._cand_units(cand)
            per_axis = [self._axis_placements(resolved.units[a]) for a in self.mesh.names]
            places = {n: tuple(p[n] for p in per_axis) for n in per_axis[0]} if per_axis else {}
            if self.context and any(names & self.context.names for names in self._split_names(cand).values()):
                # context-parallel attention places some inputs itself (the mask, the positions):
                # the data axes are those of build_program's placements
                graph, info = self._cut_graph()
                try:
                    low = lowered(graph, info, resolve_layout(self._named_red, cand.layout(self.names, self.extra),
                                                              self.mesh), self.mesh, self.context.options(self.mesh))
                    places = {**places, **{n: p for n, p in low.fixed.items() if n in places}}
                except self._LayoutError:
                    pass  # (the candidate's build says why; the layout's own placements stand meanwhile)
            axes = data_axes([(places[i.name], self.mesh.names) for i in self._st_inputs
                               if i.kind == "user" and i.name in places])
            self._places[cand.axes] = (places, axes)
        places, axes = self._places[cand.axes]
        if cand.zero_stage and not axes:
            raise self._LayoutError("zero_stage needs a data axis (an axis splitting the batch)")
        return places, axes

    def _axis_placements(self, units) -> dict:
        """{tensor input: its placement on one axis splitting ``units``}. An input's entry on an
        axis depends on that axis's units alone (``input_placements`` decides each axis apart,
        and the size of the axis does not enter), so candidates and mesh shapes share these.
        Raises LayoutError as ``input_placements`` does."""
        r = self.reduced
        graph, info = self._cut_graph()
        return self._memo(self._shared, ("axis-placements", r is not None, tuple(units)), lambda: {
            n: p[0] for n, p in input_placements(graph, info, Layout({}, {"axis": list(units)}, {}),
                                                 Mesh({"axis": 1})).items()})

    def _full_state(self, cand: Candidate):
        """Placements, storage and data axes of the whole graph (no rewrite needed). Cached by
        the candidate (the bounds ask for it per refinement step; callers only read it)."""
        got = self._full_states.get(cand)
        if got is None:
            got = self._full_states[cand] = self._make_full_state(cand)
        return got

    def _make_full_state(self, cand: Candidate):
        places, axes = self._placed(cand)
        storage = {}
        if cand.zero_stage >= 2:
            params = {n: self.vals[n] for n in self._st_grad}
            storage = choose_storage(params, places, self.mesh, axes[0], cand.zero_stage, bool(cand.reshard),
                                     memo=self._storage_memo)
        in_places = []
        for i in self._st_inputs:
            p = places.get(i.name)
            st = storage.get(i.name)
            in_places.append(st.placement if st is not None else
                             (p if p is not None else tuple(R for _ in self.mesh.names)))
        return in_places, places, storage, axes

    def segments(self, cand: Candidate):
        """Expanded segments of the candidate's program (cached by program identity)."""
        skey = (cand.axes, cand.zero_stage if cand.zero_stage >= 2 else 0, cand.reshard if cand.zero_stage == 3 else None)
        if skey in self._segments:
            return self._segments[skey]
        if cand.zero_stage == 3 and not cand.reshard:
            # The same program as with release after forward, less the second gathers: the
            # rewrite differs only in which gathers it tags for release.
            segs = self.segments(Candidate(cand.axes, 3, True))
            copies: dict = {}  # a repeated block stays one object (cost/recompute.py tells blocks apart so)
            segs = [copies.setdefault(id(sg), _without_regathers(sg)) for sg in segs]
            self._segments[skey] = segs
            return segs
        layout = cand.layout(self.names, self.extra)
        segs = None
        if self.reduced is not None:
            r = self.reduced
            try:
                program, _ = self._build(r.graph, r.inputs, r.info, layout, cand.zero_stage, cand.reshard)
                raw = program_events(program, self.mesh, self.cm, {i.name for i in r.inputs if i.kind == "parameter"
                                                                  and i.trainable}, self.vals)
                if self.train:
                    annotate_boundaries(raw, program.graph_module.graph, {i.name for i in r.inputs if i.kind == "user"})
                segs = expand_segments(raw, r.family, r.n_blocks, r.kept)
            except self._LayoutError:
                segs = None  # e.g. a constraint naming a dim of a block cut away: use the whole graph
        if segs is None:
            program, _ = self._build(self.graph, self.inputs, self.info, layout, cand.zero_stage, cand.reshard)
            segs = program_events(program, self.mesh, self.cm, self.grad_inputs, self.vals)
            if self.train:
                annotate_boundaries(segs, program.graph_module.graph, {i.name for i in self.inputs if i.kind == "user"})
        self._segments[skey] = segs
        return segs

    def _state_args(self, cand: Candidate):
        """(stored placements of the inputs, keyword args of the state and optimizer functions)."""
        in_places, places, storage, axes = self._full_state(cand)
        return in_places, dict(zero_stage=cand.zero_stage, data_axes=axes, storage=storage, use_places=dict(places),
                               counts=self._st_counts)

    def state(self, cand: Candidate):
        """(persistent state bytes, stored placements of the inputs, keyword args of the
        state functions) of the whole model under ``cand``. Cached."""
        if cand not in self._state:
            in_places, kw = self._state_args(cand)
            st = state_memory(self._st_inputs, self.vals, in_places, self.mesh, self.cm, train=self.train,
                              memo=self._state_terms, **kw)
            self._state[cand] = (st, in_places, kw)
        return self._state[cand]

    def evaluate(self, cand: Candidate) -> PlanCost:
        """Predicted cost of the candidate's plan (raises LayoutError for an invalid one)."""
        st, in_places, kw = self.state(cand)
        segs = self.segments(cand)
        elems, per, n, opt = (optimizer_phase(self._st_inputs, self.vals, in_places, self.mesh, self.cm,
                                              memo=self._opt_terms, **kw) if self.train else (0, 0, 0, []))
        axes = kw["data_axes"]

        def run(segments):
            return simulate(segments, self.mesh, self.cm, train=self.train, state=st, opt_colls=opt, opt_elems=elems,
                            opt_elem_bytes=per, n_opt_tensors=n, zero_stage=cand.zero_stage,
                            reshard=bool(cand.zero_stage == 3 and cand.reshard),
                            bucket_axis=axes[0] if self._bucketing(cand.zero_stage, axes) else None,
                            bucket_bytes=self.bucket_bytes)

        if not self._may_checkpoint(segs):
            return run(segs)
        # activation checkpointing (cost/recompute.py): on when only the recomputing plan fits
        options = {p: (lambda p=p: run(checkpointed_segments(segs, p, self.cm))) for p in ("selective", "block")}
        return checkpoint_choice(run(segs), options, self.memory_limit, self.checkpoint)[1]

    def _may_checkpoint(self, segs) -> bool:
        return (self.train and self.checkpoint is not False and has_blocks(segs)
                and (self.checkpoint or self.memory_limit is not None))

    # ------------------------------------------------------------------ lower bounds
    def _prepare_bounds(self):
        """Group the ops by the names that can touch them; per group and per set of axes
        splitting them, the summed roofline time of their ops split that way."""

        if self.reduced is not None:
            graph, info, mult_of = self.reduced.graph, self.reduced.info, self._multiplicity
        else:
            graph, info, mult_of = self.graph, self.info, (lambda n: 1)
        first_atoms = {}
        for n in self.names + list(self.extra):
            for key, lvs in info.lookup(n).items():
                for lv in lvs:
                    if lv:
                        first_atoms.setdefault(lv[0], set()).add(n)
        self._first_atoms = {a: frozenset(ns) for a, ns in first_atoms.items()}
        rg = requires_grad_nodes(graph, {i.name for i in (self.reduced.inputs if self.reduced else self.inputs)
                                          if i.kind == "parameter" and i.trainable})
        axes = [a for a in self.mesh.names if self.mesh.axes[a] > 1]
        subsets = [frozenset(c) for k in range(len(axes) + 1) for c in itertools.combinations(axes, k)]
        groups: dict = {}
        bf = self.cm.backward_factor
        # An MoE layer's nodes are replaced by its per-rank program (passes/experts.py): its
        # routing code bounds nothing. Stacked experts' code (the body) runs once per rank on this
        # rank's (token, expert) rows and experts, at least its captured work divided by the axes
        # splitting the layer's tokens or experts (looped experts' dense code runs every expert on
        # every token, the per-rank program only the tokens routed to each: it bounds nothing).
        replaced, body_touch = set(), {}
        for region in find_expert_regions(graph, info, warn=False):
            replaced |= set(region.nodes)
            if region.form != "looped":
                extra = set(self._touched(region.hidden, info)) | set(
                    first_atoms.get(region.experts_atoms[0], ()) if region.experts_atoms else ())
                body_touch.update((n, extra) for n in region.body)
        for node in graph.nodes:
            if (node.op != "call_function" or node not in info.dims or node.target is operator.getitem
                    or (node in replaced and node not in body_touch)):
                continue
            touch = set(body_touch.get(node, ()))
            atoms_lists = []
            for a in node.all_input_nodes:
                if a in info.dims and info.dims[a]:
                    atoms_lists += info.dims[a][0]
            for outs in info.dims[node]:
                atoms_lists += outs
            for atoms in atoms_lists:
                lv = info.leaves(atoms) if atoms else ()
                if lv:
                    touch |= first_atoms.get(lv[0], set())
            val = node.meta.get("val")
            outs = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
            mult = mult_of(node)
            k = frozenset(touch)
            g = groups.setdefault(k, {s: [0.0, 0.0, 0.0] for s in subsets})
            out_bytes = sum(v.numel() * v.element_size() for v in outs) if node.target not in VIEW_OPS else 0
            for s in subsets:
                P = math.prod(self.mesh.axes[a] for a in s)
                t = _split_seconds(self.cm, node, outs, P)
                if self.train and node in rg:
                    t *= 1 + bf
                    g[s][1] += mult * out_bytes / P  # saved for backward
                g[s][0] += mult * t
                g[s][2] = max(g[s][2], out_bytes / P)
        self._groups = groups

    def _multiplicity(self, node) -> int:
        b = block_of_module(module_of(node))
        r = self.reduced
        if b is not None and b[0] == r.family and b[1] == r.kept - 1:
            return r.n_blocks - r.kept + 1
        return 1

    def bound(self, cand: Candidate) -> float:
        """A lower bound on the candidate's step time: each op split at most by the axes that
        shard one of the names touching it (plus the exact optimizer time)."""
        return self._bounds(cand)[0] + self.optimizer_bound(cand)

    def compute_bound(self, cand: Candidate) -> float:
        """The compute part of :meth:`bound` (no placement work: the cheap first ordering)."""
        return self._bounds(cand)[0]

    def _bounds(self, cand: Candidate):
        key = cand.axes
        if key not in self._lb_cache:
            sets = self._split_names(cand)
            total = saved = biggest = 0.0
            for touch, table in self._groups.items():
                s = frozenset(a for a, names in sets.items() if names & touch and self.mesh.axes[a] > 1)
                total += table[s][0]
                saved += table[s][1]
                biggest = max(biggest, table[s][2])
            self._lb_cache[key] = (total, saved, biggest)
        return self._lb_cache[key]

    def _held_key(self, cand: Candidate) -> tuple:
        """What the state and optimizer functions read of a candidate: the stage, the data
        axis the stage uses, and the placements of the parameters, buffers and constants
        (the storage follows from them). Raises LayoutError as :meth:`_full_state` does."""
        places, axes = self._placed(cand)
        # the placements as a number, one per distinct tuple: the memory bound asks for every
        # (candidate, stage) pair, and hashing the placements each time cost more than the lookup
        held = self._held_ids.get(cand.axes)
        if held is None:
            held = self._held_ids[cand.axes] = self._held_places.setdefault(
                tuple(places.get(n) for n in self._held_names), len(self._held_places))
        return (cand.zero_stage, cand.reshard if cand.zero_stage == 3 else None, axes[0] if cand.zero_stage else None,
                held)

    def _bound_state(self, cand: Candidate) -> dict:
        """:meth:`state`'s bytes for the memory bound. ``state_memory`` reads only the
        placements of the parameters, buffers and constants, the stage and the data axis, so
        candidates differing in activation names (batch, seq, soft entries) share one result,
        and the storage choice is skipped for them. A cache of its own: ``state``'s dicts go on
        to ``simulate``."""
        key = self._held_key(cand)
        st = self._mb_state.get(key)
        if st is None:
            st = self._mb_state[key] = self.state(cand)[0]
        return st

    def memory_bound(self, cand: Candidate) -> float:
        """A lower bound on the candidate's peak bytes per rank: its exact persistent state
        plus the activations its ops must at least produce (each split as far as its axes can
        split it)."""
        st = self._bound_state(cand)
        _, saved, biggest = self._bounds(cand)
        if self.train:
            # state alone: the cost model counts the activations autograd keeps (cost/saved.py),
            # fewer than every op's output, which is what the ops-based estimate here would add
            # (and checkpointing may drop most of them)
            return st["total"]
        return st["params"] + st.get("buffers", 0.0) + 2 * biggest

    # ------------------------------------------------------------------ communication bound
    def _records_key(self, axis, names: frozenset) -> tuple:
        # one-axis programs depend on the axis size, not its name: shared across mesh shapes;
        # and on the units the names resolve to, not on the names: name sets giving the same
        # units share one rewrite
        extra1 = self._extra_on(axis)
        size = self.mesh.axes[axis]
        ukey = ("axis-units", self.reduced is not None, size, names, extra1)
        units = self._shared.get(ukey)
        if units is None:
            try:
                resolved = self._resolved1(axis, names)
                units = (tuple(sorted(resolved.units["axis"])), tuple(sorted(resolved.soft.get("axis", ()))))
            except self._LayoutError:
                units = ("invalid", names)
            self._shared[ukey] = units
        return ("axis-records", self.reduced is not None, size, units, extra1, self.train)

    def _resolved1(self, axis, names: frozenset) -> Layout:
        """The one-axis layout of ``names`` on ``axis`` resolved (cached; LayoutError as resolving)."""
        key = ("axis-layout", self.reduced is not None, self.mesh.axes[axis], names, self._extra_on(axis))
        got = self._shared.get(key)
        if got is None:
            try:
                got = resolve_layout(self._named_red, self._layout1(axis, names), Mesh({"axis": self.mesh.axes[axis]}))
            except self._LayoutError as e:
                got = e
            self._shared[key] = got
        if isinstance(got, Exception):
            raise got.with_traceback(None)  # (a fresh traceback each time it is raised)
        return got

    def _layout1(self, axis, names: frozenset) -> dict:
        """The one-axis layout of ``names`` on ``axis`` (renamed "axis"), with the glob entries."""
        layout1 = {n.rstrip(SOFT_MARK): "axis" + (SOFT_MARK if n.endswith(SOFT_MARK) else "") for n in names}
        for k in self._extra_on(axis):
            layout1[k] = "axis"
        return layout1

    def _extra_on(self, axis) -> tuple:
        """The constraint entries that are not names (globs, inferred names) on ``axis``, sorted."""
        return tuple(sorted(k for k, v in self.extra.items() if v and axis in v))

    def _split_names(self, cand: Candidate) -> dict:
        """{axis: the names ``cand`` splits on it, soft ones by their name, and the constraint
        entries that are not names on it}."""
        return {a: {n.rstrip(SOFT_MARK) for n in names} | set(self._extra_on(a)) for a, names in cand.axes}

    def _touched(self, src, info) -> frozenset:
        """First atoms of the dims of ``src``'s value (what a collective on it touches)."""
        touch = frozenset()
        if src is not None and src in info.dims and info.dims[src]:
            for atoms in info.dims[src][0]:
                lv = info.leaves(atoms) if atoms else ()
                if lv:
                    touch |= self._first_atoms.get(lv[0], frozenset())
        return touch

    @staticmethod
    def _aggregate(recs, r) -> dict:
        """{record: count}: with repeated blocks solved once (``r``), the last kept block's
        records stand for every block it replaces, if the last two kept blocks agree."""
        per_block: dict = {}
        if r is not None:
            for rec, blk in recs:
                if blk is not None and blk[0] == r.family:
                    per_block.setdefault(blk[1], []).append(rec)
        steady = r is None or (sorted(per_block.get(r.kept - 2, []), key=repr) ==
                               sorted(per_block.get(r.kept - 1, []), key=repr))
        agg: dict = {}
        for rec, blk in recs:
            mult = 1
            if r is not None and steady and blk == (r.family, r.kept - 1):
                mult = r.n_blocks - r.kept + 1
            agg[rec] = agg.get(rec, 0) + mult
        return agg

    def _axis_records(self, axis, names: frozenset, budget: Optional[float] = None):
        """Collectives on ``axis`` when it alone shards ``names`` (a one-axis rewrite): the
        rewrite decides each axis's ownership independently of the others, so a candidate
        with this axis option has at least these collectives on the axis, each moving at least
        its bytes divided by the other axes that can split the value. Cached.

        With ``budget`` (seconds) the rewrite stops as soon as the blocking collectives it has
        emitted cost that much, however the other axes split them: the records are then a part
        of the program's (the rewrite emits collectives in program order and, building no
        graph, never removes one), so every bound they give is still a lower bound, and one
        high enough to bound out every candidate with this axis option (see :func:`_search`).
        Such partial records carry the space that made them and what their collectives cost
        (they serve every budget up to that); another space (another mesh shape) makes its own.
        Aggregated without the repeated-block multiplicity (a part of a block proves no steady
        state). An option whose units decide the same as another's up to the node where that
        one's budgeted rewrite stopped takes its records without a rewrite
        (cost/prefix_records.py)."""

        size = self.mesh.axes[axis]
        key = self._records_key(axis, names)
        cache = self._shared
        budget = self.records_budget if budget is None else budget
        got = cache.get(key, False)
        if got is not False and (got is None or got[3] is None or (got[3][0] is self and budget is not None
                                                                     and got[3][1] >= budget)):
            return got
        r = self.reduced
        graph, info, inputs = (r.graph, r.info, r.inputs) if r is not None else (self.graph, self.info, self.inputs)
        mesh1 = Mesh({"axis": size})
        grad = {i.name for i in inputs if i.kind == "parameter" and i.trainable}
        emitted = (_Budgeted(self._budget_seconds(axis, grad), budget) if budget is not None and math.isfinite(budget)
                   else [])
        partial = False
        stopped: dict = {}
        shared_units = None  # the units, where budgeted records may be shared (cost/prefix_records.py)
        try:
            resolved = self._resolved1(axis, names)
            units = key[3]  # (the records' key holds the sorted units: _records_key)
            # the lowerings of build_program (vocab-parallel loss, MoE layers, context-parallel
            # attention): the one-axis program's collectives are then the plan's
            low = lowered(graph, info, resolved, mesh1, self.context.options(mesh1) if self.context else None)
            resolved = low.layout
            kwargs = {"regions": low.regions, "fixed": low.fixed, "fixed_local": low.fixed_local}
            # saved, shared and resumed where each node decides from its own values' units (no
            # input another pass places otherwise, no context-parallel plan of the whole layout)
            local_units = prefix_units(resolved) if low.fixed_local else None
            budgeted = isinstance(emitted, _Budgeted)
            if budgeted and local_units is not None:
                shared_units = local_units
                got = self._prefix_records().find(shared_units, budget)
                if got is not None:  # the same collectives up to where another option's rewrite stopped
                    (agg, g_agg), reached = got
                    out = (units, agg, g_agg, (self, reached))
                    cache[key] = out
                    return out
            if local_units is not None:
                # from the latest saved state of another option's rewrite up to which the units
                # decide the same (passes/rewrite_state.py)
                kwargs["resume"], kwargs["checkpoints"] = self._resume_path(size).start(
                    local_units, emitted.cost if budgeted else None, budget if budgeted else math.inf)
            self.rewrites += 1
            with lazy_programs():
                rewrite(graph, info, resolved, mesh1, grad, self.display, collectives_only=True, collectives=emitted,
                        stopped=stopped, **kwargs)
        except _OverBudget:
            partial = True
        except self._LayoutError:
            cache[key] = None
            return None
        if partial:
            r = None  # no block multiplicity: a part of the program proves no steady state
        nodes = {n.name: n for n in graph.nodes}
        recs = []
        grad_recs = []  # parameter gradient all-reduces: for the comm-stream bound only
        for c in list(emitted):
            if c.phase != "forward" and not self.train or self._left_out(c):
                continue
            is_param = c.node in grad
            if c.phase != "forward" and is_param:
                # a gradient sync: hidden under backward, or merged into buckets (not blocking);
                # it still occupies the comm stream (:meth:`stream_bound`)
                if c.kind == "all_reduce":
                    grad_recs.append((c, block_of_module(c.where)))
                continue

            blk = block_of_module(c.where)
            recs.append(((c.kind, c.bytes, self._touched(nodes.get(c.node), info), is_param), blk))
        agg = self._aggregate(recs, r)
        # the gradient syncs, aggregated the same way (their own steady-state check)
        g_agg = self._aggregate([((c.kind, c.bytes, self._touched(nodes.get(c.node), info), True), blk)
                                 for c, blk in grad_recs], r)
        # partial records bound out every budget up to what their collectives cost
        out = (units, agg, g_agg, (self, emitted.spent) if partial else None)
        if partial and shared_units is not None:
            self._prefix.add(shared_units, stopped["position"], emitted.spent, (agg, g_agg))
        cache[key] = out
        return out

    def option_units(self, axis, names: frozenset) -> Optional[tuple]:
        """The (hard, soft) units of the one-axis layout of ``names`` on ``axis`` in layout order,
        where its rewrite may be saved and resumed (``passes.untouched.prefix_units``); else None."""
        try:
            resolved = self._resolved1(axis, names)
        except self._LayoutError:
            return None
        return prefix_units(resolved)

    def _prefix_records(self) -> PrefixRecords:
        """The PrefixRecords of this space's one-axis rewrites (made on first use)."""
        if self._prefix is None:
            self._prefix = PrefixRecords(*self._cut_graph())
        return self._prefix

    def _resume_path(self, size: int) -> ResumePath:
        """The ResumePath of the one-axis rewrites of axis size ``size``, saving states at the
        nodes where a unit of an option of an axis of that size starts to decide."""
        if size not in self._paths:
            first = self._prefix_records().first
            positions = set()
            for axis, opts in zip(self.mesh.names, self.per_axis_options()):
                if self.mesh.axes[axis] == size:
                    for o in opts:
                        units = self.option_units(axis, o.pair[1])
                        if units is not None:
                            positions.update(p for p, _ in reaches(first, units))
            self._paths[size] = ResumePath(first, positions)
        return self._paths[size]

    def stopped_records(self, cand: Candidate) -> bool:
        """Whether a known one-axis record of ``cand``'s axes stopped at a budget."""
        for a, names in cand.axes:
            got = self._shared.get(self._records_key(a, names)) if self.mesh.axes[a] > 1 else None
            if got and got[3] is not None:
                return True
        return False

    def complete_records(self, cand: Candidate, budget: float) -> bool:
        """Rewrite again, up to ``budget`` seconds (``math.inf``: whole), the one-axis records of
        ``cand``'s axes that stopped short of it; True if any was (the bounds cached from them are
        dropped)."""
        changed = False
        for a, names in cand.axes:
            if self.mesh.axes[a] == 1:
                continue
            got = self._shared.get(self._records_key(a, names))
            if got and got[3] is not None and (got[3][0] is not self or got[3][1] < budget):
                self._axis_records(a, names, budget)
                changed = True
        if changed:
            self._cb_cache.clear()
        return changed

    def _left_out(self, c) -> bool:
        """Whether one-axis program collective ``c`` bounds nothing: a gradient bucket (costed
        from the program's ready points), context-parallel attention's own traffic (costed with
        the node), a vocab-parallel loss's statistics (the loss lowers so only where one axis
        splits the logits; split on several, the rule's one gather spans them all)."""
        return c.op in ("grad_bucket", VOCAB_PARALLEL) or self.context.overlapped(c)

    def _budget_seconds(self, axis, grad: set):
        """What a collective of a one-axis rewrite on ``axis`` adds, at least, to the
        communication bound of any candidate using it (:meth:`_comm_bound`): nothing for what
        that bound leaves out (gradient syncs, :meth:`_left_out`, a parameter's own conversions,
        which a ZeRO 2/3 data axis may skip), else its time with
        its bytes divided by every other axis."""
        others = math.prod(n for b, n in self.mesh.axes.items() if b != axis)

        def seconds(c) -> float:
            if c.phase != "forward" and not self.train or self._left_out(c) or c.node in grad:
                return 0.0
            return collective_seconds(self.cm, self.mesh, c.kind, (axis,), c.bytes / others)
        return seconds

    def comm_bound(self, cand: Candidate) -> float:
        """A lower bound on the blocking communication time of ``cand`` (seconds)."""
        return self._comm_bound(cand)[0]

    def cached_comm_bound(self, cand: Candidate) -> tuple:
        """(bound, complete): :meth:`comm_bound` over the axes whose one-axis records are known
        already (no rewrite). Each axis adds a sum of non-negative terms, so a part of the axes
        bounds the whole; ``complete`` when no axis was left out."""
        return self._comm_bound(cand, cached_only=True)

    def _comm_bound(self, cand: Candidate, cached_only: bool = False) -> tuple:
        if cand.axes in self._cb_cache and cand.zero_stage < 2:
            return self._cb_cache[cand.axes], True
        try:
            resolved2 = self._cand_units(cand)
        except self._LayoutError:
            return 0.0, True
        units2 = resolved2.units
        sets = self._split_names(cand)
        data_axis = None
        if cand.zero_stage >= 2:
            axes = self._placed(cand)[1]  # raises LayoutError without a data axis, as _full_state
            data_axis = axes[0] if axes else None
        total = 0.0
        complete = True
        for a, names in cand.axes:
            if self.mesh.axes[a] == 1:
                continue
            if cached_only and self._records_key(a, names) not in self._shared:
                complete = False
                continue
            got = self._axis_records(a, names)
            if got is None or got[0] != (tuple(sorted(units2[a])), tuple(sorted(resolved2.soft.get(a, ())))):
                continue
            for (kind, nbytes, touch, is_param), mult in got[1].items():
                if is_param and data_axis is not None and a == data_axis:
                    continue  # stored sharded on this axis: other conversions
                div = 1
                for b, bnames in sets.items():
                    if b != a and self.mesh.axes[b] > 1 and (bnames & touch or (is_param and b == data_axis)):
                        div *= self.mesh.axes[b]
                total += mult * collective_seconds(self.cm, self.mesh, kind, (a,), nbytes / div)
        if not complete:
            return total, False
        if cand.zero_stage == 3 and data_axis is not None:
            total += self._zero3_gathers(cand, data_axis)
        if cand.zero_stage < 2:
            self._cb_cache[cand.axes] = total
        return total, True

    def stream_bound(self, cand: Candidate, comm: Optional[float] = None) -> float:
        """A lower bound on the communication stream's busy time in forward and backward
        (training only; seconds). ``simulate`` runs every collective on one stream, one after
        another, and backward ends only when the stream is idle, so the step takes at least
        this plus the optimizer phase, however much of it compute hides. Added to
        :meth:`comm_bound`'s collectives (each on the stream too): the gradient syncs on the
        data axis (one all-reduce per parameter in the one-axis program; in the plan merged into
        buckets, joined with other axes, or with ZeRO 2/3 a reduce-scatter, whichever costs
        less is counted) and ZeRO-3's forward gathers of every stored shard (grouped into
        units). Both are costed by bandwidth, ``t(V) - t(0)``, additive under the alpha-beta
        model (a collective spanning more axes is no faster per byte than its data-axis share);
        ZeRO-3's units add their latency, ``t(0)`` of their collectives
        (:meth:`_unit_latency`). Backward re-gathers (ZeRO-3 with release after forward) are
        left out. ``comm``: the candidate's :meth:`comm_bound`, if known."""
        if not self.train:
            return 0.0  # forward: the step does not wait for background collectives
        total = self.comm_bound(cand) if comm is None else comm
        _, _, storage, axes = self._full_state(cand)
        if not axes:
            return total
        d = axes[0]
        if self.mesh.axes[d] == 1:
            return total

        def bw(kind, nbytes):
            return (collective_seconds(self.cm, self.mesh, kind, (d,), nbytes)
                    - collective_seconds(self.cm, self.mesh, kind, (d,), 0.0))

        names = dict(cand.axes)[d]
        got = self._axis_records(d, names)
        resolved2 = self._cand_units(cand)
        if got is not None and got[0] == (tuple(sorted(resolved2.units[d])), tuple(sorted(resolved2.soft.get(d, ())))):
            sets = self._split_names(cand)
            for (kind, nbytes, touch, _), mult in got[2].items():
                div = 1  # each other axis that may split the gradient divides it at most by its size
                for b, bnames in sets.items():
                    if b != d and self.mesh.axes[b] > 1 and bnames & touch:
                        div *= self.mesh.axes[b]
                # ZeRO 2/3 reduce-scatter a gradient stored sharded (less traffic than the all-reduce)
                sec = bw(kind, nbytes / div)
                total += mult * (sec if cand.zero_stage < 2 else min(sec, bw("reduce_scatter", nbytes / div)))
        if cand.zero_stage == 3 and self.units != "param":  # "param" units: in comm_bound already
            in_places, places, _, _ = self._full_state(cand)
            i_axis = self.mesh.names.index(d)
            nbytes = 0.0
            for inp, place, cnt in zip(self._st_inputs, in_places, self._st_counts):
                if not _gathered(storage, places, inp.name, i_axis):
                    continue
                v = self.vals[inp.name]
                nbytes += cnt * _local_numel(v.shape, place, self.mesh) * v.element_size()
            total += bw("all_gather", nbytes)
            # (small models: the latency of the units, not their bytes, is most of their traffic)
            total += self._unit_latency(cand, d)
        return total

    def _unit_latency(self, cand: Candidate, axis) -> float:
        """The least latency of the ZeRO-3 units of the candidate's plan on ``axis``
        (``cost.zero_units.least_unit_latency``), over the parameters it certainly gathers, named
        as in the whole model (a cut-away block's parameters by their own block). Certainly
        gathered: stored sharded, read whole on ``axis``, read at all, and outside the
        Mixture-of-Experts regions (an expert's parameters may stay with the rank owning it).
        Cached by what the storage depends on."""
        key = self._held_key(cand)
        got = self._unit_latencies.get(key)
        if got is None:
            _, places, storage, _ = self._full_state(cand)
            i_axis = self.mesh.names.index(axis)
            if self._gatherable is None:
                experts = {p.name for r in find_expert_regions(self.graph, self.info)
                           for p in r.every_param}
                read = {n.name for n in self.graph.nodes if n.op == "placeholder" and n.users}
                self._gatherable = [(i.name, self.display.get(i.name, i.name)) for i in self.inputs
                                    if i.kind == "parameter" and i.trainable and i.name not in experts
                                    and i.name in read]
            fold = self.reduced.input_map if self.reduced is not None else None
            fqns = []
            for name, fqn in self._gatherable:
                red = fold.get(name) if fold is not None else name
                if red is not None and _gathered(storage, places, red, i_axis):
                    fqns.append(fqn)
            got = self._unit_latencies[key] = least_unit_latency(
                fqns, self.units, *(collective_seconds(self.cm, self.mesh, kind, (axis,), 0.0)
                                    for kind in ("all_gather", "reduce_scatter")))
        return got

    def _zero3_gathers(self, cand: Candidate, axis) -> float:
        """ZeRO-3 parameters gathered one by one (unit policy ``"param"``): every stored shard is
        gathered at least once in forward (and again in backward when released after forward),
        blocking. Grouped units are prefetched under compute: nothing is certain to block."""
        if self.units != "param":
            return 0.0
        in_places, places, storage, _ = self._full_state(cand)
        i_axis = self.mesh.names.index(axis)
        total = 0.0
        for inp, place, cnt in zip(self._st_inputs, in_places, self._st_counts):
            if not _gathered(storage, places, inp.name, i_axis):
                continue
            v = self.vals[inp.name]
            nbytes = _local_numel(v.shape, place, self.mesh) * v.element_size()
            total += cnt * (2 if cand.reshard else 1) * collective_seconds(self.cm, self.mesh, "all_gather", (axis,),
                                                                           nbytes)
        return total

    def optimizer_bound(self, cand: Candidate) -> float:
        """Exact optimizer-phase time (step traffic and ZeRO gathers, all blocking)."""
        if not self.train:
            return 0.0
        if cand in self._ob_cache:
            return self._ob_cache[cand]
        key = self._held_key(cand)  # candidates placing their parameters alike: one time
        if key in self._ob_shared:
            self._ob_cache[cand] = self._ob_shared[key]
            return self._ob_cache[cand]
        in_places, kw = self._state_args(cand)  # state_memory itself is not needed here
        elems, per, n, colls = optimizer_phase(self._st_inputs, self.vals, in_places, self.mesh, self.cm,
                                               memo=self._opt_terms, **kw)
        dev = self.cm.hardware.device
        t = (elems * per) / (dev.mem_bandwidth * dev.mem_efficiency) + n * dev.op_overhead
        for kind, axes, nbytes in colls:
            t += collective_seconds(self.cm, self.mesh, kind, axes, nbytes)
        self._ob_cache[cand] = self._ob_shared[key] = t
        return t


@dataclass(frozen=True)
class _AxisOption:
    """One mesh axis's option as the enumeration reads it (:meth:`SearchSpace._option`)."""

    pair: tuple  # (axis, frozenset(names))
    count: int
    softs: tuple  # its soft names, without the mark
    key: tuple  # (axis, hard units, soft units) when no name of it is on another axis
    first: int  # bit i: holds the first name of overlapping pair i
    second: int  # bit i: holds the second


@dataclass
class _Resolved:
    """What the search reads of a resolved Layout: the units per axis, hard and soft."""

    units: dict
    soft: dict


class _OverBudget(Exception):
    """A budgeted one-axis rewrite has emitted enough collectives (:class:`_Budgeted`)."""


class _Budgeted(list):
    """The collective list of a one-axis rewrite that stops it (raises :class:`_OverBudget`)
    once the collectives appended cost ``budget`` seconds by ``seconds(collective)``."""

    def __init__(self, seconds, budget: float):
        super().__init__()
        self._seconds, self._budget, self.spent = seconds, budget, 0.0

    def append(self, c):
        super().append(c)
        self.spent += self._seconds(c)
        if self.spent >= self._budget:
            raise _OverBudget()

    def extend(self, cs):
        """Collectives a resumed rewrite starts with (counted; below the budget: ``ResumePath.start``)."""
        for c in cs:
            super().append(c)
            self.spent += self._seconds(c)

    def cost(self, cs) -> float:
        """What collectives ``cs`` would add to :attr:`spent`."""
        return sum(self._seconds(c) for c in cs)


class _CachedNames:
    """A read-only view of a DimInfo whose ``all_names`` / ``lookup`` are computed once (the
    search resolves hundreds of layouts against names that no longer change)."""

    def __init__(self, info):
        self._info = info
        self._all = None
        self._look: dict = {}

    def __getattr__(self, k):
        return getattr(self._info, k)

    def all_names(self):
        if self._all is None:
            self._all = self._info.all_names()
        return self._all

    def lookup(self, pattern):
        if pattern not in self._look:
            names = self.all_names()
            self._look[pattern] = ({pattern: names[pattern]} if pattern in names else
                                   {n: lv for n, lv in names.items() if fnmatch.fnmatchcase(n, pattern)})
        return self._look[pattern]


def _without_regathers(seg):
    out = copy.copy(seg)
    out.items = [dataclasses.replace(it, regather_s=0.0, regather_bytes=0) if isinstance(it, Comm) and it.regather_s
                 else it for it in seg.items]
    return out


def _split_seconds(cm, node, outs, P: int) -> float:
    """Roofline time of ``node`` with every operand and result divided by ``P``."""
    flops, nbytes = op_work(node.target, node.args, node.kwargs, outs)
    dev = cm.hardware.device
    dtype = _dtype_of(outs, _tensors(list(node.args), []))
    if dtype not in dev.peak_flops:
        dtype = "fp32" if "fp32" in dev.peak_flops else max(dev.peak_flops, key=dev.peak_flops.get)
    if not (flops or nbytes):
        return dev.op_overhead
    return roofline_time(flops / P, nbytes / P, dev, dtype=dtype) + dev.op_overhead


# =========================================================================== the search


def search_layout(space: SearchSpace, *, keep: int = 3, progress=None, verbose: bool = False,
                  refine: bool = True, incumbent=None, lazy: Optional[bool] = None) -> SearchResult:
    """Best-first branch and bound over ``space``.

    Every candidate gets a cheap lower bound (its compute, each op split as far as the axes
    that can touch it split it); candidates are taken in bound order, and before one is
    evaluated its bound is refined with the exact optimizer phase and the blocking
    communication it cannot avoid (one-axis rewrites, cached per axis option; the axes already
    known first), and in training with the communication stream's busy time
    (:meth:`SearchSpace.stream_bound`), whichever is larger. The search
    stops when the next bound reaches the cost of the ``keep``-th best plan found (here or in
    ``incumbent``, costs found on other meshes), so the best ``keep`` are exactly the best of the
    space. Candidates over ``memory_limit`` (state plus least activations, then the evaluated
    peak) are skipped. ``progress(done, total, best)`` is called after each evaluation; with ``verbose``
    (or once the search has run 3 s) a progress line goes to stderr every 2 s.

    ``lazy``: take the combinations of axis options in the order of a bound per option
    (``cost/lazy_search.py``) instead of enumerating their product; None: when the product is
    large (:data:`~autoshard.cost.lazy_search.LAZY_ABOVE`). The result is the same optimum."""
    t0 = time.perf_counter()
    # The search reads the rewritten graphs, never runs them: their GraphModules generate
    # and compile Python code only if called (a third of a rewrite's time otherwise).
    # The captured graphs are only read: the rewrite derives its per-graph node sets once.
    with _collector_paused(), warnings.catch_warnings(), lazy_programs(), unchanged_graphs():
        # ops without a rule warn once, when the chosen plan is built, not per candidate
        warnings.simplefilter("ignore", UnsupportedOpWarning)
        try:
            return _search(space, keep, progress, verbose, refine, incumbent, t0, lazy)
        finally:
            # the rewrites' saved states serve this search only; the space lives on in a cycle
            # (its records name it), freed by the cyclic collector, which would walk them all
            space._paths.clear()


def _gathered(storage: dict, places: dict, name: str, i_axis: int) -> bool:
    """Whether ZeRO-3 gathers input ``name`` on the mesh axis at index ``i_axis``: stored sharded
    (``storage``) and read whole there (``places``, its use placements)."""
    return storage.get(name) is not None and isinstance(places[name][i_axis], Replicate)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off inside: the rewrites allocate many short-lived
    cyclic objects, collected once when the outermost pause ends (a collection after each mesh
    shape's search would traverse the same long-lived graphs again each time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _search(space, keep, progress, verbose, refine, incumbent, t0, lazy=None):
    limit = space.memory_limit
    heap = []
    infeasible = 0
    ids = itertools.count()
    lazily = use_lazy(space, lazy)
    seen: set = set()  # lazily: units keys taken (same units, same program)

    def admit(cands, bound: float = 0.0) -> list:
        """Push each (candidate, stage) pair with its compute bound (or ``bound``, if larger);
        the ones pushed, as (id, candidate)."""
        nonlocal infeasible
        out = []
        for c in cands:
            k = next(ids)
            try:
                if c.zero_stage:
                    space._placed(c)  # a ZeRO stage needs a data axis: LayoutError without one
                if limit is not None and space.memory_bound(c) > limit:
                    infeasible += 1
                    continue
                cb = space.compute_bound(c)
                item = (max(cb, bound), k, c, 4 if not refine else 0, cb)
                if lazily:
                    heapq.heappush(heap, item)
                else:
                    heap.append(item)
                out.append((k, c))
            except space._LayoutError:
                space.invalid += 1
        return out

    def admit_combination(combo, bound: float = 0.0) -> list:
        got = space.combination(combo)
        if got is None or got[1] in seen:
            return []
        seen.add(got[1])
        return admit([Candidate(got[0].axes, z, r) for z, r in space._stage_options], bound)

    if lazily:
        total = product_size(space)
        seeds = [(sum(o.count for o in combo), k, c) for combo in seed_combinations(space)
                 for k, c in admit_combination(combo)]
        least = sum(floors(space))
    else:
        pairs = space.space()
        admit(pairs)
        heapq.heapify(heap)
        total = len(pairs)
        seeds = [(sum(len(s) for _, s in c.axes), k, c) for _, k, c, _, _ in heap]
        least = min((h[0] for h in heap), default=0.0) + floors(space)[1]
    found: list = []
    over = None
    evaluated = 0
    popped = 0
    invalid = 0  # in the loop below; space.invalid counts the enumeration's
    last_print = t0
    notes = []
    # No candidate's step is below ``least`` (the least compute bound, or taken lazily the compute
    # floor, plus the optimizer floor): once ``keep`` costs are known, a one-axis rewrite whose blocking
    # collectives reach (keep-th cost - that) seconds has bound out every candidate with its
    # axis option, and stops there (SearchSpace._axis_records).

    def update_budget():
        # against the keep-th cost (bounding out most axis options after a collective or two);
        # records that stopped there are rewritten whole before a candidate relying on them is
        # evaluated (SearchSpace.complete_records)
        costs = sorted([e.cost.step_time for e in found] + list(incumbent or ()))
        space.records_budget = costs[keep - 1] - least if len(costs) >= keep else None
        return costs

    seeded = set()

    def evaluate(c, lb: float) -> bool:
        """Cost ``c`` (bounded from below by ``lb``) into ``found``, or ``over`` where it does not
        fit; whether it was found."""
        nonlocal evaluated, infeasible, invalid, over
        try:
            cost = space.evaluate(c)
        except space._LayoutError:  # e.g. a ZeRO stage without a data axis
            invalid += 1
            return False
        evaluated += 1
        if not cost.fits(limit):
            infeasible += 1
            if over is None or cost.step_time < over.cost.step_time:
                over = Evaluated(c, c.layout(space.names, space.extra), cost, lb, space.mesh)
            return False
        found.append(Evaluated(c, c.layout(space.names, space.extra), cost, lb, space.mesh))
        found.sort(key=lambda e: (e.cost.step_time, e.cost.memory["peak"]))
        return True

    def seed(k, c):
        seeded.add(k)
        evaluate(c, 0.0)

    def stopped(c) -> bool:  # whether a one-axis rewrite of c stopped at the budget
        try:
            space.comm_bound(c)
            return space.stopped_records(c)
        except space._LayoutError:
            return True

    if refine and heap and latency_bound(space):
        # The whole compute unsplit is worth a few collective latencies (a small, latency-bound
        # model): the plans sharding least are the likely best, and their costs, known first,
        # let the one-axis rewrites stop early. They are evaluated first; the search is
        # otherwise unchanged. The least-sharding plan first; then, with its cost as a
        # provisional budget (the seeds' one-axis rewrites stop at their first collective), the
        # other seeds at ZeRO stage 0 whose rewrites ran whole first (no blocking collective
        # reached the budget: plans needing none give the keep-th cost, and with it the budget,
        # its least value), 2 x keep in all: one costly plan among the first keep would raise
        # the budget of every rewrite.
        order = sorted(seeds, key=lambda h: (h[0], h[2].zero_stage, h[1]))
        seed(order[0][1], order[0][2])
        rest = order[1:]
        if found:
            space.records_budget = found[0].cost.step_time - least
            rest = [h for h in rest if not h[2].zero_stage]
            warm_records(space, {pair for h in rest for pair in h[2].axes})  # (in the order that resumes rewrites)
            rest.sort(key=lambda h: (stopped(h[2]), h[0], h[1]))
            space._cb_cache.clear()  # (bounds from records at the provisional budget)
        for _, k, c in rest:
            if evaluated >= 2 * keep:
                break
            seed(k, c)
    costs = update_budget()
    if seeded and space.records_budget is not None:
        warm_records(space)
    # taken lazily: every option's one-axis records (stopping at the budget just set), then the
    # combinations in the order of their bounds, each taken once it may come before the heap's top
    stream = LazyCandidates(space, base=least) if lazily else None
    while True:
        if stream is not None:
            threshold = costs[keep - 1] if len(costs) >= keep else math.inf
            while stream.peek() is not None and stream.peek() < threshold and (not heap or stream.peek() <= heap[0][0]):
                _, combo = stream.pop()
                bound = stream.combination_bound(tuple(o.pair for o in combo))
                if bound < threshold:  # (else bounded out: its fragile names are on no other axis)
                    admit_combination(combo, bound)
        if not heap:
            break
        lb, k, c, level, base = heapq.heappop(heap)
        costs = sorted([e.cost.step_time for e in found] + list(incumbent or ()))
        if len(costs) >= keep and lb >= costs[keep - 1]:
            break  # nothing left can enter the best ``keep`` (of this and earlier meshes)
        if k in seeded:
            continue  # evaluated before the loop
        if level == 3 and space.records_budget is not None:
            # records that stopped at the best cost bound this candidate from below, but not
            # necessarily out of the best ``keep``: rewrite them whole first (the gradient syncs
            # they hold lift the stream bound too), and bound again (another candidate may have
            # completed them since this one's bound was taken)
            try:
                space.complete_records(c, math.inf)
                cb = space.comm_bound(c)
                nxt = max(base + cb, space.optimizer_bound(c) + space.stream_bound(c, cb))
                if nxt > lb:
                    heapq.heappush(heap, (nxt, k, c, 4, base))
                    continue
            except space._LayoutError:
                invalid += 1
                continue
        if level < 3:
            # refine in steps, cheapest first: the exact optimizer phase (``base`` = compute +
            # optimizer from then on), the communication of the axes whose one-axis records are
            # known, then all the communication the candidate cannot avoid (one-axis rewrites
            # for the rest: skipped where the known axes already bound the candidate out)
            try:
                # (each step keeps the larger of its bound and the one the candidate came with:
                # taken lazily, that is its combination's bound)
                if level == 0:
                    base = base + space.optimizer_bound(c)  # ``base`` was the compute bound
                    heapq.heappush(heap, (max(lb, base), k, c, 1, base))
                    continue
                cb, complete = space.cached_comm_bound(c) if level == 1 else (space.comm_bound(c), True)
                if not complete:
                    heapq.heappush(heap, (max(lb, base + cb), k, c, 2, base))
                    continue
                # compute, blocking communication and optimizer in sequence; or, in training,
                # the whole comm stream's forward and backward work, then the optimizer
                nxt = max(base + cb, space.optimizer_bound(c) + space.stream_bound(c, cb))
                heapq.heappush(heap, (max(lb, nxt), k, c, 3, base))
            except space._LayoutError:  # e.g. a ZeRO stage without a data axis
                invalid += 1
            continue
        popped += 1
        if not evaluate(c, lb):
            continue
        costs = update_budget()
        now = time.perf_counter()
        if progress is not None:
            progress(popped, total, found[0])
        if (verbose or now - t0 > 3.0) and now - last_print > (0.0 if verbose else 2.0):
            last_print = now
            print(f"[autoshard] search on {space.mesh}: {evaluated} of {total} candidates evaluated "
                  f"({total - len(heap)} bounded out or done), best {found[0].cost.step_time * 1e3:.3f} ms "
                  f"({found[0].candidate.describe()})", file=sys.stderr, flush=True)
    if not found and total and limit is not None:
        notes.append(f"no candidate fits memory_limit={limit:.4g} bytes per rank")
    if lazily:
        # the whole enumeration reports, of candidates with the same units, the one naming most
        for e in found[:keep] + ([over] if over is not None else []):
            e.candidate = most_named(space, e.candidate)
            e.layout = e.candidate.layout(space.names, space.extra)
    best = found[0] if found else None
    if over is not None and best is not None and over.cost.step_time >= best.cost.step_time * (1 - 1e-9):
        over = None
    return SearchResult(best, found[1:keep], space.mesh, total, evaluated,
                        space.rewrites, time.perf_counter() - t0, space.reduced is not None, limit,
                        infeasible, invalid + space.invalid, notes, over, [space.mesh],
                        taken=stream.taken if stream is not None else None)


def plan_search(graph, inputs, info, meshes, constraints=None, *, train: bool = False, zero_stage=None,
                reshard_after_forward=None, memory_limit=None, cost_model=None, bucket_mb: float = 25.0,
                keep: int = 3, verbose: bool = False, display=None, units="block",
                checkpoint: Optional[bool] = None) -> SearchResult:
    """Search every mesh of ``meshes`` (one, or all factorizations from ``Mesh.auto``) and
    return the best plan over all of them; ``alternatives`` mixes meshes, cheapest first.
    Raises LayoutError when no mesh admits the constraints, ValueError when nothing fits
    ``memory_limit``."""

    cm = resolve_cost_model(cost_model)
    t0 = time.perf_counter()
    results, errors = [], []
    incumbent: list = []  # step times found on earlier meshes: they bound the later searches
    shared: dict = {}  # the cut graph and one-axis records, the same for every mesh shape
    # balanced shapes first: they usually hold the best plans, which then prune the others
    order = sorted(meshes, key=lambda m: (max(m.axes.values()), list(meshes).index(m)))
    with _collector_paused():  # one collection after every mesh shape's search
        for mesh in order:
            try:
                space = SearchSpace(graph, inputs, info, mesh, cm, train=train, constraints=constraints, shared=shared,
                                    memory_limit=memory_limit, zero_stage=zero_stage,
                                    reshard_after_forward=reshard_after_forward, display=display, bucket_mb=bucket_mb,
                                    units=units, checkpoint=checkpoint)
            except LayoutError as e:
                errors.append(e)
                continue
            r = search_layout(space, keep=keep, verbose=verbose, incumbent=incumbent)
            incumbent += [e.cost.step_time for e in ([r.best] if r.best else []) + r.alternatives]
            if verbose and len(meshes) > 1:
                print(f"[autoshard] mesh {mesh}: " + (f"best {r.best.cost.step_time * 1e3:.3f} ms" if r.best else "no plan"),
                      file=sys.stderr, flush=True)
            results.append(r)
        # the records name the spaces that made them: dropped, the spaces are freed as soon as
        # they are, not by the cyclic collector walking everything the searches made
        shared.clear()
    if not results:
        raise errors[0]
    ranked = sorted([e for r in results for e in ([r.best] if r.best else []) + r.alternatives],
                    key=lambda e: (e.cost.step_time, e.cost.memory["peak"]))
    if not ranked:
        overs = [r.best_infeasible for r in results if r.best_infeasible is not None]
        msg = (f"no plan fits memory_limit={memory_limit:.4g} bytes per rank"
               if memory_limit is not None else "no valid plan in the search space")
        if overs:
            o = min(overs, key=lambda e: e.cost.memory["peak"])
            msg += f"; the leanest evaluated needs {o.cost.memory['peak']:.4g} ({o.candidate.describe()} on {o.mesh})"
        raise ValueError(msg)
    overs = [r.best_infeasible for r in results if r.best_infeasible is not None]
    over = min(overs, key=lambda e: e.cost.step_time) if overs else None
    if over is not None and over.cost.step_time >= ranked[0].cost.step_time * (1 - 1e-9):
        over = None
    best = ranked[0]
    return SearchResult(best, ranked[1:keep], best.mesh, sum(r.space_size for r in results),
                        sum(r.evaluated for r in results), sum(r.rewrites for r in results),
                        time.perf_counter() - t0, all(r.reduced for r in results), memory_limit,
                        sum(r.infeasible for r in results), sum(r.invalid for r in results),
                        [n for r in results for n in r.notes], over, [m for m in meshes if any(r.mesh == m for r in results)],
                        dict(constraints or {}),
                        None if all(r.taken is None for r in results) else sum(r.taken or 0 for r in results))
