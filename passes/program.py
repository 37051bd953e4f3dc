"""The per-rank program of a resolved layout: data axes, ZeRO storage, the SPMD rewrite, and the
collectives of state sharding and gradient buckets that the forward program does not show.

Used by ``autoshard.autoshard`` for the chosen layout and by the layout search for every
candidate it evaluates, so both cost exactly the same program.

Example::

    >>> from autoshard.passes.program import build_program                       # doctest: +SKIP
    >>> program, data_axes = build_program(graph, inputs, info, resolved, mesh, train=True,
    ...     zero_stage=3, reshard=True, bucket_mb=25, display={})                  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from autoshard.ownership import ParamStorage, Shard, data_axes, local_shape, slice_dim_for
from autoshard.runtime.primitives.buckets import assign_buckets

from autoshard.passes import context_parallel as cp
from . import vocab_parallel as vp
from .manager import PassContext, run_program_passes
from .experts import find_expert_regions, lowerings, owned_placements, regional_layout, stacked_placements
from .collective import Collective
from .spmd import LayoutError, _memo_value, input_placements, lazy_programs, rewrite
from autoshard.passes.zero_units import group_units


def choose_storage(param_nodes: dict, use_placements: dict, mesh, axis: str, stage: int,
                   reshard: bool, keep=(), memo: Optional[dict] = None) -> dict:
    """{placeholder name: ParamStorage} for stage 2 and 3: each parameter is split on ``axis``
    along its first dim that no other axis splits and that ``axis`` divides evenly. A parameter
    with no such dim, or in ``keep`` (one expert of a ModuleList placed on its owner), stays
    whole (listed in the plan). ``memo``: each parameter's storage by its use placement, kept
    across calls with the same parameters and mesh (the layout search's)."""
    out = {}
    if stage < 2:
        return out
    for name, val in param_nodes.items():
        if name in keep:
            continue
        use = use_placements[name]
        key = (name, use, axis, stage, reshard)
        st = memo.get(key, False) if memo is not None else False
        if st is False:
            st = _storage(val.shape, use, mesh, axis, stage, reshard)
            if memo is not None:
                memo[key] = st
        if st is not None:
            out[name] = st
    return out


def _storage(shape, use, mesh, axis, stage, reshard) -> Optional[ParamStorage]:
    for d, size in enumerate(shape):
        taken = any(isinstance(o, Shard) and o.dim == d for o in use)
        if not taken and size % mesh.axes[axis] == 0:
            place = tuple(Shard(d) if a == axis else o for o, a in zip(use, mesh.names))
            return ParamStorage(place, axis, d, stage, "persistent" if stage == 2 else "gather",
                                reshard=(stage == 3 and reshard))
    return None


@dataclass
class Lowered:
    """What a rewrite of a layout takes besides it (:func:`lowered`): the layout with the MoE
    regions' experts units regional, the lowerings of the nodes other passes write (vocab-parallel
    cross-entropy, MoE layers, context-parallel attention), the inputs those passes place, and
    what the lowerings fill in as the rewrite runs."""

    layout: object
    regions: dict  # node -> visitor (spmd.rewrite's ``regions``)
    fixed: dict  # placeholder name -> placement another pass decides (spmd.rewrite's ``fixed``)
    owned: dict  # looped experts' parameters: placed on the index owning them (ZeRO keeps them whole)
    moe: list  # one RegionPlan per MoE layer, filled by the rewrite
    ctx: object  # the context-parallel plan

    @property
    def fixed_local(self) -> bool:
        """Whether the fixed placements are the layout's where the inputs are read (stacked
        experts' parameters, split on their own experts dim): ``spmd.rewrite(fixed_local=)``. Not
        where a context-parallel plan fixed some, or looped experts are owned by index (a dim
        their parameters do not have)."""
        return not self.ctx and not self.owned


def lowered(graph, info, resolved, mesh, context=None) -> Lowered:
    """The lowerings and input placements of other passes for a rewrite of ``resolved`` on
    ``mesh``, as :func:`build_program` makes them (the layout search's one-axis programs too, so
    that their collectives are the plan's). ``context``: the context-parallel options (None:
    attention over a split sequence is gathered).

    Example::

        low = lowered(graph, info, resolve_layout(info, layout, mesh), mesh)
        program = rewrite(graph, info, low.layout, mesh, grad_inputs, regions=low.regions, fixed=low.fixed)
    """
    regions = find_expert_regions(graph, info)
    # Context-parallel attention when the caller asks for it (autoshard() and the layout search
    # always do, cost.context.ContextSearch; context=None keeps SDPA over a split sequence gathered).
    ctx = cp.plan_context(graph, info, resolved, mesh, context) if context is not None else cp.ContextPlan()
    laid_out = input_placements(graph, info, resolved, mesh) if regions or ctx else {}
    owned = owned_placements(regions, laid_out, resolved, mesh)
    regional = regional_layout(regions, resolved, mesh)
    # experts dims split only in the MoE regions' parameters (the router's stay whole): their
    # placements as the layout gives them, fixed before the experts units become regional
    stacked = stacked_placements(regions, laid_out) if regional is not resolved else {}
    resolved = regional
    if ctx:
        owned = {**owned, **cp.fixed_inputs(ctx, graph, input_placements(graph, info, resolved, mesh,
                                                                         {**owned, **stacked}), info, resolved, mesh)}
    moe: list = []
    vocab = _memo_value(graph, info, "vocab_lowerings", lambda g, _: vp.lowerings(g))
    return Lowered(resolved, {**vocab, **lowerings(regions, moe), **cp.lowerings(ctx)}, {**owned, **stacked}, owned,
                   moe, ctx)


def build_program(graph, inputs, info, resolved, mesh, *, train: bool, zero_stage: int, reshard: bool,
                  bucket_mb: float, display: dict, units="block", context=None, program_passes: bool = False,
                  disable_passes=()):
    """The per-rank program of a resolved layout with a state-sharding level: the data axes
    (axes that split an input), ZeRO storage, the SPMD rewrite, and the collectives of state
    sharding and gradient buckets that the forward program does not show; ZeRO-3 gathers are
    grouped by the unit policy ``units`` (:mod:`autoshard.passes.zero_units`); attention over a split
    sequence becomes ring / all-gather attention (:mod:`autoshard.passes.context_parallel`, options
    ``context``); a cross-entropy over logits split by class on one axis is computed there
    (:mod:`autoshard.passes.vocab_parallel`). ``program_passes``: run the passes of
    :mod:`autoshard.passes.manager` on the rewritten program (forward sums started early, lazy
    outputs, overlapped and late gradient sums, sums into their inputs), except those named in
    ``disable_passes``; not for pipeline stages, which the program is cut into by its order
    (``program.passes`` records what each pass did). Returns
    ``(program, data_axes)``; used by ``autoshard.autoshard`` and by the layout search alike."""
    grad_inputs = {i.name for i in inputs if i.kind == "parameter" and i.trainable}
    low = lowered(graph, info, resolved, mesh, context)
    resolved, fixed, owned = low.layout, low.fixed, low.owned
    places = input_placements(graph, info, resolved, mesh, fixed)
    axes = data_axes([(places[i.name], mesh.names) for i in inputs if i.kind == "user" and i.name in places])
    if zero_stage and not axes:
        raise LayoutError(f"zero_stage={zero_stage} shards training state over the data-parallel axis, but no mesh "
                          f"axis splits an input: put the batch dim on a mesh axis in layout (e.g. {{'batch': 'dp'}})")
    params = {n.name: n.meta["val"] for n in graph.nodes if n.op == "placeholder" and n.name in grad_inputs}
    storage = choose_storage(params, places, mesh, axes[0], zero_stage, reshard, owned) if zero_stage else {}
    bucket_axis = axes[0] if (train and zero_stage < 2 and axes and bucket_mb) else None
    # the program passes edit the rewritten graph: rewrite lazily then, so the Python code is
    # generated once, for the final graph (on first use, or when a Plan is made), not twice.
    with lazy_programs() if program_passes else contextlib.nullcontext():
        program = rewrite(graph, info, resolved, mesh, grad_inputs, display, storage, bucket_axis=bucket_axis,
                          bucket_candidates=[n for n in params if n not in storage] if bucket_axis else (),
                          regions=low.regions, fixed=fixed,
                          region_axis=axes[0] if (train and storage and not bucket_axis) else None,
                          user_inputs={i.name for i in inputs if i.kind == "user"}, data_axes=axes)
    program.experts = low.moe
    program.context = low.ctx
    if zero_stage == 3:
        program.units = group_units(program, units, mesh, display)
    program.collectives += state_collectives(program, zero_stage, axes, mesh, params, display)
    program.collectives += bucket_collectives(program, bucket_axis, params, display,
                                              int(bucket_mb * 2 ** 20) if bucket_axis else 0, mesh)
    program.passes = run_program_passes(program, PassContext(frozenset(grad_inputs), train), disable_passes,
                                        "" if program_passes else "off for pipeline stages and search candidates")
    return program, axes


def state_collectives(program, stage: int, axes: list, mesh, shapes: dict, display: dict) -> list:
    """Collectives of state sharding that the forward program does not show: the second gather
    of a resharded parameter (backward) and the optimizer-phase gathers of ZeRO-1/2."""
    out = []
    for c in program.collectives:
        if c.tag in program.reshard_tags and c.phase == "forward":
            out.append(Collective("all_gather", c.axes, c.bytes, "backward", c.where,
                                  c.why.split(";")[0] + "; gathered again when backward reads it", c.node,
                                  c.line, c.tag, c.op, c.params))
    if stage in (1, 2) and axes:
        axis = axes[0]
        for name, val in shapes.items():
            use = program.use_placements[name]
            d = slice_dim_for(use, val.shape, mesh, axis)
            if d is None:
                continue
            n = torch.Size(local_shape(val.shape, use, mesh)).numel() // mesh.axes[axis] * val.element_size()
            out.append(Collective("all_gather", (axis,), n, "optimizer", display.get(name, name).rsplit(".", 1)[0],
                                  f"ZeRO-{stage}: each rank updated its slice of {display.get(name, name)}; "
                                  f"the updated slices are gathered into the whole parameter", name))
    return out


def bucket_collectives(program, axis, shapes: dict, display: dict, bucket_bytes: int, mesh) -> list:
    """One backward all-reduce per gradient bucket (tags after the program's own)."""
    if not program.bucketed:
        return []
    # This rank's pieces are what a bucket all-reduces.
    sizes = [(n, torch.Size(local_shape(shapes[n].shape, program.use_placements[n], mesh)).numel()
              * shapes[n].element_size()) for n in program.bucketed]
    first_tag = 1 + max((c.tag for c in program.collectives), default=-1)
    program.buckets = [(first_tag + k, names) for k, names in enumerate(assign_buckets(sizes, bucket_bytes))]
    out = []
    for tag, names in program.buckets:
        size = sum(dict(sizes)[n] for n in names)
        params = [display.get(n, n) for n in names]
        out.append(Collective("all_reduce", (axis,), size, "backward", params[0].rsplit(".", 1)[0],
                              f"gradient bucket of {len(names)} replicated parameters used by per-rank work on "
                              f"{axis} ({', '.join(params[:3])}{', ...' if len(params) > 3 else ''}): backward sums "
                              f"them, started once the bucket is ready so it overlaps the rest of backward",
                              ",".join(names), "", tag, "grad_bucket"))
    return out
