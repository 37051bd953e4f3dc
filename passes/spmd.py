"""SPMD rewrite: ownership propagation and collective insertion.

Given named dims (``passes.dims``) and a layout (which mesh axes shard which logical dims),
decide for every value its placement (one of Shard(d) / Replicate / Partial per mesh axis), and
build the per-rank program: the original aten ops on local blocks, with a collective from
``autoshard.runtime.primitives.collectives`` wherever a consumer needs another ownership than the producer
gave. Each collective's backward is its declared adjoint, so gradients follow exactly.

Per op and per mesh axis, one of three modes (the op's rule says which letters allow which):

- shard: a loop letter is split on the axis; operands carrying it are Shard, the others
  Replicate (and, if they need gradients, marked varying so backward sums their gradient);
- contract: a summed letter is split; the result is Partial (a bias is made Partial so it is
  added once);
- replicate: every operand whole; Partial operands pass through ops linear in them.

Conversions are emitted lazily at the consumer and cached per value, so a value read by q, k and
v projections is converted once (one backward all-reduce, not three). Each conversion is a table
of placement changes per axis (:mod:`autoshard.passes.conversions`); nodes that a pass lowers
itself (``regions``) are written through :class:`autoshard.passes.lowering.Lowering`.

Example::

    >>> from autoshard.passes.spmd import rewrite            # doctest: +SKIP
    >>> program = rewrite(captured, dim_info, layout, mesh)  # doctest: +SKIP
    >>> print(program.graph_module.code)                     # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx
# GraphModules that generate their Python code on first run or print
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from autoshard.ownership import P, R, Partial, Shard, local_shape
from autoshard.runtime.primitives import collectives as C

from . import conversions
from .collective import Collective
from .dims import DimInfo, module_of, source_line
from .export_errors import CaptureError
from .grad_sync import GradSync
from .layout_error import LayoutError
from .lowering import Lowering, all_decide_locally
from .reasons import explain
from .regions import no_grad_node
from .rewrite_state import Checkpoints, RewriteState, restore, save
from .rules import (GETITEM, LOCAL_ARGS, MEAN_OPS, POSITIONAL_CREATION, Indexing, _is_view, aliases_read_later,
                    get_path, is_inplace, is_tensor_node, shape_of)
from .soft import SoftLayoutError, soft_dim, soft_feasible, split_soft
from .untouched import (first_reads, input_prefixes, input_reads, prefix_units, result_prefixes, units_if_local,
                        untouched_prefix, whole_inputs)
from .zero_storage import ZeroStorage
from .zigzag import zigzag_dim

aten = torch.ops.aten


class UnsupportedOpWarning(UserWarning):
    """An op without a sharding rule runs replicated (exact, but gathers its inputs)."""


# The name of a Mixture-of-Experts layer's experts dim (passes/experts.py names it when the user
# did not): outside such a layer it is an ordinary dim, which errors about it say.
EXPERTS = "experts"


@dataclass
class Layout:
    """Resolved layout: for each mesh axis, the atom prefixes (units) it splits."""

    assignment: dict  # name -> tuple of axes (as the user gave it, matched)
    units: dict  # axis -> list of leaf-atom tuples
    sizes: dict  # name -> size
    soft: dict = field(default_factory=dict)  # axis -> units of soft entries (passes/soft.py)
    soft_assignment: dict = field(default_factory=dict)  # name -> axes, soft entries
    # Context parallelism (passes/context_parallel.py): axis -> (unit, "zigzag" | "contiguous") for a
    # sequence split on that axis. A tensor with that dim twice (a mask [s_q, s_k]) is split
    # on the first (its query rows); under zigzag, a block of that dim holds chunks i and 2R-1-i,
    # so gathers and slices of it reorder (runtime.ring_attention.zigzag_permute).
    orders: dict = field(default_factory=dict)
    # Mixtures of experts (passes/experts.py): axis -> units of experts dims that only the MoE
    # regions' own parameters are split along (their placements are fixed by that pass); every
    # other value keeps such a dim whole on the axis (the router scores every expert per token).
    regional: dict = field(default_factory=dict)


def resolve_layout(info: DimInfo, layout: Optional[dict], mesh) -> Layout:
    """Check a user layout against the named dims and the mesh, and compute its units (soft
    entries, ``"seq": "tp?"``, get their own units: :mod:`autoshard.passes.soft`)."""
    try:
        hard, soft = split_soft(layout)
    except SoftLayoutError as e:
        raise LayoutError(str(e)) from None
    units = {a: [] for a in mesh.names}
    assignment, sizes = {}, {}
    seen = {a: set() for a in mesh.names}  # units[a] as a set: a full model's layout has hundreds
    for key, axes in hard.items():
        _resolve_entry(info, mesh, key, axes, assignment, units, sizes, seen)
    soft_units = {a: [] for a in mesh.names}
    soft_assignment = {}
    soft_seen = {a: set() for a in mesh.names}
    for key, axes in soft.items():
        _resolve_entry(info, mesh, key, axes, soft_assignment, soft_units, sizes, soft_seen)
    for name in set(soft_assignment) & set(assignment):
        raise LayoutError(f"layout gives dim {name!r} both a hard and a soft entry")
    return Layout(assignment, units, sizes, {a: u for a, u in soft_units.items() if u}, soft_assignment)


def _resolve_entry(info, mesh, key, axes, assignment, units, sizes, seen=None):
    if axes is None:
        axes = ()
    elif isinstance(axes, str):
        axes = (axes,)
    axes = tuple(axes)
    for a in axes:
        if a not in mesh.axes:
            raise LayoutError(f"layout[{key!r}] names mesh axis {a!r}; this mesh has axes {list(mesh.names)}")
    if len(set(axes)) != len(axes):
        raise LayoutError(f"layout[{key!r}] repeats a mesh axis: {axes}")
    # Axes splitting one dim nest in mesh order (the first mesh axis is the major split).
    axes = tuple(sorted(axes, key=mesh.names.index))
    matches = info.lookup(key)
    if not matches:
        known = set(info.names.values())
        inferred = next((n for n in info.all_names() if n not in known), "")
        raise LayoutError(f"layout names dim {key!r}, which no tensor has; named dims are {sorted(known)} "
                          f"(inferred names such as '{inferred}' and globs work too)")
    for name, leaf_lists in matches.items():
        assignment[name] = axes
        for lv in leaf_lists:
            size = math.prod(info.table.size[a] for a in lv)
            sizes[name] = size
            degree = 1
            for a in axes:
                degree *= mesh.axes[a]
                if size % degree:
                    raise LayoutError(f"dim {name!r} has size {size}, which mesh axes {axes[:axes.index(a) + 1]} "
                                      f"(together {degree} ranks) cannot split evenly")
                prod, k = 1, 0
                while prod % degree:
                    prod *= info.table.size[lv[k]]
                    k += 1
                unit = tuple(lv[:max(k, 1)])
                if seen is None:  # (a caller's own units table: searched as a list)
                    if unit not in units[a]:
                        units[a].append(unit)
                elif unit not in seen[a]:
                    seen[a].add(unit)
                    units[a].append(unit)


@dataclass
class Program:
    """The per-rank program and everything needed to run and explain it."""

    graph_module: fx.GraphModule
    placements: dict  # original node name -> list of placements (per output)
    input_placements: list  # per placeholder, in order
    output_placements: list  # per flat output
    collectives: list
    fallbacks: list  # (op, module, line)
    # Placeholders of the per-rank program in order: (name, kind, index into captured inputs),
    # kind "input" (the value in its stored placement) or "full" (ZeRO-2's persistent full copy
    # of that parameter, in its use placement).
    placeholders: list = field(default_factory=list)
    reshard_tags: frozenset = frozenset()  # parameter gathers released after forward
    storage: dict = field(default_factory=dict)  # placeholder name -> ParamStorage
    use_placements: dict = field(default_factory=dict)  # placeholder name -> placement where used
    bucketed: list = field(default_factory=list)  # parameters synchronized by gradient buckets, in ready order
    buckets: list = field(default_factory=list)  # (tag, [parameter names]) per bucket, in launch order
    units: list = field(default_factory=list)  # ZeRO-3 units: (name, tag, [parameter names]), in program order


class _Value:
    """A node of :class:`_CollectivesOnly`: what the rewrite reads back of the nodes it made
    (their arguments, metadata and name)."""

    __slots__ = ("op", "name", "target", "args", "kwargs", "meta")

    def __init__(self, op, name, target, args, kwargs):
        self.op, self.name, self.target, self.args, self.kwargs, self.meta = op, name, target, args, kwargs, {}


class _CollectivesOnly:
    """Stands in for the per-rank ``fx.Graph`` when only the program's collectives and
    placements are wanted (the layout search's one-axis programs): every decision of the
    rewrite reads the captured graph, the layout and the values' metadata, never the new
    graph, so its collectives are the same; fx's node naming, argument checks and use lists
    (a quarter of a rewrite's time), and the collection of the graph's cycles, are saved."""

    def placeholder(self, name):
        return _Value("placeholder", name, name, (), {})

    def call_function(self, target, args=(), kwargs=None):
        name = getattr(target, "__name__", None)  # (str() of an op costs more than the rest of this)
        return _Value("call_function", name if name is not None else str(target), target, args, kwargs or {})

    def output(self, result):
        return _Value("output", "output", "output", (result,), {})

    def node_copy(self, node: fx.Node, arg_transform):
        """A copy of captured ``node`` reading ``arg_transform`` of its node arguments (a lowering
        copying code the model wrote: an MoE layer's experts)."""
        new = _Value(node.op, node.name, node.target, fx.node.map_arg(node.args, arg_transform),
                     fx.node.map_arg(node.kwargs, arg_transform))
        new.meta = dict(node.meta)
        return new


@dataclass
class _Inputs:
    """What a rewrite has decided of the placeholders: their placements as stored, the program's
    placeholders ((name, kind, index into the captured inputs): ``Program.placeholders``) and the
    placements where they are used, by name."""

    places: list = field(default_factory=list)
    placeholders: list = field(default_factory=list)
    use: dict = field(default_factory=dict)


class _Rewriter:
    def __init__(self, graph: fx.Graph, info: DimInfo, layout: Layout, mesh, requires_grad: set, display: dict,
                 storage: dict, bucket_axis=None, bucket_candidates=(), regions=None, fixed=None,
                 collectives_only: bool = False, region_axis=None,
                 user_inputs=(), data_axes=()):
        # Nodes whose program another pass writes ({node: visitor(lowering, node)}, with the
        # passes/lowering.Lowering of this rewrite; e.g. the MoE regions of passes/experts.py),
        # and inputs placed by such a pass ({name: placement}).
        self.regions = regions or {}
        self.fixed = fixed or {}
        self.fixed_local = False  # the fixed placements are the layout's where the inputs are read (rewrite)
        self.display = display  # placeholder name -> parameter FQN / argument name, for messages
        self.zero = ZeroStorage(storage)  # sharded parameter state (ZeRO-2/3): passes/zero_storage.py
        # data-parallel gradient sync (buckets, region sums): passes/grad_sync.py
        self.grad_sync = GradSync(bucket_axis, bucket_candidates, region_axis)
        self.g0, self.info, self.layout, self.mesh = graph, info, layout, mesh
        self.axes = mesh.names
        self.rg = requires_grad
        # Values computed from a user input (the batch): their gradient differs per microbatch,
        # so a data-axis sum of it may not be held for a later microbatch (LocalModule.no_sync).
        self.from_user = _memo_nodes(graph, "depends_on", set(user_inputs), depends_on)
        self.data_axes = frozenset(data_axes)  # the axes that split a user input
        self.g = _CollectivesOnly() if collectives_only else fx.Graph()
        self.local: dict = {}  # node -> new node
        self.place: dict = {}  # node -> list of placements per output
        self.cache: dict = {}
        # (local node, axis) -> its all-reduce: a pending sum is summed once, whichever
        # consumers need it whole (their other conversions may differ).
        self.all_reduced: dict = {}
        self.summed: set = set()  # (value, axis): pending sums already all-reduced for some consumer
        self.collectives: list = []
        self.fallbacks: list = []
        self.partial_why: dict = {}  # (node, axis) -> why the value is a pending sum
        self.joined: set = set()  # (node, axis): pending sums of branches joined with a whole operand
        self.hook_state: dict = {}  # per-rewrite state of placement-change hooks (conversions.Step.memo)
        self.copies: set = set()  # views whose local value views a converted copy (not the value's storage)
        self.tag = 0  # the next collective tag (new_tags)
        self.position = -1  # index in graph.nodes of the node being rewritten
        self.whole = tuple(R for _ in mesh.names)  # whole on every axis
        self.lowering = Lowering(self)  # what the visitors of ``regions`` see of this rewrite
        self.unit_index: dict = {}  # (axis, soft) -> _unit_index's answer
        self.unit_memo: dict = {}  # (atoms, axis, soft) -> unit (the layout is fixed for one rewrite)
        # every unit of the layout, where a value is whole on every axis when none of its dims'
        # leaf prefixes is one (no soft entry, every unit an atom prefix; a regional unit splits
        # fewer dims: a value it touches is decided one dim at a time)
        units = prefix_units(layout) if not any(layout.soft.values()) else None
        self.all_units = frozenset(units[0]) if units is not None else None
        self.result_prefixes = _memo_value(graph, info, "result_prefixes", result_prefixes) if units else None

    # ------------------------------------------------------------------ layout queries
    def unit_of(self, atoms, axis, soft=False) -> Optional[tuple]:
        # asked for every dim of every value, per axis: memoized by the dim's atoms (the names
        # are settled before a rewrite starts, so atoms give the same leaves throughout it)
        key = (tuple(atoms), axis, soft)
        memo = self.unit_memo
        got = memo.get(key, memo)
        if got is not memo:
            return got
        lv = self.info.leaves(atoms)
        units, first = self._unit_index(axis, soft)
        if first is None:
            regional = () if soft else self.layout.regional.get(axis, ())
            memo[key] = next((u for u in units if lv[: len(u)] == u and u not in regional), None)
            return memo[key]
        # the first unit in layout order that is a prefix of the leaves: only lv's prefixes can be
        hits = [first[lv[:k]] for k in range(len(lv) + 1) if lv[:k] in first]
        memo[key] = units[min(hits)] if hits else None
        return memo[key]

    def _unit_index(self, axis, soft) -> tuple:
        """(units of ``axis``, {unit: its first position} without the regional ones), or
        (units, None) when a unit is not a tuple (then :meth:`unit_of` scans them). A full
        model's layout has a unit per block and name: a scan per dim would cost as much."""
        got = self.unit_index.get((axis, soft))
        if got is None:
            units = self.layout.soft.get(axis, ()) if soft else self.layout.units[axis]
            regional = () if soft else self.layout.regional.get(axis, ())
            first: Optional[dict] = {}
            for i, u in enumerate(units):
                if not isinstance(u, tuple):
                    first = None
                    break
                if u not in first and u not in regional:
                    first[u] = i
            got = self.unit_index[(axis, soft)] = (units, first)
        return got

    def desired(self, node: fx.Node, out: int = 0) -> tuple:
        dims = self.info.of(node, out)
        place = []
        for a in self.axes:
            hits = [d for d, atoms in enumerate(dims) if atoms and self.unit_of(atoms, a)]
            if len(hits) > 1 and len({self.info.dim_name(dims[d]) for d in hits}) == 1:
                # One dim twice (query rows x key columns, image x text logits [batch, batch]):
                # rows are split, the columns whole (each rank's rows against every column, the
                # other side's embeddings gathered as contrastive training does)
                hits = hits[:1]
            if len(hits) > 1:
                names = [self.info.dim_name(dims[d]) for d in hits]
                hint = "shard one of them on another axis or not at all"
                if EXPERTS in names:  # README's EP layouts put the batch and the experts on one axis
                    hint += (" (experts share an axis with the tokens only in a Mixture-of-Experts layer autoshard "
                             "recognises, passes/experts.py; a MoEWarning names a layer it could not)")
                raise LayoutError(
                    f"mesh axis {a!r} would shard two dims of one tensor, {names[0]!r} (dim {hits[0]}) and "
                    f"{names[1]!r} (dim {hits[1]}), at {self.where(node)}: only diagonal blocks of it would exist; "
                    f"{hint}")
            if not hits and self.layout.soft.get(a):  # a soft entry where the axis is free
                d = soft_dim(self.info, node, out, self.layout, a, self.rg)
                hits = [] if d is None else [d]
            place.append(Shard(hits[0]) if hits else R)
        return tuple(place)

    def where(self, node: fx.Node) -> str:
        mod = module_of(node)
        line = source_line(node)
        return f"node {node.name} ({node.target}) in module '{mod or '<root>'}'" + (f" at {line}" if line else "")

    def dim_label(self, node, out, d) -> str:
        return self.info.dim_name(self.info.of(node, out)[d])

    # ------------------------------------------------------------------ conversions
    def convert(self, src: fx.Node, out: int, target: tuple, varying: set, consumer: fx.Node, reason):
        """Local node holding ``src`` (output ``out``) with placement ``target``: the placement-
        change table of :mod:`autoshard.passes.conversions`."""
        return conversions.convert(self, src, out, target, varying, consumer, reason)

    def emit(self, fn, node, axis, extra, src, consumer, reason, s, t, extra_inputs=(), kwargs=None):
        """Add collective ``fn`` (``runtime.collectives``) of ``node`` (a value of ``src``) on
        ``axis``, changing ``s`` into ``t`` for ``consumer``; record it (and, when ``src`` carries
        a gradient, its adjoint) in the plan with its reason."""
        if callable(reason):
            reason = reason()
        tag = self.new_tags(1)
        new = self.g.call_function(fn, (node, *extra_inputs, axis, *extra), {"tag": tag, **(kwargs or {})})
        val = self.local_val(node)
        nbytes = 0
        if val is not None:
            nbytes = val.numel() * val.element_size()
        if val is not None:
            new.meta["val"] = conversions.converted_val(self.mesh, val, fn.__name__, axis, extra)
        new.meta["autoshard"] = {"where": module_of(consumer), "why": reason, "tag": tag, "grad": src in self.rg}
        if fn is C.mark_varying:
            self.grad_sync.note_mark(src, axis, new)
        fwd, bwd = C.ADJOINTS[fn.__name__]
        where, line = module_of(consumer), source_line(consumer)
        why = explain(self, fn.__name__, src, consumer, axis, s, t, reason)
        new.meta["autoshard"]["why"] = why
        if fwd in C.COMM_KINDS:
            self.collectives.append(Collective(fwd, (axis,), nbytes, "forward", where, why, src.name, line, tag, fn.__name__))
        if bwd in C.COMM_KINDS and src in self.rg:
            out_bytes = new.meta["val"].numel() * new.meta["val"].element_size() if val is not None else 0
            self.collectives.append(Collective(bwd, (axis,), out_bytes, "backward", where,
                                               why if fn.__name__ == "mark_varying" else "adjoint: " + why,
                                               src.name, line, tag, fn.__name__))
        return new

    def new_tags(self, n: int) -> int:
        """Reserve ``n`` consecutive collective tags; returns the first."""
        first = self.tag
        self.tag += n
        return first

    def local_val(self, node):
        v = node.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None

    # ------------------------------------------------------------------ ops
    def run(self, resume: Optional[RewriteState] = None, checkpoints: Optional[Checkpoints] = None) -> Program:
        inputs = _Inputs()
        out_places = []
        # building no graph, the nodes before the layout's first touch are recorded whole
        whole, whole_in = 0, frozenset()
        if isinstance(self.g, _CollectivesOnly):
            whole = untouched_prefix(self, _memo_value(self.g0, self.info, "first_reads", first_reads))
            whole_in = whole_inputs(self, _memo_value(self.g0, self.info, "input_prefixes", input_prefixes))
        nodes = _memo_value(self.g0, self.info, "nodes", lambda g, _: list(g.nodes))
        start = 0
        if resume is not None:  # (passes/rewrite_state.py)
            start = resume.position
            inputs = _Inputs(*restore(self, resume))
            read = _memo_value(self.g0, self.info, "input_reads", input_reads)
            for index, node in enumerate(n for n in nodes if n.op == "placeholder"):
                if read.get(node, math.inf) >= start:  # placed by this layout, where it is read
                    self.visit_input(node, index, whole_in, inputs)
        for self.position in range(start, len(nodes)):
            node = nodes[self.position]
            if checkpoints is not None and self.position in checkpoints.positions and self.position > start:
                checkpoints.take(save(self, inputs))
            if node.op == "call_function" and self.position < whole and node not in self.regions:
                self.visit_whole(node)  # (a lowered node is written by its lowering, as it would be)
            elif node.op == "placeholder":
                self.visit_input(node, len(inputs.places), whole_in, inputs)
            elif node.op == "call_function":
                self.visit(node)
            elif node.op == "output":
                flat = node.args[0]
                outs = []
                for o in flat:
                    if isinstance(o, fx.Node):
                        # A pending sum is finished before it leaves: every rank returns the
                        # value (sharded outputs stay sharded; the caller assembles them).
                        # A zigzag-ordered sequence is gathered in natural order.
                        place = tuple(R if isinstance(p_, Partial) or zigzag_dim(self, o, self.place[o][0], i) else p_
                                      for i, p_ in enumerate(self.place[o][0]))
                        outs.append(self.convert(o, 0, place, set(), node, "the program returns it"))
                        out_places.append(place)
                    else:
                        outs.append(o)
                        out_places.append(None)
                self.g.output(tuple(outs))
            else:
                # capture leaves placeholders, call_function and output nodes only (passes/regions.py
                # inlines or refuses the submodules of higher-order ops)
                raise CaptureError(f"the rewriter cannot run a {node.op} node: {self.where(node)} (capture "
                                   f"inlines or refuses the submodules of higher-order ops; this one it left)")
        bucketed = self.grad_sync.take_bucketed(self)
        self.grad_sync.sum_in_storage(self)
        zero = self.zero
        # (inside lazy_programs() the Python code is generated only if the program is run or printed)
        gm = None if isinstance(self.g, _CollectivesOnly) else _make_graph_module(torch.nn.Module(), self.g)
        return Program(gm, {n.name: p for n, p in self.place.items()}, inputs.places, out_places,
                       self.collectives, self.fallbacks, inputs.placeholders, frozenset(zero.reshard_tags),
                       dict(zero.storage), inputs.use, bucketed)

    def visit_input(self, node: fx.Node, index: int, whole_in: frozenset, inputs: "_Inputs"):
        """Place placeholder ``node`` (the ``index``-th): whole where it is in ``whole_in`` (no unit
        of the layout splits it), else as stored (ZeRO storage) or as its dims' units give. An
        input placed again (on resume: passes/rewrite_state.py) keeps its entries' order."""
        again = index < len(inputs.places)
        if not again:
            inputs.placeholders.append((node.name, "input", index))
        if node in whole_in:
            self.local[node] = node
            inputs.use[node.name] = self.whole
            self.place[node] = [self.whole]
        else:
            new = self.g.placeholder(node.name)
            new.meta = dict(node.meta)
            self.local[node] = new
            if is_tensor_node(node):
                st = self.zero.storage.get(node.name)
                inputs.use[node.name] = self.fixed.get(node.name) or self.desired(node)
                self.place[node] = [st.placement if st else inputs.use[node.name]]
                new.meta["val"] = self.meta_local(node.meta["val"], self.place[node][0])
                if st is not None and st.mode == "persistent":
                    self.zero.add_full_copy(self, node, index, inputs.placeholders)
            else:
                self.place[node] = [tuple(R for _ in self.axes)]
        if again:
            inputs.places[index] = self.place[node][0]
        else:
            inputs.places.append(self.place[node][0])

    def visit_whole(self, node: fx.Node):
        """A node before the layout's first touch (passes/untouched.py), in a rewrite building no
        graph: every operand and result whole on every rank, the captured node standing for its
        local value (the same shape and dtype), as a whole input's placeholder does."""
        ix = self.info.indexing.get(node)
        if node.target is GETITEM or ix.kind in ("view", "creation"):
            n = 1
        elif isinstance(node.meta.get("val"), (tuple, list)):
            n = len(node.meta["val"])
        else:
            n = len(ix.outputs)
        self.local[node] = node
        self.place[node] = [self.whole] * n

    def meta_local(self, val, place):
        return torch.empty(local_shape(val.shape, place, self.mesh), dtype=val.dtype, device="meta")

    def visit(self, node: fx.Node):
        if node in self.regions:
            return self.regions[node](self.lowering, node)
        self.visit_op(node)
        src = node.args[0] if node.args else None
        if isinstance(src, fx.Node) and _is_view(node) and (
                src in self.copies or (node.target is not GETITEM and self.local[node].args[0] is not self.local[src])):
            # a view of a converted copy: a write through it would not reach src's storage
            self.copies.add(node)

    def writes_into_copy(self, node, args) -> bool:
        """Whether an in-place node's write lands in a copy of the tensor it names: its operand
        was converted, or it is a view of a value converted before a view op."""
        return args[0] is not self.local[node.args[0]] or node.args[0] in self.copies

    def visit_op(self, node: fx.Node):
        if node.target is GETITEM:
            src, i = node.args
            new = self.g.call_function(operator.getitem, (self.local[src], i))
            new.meta = {k: v for k, v in node.meta.items() if k != "val"}
            self.local[node] = new
            self.place[node] = [self.place[src][i]]
            if is_tensor_node(node):
                new.meta["val"] = self.meta_local(node.meta["val"], self.place[node][0])
            return
        ix = self.info.indexing.get(node)
        if ix is None:
            return self.visit_fallback(node)
        if ix.kind == "view":
            return self.visit_view(node, ix)
        if ix.kind == "creation":
            return self.visit_creation(node, ix)
        return self.visit_einsum(node, ix)

    def out_values(self, node):
        v = node.meta.get("val")
        return list(v) if isinstance(v, (tuple, list)) else [v]

    def choose_modes(self, node: fx.Node, ix: Indexing):
        """Per axis: ("shard", letter) | ("contract", letter) | ("replicate", None)."""
        outs = self.out_values(node)
        desired = [self.desired(node, k) if isinstance(v, torch.Tensor) else None for k, v in enumerate(outs)]
        inplace = is_inplace(node.target)
        if inplace:  # the written tensor keeps its ownership: its other aliases must see the write
            desired = [self.place[node.args[0]][0]]
        modes = []
        for i, a in enumerate(self.axes):
            mode = ("replicate", None)
            for k, d in enumerate(desired):
                if d is not None and isinstance(d[i], Shard):
                    letter = ix.outputs[k][d[i].dim]
                    if letter is not None and letter not in ix.local and self.feasible(node, ix, letter, a):
                        mode = ("shard", letter)
                    break
            if mode[0] == "replicate" and not inplace:
                for path, letters in ix.inputs:
                    src = get_path(node, path)
                    if src not in self.place:
                        continue
                    o = self.place[src][0][i]
                    if isinstance(o, Shard) and o.dim < len(letters):
                        letter = letters[o.dim]
                        if letter in ix.summed and self.feasible(node, ix, letter, a):
                            mode = ("contract", letter)
                            break
            modes.append(mode)
        return modes

    def feasible(self, node, ix, letter, axis) -> bool:
        """Every operand dim carrying ``letter`` must start with the axis's unit (a hard one, or
        a soft one where no operand is claimed by a hard entry: passes/soft.py)."""
        return self.feasible_hard(node, ix, letter, axis) or (
            bool(self.layout.soft.get(axis)) and self.feasible_soft(node, ix, letter, axis))

    def feasible_soft(self, node, ix, letter, axis) -> bool:
        tensors, carrying = [], []
        for path, letters in ix.inputs:
            dims = self.info.of(get_path(node, path))
            tensors.append(dims)
            carrying += [dims[d] for d, l in enumerate(letters) if l == letter]
        for k, letters in enumerate(ix.outputs):
            dims = self.info.of(node, k)
            tensors.append(dims)
            carrying += [dims[d] for d, l in enumerate(letters) if l == letter]
        return soft_feasible(self.info, tensors, carrying, self.layout, axis)

    def feasible_hard(self, node, ix, letter, axis) -> bool:
        unit = None
        for path, letters in ix.inputs:
            src = get_path(node, path)
            for d, l in enumerate(letters):
                if l == letter:
                    u = self.unit_of(self.info.of(src)[d], axis)
                    if u is None or (unit is not None and u != unit):
                        return False
                    unit = u
        for k, letters in enumerate(ix.outputs):
            for d, l in enumerate(letters):
                if l == letter:
                    u = self.unit_of(self.info.of(node, k)[d], axis)
                    if u is None or (unit is not None and u != unit):
                        return False
        return True

    def computed_whole(self, node: fx.Node, ix: Indexing) -> bool:
        """Whether every operand of ``node`` is whole on every axis and no axis would split its
        results (what :meth:`choose_modes` would find: replicate on every axis, nothing to
        convert). Most ops of a one-axis program are."""
        whole = self.whole
        for path, _ in ix.inputs:
            src = get_path(node, path)
            if src not in self.place or self.place[src][0] != whole:
                return False
        if is_inplace(node.target):  # the written operand's placement is its result's
            src = node.args[0]
            return src in self.place and self.place[src][0] == whole
        if self.all_units is not None:  # (what desired() finds, by one set operation)
            return self.result_prefixes[node].isdisjoint(self.all_units)
        return all(self.desired(node, k) == whole for k, v in enumerate(self.out_values(node))
                   if isinstance(v, torch.Tensor))

    def visit_einsum(self, node: fx.Node, ix: Indexing):
        if self.computed_whole(node, ix):
            # every operand read as it is (conversions to the same placement: none, only the
            # gradient sync's note of the read), every result whole
            converted = {}
            for path, _ in ix.inputs:
                src = get_path(node, path)
                self.grad_sync.note_use(self, src, self.whole, self.whole, frozenset(), node)
                loc = self.local[src]
                converted[path] = loc[0] if isinstance(loc, list) else loc
            args, kwargs = self.replace_args(node, converted)
            if isinstance(self.g, _CollectivesOnly) and not is_inplace(node.target):
                # building no graph: the local value is the captured one (whole: the same shape);
                # only its operands (views of copies) and value are read later
                new = self.g.call_function(node.target, args, kwargs)
                new.meta["val"] = node.meta.get("val")
                self.local[node] = new
                outs = new.meta["val"]
                self.place[node] = [self.whole] * (len(outs) if isinstance(outs, (tuple, list)) else len(ix.outputs))
                return None
            return self.finish_einsum(node, ix, [("replicate", None)] * len(self.axes), None,
                                      [self.whole] * len(ix.outputs), args, kwargs)
        modes = self.choose_modes(node, ix)
        n_in = len(ix.inputs)
        targets = [[None] * len(self.axes) for _ in range(n_in)]
        out_place = [[None] * len(self.axes) for _ in ix.outputs]
        varying_axes = set()
        for i, a in enumerate(self.axes):
            kind, letter = modes[i]
            if kind in ("shard", "contract"):
                varying_axes.add(a)
                for j, (path, letters) in enumerate(ix.inputs):
                    if letter in letters:
                        targets[j][i] = Shard(letters.index(letter))
                    elif kind == "contract" and j in ix.additive:
                        targets[j][i] = P
                    else:
                        targets[j][i] = R
                for k, letters in enumerate(ix.outputs):
                    out_place[k][i] = Shard(letters.index(letter)) if (kind == "shard" and letter in letters) else (
                        P if kind == "contract" else R)
                    if kind == "shard" and letter not in letters:
                        raise LayoutError(f"{self.where(node)}: letter {letter} missing from an output")
                continue
            # replicate mode: Partial passes through ops linear in that operand, unless it has
            # been summed already for another consumer: then the sum is reused, not redone later.
            partial_in = [j for j, (path, _) in enumerate(ix.inputs)
                          if isinstance(self.place[get_path(node, path)][0][i], Partial)
                          and (get_path(node, path), a) not in self.summed]
            passthrough = False
            if any((get_path(node, ix.inputs[j][0]), a) in self.joined and len(get_path(node, ix.inputs[j][0]).users) > 1
                   for j in partial_in):
                # a pending sum of joined branches (residual + attn + mlp) read by several ops (the
                # next block's norm and its residual add): summed once where it forks, not once per
                # branch it would flow on into
                partial_in = []
            if partial_in:
                if ix.joint:
                    # add/sub: every operand must be partial (mixing would add the whole one R
                    # times), so a whole operand becomes one on rank 0 (to_partial), where that
                    # sums no more than the partial ones would: residual + attn + mlp then pays
                    # one all-reduce for both branches
                    joined = False
                    passthrough = all(j in ix.linear for j in partial_in) and (
                        len(partial_in) == len([j for j in ix.linear if j < n_in])
                        or (joined := self.joins_pending_sums(node, ix, partial_in, a)))
                else:
                    passthrough = len(partial_in) == 1 and partial_in[0] in ix.linear
                if is_inplace(node.target) and 0 not in partial_in:
                    passthrough = False  # a whole tensor written in place cannot become a pending sum
            for j in range(n_in):
                # A bias added to a passed-through pending sum must be added once: Partial too
                # (and every operand of a jointly linear op).
                targets[j][i] = P if (passthrough and (j in partial_in or j in ix.additive
                                                       or (ix.joint and j in ix.linear))) else R
            if passthrough:
                varying_axes.add(a)
                if (ix.joint and joined) or any((get_path(node, ix.inputs[j][0]), a) in self.joined for j in partial_in):
                    self.joined.add((node, a))  # (and what it flows on into: a cast, a view)
            for k in range(len(ix.outputs)):
                out_place[k][i] = P if passthrough else R
        args, kwargs = self.map_args(node, ix, targets, varying_axes, modes)
        self.finish_einsum(node, ix, modes, targets, [tuple(p) for p in out_place], args, kwargs)

    def finish_einsum(self, node, ix, modes, targets, places, args, kwargs):
        """The local op of ``node`` on its converted ``args``, with result placements ``places``
        (``targets``: the operands' placements, None where every one is whole)."""
        if is_inplace(node.target) and self.writes_into_copy(node, args) and aliases_read_later(node):
            raise LayoutError(
                f"{self.where(node)} writes in place into {node.args[0].name}, whose aliases are read later, but "
                f"this layout converts it (or the tensor it is a view of) first "
                f"({self.reason(node, ix, modes, ix.inputs[0][1])}): "
                f"the write would land in a copy. Shard the dims of {node.args[0].name} as the values written into it "
                f"are, or leave them whole")
        if node.target in SIZE_ARG:  # sizes written into the op become local sizes
            args = list(args)
            args[SIZE_ARG[node.target]] = list(local_shape(shape_of(node), places[0], self.mesh))
            args = tuple(args)
        if node.target in LOCAL_ARGS:
            args = LOCAL_ARGS[node.target](node, args)
        new = self.g.call_function(node.target, args, kwargs)
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        outs = self.out_values(node)
        if isinstance(node.meta.get("val"), (tuple, list)):
            new.meta["val"] = tuple(self.meta_local(v, places[min(k, len(places) - 1)]) if isinstance(v, torch.Tensor) else v
                                    for k, v in enumerate(outs))
            places = [places[min(k, len(places) - 1)] for k in range(len(outs))]
        else:
            new.meta["val"] = self.meta_local(outs[0], places[0]) if isinstance(outs[0], torch.Tensor) else outs[0]
        for i, a in enumerate(self.axes):
            if any(isinstance(p_[i], Partial) for p_ in places):
                kind, letter = modes[i]
                src = next((get_path(node, p_) for j, (p_, _) in enumerate(ix.inputs)
                            if isinstance(targets[j][i], Partial) and (get_path(node, p_), a) in self.partial_why), None)
                self.partial_why[(node, a)] = (
                    f"contracted dim {self.letter_name(node, ix, letter)} is sharded on {a} in {module_of(node) or node.name}"
                    f" -> partial sum" if kind == "contract" else
                    self.partial_why.get((src, a), f"{node.name} is a partial sum on {a}"))
        if node.target in MEAN_OPS and any(m[0] == "contract" for m in modes):
            new = self.rescale_mean(node, new, ix, modes)
        self.local[node] = new
        self.place[node] = places

    def joins_pending_sums(self, node, ix, partial_in, axis) -> bool:
        """Whether a jointly linear op (add, sub) whose operands ``partial_in`` are pending sums on
        ``axis`` and whose others are whole should stay a pending sum (the whole operands kept on
        rank 0): when its only reader is another jointly linear op (which may add a second pending
        sum to it: ``residual + attn + mlp``), and each pending operand is as large as the result
        (its later all-reduce moves no more bytes) and read only here (no other reader sums it)."""
        readers = list(node.users)
        nxt = self.info.indexing.get(readers[0]) if len(readers) == 1 else None
        if nxt is None or not nxt.joint:
            return False
        numel = math.prod(shape_of(node))
        for j in partial_in:
            src = get_path(node, ix.inputs[j][0])
            if math.prod(shape_of(src)) != numel or list(src.users) != [node]:
                return False
        return True

    def map_args(self, node, ix, targets, varying_axes, modes):
        converted = {}
        why = lambda: self.reason(node, ix, modes, ())  # noqa: E731 (worded only for a conversion emitted)
        for j, (path, letters) in enumerate(ix.inputs):
            src = get_path(node, path)
            converted[path] = self.convert(src, 0, tuple(targets[j]), varying_axes, node, why)
        return self.replace_args(node, converted)

    def reason(self, node, ix, modes, letters) -> str:
        parts = []
        for (kind, letter), a in zip(modes, self.axes):
            if kind == "shard":
                parts.append(f"{self.letter_name(node, ix, letter)} sharded on {a}")
            elif kind == "contract":
                parts.append(f"contracted dim {self.letter_name(node, ix, letter)} is sharded on {a} -> partial sum")
        return "; ".join(parts) or "op computed whole on every rank"

    def letter_name(self, node, ix, letter) -> str:
        for path, letters in ix.inputs:
            if letter in letters:
                return self.info.dim_name(self.info.of(get_path(node, path))[letters.index(letter)])
        for k, letters in enumerate(ix.outputs):
            if letter in letters:
                return self.info.dim_name(self.info.of(node, k)[letters.index(letter)])
        return str(letter)

    def replace_args(self, node, converted: dict):
        args = list(node.args)
        kwargs = dict(node.kwargs)
        for path, new in converted.items():
            if path[0] == "kw":
                kwargs[path[1]] = new
            elif len(path) == 1:
                args[path[0]] = new
            else:
                seq = list(args[path[0]])
                seq[path[1]] = new
                args[path[0]] = seq
        args = [self.local.get(a, a) if isinstance(a, fx.Node) else a for a in args]
        args = [[self.local.get(b, b) if isinstance(b, fx.Node) and b not in converted.values() and b in self.local else b
                 for b in a] if isinstance(a, list) else a for a in args]
        return tuple(args), kwargs

    def rescale_mean(self, node, new, ix, modes):
        """A local mean over a split dim divided by the local count; the sum of partial results
        needs the global count."""
        factor = 1.0
        for i, (kind, letter) in enumerate(modes):
            if kind == "contract":
                factor /= self.mesh.axes[self.axes[i]]
        scaled = self.g.call_function(aten.mul.Tensor, (new, factor))
        scaled.meta = dict(new.meta, mean_rescale=True)  # the pipeline split reads a loss's tail past it
        return scaled

    def visit_view(self, node: fx.Node, ix: Indexing):
        src = node.args[0]
        cur = self.place[src][0]
        in_dims, out_dims = self.info.of(src), self.info.of(node)
        target, out_place = [], []
        for i, a in enumerate(self.axes):
            o = cur[i]
            if isinstance(o, Shard):
                soft = self.unit_of(in_dims[o.dim], a) is None  # split by a soft entry
                unit = self.unit_of(in_dims[o.dim], a, soft)
                hit = [d for d, atoms in enumerate(out_dims)
                       if atoms and unit and self.unit_of(atoms, a, soft) == unit]
                if hit:
                    target.append(o)
                    out_place.append(Shard(hit[0]))
                else:
                    target.append(R)
                    out_place.append(R)
            else:
                target.append(o)
                out_place.append(o)
        x = self.convert(src, 0, tuple(target), set(), node, "a reshape regroups a split dim")
        out_place = tuple(out_place)
        shape = list(local_shape(shape_of(node), out_place, self.mesh))
        # reshape, not view: a gathered block (or an op on one) need not be laid out as the
        # global tensor was, and reshape is still a view wherever the strides allow.
        new = self.g.call_function(aten.reshape.default, (x, shape))
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        new.meta["val"] = self.meta_local(node.meta["val"], out_place)
        self.local[node] = new
        self.place[node] = [out_place]

    def visit_creation(self, node: fx.Node, ix: Indexing):
        val = node.meta["val"]
        place = tuple(R for _ in self.axes) if node.target in POSITIONAL_CREATION else self.desired(node)
        args, kwargs = list(node.args), dict(node.kwargs)
        loc = list(local_shape(val.shape, place, self.mesh))
        size_pos = {aten.new_ones.default: 1, aten.new_zeros.default: 1, aten.new_full.default: 1,
                    aten.new_empty.default: 1, aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0,
                    aten.empty.memory_format: 0}.get(node.target)
        if size_pos is not None and place != tuple(R for _ in self.axes):
            args[size_pos] = loc
        args = [self.local.get(a, a) if isinstance(a, fx.Node) else a for a in args]
        new = self.g.call_function(node.target, tuple(args), kwargs)
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}
        new.meta["val"] = self.meta_local(val, place)
        self.local[node] = new
        self.place[node] = [place]

    def visit_fallback(self, node: fx.Node):
        """No rule: gather every tensor operand, run the op whole on every rank."""
        mod, line = module_of(node), source_line(node)
        self.fallbacks.append((str(node.target), mod, line))
        warnings.warn(f"autoshard: no sharding rule for {node.target} at {self.where(node)}; it runs replicated "
                      f"(its inputs are gathered first)", UnsupportedOpWarning, stacklevel=2)
        whole = tuple(R for _ in self.axes)
        converted = {}

        def conv(a):
            if is_tensor_node(a):
                return self.convert(a, 0, whole, set(), node, f"{node.target} has no sharding rule")
            if isinstance(a, fx.Node):
                return self.local[a]
            if isinstance(a, (list, tuple)):
                return type(a)(conv(b) for b in a)
            return a

        args = tuple(conv(a) for a in node.args)
        kwargs = {k: conv(v) for k, v in node.kwargs.items()}
        if is_inplace(node.target) and self.writes_into_copy(node, args) and aliases_read_later(node):
            raise LayoutError(f"{self.where(node)} has no sharding rule and writes in place into {node.args[0].name}, "
                              f"whose aliases are read later: gathering it would write into a copy; leave the dims "
                              f"of {node.args[0].name} whole in the layout")
        new = self.g.call_function(node.target, args, kwargs)
        new.meta = dict(node.meta)
        self.local[node] = new
        outs = self.out_values(node)
        self.place[node] = [whole for _ in outs]


SIZE_ARG = {aten.expand.default: 1}


# Inside unchanged_graphs(): {(id(graph), what, names): (graph, frozen set of nodes)}; None outside
_graph_memo: Optional[dict] = None


@contextlib.contextmanager
def unchanged_graphs():
    """Context in which the captured graphs given to :func:`rewrite` are not edited, so the
    node sets it derives from a graph and a set of input names (:func:`requires_grad_nodes`,
    :func:`depends_on`) are computed once per graph by the rewrite: the layout search rewrites one graph
    hundreds of times. Nested uses share the outer memo.

    Example::

        >>> with unchanged_graphs():                                        # doctest: +SKIP
        ...     programs = [rewrite(graph, info, layout, mesh, grad) for layout in layouts]
    """
    global _graph_memo
    if _graph_memo is not None:
        yield
        return
    _graph_memo = {}
    try:
        yield
    finally:
        _graph_memo = None


def _memo_value(graph: fx.Graph, info, what: str, fn):
    """``fn(graph, info)``, computed once per graph and DimInfo inside :func:`unchanged_graphs`."""
    if _graph_memo is None:
        return fn(graph, info)
    key = (id(graph), id(info), what)
    got = _graph_memo.get(key)
    if got is None or got[0] is not graph or got[1] is not info:  # (both kept alive with it)
        got = _graph_memo[key] = (graph, info, fn(graph, info))
    return got[2]


def _memo_nodes(graph: fx.Graph, what: str, names, fn):
    if _graph_memo is None:
        return fn(graph, names)
    key = (id(graph), what, frozenset(names))
    got = _graph_memo.get(key)
    if got is None or got[0] is not graph:  # (the graph is kept alive with it: its id is not reused)
        got = _graph_memo[key] = (graph, frozenset(fn(graph, names)))
    return got[1]


def depends_on(graph: fx.Graph, names: set) -> set:
    """Nodes computed from the placeholders named in ``names`` (those included)."""
    out = set()
    if not names:  # (input_placements makes a rewriter with none: no walk over the graph)
        return out
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in names) or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def requires_grad_nodes(graph: fx.Graph, grad_inputs: set) -> set:
    """Values that depend on a gradient-requiring input through float ops."""
    out = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in grad_inputs:
                out.add(node)
            continue
        if node.op != "call_function" or no_grad_node(node):  # computed under no_grad, or a detach
            continue
        vals = node.meta.get("val")
        vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
        floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
        if floating and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def input_placements(graph: fx.Graph, info: DimInfo, layout: Layout, mesh, fixed=None) -> dict:
    """{placeholder name: placement the layout gives it} for every tensor input (``fixed``:
    placements decided by another pass, by name)."""
    r = _Rewriter(graph, info, layout, mesh, set(), {}, {})
    r.lowering = None  # (no region is visited here; see rewrite)
    fixed = fixed or {}
    return {n.name: fixed.get(n.name) or r.desired(n) for n in graph.nodes if n.op == "placeholder" and is_tensor_node(n)}


def lazy_programs():
    """Context in which rewritten programs skip generating and compiling their Python code until
    they are run or printed: the layout search only reads their graphs, and compiling a graph of
    thousands of nodes costs more than rewriting it."""
    return _use_lazy_graph_module(True)


def rewrite(graph: fx.Graph, info: DimInfo, layout: Layout, mesh, grad_inputs: set, display=None,
            storage=None, bucket_axis=None, bucket_candidates=(), regions=None, fixed=None,
            collectives_only: bool = False, region_axis=None,
            user_inputs=(), data_axes=(), collectives: Optional[list] = None,
            stopped: Optional[dict] = None, resume: Optional[RewriteState] = None,
            checkpoints: Optional[Checkpoints] = None, fixed_local: bool = False) -> Program:
    """Build the per-rank program for ``layout`` on ``mesh``. ``grad_inputs``: placeholder
    names that need gradients; ``display``: placeholder name -> name to use in messages;
    ``storage``: placeholder name -> :class:`ParamStorage` for state-sharded parameters;
    ``bucket_candidates``: parameters whose ``bucket_axis`` gradient sync may be bucketed;
    ``regions``: {node: visitor} for nodes another pass writes (``passes.experts.lowerings``);
    ``fixed``: placements of inputs decided by such a pass. ``collectives_only``: the program's
    collectives and placements without its graph (``graph_module`` None; no gradient buckets).
    ``region_axis``: the data axis on which, without buckets, the gradient sums of replicated
    regions computed from sharded state move into its reduce-scatters (``grad_regions``).
    ``user_inputs``: placeholder names of the model's own inputs (the batch), whose dependent
    values' gradient sums on ``data_axes`` (the axes that split them, ``ownership.data_axes``)
    are not deferred under gradient accumulation. ``collectives``: the list the collectives are
    appended to as the rewrite emits them, in program order (the layout search passes one that
    stops a one-axis rewrite once what it has emitted already bounds the candidates out).
    ``stopped``: set, when the rewrite ends, to ``{"position": index in graph.nodes of the node it
    was at}`` (where such a list stopped it). ``checkpoints``: where to save the rewrite's state
    and what to give each to; ``resume``: a state saved so by a rewrite of another layout whose
    units decide alike before its node, to start from there (``passes/rewrite_state.py``; both
    only with ``collectives_only`` and a layout each of whose nodes decides from its own values'
    units). ``fixed_local``: the ``fixed`` placements are those the layout's units give the inputs
    where they are read (an MoE layer's stacked expert parameters, placed before its experts
    units became regional: ``program.lowered``), so a rewrite building no graph may still skip,
    save and resume as above."""
    if collectives_only and (bucket_axis is not None or region_axis is not None):
        raise ValueError("gradient buckets edit the program's graph: collectives_only=True builds none")
    rg = _memo_nodes(graph, "requires_grad", grad_inputs, requires_grad_nodes)
    rewriter = _Rewriter(graph, info, layout, mesh, rg, display or {}, storage or {}, bucket_axis,
                         bucket_candidates, regions, fixed, collectives_only, region_axis, user_inputs, data_axes)
    if collectives is not None:
        rewriter.collectives = collectives
    rewriter.fixed_local = fixed_local
    if (resume is not None or checkpoints is not None) and (
            not collectives_only or not all_decide_locally(rewriter.regions) or units_if_local(rewriter) is None):
        raise ValueError("a rewrite's state is saved or resumed only building no graph, for a layout each of whose "
                         "nodes decides from its own values' units (passes/rewrite_state.py)")
    try:
        return rewriter.run(resume, checkpoints)
    finally:
        if stopped is not None:
            stopped["position"] = rewriter.position
        # the rewriter and its lowering refer to each other: without that cycle its tables are
        # freed as soon as it is dropped, not by the cyclic collector (the search makes hundreds)
        rewriter.lowering = None
