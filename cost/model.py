"""Graph cost model: predicted step time and memory per rank of a rewritten (per-rank) program.

Applied to what the SPMD rewrite actually produced: every aten op of the per-rank program with
its *local* shapes (roofline time), every collective record of the plan (alpha-beta time on the
link of its mesh axis, ``cost.comm``), and the placements of parameters and state. The search
(``cost.search``) evaluates candidates with the same functions, so a candidate's predicted cost
is exactly the cost of the plan built from it.

Time model (one training step; forward only when ``train=False``)::

    forward   ops in program order on a compute stream; every forward collective blocks it
    backward  ops in reverse order, each ``backward_factor`` x its forward time (ops whose result
              needs no gradient cost nothing); activation collectives block; a gradient
              bucket's all-reduce starts on a separate communication stream once its last
              gradient exists and runs under the rest of backward: only its exposed tail
              counts (``overlap=False`` blocks it). Per-parameter syncs inside the backward
              program (mark_varying / all_gather_varying / use_persistent adjoints) block, as
              the runtime runs them, unless ``async_param_syncs``
    optimizer the step's memory traffic over this rank's optimizer slice, then the ZeRO-1/2
              all-gathers of updated parameters (blocking)

Exposed communication is the time the compute stream waits, attributed to the collectives
running while it waits, by mesh axis and phase. Memory per rank: persistent (parameters,
gradients, optimizer state, by dtype and by what is sharded) and peak (plus activations saved
for backward, gathered parameters, the largest communication buffer).

Example::

    >>> cm = CostModel(load_hardware("h100"))
    >>> round(collective_seconds(cm, {"tp": 8}, "all_reduce", ("tp",), 2**20) * 1e6, 2)   # us
    18.08
"""
from __future__ import annotations

import json
import math
import operator
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

import torch

from autoshard.ownership import held_fraction, slice_dim_for
from autoshard.passes.early_sums import EARLY_COPY
from autoshard.passes import rules
from autoshard.passes.overlap_linear import unfused
from autoshard.passes.spmd import requires_grad_nodes
from autoshard.runtime.primitives.buckets import assign_buckets
from autoshard.runtime.primitives.collectives import backward_collective, start_gather_unit

from autoshard.cost.context_parallel import attention_seconds
from .comm import R as R_SYM, V as V_SYM, collective_bytes, collective_formula, collective_time
from .compute import roofline_time
from .hardware import Hardware, load_hardware, normalize_dtype
from .saved import ATTENTION, SavedCounter

_GETITEM = operator.getitem

aten = torch.ops.aten

__all__ = [
    "CostModel", "PlanCost", "resolve_cost_model", "collective_seconds", "payload_bytes",
    "program_events", "simulate", "state_memory", "optimizer_phase", "block_of_module",
    "formula_text", "formula_for",
]

DEFAULT_HARDWARE_ENV = "AUTOSHARD_HARDWARE"


@dataclass(frozen=True)
class CostModel:
    """Hardware plus the modelling choices that are not hardware.

    ``overlap``: asynchronous gradient syncs (the plan's gradient buckets) run under the rest
    of backward (False describes a machine where they cannot, e.g. CPU ranks sharing cores).
    ``async_param_syncs``: gradient syncs inside the backward program (one per parameter: no
    buckets, ZeRO-2/3 reduce-scatters) are asynchronous too; False for the autoshard runtime,
    which runs them in autograd order.
    ``backward_factor``: backward time of an op / its forward time (2: input and weight grads).
    ``collective_factors``: ((kind, factor), ...) multiplying the time of that kind of
    collective (calibration measures how much slower than the alpha-beta fit a runtime's
    all-gather or reduce-scatter is, e.g. for its extra copies); empty = 1 for every kind.
    ``optimizer_bytes``: optimizer state bytes per parameter; None = Adam under the
    ``model_state_bytes`` convention: 12 for 16-bit parameters (fp32 master + two moments),
    8 for fp32 parameters (two moments).
    """

    hardware: Hardware
    overlap: bool = True
    async_param_syncs: bool = False
    collective_factors: tuple = ()
    backward_factor: float = 2.0
    optimizer_bytes: Optional[float] = None

    def opt_bytes(self, param_bytes: int) -> float:
        if self.optimizer_bytes is not None:
            return float(self.optimizer_bytes)
        return 12.0 if param_bytes <= 2 else 2.0 * param_bytes


def resolve_cost_model(spec: Any = None) -> CostModel:
    """A CostModel from a CostModel, Hardware, preset name, JSON path or dict. ``None`` uses
    ``$AUTOSHARD_HARDWARE`` if set (a preset or a file written by ``calibrate``), else
    ``"cpu-gloo"``. A JSON file's optional top-level ``"overlap"`` and ``"collective_factors"``
    keys (written by ``calibrate``) set those fields."""
    if isinstance(spec, CostModel):
        return spec
    if spec is None:
        spec = os.environ.get(DEFAULT_HARDWARE_ENV) or "cpu-gloo"
    extra: dict = {}
    if isinstance(spec, (str, os.PathLike)) and os.path.isfile(str(spec)):
        with open(spec) as f:
            spec = json.load(f)
    if isinstance(spec, dict):
        extra = {"overlap": bool(spec.get("overlap", True)),
                 "collective_factors": tuple(sorted((spec.get("collective_factors") or {}).items()))}
    return CostModel(load_hardware(spec), **extra)


# --------------------------------------------------------------------------- communication

def payload_bytes(kind: str, input_bytes: float, ranks: int) -> float:
    """``V`` of ``cost.comm`` for a collective whose rank-local input buffer has
    ``input_bytes`` (what plan records carry): the gathered tensor for all-gather, the input
    buffer for the others."""
    return input_bytes * ranks if kind == "all_gather" else input_bytes


def _items(mesh) -> tuple:
    axes = getattr(mesh, "axes", mesh)
    return tuple(axes.items())


@lru_cache(maxsize=65536)
def _coll_seconds(hw: Hardware, items: tuple, kind: str, axes: tuple, input_bytes: float) -> float:
    ranks = math.prod(dict(items)[a] for a in axes)
    link = hw.link_for_axes(dict(items), axes)
    return collective_time(kind, payload_bytes(kind, input_bytes, ranks), ranks, link)


# id(hardware) -> (hardware, {(mesh items, kind, axes, input bytes): seconds}): collective_seconds
# is asked hundreds of thousands of times in a search, and hashing the Hardware (a nested
# dataclass) for _coll_seconds' cache cost more than the formula
_COLL_MEMO: dict = {}


def collective_seconds(cm: CostModel, mesh, kind: str, axes: tuple, input_bytes: float) -> float:
    """Seconds of one collective over ``axes`` of ``mesh`` whose local input has ``input_bytes``
    (the slowest link the group spans; ring volumes and latency steps of ``cost.comm``)."""
    hw = cm.hardware
    entry = _COLL_MEMO.get(id(hw))
    if entry is None or entry[0] is not hw:
        if len(_COLL_MEMO) >= 64:
            _COLL_MEMO.clear()
        entry = _COLL_MEMO[id(hw)] = (hw, {})  # (kept alive with it: its id is not reused)
    memo = entry[1]
    key = (_items(mesh), kind, tuple(axes), float(input_bytes))
    t = memo.get(key)
    if t is None:
        if len(memo) >= 1 << 16:
            memo.clear()
        t = memo[key] = _coll_seconds(hw, *key)
    if cm.collective_factors and t:
        t *= dict(cm.collective_factors).get(kind, 1.0)
    return t


def formula_text(kind: str) -> str:
    """The per-rank volume formula of ``kind`` in words, e.g. ``2*(R-1)/R*V``."""
    return str(collective_formula(kind)).replace(" ", "")


# --------------------------------------------------------------------------- compute

# Matrix products ({op: index of the first factor}) and ops that only re-describe memory (no
# flops, no traffic; their dispatch overhead still counts): classes of the rule table.
MATMUL_OPS, VIEW_OPS = rules.MATMUL_OPS, rules.VIEW_OPS


def _tensors(x, out):
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.append(v)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    return out


def _numel(t) -> int:
    n = 1
    for s in t.shape:
        n *= int(s)
    return n


def op_work(target, args, kwargs, outs: list) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one op from its local operand and result tensors: matmuls
    ``2mnk``, attention ``2*s*t*(d+e)`` per head, embedding a gather, everything else one FLOP
    per element; bytes read every operand and write every result once."""
    ins = _tensors(list(args) + list(kwargs.values()), [])
    if target in VIEW_OPS:
        return 0.0, 0.0
    nbytes = float(sum(_numel(t) * t.element_size() for t in ins) + sum(_numel(t) * t.element_size() for t in outs))
    out0 = outs[0] if outs else None
    if target in MATMUL_OPS and out0 is not None:
        a = args[MATMUL_OPS[target]]
        av = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        k = int(av.shape[-1]) if av is not None and av.dim() else 1
        if target is aten.linear.default:
            k = int(args[1].meta["val"].shape[-1])
        return 2.0 * _numel(out0) * k, nbytes
    if target is aten.scaled_dot_product_attention.default and out0 is not None:
        q, k = args[0].meta["val"], args[1].meta["val"]
        t, d = int(k.shape[-2]), int(q.shape[-1])
        # a causal kernel computes the visible (query, key) pairs only: (t+1)/2t of them, as
        # ring attention's cost does (cost/context_parallel.py), so the two compare on equal terms
        causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        frac = (t + 1) / (2 * t) if causal and int(q.shape[-2]) == t else 1.0
        return 2.0 * (_numel(q) * t + _numel(out0) * t) * frac + 0 * d, nbytes
    if target is aten.embedding.default and out0 is not None:
        return 0.0, float(2 * _numel(out0) * out0.element_size())
    n = max([_numel(t) for t in outs] + [_numel(t) for t in ins[:1]] + [0])
    return float(n), nbytes


def _dtype_of(outs, ins) -> str:
    for t in list(ins) + list(outs):
        if t.dtype.is_floating_point:
            return normalize_dtype(t.dtype)
    return "fp32"


def op_seconds(cm: CostModel, target, args, kwargs, outs: list) -> float:
    flops, nbytes = op_work(target, args, kwargs, outs)
    dev = cm.hardware.device
    dtype = _dtype_of(outs, _tensors(list(args), []))
    if dtype not in dev.peak_flops:
        dtype = "fp32" if "fp32" in dev.peak_flops else max(dev.peak_flops, key=dev.peak_flops.get)
    t = roofline_time(flops, nbytes, dev, dtype=dtype) if (flops or nbytes) else 0.0
    return t + dev.op_overhead


# --------------------------------------------------------------------------- program -> events

def block_of_module(fqn: str) -> Optional[tuple]:
    """The repeated block a module belongs to: its first numeric path component
    (``"layers.3.mlp"`` -> ``("layers", 3)``, ``"h.0"`` -> ``("h", 0)``); None outside blocks."""
    if not fqn:
        return None
    parts = fqn.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and i > 0:
            return (".".join(parts[:i]), int(p))
    return None


def _module_of_local(node) -> str:
    meta = node.meta.get("autoshard")
    if meta is not None:
        return meta.get("where", "") or ""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


@dataclass
class Comm:
    """One collective of the plan at its place in program order: its forward part, its
    backward part (the adjoint), and for a ZeRO-3 parameter released after forward the second
    gather in backward."""

    axes: tuple
    fwd_kind: Optional[str]
    fwd_bytes: int
    fwd_s: float
    bwd_kind: Optional[str]
    bwd_bytes: int
    bwd_s: float
    bwd_overlap: bool  # a parameter's gradient sync: may run under the rest of backward
    regather_s: float = 0.0  # ZeRO-3 reshard: the parameter is gathered again in backward
    regather_bytes: int = 0
    gathered_param_bytes: int = 0  # output bytes of a parameter gather (ZeRO-3 temporaries)
    buffer_bytes: int = 0  # send + receive buffers of the largest part
    # ZeRO-3 units: the gather was started when the previous unit's finished (prefetch) or after
    # the plain collectives on its axes that follow that one (passes/zero_units.py), and
    # the flat buffers are copied in and out (forward; backward with the gradient buffers).
    prefetched: bool = False
    copy_fwd_s: float = 0.0
    copy_bwd_s: float = 0.0

    def key(self):
        return (self.axes, self.fwd_kind, self.fwd_bytes, self.bwd_kind, self.bwd_bytes, self.bwd_overlap,
                self.regather_bytes, self.gathered_param_bytes, self.prefetched, self.copy_fwd_s, self.copy_bwd_s)


@dataclass(frozen=True)
class Ready:
    """A trainable parameter synchronized by gradient buckets: its gradient is complete once
    backward passes this point (just before its first use in forward order)."""

    size: int  # bytes of the whole parameter
    local_bytes: int  # bytes of this rank's gradient (what a bucket holds and all-reduces)

    def key(self):
        return ("ready", self.size, self.local_bytes)


@dataclass
class Segment:
    """Consecutive events of one block (or of the code outside blocks), in forward order.
    ``items``: merged compute as ``(fwd_s, bwd_s)`` pairs, :class:`Comm` and :class:`Ready`."""

    block: Optional[tuple]
    items: list = field(default_factory=list)
    saved_bytes: int = 0  # activations saved for backward
    max_act_bytes: int = 0
    saved_by_module: dict = field(default_factory=dict)  # module FQN -> its part of saved_bytes
    boundary_bytes: int = 0  # activations a checkpointed block keeps (its inputs; cost/recompute.py)
    selective: Optional[tuple] = None  # (held bytes, recomputed ops) under the selective policy (cost/recompute.py)

    def key(self):
        return (tuple(x if isinstance(x, tuple) else x.key() for x in self.items), self.saved_bytes,
                self.max_act_bytes)


def _is_collective_fn(target) -> bool:
    return getattr(target, "__module__", "") == "autoshard.runtime.primitives.collectives"


def _add(d: dict, key, n) -> None:
    d[key] = d.get(key, 0) + n


def activations_by_module(segments) -> dict:
    """{module FQN: bytes of activations it saves for backward, per rank} over the program's
    segments (what the memory model counts: sequence-parallel regions hold 1/p of the tokens).

    Example::

        segs = program_events(plan.program, plan.mesh, cm, param_names)
        norms = sum(b for m, b in activations_by_module(segs).items() if m.endswith("norm"))
    """
    out: dict = {}
    for s in segments:
        for m, n in s.saved_by_module.items():
            _add(out, m, n)
    return out


def program_events(program, mesh, cm: CostModel, param_names: set, vals: Optional[dict] = None,
                   counter=SavedCounter) -> list:
    """Segments (per block, in program order) of the per-rank program: merged compute times,
    the plan's collectives with their forward / backward times, and gradient-ready points of
    bucketed parameters.

    ``param_names``: placeholder names of trainable parameters (their gradient syncs may
    overlap backward compute); ``vals``: placeholder name -> whole (global) meta tensor, for
    the bucket assignment; ``counter``: what ``saved_bytes`` counts (a ``SavedCounter`` class,
    as ``cost/stage_copies.py``'s)."""
    graph = unfused(program.graph_module.graph)  # priced as the unfused program (no overlap modelled)
    rg = requires_grad_nodes(graph, param_names)
    kept = counter(graph, rg)  # what autograd keeps for backward, op by op (cost/saved.py)
    by_tag: dict = {}
    for c in program.collectives:
        by_tag.setdefault(c.tag, []).append(c)
    reshard = program.reshard_tags
    bucketed = set(program.bucketed)
    ready_seen: set = set()
    segs: list = []
    cur: Optional[Segment] = None
    pend = [0.0, 0.0]
    bf = cm.backward_factor
    overhead = cm.hardware.device.op_overhead
    copy_bw = cm.hardware.device.mem_bandwidth * cm.hardware.device.mem_efficiency
    seen_unit = False

    def flush():
        if cur is not None and (pend[0] or pend[1]):
            cur.items.append((pend[0], pend[1]))
        pend[0] = pend[1] = 0.0

    for node in graph.nodes:
        if (node.op != "call_function" or node.target is _GETITEM or node.meta.get(EARLY_COPY)
                or node.target is start_gather_unit):
            # (a forward sum's early start is costed where its all_reduce waits, a unit's
            # separate start where the unit is gathered)
            continue
        block = block_of_module(_module_of_local(node))
        if cur is None or block != cur.block:
            flush()
            cur = Segment(block)
            segs.append(cur)
        for a in node.all_input_nodes:
            if a.op == "placeholder" and a.name in bucketed and a.name not in ready_seen:
                ready_seen.add(a.name)
                flush()
                v = a.meta["val"]
                g = (vals or {}).get(a.name, v)
                cur.items.append(Ready(_numel(g) * g.element_size(), _numel(v) * v.element_size()))
        val = node.meta.get("val")
        outs = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
        out_bytes = sum(_numel(t) * t.element_size() for t in outs)
        if _is_collective_fn(node.target):
            tag = node.kwargs.get("tag")
            recs = by_tag.get(tag, [])
            op = recs[0].op if recs else ""
            adj = backward_collective(op) if op else None
            fwd = next((r for r in recs if r.phase == "forward"), None)
            bwd = next((r for r in recs if r.phase == "backward" and r.kind == adj), None)
            again = next((r for r in recs if r.phase == "backward" and r is not bwd and tag in reshard), None)
            if fwd is None and bwd is None:
                pend[0] += overhead  # a local conversion (slice, keep-first, identity)
                continue
            flush()
            is_param = recs[0].node in param_names
            axes = (fwd or bwd).axes
            in_bytes = fwd.bytes if fwd else (bwd.bytes if bwd else 0)
            c = Comm(axes, fwd.kind if fwd else None, fwd.bytes if fwd else 0,
                     collective_seconds(cm, mesh, fwd.kind, axes, fwd.bytes) if fwd else 0.0,
                     bwd.kind if bwd else None, bwd.bytes if bwd else 0,
                     collective_seconds(cm, mesh, bwd.kind, axes, bwd.bytes) if bwd else 0.0,
                     bwd_overlap=bwd is not None and is_param and cm.async_param_syncs)
            if again is not None:
                c.regather_bytes = again.bytes
                c.regather_s = collective_seconds(cm, mesh, again.kind, again.axes, again.bytes)
            if fwd is not None and is_param:
                c.gathered_param_bytes = out_bytes
            if op == "gather_unit":
                c.prefetched = seen_unit
                seen_unit = True
                # copy-in and copy-out of the flat buffers, read and written once each
                c.copy_fwd_s = 2 * (fwd.bytes + out_bytes) / copy_bw
                c.copy_bwd_s = 2 * (bwd.bytes + fwd.bytes) / copy_bw  # (+ copy_fwd_s again if regathered)
            c.buffer_bytes = max(in_bytes + out_bytes, (bwd.bytes if bwd else 0) + in_bytes)
            cur.items.append(c)  # (a collective's backward keeps nothing: its adjoint needs no values)
            cur.max_act_bytes = max(cur.max_act_bytes, out_bytes)
            continue
        att = (node.meta.get("autoshard") or {}).get("context")
        if att is not None:  # ring / all-gather attention: its hops and compute (cost/context_parallel.py)
            q, kv = node.args[0].meta["val"], node.args[1].meta["val"]
            t, tb = attention_seconds(cm, mesh, att.axis, att.variant, tuple(q.shape), tuple(kv.shape),
                                      q.element_size(), att.causal, att.order)
            pend[0] += t
            if node in rg:
                pend[1] += tb
                cur.saved_bytes += kept.add_rule(node, ATTENTION)
            cur.max_act_bytes = max(cur.max_act_bytes, out_bytes)
            continue
        if (node.meta.get("autoshard") or {}).get("moe"):
            # an MoE layer's capacity gathers, count exchange, dispatch or combine
            # (passes/experts.py): its all-to-alls, forward and backward, block as a collective's do
            recs = by_tag.get(node.meta["autoshard"]["tag"], [])
            for fwd in [r for r in recs if r.phase == "forward"]:
                bwd = next((r for r in recs if r.phase == "backward" and r.axes == fwd.axes), None)
                flush()
                cur.items.append(Comm(
                    fwd.axes, fwd.kind, fwd.bytes, collective_seconds(cm, mesh, fwd.kind, fwd.axes, fwd.bytes),
                    bwd.kind if bwd else None, bwd.bytes if bwd else 0,
                    collective_seconds(cm, mesh, bwd.kind, bwd.axes, bwd.bytes) if bwd else 0.0,
                    bwd_overlap=False, buffer_bytes=2 * max(fwd.bytes, bwd.bytes if bwd else 0)))
        if (node.meta.get("autoshard") or {}).get("vocab_parallel") is not None:
            # vocab-parallel cross-entropy (passes/vocab_parallel.py): its forward gather of row
            # maxima and its sum of statistics block; the compute is costed below as one op
            tag = node.kwargs.get("tag")
            for r in by_tag.get(tag, []) + by_tag.get(tag + 1, []):
                flush()
                cur.items.append(Comm(r.axes, r.kind, r.bytes, collective_seconds(cm, mesh, r.kind, r.axes, r.bytes),
                                      None, 0, 0.0, bwd_overlap=False, buffer_bytes=r.bytes * (1 + mesh.axes[r.axes[0]])))
        t = op_seconds(cm, node.target, node.args, node.kwargs, outs)
        pend[0] += t
        if node in rg:
            pend[1] += bf * t
            n_kept = kept.add(node, out_bytes)
            if n_kept:
                cur.saved_bytes += n_kept
                _add(cur.saved_by_module, _module_of_local(node), n_kept)
        if node.target not in VIEW_OPS:
            cur.max_act_bytes = max(cur.max_act_bytes, out_bytes)
    flush()
    return segs


# --------------------------------------------------------------------------- state memory

def _local_numel(shape, place, mesh) -> int:
    out = list(shape)
    for o, a in zip(place, mesh.names):
        d = getattr(o, "dim", None)
        if d is not None:
            out[d] //= mesh.axes[a]
    n = 1
    for s in out:
        n *= int(s)
    return int(n * held_fraction(place, mesh))  # one expert of a ModuleList: on 1/n of the ranks


def _state_inputs(inputs, vals, input_places, use_places, counts, kinds=("parameter",), trainable=True):
    """(input, global tensor, element size, stored placement, use placement, copies) for the
    tensor inputs of ``kinds`` (only trainable parameters when ``trainable``)."""
    for inp, place, cnt in zip(inputs, input_places, counts or [1] * len(inputs)):
        if inp.kind not in kinds or (trainable and not inp.trainable):
            continue
        v = vals.get(inp.name)
        if isinstance(v, torch.Tensor):
            yield inp, v, v.element_size(), place, use_places.get(inp.name, place), cnt


def state_memory(inputs, vals: dict, input_places: list, mesh, cm: CostModel, *, train: bool,
                 zero_stage: int = 0, data_axes=(), storage=None, use_places=None, counts=None,
                 memo: Optional[dict] = None) -> dict:
    """Persistent bytes per rank: parameters (and buffers), gradients, optimizer state.

    ``inputs``: captured inputs (``.name .kind .trainable``) in placeholder order; ``vals``:
    placeholder name -> global meta tensor; ``input_places``: their placements; ``storage``:
    ZeRO-2/3 parameter storage (``ParamStorage`` by placeholder name); ``use_places``: where
    each parameter is used. Mirrors what ``Plan.build`` / ``ShardedOptimizer`` allocate, with
    optimizer state per ``CostModel.opt_bytes``. ``counts``: how many inputs each one stands
    for (identical blocks). ``memo``: a dict kept across calls with the same inputs, values,
    mesh, cost model and ``train`` (the layout search's), caching each input's share by its
    placements."""
    storage = storage or {}
    use_places = use_places or {}
    out = {"params": 0.0, "buffers": 0.0, "grads": 0.0, "optimizer": 0.0}
    zero1_axis = data_axes[0] if zero_stage == 1 and data_axes else None
    for inp, v, es, place, use, cnt in _state_inputs(inputs, vals, input_places, use_places, counts,
                                                     ("parameter", "buffer", "constant"), trainable=False):
        st = storage.get(inp.name)
        persistent = st is not None and st.mode == "persistent"
        key = (inp.name, place, use, persistent, zero1_axis, cnt)
        terms = memo.get(key) if memo is not None else None
        if terms is None:
            terms = _state_terms(inp, v, es, place, use, cnt, persistent, zero1_axis, mesh, cm, train)
            if memo is not None:
                memo[key] = terms
        kind, params, grads, opt = terms
        out[kind] += params
        if grads is not None:
            out["grads"] += grads
            out["optimizer"] += opt
    out["total"] = out["params"] + out["buffers"] + out["grads"] + out["optimizer"]
    return out


def _state_terms(inp, v, es, place, use, cnt, persistent, zero1_axis, mesh, cm, train) -> tuple:
    """One input's share of :func:`state_memory`: (``"params"`` or ``"buffers"``, its bytes,
    gradient bytes, optimizer bytes; None, None when it has no gradient)."""
    stored = _local_numel(v.shape, place, mesh)
    use_n = _local_numel(v.shape, use, mesh)
    kind = "params" if inp.kind == "parameter" else "buffers"
    params = cnt * es * (use_n if persistent else stored)
    if not (train and inp.kind == "parameter" and inp.trainable):
        return kind, params, None, None
    opt = stored
    if zero1_axis is not None:
        d = slice_dim_for(use, v.shape, mesh, zero1_axis)
        opt = use_n // mesh.axes[zero1_axis] if d is not None else use_n
    return kind, params, cnt * es * stored, cnt * cm.opt_bytes(es) * opt


# --------------------------------------------------------------------------- the timeline

@dataclass
class PlanCost:
    """Predicted cost of one plan (seconds and bytes per rank).

    ``step_time`` = ``compute`` + exposed communication; ``exposed`` maps (axis, phase) to the
    seconds the compute stream waits on that axis's collectives; ``comm_total`` the same
    without overlap; ``memory`` persistent state and peak per rank."""

    step_time: float
    compute: float
    compute_by_phase: dict
    exposed: dict
    comm_total: dict
    memory: dict
    train: bool
    zero_stage: int = 0
    counts: dict = field(default_factory=dict)  # (axis, phase, kind) -> number of collectives
    volume: dict = field(default_factory=dict)  # (axis, phase, kind) -> bytes sent per rank
    activations_by_module: dict = field(default_factory=dict)  # module FQN -> saved bytes per rank
    checkpoint: bool = False  # repeated blocks recomputed in backward (activation checkpointing)

    @property
    def comm_exposed(self) -> float:
        return sum(self.exposed.values())

    def fits(self, memory_limit) -> bool:
        return memory_limit is None or self.memory["peak"] <= memory_limit

    def as_dict(self) -> dict:
        return {"step_time": self.step_time, "compute": self.compute, "compute_by_phase": dict(self.compute_by_phase),
                "comm_exposed": dict(self.exposed), "comm_total": dict(self.comm_total),
                "memory": dict(self.memory), "zero_stage": self.zero_stage}

    def summary(self) -> str:
        ms = lambda s: f"{s * 1e3:.3f} ms"
        gb = lambda b: f"{b / 1e9:.3f} GB"
        parts = [f"step {ms(self.step_time)} = compute {ms(self.compute)}"]
        for (axis, phase), t in sorted(self.exposed.items()):
            if t > 0:
                parts.append(f"{axis}/{phase} {ms(t)}")
        return " + ".join(parts) + f"; memory persistent {gb(self.memory['persistent'])}, peak {gb(self.memory['peak'])}"


def simulate(segments, mesh, cm: CostModel, *, train: bool, state: dict, opt_colls=(), opt_elems: float = 0.0,
             opt_elem_bytes: float = 0.0, n_opt_tensors: int = 0, zero_stage: int = 0,
             reshard: bool = False, bucket_axis: Optional[str] = None, bucket_bytes: int = 0) -> PlanCost:
    """Run the two-stream timeline over ``segments`` (forward, then backward in reverse) and
    the optimizer phase; return the cost with exposed communication by axis and phase.

    Gradient buckets (``bucket_bytes`` > 0 on ``bucket_axis``): the Ready points met in
    backward, in that order, are grouped as the plan groups them (a bucket closes once it holds
    ``bucket_bytes`` of this rank's gradients) and each bucket's all-reduce starts when its last
    gradient is ready."""
    overlap = cm.overlap and train
    tc = tm = 0.0
    exposed: dict = {}
    total: dict = {}
    counts: dict = {}
    volume: dict = {}
    queue: list = []  # overlappable collectives in flight on the comm stream: (start, end, key)
    sent: dict = {}  # (kind, input bytes, axes) -> bytes sent: the repeated blocks repeat them

    def account(key, kind, nbytes, secs):
        total[key] = total.get(key, 0.0) + secs
        ck = key + (kind,)
        counts[ck] = counts.get(ck, 0) + 1
        sk = (kind, nbytes, key[0])
        if sk not in sent:
            sent[sk] = _sent_bytes(kind, nbytes, key[0], mesh)
        volume[ck] = volume.get(ck, 0.0) + sent[sk]

    def wait_until(t_end, own=None):
        """The compute stream idles from tc to t_end: the idle time is charged to whatever the
        comm stream runs meanwhile (queued gradient syncs first, then ``own``)."""
        nonlocal tc
        if t_end <= tc:
            return
        lo = tc
        for s_, e_, key in queue:
            a, b = max(lo, s_), min(t_end, e_)
            if b > a:
                exposed[key] = exposed.get(key, 0.0) + (b - a)
        if own is not None:
            s_, e_, key = own
            a, b = max(lo, s_), min(t_end, e_)
            if b > a:
                exposed[key] = exposed.get(key, 0.0) + (b - a)
        tc = t_end

    def blocking(secs, key):
        # wait_until(end, (start, end, key)) written out: the timeline's most frequent step
        nonlocal tm, tc
        start = max(tc, tm)
        end = start + secs
        if end > tc:
            lo = tc
            for s_, e_, k in queue:
                a, b = max(lo, s_), min(end, e_)
                if b > a:
                    exposed[k] = exposed.get(k, 0.0) + (b - a)
            a = max(lo, start)
            if end > a:
                exposed[key] = exposed.get(key, 0.0) + (end - a)
            tc = end
        tm = end
        queue.clear()

    def background(secs, key):
        nonlocal tm
        if not overlap:
            return blocking(secs, key)
        start = max(tc, tm)
        tm = start + secs
        queue.append((start, tm, key))

    def prefetched(secs, key, issued):
        """A gather started at ``issued`` (when the previous unit's gather finished): compute
        waits only for what is left of it."""
        nonlocal tm
        if not overlap:
            return blocking(secs, key)
        start = max(issued, tm)
        end = start + secs
        wait_until(end, (start, end, key))
        tm = end

    compute = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    issued = 0.0  # when the next ZeRO-3 unit's gather is started (prefetch)
    unit_axes = None  # the axes of the last unit gathered
    for seg in segments:
        for it in seg.items:
            if isinstance(it, tuple):
                tc += it[0]
                compute["forward"] += it[0]
            elif isinstance(it, Comm) and it.fwd_kind is not None:
                key = (_axes_label(it.axes), "forward")
                account(key, it.fwd_kind, it.fwd_bytes, it.fwd_s)
                if it.prefetched:
                    prefetched(it.fwd_s, key, issued)
                else:
                    blocking(it.fwd_s, key)
                    if it.axes == unit_axes:
                        # the next unit's gather is started after the plain collectives before it
                        issued = max(issued, tm)
                if it.copy_fwd_s:
                    issued, unit_axes = tc, it.axes
                    tc += it.copy_fwd_s
                    compute["forward"] += it.copy_fwd_s
    if train:
        # gradient buckets, in the order backward makes their gradients ready
        readies = [it for seg in reversed(segments) for it in reversed(seg.items) if isinstance(it, Ready)]
        launches: dict = {}
        if readies and bucket_axis is not None:
            groups = assign_buckets([(k, r.local_bytes) for k, r in enumerate(readies)], bucket_bytes)
            for g in groups:
                launches[g[-1]] = sum(readies[k].local_bytes for k in g)
        n_ready = 0
        bkey = (bucket_axis, "backward")
        first_regather = True  # backward prefetches every unit's second gather but the first
        for seg in reversed(segments):
            for it in reversed(seg.items):
                if isinstance(it, tuple):
                    tc += it[1]
                    compute["backward"] += it[1]
                    continue
                if isinstance(it, Ready):
                    if n_ready in launches:
                        nbytes = launches[n_ready]
                        secs = collective_seconds(cm, mesh, "all_reduce", (bucket_axis,), nbytes)
                        account(bkey, "all_reduce", nbytes, secs)
                        background(secs, bkey)
                    n_ready += 1
                    continue
                key = (_axes_label(it.axes), "backward")
                if it.regather_s:
                    account(key, it.fwd_kind, it.regather_bytes, it.regather_s)
                    if it.copy_bwd_s and first_regather is False:
                        prefetched(it.regather_s, key, issued)
                    else:
                        blocking(it.regather_s, key)
                    first_regather = False
                    issued = tc
                    tc += it.copy_fwd_s
                    compute["backward"] += it.copy_fwd_s
                if it.copy_bwd_s:
                    tc += it.copy_bwd_s
                    compute["backward"] += it.copy_bwd_s
                if it.bwd_kind is None:
                    continue
                account(key, it.bwd_kind, it.bwd_bytes, it.bwd_s)
                if it.bwd_overlap:
                    background(it.bwd_s, key)
                else:
                    blocking(it.bwd_s, key)
        wait_until(tm)  # backward ends when every gradient sync has arrived
        queue.clear()
        tm = max(tm, tc)
        # optimizer: one pass over this rank's optimizer slice, then the ZeRO gathers
        dev = cm.hardware.device
        t_opt = (opt_elems * opt_elem_bytes) / (dev.mem_bandwidth * dev.mem_efficiency) + n_opt_tensors * dev.op_overhead
        tc += t_opt
        compute["optimizer"] += t_opt
        tm = tc
        for kind, axes, nbytes in opt_colls:
            key = (_axes_label(axes), "optimizer")
            secs = collective_seconds(cm, mesh, kind, axes, nbytes)
            account(key, kind, nbytes, secs)
            blocking(secs, key)
    # memory
    comms = [it for s in segments for it in s.items if isinstance(it, Comm)]
    saved = sum(s.saved_bytes for s in segments) if train else 0
    max_act = max([s.max_act_bytes for s in segments] + [0])
    buf = max([it.buffer_bytes for it in comms] + [0])
    gathered = [sum(it.gathered_param_bytes for it in s.items if isinstance(it, Comm)) for s in segments]
    # ZeRO-3: parameters released after forward are held one block at a time (plus the next,
    # prefetched); kept ones stay gathered until backward has used them.
    temp = (max(gathered + [0]) * (2 if len(gathered) > 1 else 1)) if reshard else sum(gathered)
    persistent = state["total"] if train else state["params"] + state.get("buffers", 0.0)
    acts = saved if train else 2 * max_act
    peak = persistent + acts + temp + buf
    memory = {"params": state["params"], "buffers": state.get("buffers", 0.0), "grads": state["grads"] if train else 0.0,
              "optimizer": state["optimizer"] if train else 0.0, "persistent": persistent,
              "activations": float(acts), "gathered_params": float(temp), "comm_buffers": float(buf),
              "peak": float(peak)}
    return PlanCost(step_time=tc, compute=sum(compute.values()), compute_by_phase=compute, exposed=exposed,
                    comm_total=total, memory=memory, train=train, zero_stage=zero_stage, counts=counts,
                    volume=volume)


def _axes_label(axes) -> str:
    return axes[0] if len(axes) == 1 else ",".join(axes)


def _sent_bytes(kind, input_bytes, axis_label, mesh) -> float:
    ranks = math.prod(mesh.axes[a] for a in axis_label.split(","))
    return collective_bytes(kind, payload_bytes(kind, input_bytes, ranks), ranks)


def optimizer_phase(inputs, vals, input_places, mesh, cm: CostModel, *, zero_stage: int, data_axes=(),
                    storage=None, use_places=None, counts=None, memo: Optional[dict] = None) -> tuple:
    """(elements stepped, bytes moved per element, parameter tensors, collectives) of the
    optimizer step on this rank: Adam reads the gradient and reads and writes the parameter and
    its state; the collectives, (kind, axes, input bytes) each, are the optimizer phase's
    all-gathers (ZeRO-1 gathers each parameter's updated slice, ZeRO-2 refreshes the full copy
    from the updated shard). Arguments as :func:`state_memory`'s (``memo``: each parameter's
    share by its placements, kept across calls with the same inputs, values, mesh and cost
    model)."""
    storage = storage or {}
    use_places = use_places or {}
    zero1_axis = data_axes[0] if zero_stage == 1 and data_axes else None
    elems = nbytes = 0.0
    n = 0
    colls = []
    for inp, v, es, place, use, cnt in _state_inputs(inputs, vals, input_places, use_places, counts):
        st = storage.get(inp.name)
        full_axis = st.axis if st is not None and st.mode == "persistent" else None
        key = (inp.name, place, use if zero1_axis is not None else None, zero1_axis, full_axis, cnt)
        terms = memo.get(key) if memo is not None else None
        if terms is None:
            terms = _optimizer_terms(v, es, place, use, cnt, mesh, cm, zero1_axis, full_axis)
            if memo is not None:
                memo[key] = terms
        elems += terms[0]
        nbytes += terms[1]
        n += cnt
        colls += terms[2]
    return elems, (nbytes / elems if elems else 0.0), n, colls


def _optimizer_terms(v, es, place, use, cnt, mesh, cm, zero1_axis, full_axis) -> tuple:
    """One parameter's share of :func:`optimizer_phase`: (elements, bytes, collectives)."""
    k = _local_numel(v.shape, place, mesh)
    colls = []
    if zero1_axis is not None:
        if slice_dim_for(use, v.shape, mesh, zero1_axis) is not None:
            whole = _local_numel(v.shape, use, mesh)
            k = whole // mesh.axes[zero1_axis]
            colls = [("all_gather", (zero1_axis,), es * whole // mesh.axes[zero1_axis])] * cnt
    elif full_axis is not None:
        colls = [("all_gather", (full_axis,), es * k)] * cnt
    return cnt * k, cnt * k * (3 * es + 2 * cm.opt_bytes(es)), colls


def program_cost(program, inputs, vals, mesh, cm: CostModel, *, train: bool, zero_stage: int = 0,
                 data_axes=(), bucket_bytes: int = 0, segments=None) -> PlanCost:
    """The cost of a rewritten program (``autoshard.passes.spmd.Program``). ``inputs``:
    captured inputs in placeholder order; ``vals``: placeholder name -> global meta tensor;
    ``bucket_bytes``: the plan's gradient bucket size (its ``bucket_mb`` in bytes).
    ``segments`` (from :func:`program_events`, possibly expanded from repeated blocks) may be
    given to skip the walk over the graph."""
    param_names = {i.name for i in inputs if i.kind == "parameter" and i.trainable}
    if segments is None:
        segments = program_events(program, mesh, cm, param_names, vals)
    storage = program.storage
    use_places = program.use_placements
    kw = dict(zero_stage=zero_stage, data_axes=list(data_axes), storage=storage, use_places=use_places)
    state = state_memory(inputs, vals, program.input_placements, mesh, cm, train=train, **kw)
    elems, per, n, opt = (optimizer_phase(inputs, vals, program.input_placements, mesh, cm, **kw) if train
                          else (0, 0, 0, []))
    reshard = bool(program.reshard_tags)
    bucketed = bool(program.bucketed)
    cost = simulate(segments, mesh, cm, train=train, state=state, opt_colls=opt, opt_elems=elems, opt_elem_bytes=per,
                    n_opt_tensors=n, zero_stage=zero_stage, reshard=reshard,
                    bucket_axis=data_axes[0] if bucketed and data_axes else None, bucket_bytes=bucket_bytes)
    cost.activations_by_module = activations_by_module(segments)
    return cost


def formula_for(kind: str, input_bytes: float, ranks: int) -> str:
    """``'2*V*(R - 1)/R with V=..., R=...'`` for printing."""
    V = payload_bytes(kind, input_bytes, ranks)
    expr = collective_formula(kind)
    val = float(expr.subs({V_SYM: V, R_SYM: ranks}))
    return f"{expr} = {val:,.0f} B (V={V:,.0f} B, R={ranks})"
