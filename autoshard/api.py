"""The public entry point: ``autoshard.autoshard(model, args, mesh=..., dims=..., layout=...)``.

One function calling small steps in data-flow order: check -> capture -> name -> search ->
build -> finish (``_check`` ... ``_finish`` below, each one call). Its options are the typed
objects of :mod:`autoshard.options` or the keywords of the same names. The result is a
:class:`~autoshard.plan.Plan`.

Example::

    >>> import torch, autoshard
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(),
    ...                           torch.nn.Linear(16, 8, bias=False))
    >>> plan = autoshard.autoshard(mlp, (torch.randn(4, 8),), mesh=autoshard.Mesh({"tp": 2}),
    ...                            dims={"input": "batch hidden", "0.weight": "ffn hidden",
    ...                                  "2.weight": "hidden ffn"},
    ...                            layout={"ffn": "tp"})
    >>> [c.kind for c in plan.collectives if c.phase == "forward"]
    ['all_reduce']
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import gc
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence, Union

import torch
from torch.utils import _pytree as pytree

from .arguments import check_dims, check_layout, check_zero_stage
from .mesh import AutoMesh, Mesh
from .options import (ContextOptions, ExpertOptions, Options, PipelineOptions, PrecisionOptions, RecomputeOptions,
                      SearchOptions, collect, parse_bytes)
from .pipeline_plan import (PipelinePlan, auto_pipeline_axis, default_microbatches, finish_pipeline,
                            first_microbatch, pipeline_options, recompute_stages)
from .block_check import add_block_check
from .plan import EXPORT_HOOKS, Plan
from autoshard.passes.capture import capture
from autoshard.passes.guards import UnsupportedModelError
from autoshard.passes.recompute import block_name, block_regions
from autoshard.passes.recompute import check_policy as check_recompute_policy
from autoshard.passes.dims import infer_dims
from autoshard.passes.experts import find_expert_regions
from autoshard.passes.pipeline import tag_origins
from autoshard.passes.param_names import name_parameter_dims
from autoshard.passes.spmd import LayoutError, lazy_programs, resolve_layout
from autoshard.cost.model import CostModel, program_cost, resolve_cost_model
from autoshard.cost.context_parallel import choose_variant
from autoshard.cost.recompute import checkpointed_program_cost
from autoshard.cost.zero_units import choose_units
from autoshard.cost.idle import IdleAxisWarning, idle_axes
from autoshard.cost.search import plan_search
from autoshard.cost.pipeline_search import choose_pipeline
from autoshard.passes.manager import check_disabled
from autoshard.passes.program import build_program
from autoshard.passes.zero_units import check_policy


def autoshard(model: torch.nn.Module, args, kwargs=None, *, mesh, dims=None, layout=None,
              options: Union[None, object, Sequence] = (), train: bool = False,
              zero_stage: Optional[int] = None, reshard_after_forward: Optional[bool] = None,
              memory_limit=None, bucket_mb: float = 25.0, units=None, hardware=None,
              search: Optional[bool] = None, pipeline: Union[dict, PipelineOptions, None] = None,
              moe: Union[dict, ExpertOptions, None] = None, verbose: bool = False, captured=None,
              precision: Union[dict, PrecisionOptions, None] = None, checkpoint: Union[bool, str, None] = None,
              context: Union[dict, ContextOptions, None] = None, strict: bool = False, disable_passes=()) -> Plan:
    """Plan ``model(*args, **kwargs)`` on ``mesh``: name every dim, place every value, insert
    the collectives. ``layout`` maps dim names (or globs over inferred names) to mesh axes;
    dims it leaves out stay whole (replicated).

    Every other keyword is a field of an option object of :mod:`autoshard.options`
    (``TrainingOptions``, ``SearchOptions``, ``RewriteOptions``, ``PipelineOptions``,
    ``PrecisionOptions``, ``RecomputeOptions``, ``ContextOptions``, ``ExpertOptions``): give
    either the keyword or the object in ``options=`` (one object or a sequence); the two at once
    must agree (``ValueError`` otherwise). ``autoshard plan --help`` lists the same options as
    flags. These two plans are the same::

        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, train=True,
                            zero_stage=3, hardware="h100", precision={"param": torch.bfloat16})
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"},
                            options=[TrainingOptions(train=True, zero_stage=3), SearchOptions(hardware="h100"),
                                     PrecisionOptions(param=torch.bfloat16)])

    With ``train=True``, data-parallel gradients of replicated parameters are all-reduced in
    buckets of ``bucket_mb`` MiB (0: one all-reduce per parameter, inside backward), launched as
    they fill so they overlap the rest of backward. ZeRO-3 parameters are gathered and their
    gradients reduce-scattered per *unit*, one flat buffer each, the next unit's gather
    prefetched: ``units`` is ``"block"`` (one per repeated block), ``"model"``, ``"param"`` (one
    per parameter) or a list of module prefixes / globs; None: chosen by cost when the search
    runs, else ``"block"`` (``"param"`` when ``bucket_mb=0``).

    The layout search (``autoshard.cost.search``) runs when ``layout`` is None or only forbids
    sharding (``{"batch": None}``), when ``mesh`` is ``Mesh.auto(n, axes)`` (every mesh shape
    is tried), when ``memory_limit`` is given (bytes per device, or ``"80GB"``), or with
    ``search=True`` (then ``layout`` entries are constraints and every other dim is open;
    ``search=False`` never searches). It also picks ``zero_stage`` (and
    ``reshard_after_forward``) for training when they are None. ``hardware``: a
    ``cost.Hardware``, ``CostModel``, preset name (``"h100"``, ``"cpu-gloo"``) or calibrated JSON
    file; default ``$AUTOSHARD_HARDWARE`` or ``"cpu-gloo"``. ``precision={"param": torch.bfloat16,
    "reduce": torch.float32}``: mixed precision (parameters, activations and gathers in
    ``param``; gradient sums in ``reduce``; 16-bit parameters are stepped through fp32 master
    copies of each rank's slices by ``plan.optimizer``). ``captured``: the ``plan.captured``
    of an earlier plan of the same model and inputs, to plan again (another mesh, layout or
    dims) without running torch.export again::

        dp = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"})
        tp = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, layout={"heads": "tp"},
                                 captured=dp.captured)

    ``pipeline``: ``{"axis": "pp", "microbatches": 8, "schedule": "1f1b", "virtual": 1, "cuts":
    ["layers.4"]}`` splits the layer sequence over that mesh axis (a mesh axis named ``pp``
    implies it); keys left out are chosen by the planner. ``args`` is then one step's whole
    batch, split along dim 0 into the microbatches (a ``captured`` graph must then be of one
    microbatch). See :mod:`autoshard.pipeline_plan`.

    Mixture-of-Experts layers are recognised (``passes.experts``): their experts dim is named
    ``experts`` and ``layout={"experts": "ep"}`` places experts on ``ep`` with dispatch and
    combine all-to-alls. ``moe={"capacity_factor": 1.25}`` caps the rows per expert (the drop
    policy of ``autoshard.runtime.primitives.experts``); the default is dropless.

    Context parallelism: a layout that splits attention's query sequence (``{"seq": "cp"}``)
    runs it as ring attention or all-gather-KV attention, chosen by cost
    (``autoshard.passes.context_parallel``); ``context={"order": "zigzag" | "contiguous", "variant":
    "ring" | "allgather"}`` fixes the sequence order (zigzag by default for causal or masked
    attention) or the variant.

    ``checkpoint`` (training): recompute each repeated block's activations in backward instead
    of keeping them (activation checkpointing; ``plan.checkpoint`` lists the blocks,
    ``plan.checkpoint_policy`` says how). True or ``"block"``: whole blocks; ``"selective"``:
    keep matmul and attention outputs, recompute pointwise ops and norms
    (``autoshard.passes.recompute``); False: never; None lets the search turn it on when the
    plan fits ``memory_limit`` only with it, by the faster policy that fits (``autoshard.cost.recompute``).

    ``disable_passes``: names of program passes (``autoshard.passes.manager.PROGRAM_PASSES``:
    ``"early_sums"``, ``"overlap_linear"``, ...) not to run on the rewritten program;
    ``plan.passes`` records what each pass did.

    ``strict=True``: refuse (``LayoutError``) a plan that gathers in forward a value the layout
    shards (an op without a rule, or one that needs the dim whole; ``plan.unsharded`` lists them,
    ``print(plan)`` shows them in any case).

    The steps, in order: check the arguments, capture the program, name its dims, search the
    layout, build the per-rank program, finish the plan (one function each, below)."""
    opts = collect(options, dict(
        train=train, zero_stage=zero_stage, reshard_after_forward=reshard_after_forward, bucket_mb=bucket_mb,
        units=units, search=search, hardware=hardware, memory_limit=memory_limit, strict=strict,
        disable_passes=disable_passes, checkpoint=checkpoint, pipeline=pipeline, precision=precision,
        context=context, moe=moe))
    return _plan(model, args, kwargs, mesh, dims, layout, opts, captured=captured, verbose=verbose)


@dataclass
class _Request:
    """What one ``autoshard()`` call asks for, checked (the output of :func:`_check`)."""

    model: torch.nn.Module  # in the parameter dtype of mixed precision
    args: tuple
    kwargs: Optional[dict]
    mesh: Union[Mesh, AutoMesh]
    meshes: Optional[list]  # every mesh shape of a Mesh.auto; None for a fixed mesh
    dims: object
    layout: Optional[dict]
    options: Options
    memory_limit: Optional[float]  # bytes
    searching: bool
    pipe: Optional[PipelineOptions]  # the pipeline of a fixed mesh, its axis resolved
    auto_pp: Optional[str]  # the pipeline axis of a Mesh.auto whose degree is searched
    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    cost_model: CostModel
    verbose: bool
    decision: object = None  # the PipelineDecision a Mesh.auto call made, for the plan it chose
    timings: dict = field(default_factory=dict)

    @property
    def train(self) -> bool:
        return self.options.training.train


@dataclass
class _Found:
    """The layout and state sharding to build (given, or what the search chose)."""

    layout: Optional[dict]
    mesh: Mesh
    zero_stage: int
    reshard_after_forward: Optional[bool]
    checkpoint: Union[bool, str]  # False, or the recompute policy ("block", "selective")
    result: object = None  # cost.search.SearchResult when the search ran
    decision: object = None  # cost.pipeline_search.PipelineDecision of a Mesh.auto with a pipeline axis
    pipelined: Optional[Plan] = None  # that decision's pipelined plan (planned on its own mesh)


@dataclass
class _Built:
    resolved: object  # passes.spmd.Layout
    program: object  # passes.spmd.Program
    data_axes: list
    units: object  # the unit policy built with


def _plan(model, args, kwargs, mesh, dims, layout, opts: Options, *, captured=None, verbose=False,
          decision=None) -> Plan:
    """:func:`autoshard` with its options gathered: check -> capture -> name -> search -> build -> finish."""
    req = _check(model, args, kwargs, mesh, dims, layout, opts, captured, verbose, decision)
    cap = _capture(req, captured)
    # Everything from here on plans a program captured above: its graphs, values and fake tensors
    # live until the plan is returned, so the cyclic collector need not traverse them again
    with _heap_frozen():
        info = _name(req, cap)
        found = _search(req, cap, info)
        if found.pipelined is not None:  # Mesh.auto chose a pipeline: planned on its own mesh
            return found.pipelined
        built = _build(req, cap, info, found)
        return _finish(req, cap, info, found, built)


def _check(model, args, kwargs, mesh, dims, layout, opts: Options, captured, verbose, decision) -> _Request:
    """Every argument checked before anything is captured; the mesh, pipeline, search and
    precision decided from them."""
    _check_training(opts)
    check_layout(layout)
    check_dims(dims)
    memory_limit = parse_bytes(opts.search.memory_limit)
    checkpoint, pipeline = opts.recompute.checkpoint, opts.pipeline
    meshes = mesh.meshes() if isinstance(mesh, AutoMesh) else None
    if meshes is None:
        mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    searching = _wants_search(layout, opts.search.search, meshes, memory_limit)
    pipe = pipeline_options(pipeline, mesh)
    # Mesh.auto with a pipeline axis: the pipeline degree is searched too (cost/pipeline_search.py)
    auto_pp = auto_pipeline_axis(mesh, pipeline) if meshes is not None else None
    if auto_pp is not None:
        pipe = None  # the degree is searched first; a chosen pipeline is planned on its own mesh
    elif meshes is not None and pipeline is not None:
        raise ValueError(f"pipeline= with {mesh}: name the pipeline axis among its axes, e.g. "
                         f"Mesh.auto(n, ('pp', 'dp', 'tp'))")
    if pipe is not None and meshes is None and len(mesh.axes) == 1:
        searching = False  # the pipeline axis is the whole mesh: nothing else to lay out
    param_dtype, reduce_dtype = check_precision(opts.precision)
    if captured is None and param_dtype is not None:
        # the program is captured in the parameter dtype: every value, gather and byte count in it
        model, args, kwargs = cast_for_precision(model, args, kwargs, param_dtype)
    return _Request(model, tuple(args), kwargs, mesh, meshes, dims, layout, opts, memory_limit, searching, pipe,
                    auto_pp, param_dtype, reduce_dtype, resolve_cost_model(opts.search.hardware), verbose, decision)


def _check_training(opts: Options) -> None:
    """The training options agree with each other (ZeRO and recompute need ``train=True``)."""
    tr, checkpoint = opts.training, opts.recompute.checkpoint
    check_zero_stage(tr.zero_stage)
    check_disabled(opts.rewrite.disable_passes)
    if (tr.zero_stage or tr.reshard_after_forward is not None) and not tr.train:
        raise ValueError("zero_stage and reshard_after_forward shard training state: pass train=True")
    if tr.reshard_after_forward is not None and tr.zero_stage != 3:
        raise ValueError("reshard_after_forward applies to zero_stage=3 (parameters gathered for use)")
    if tr.units is not None:
        check_policy(tr.units)
    if checkpoint not in (None, False):
        check_recompute_policy(checkpoint)  # True, "block" or "selective"
    if checkpoint and not tr.train:
        raise ValueError("checkpoint=True recomputes activations in backward: pass train=True")


def _capture(req: _Request, captured):
    """The captured program (``passes.capture``): of the whole batch, or of a pipeline's first
    microbatch; ``captured`` (an earlier plan's) is used as it is."""
    t0 = time.perf_counter()
    c0 = time.process_time()  # CPU seconds too: on a shared machine wall time includes others' work
    pipe = req.pipe
    if pipe is not None:
        pp = req.mesh.axes[pipe.axis] * (pipe.virtual or 1)
        req.pipe = pipe = replace(pipe, microbatches=pipe.microbatches or default_microbatches(req.args, req.kwargs, pp))
        cap = captured if captured is not None else capture(req.model, *first_microbatch(req.args, req.kwargs,
                                                                                         pipe.microbatches))
        tag_origins(cap.graph)  # so stage boundaries can name the captured values they carry
    else:
        cap = captured if captured is not None else capture(req.model, req.args, req.kwargs)
    _refuse_stateful(cap, pipe is not None, req.options.recompute.checkpoint)
    req.timings["capture"] = time.perf_counter() - t0
    req.timings["capture_cpu"] = time.process_time() - c0
    if req.train:
        cap.require_scalar_loss("train=True")  # as loss.backward(): no silent training on its sum
    _progress(req.verbose, f"captured {len(cap.graph.nodes)} nodes in {req.timings['capture']:.2f}s")
    return cap


def _name(req: _Request, cap):
    """Every dim of the program named: inferred (``passes.dims``), then the user's ``dims``,
    the experts of MoE layers, and (for the search) readable names of parameter dims."""
    t = time.perf_counter()
    info = infer_dims(cap.graph, {i.name: i.target for i in cap.inputs})
    apply_dim_names(info, cap, req.dims)
    find_expert_regions(cap.graph, info, **_moe_options(req.options.experts))
    if req.searching:
        # dims of parameters nobody named get readable names, so the search can shard them
        name_parameter_dims(info, cap.graph, cap.inputs)
    req.timings["dims"] = time.perf_counter() - t
    _progress(req.verbose, f"named dims in {req.timings['dims']:.2f}s")
    return info


def _search(req: _Request, cap, info) -> _Found:
    """The layout, mesh shape and state sharding: the given ones, or what the cost model
    prefers (``autoshard.cost``). For a ``Mesh.auto`` with a pipeline axis that chose a
    pipeline, the pipelined plan itself (``_Found.pipelined``)."""
    tr, pipe = req.options.training, req.pipe
    if not req.searching:
        return _Found(req.layout, req.mesh, tr.zero_stage or 0, tr.reshard_after_forward,
                      _recompute_policy(req.options.recompute.checkpoint) if tr.train else False)
    t = time.perf_counter()
    search_args = dict(
        train=tr.train, zero_stage=tr.zero_stage, reshard_after_forward=tr.reshard_after_forward,
        memory_limit=req.memory_limit, cost_model=req.cost_model, bucket_mb=tr.bucket_mb, verbose=req.verbose,
        display={i.name: i.target for i in cap.inputs},
        units=check_policy(tr.units) if tr.units is not None else ("param" if not tr.bucket_mb else "block"),
        checkpoint=_recompute_policy(req.options.recompute.checkpoint))
    constraints = _constraints(req.layout, req.options.search.search, info)
    decision = None
    if req.auto_pp is not None:
        pipeline = req.options.pipeline or PipelineOptions()
        decision = choose_pipeline(cap.graph, cap.inputs, info, req.mesh, req.auto_pp,
                                   batch=_batch_size(req.args, req.kwargs), constraints=constraints, **search_args,
                                   schedule=pipeline.schedule, microbatches=pipeline.microbatches,
                                   virtual=pipeline.virtual)
        if decision.pp > 1:
            return _Found(None, req.mesh, 0, None, False, None, decision, _plan_pipeline(req, decision))
        result = decision.flat
    else:
        meshes = req.meshes or [req.mesh if pipe is None else
                                Mesh({a: n for a, n in req.mesh.axes.items() if a != pipe.axis})]
        result = plan_search(cap.graph, cap.inputs, info, meshes, constraints, **search_args)
    mesh = result.mesh if pipe is None else req.mesh
    zero_stage, reshard = tr.zero_stage, tr.reshard_after_forward
    if tr.train and zero_stage is None:
        zero_stage = result.zero_stage
        reshard = result.reshard_after_forward if zero_stage == 3 else None
    req.timings["search"] = time.perf_counter() - t
    _progress(req.verbose, f"searched {result.space_size} candidates ({result.evaluated} evaluated) in "
                           f"{req.timings['search']:.2f}s: {mesh}, {result.best.candidate.describe()}")
    return _Found(result.layout, mesh, zero_stage or 0, reshard, (result.checkpoint or False) if tr.train else False,
                  result, decision)


def _recompute_policy(checkpoint):
    """``checkpoint=`` as the search and the plan take it: None, False or a policy name."""
    return checkpoint if checkpoint in (None, False) else check_recompute_policy(checkpoint)


def _plan_pipeline(req: _Request, decision) -> Plan:
    """The pipelined plan ``decision`` (``cost.pipeline_search``) chose for ``Mesh.auto``: the
    layout and ZeRO stage found, planned on its mesh, the program captured again for one
    microbatch."""
    c = decision.chosen
    inner, opts = c.inner, req.options
    cand = inner.candidate
    training = replace(opts.training, zero_stage=cand.zero_stage if opts.training.train else None,
                       reshard_after_forward=cand.reshard if cand.zero_stage == 3 else None)
    pipeline = PipelineOptions(axis=decision.axis, microbatches=c.microbatches, schedule=c.schedule,
                               virtual=c.virtual, cuts=(opts.pipeline or PipelineOptions()).cuts)
    opts = replace(opts, training=training, pipeline=pipeline, search=SearchOptions(search=True, hardware=req.cost_model),
                   recompute=RecomputeOptions(checkpoint=inner.cost.checkpoint or False))
    plan = _plan(req.model, req.args, req.kwargs, Mesh({decision.axis: c.pp, **inner.mesh.axes}), req.dims,
                 dict(inner.layout), opts, verbose=req.verbose, decision=decision)
    plan.timings["capture"] += req.timings["capture"]
    plan.timings["capture_cpu"] += req.timings["capture_cpu"]
    plan.timings["search"] = decision.seconds + plan.timings.get("search", 0.0)
    plan.timings["dims"] += req.timings["dims"]
    return plan


def _build(req: _Request, cap, info, found: _Found) -> _Built:
    """The per-rank program of the layout found (``passes.program``), with the ZeRO-3 unit
    policy chosen by cost when it was left open."""
    _refuse_stateful(cap, False, found.checkpoint)  # the search may choose recompute too
    t = time.perf_counter()
    tr, pipe, mesh = req.options.training, req.pipe, found.mesh
    resolved = resolve_layout(info, found.layout, mesh)
    display = {i.name: i.target for i in cap.inputs}
    context = asdict(req.options.context)
    context = {k: v for k, v in context.items() if v is not None}
    if "variant" not in context:  # ring or all-gather attention: the cost model chooses
        context["variant"] = choose_variant(req.cost_model, mesh)

    def build(policy):
        return build_program(cap.graph, cap.inputs, info, resolved, mesh, train=tr.train, zero_stage=found.zero_stage,
                             reshard=True if found.reshard_after_forward is None else found.reshard_after_forward,
                             bucket_mb=tr.bucket_mb if pipe is None else 0, display=display, units=policy,
                             context=context, program_passes=pipe is None,
                             disable_passes=check_disabled(req.options.rewrite.disable_passes))

    if tr.units is None and found.zero_stage == 3 and tr.bucket_mb and req.searching and pipe is None:
        # the unit policy (FSDP's wrapping) by cost: fastest within memory_limit
        vals = {n.name: n.meta.get("val") for n in cap.graph.nodes if n.op == "placeholder"}
        cost_fn = (functools.partial(checkpointed_program_cost, policy=found.checkpoint) if found.checkpoint
                   else program_cost)

        def lazy_build(policy):  # Python code is generated for the chosen program only
            with lazy_programs():
                return build(policy)

        units, (program, axes), _ = choose_units(
            lazy_build, lambda b: cost_fn(b[0], cap.inputs, vals, mesh, req.cost_model, train=tr.train,
                                          zero_stage=found.zero_stage, data_axes=b[1]), req.memory_limit)
        program.graph_module = torch.fx.GraphModule(program.graph_module, program.graph_module.graph)
    else:
        # (pipelined plans gather per parameter: a stage cut does not split units yet)
        units = check_policy(tr.units) if tr.units is not None else (
            "param" if not tr.bucket_mb or pipe is not None else "block")
        program, axes = build(units)
    req.timings["rewrite"] = time.perf_counter() - t
    _progress(req.verbose, f"rewrote for {mesh} in {req.timings['rewrite']:.2f}s")
    return _Built(resolved, program, axes, units)


def _finish(req: _Request, cap, info, found: _Found, built: _Built) -> Plan:
    """The Plan (a PipelinePlan, its program cut into stages, for a pipeline), checked: strict
    refuses layout lapses; idle mesh axes are warned of."""
    program = built.program
    checkpoint = checkpointed_blocks(program, cap, forced=req.options.recompute.checkpoint) if found.checkpoint else []
    fields = dict(model=req.model, mesh=found.mesh, captured=cap, info=info, resolved=built.resolved, program=program,
                  train=req.train, timings=req.timings, zero_stage=found.zero_stage, data_axes=built.data_axes,
                  checkpoint=checkpoint, checkpoint_policy=found.checkpoint or "block",
                  example_inputs=(tuple(req.args), dict(req.kwargs or {})),
                  options=req.options, search=found.result, cost_model=req.cost_model,
                  bucket_mb=req.options.training.bucket_mb, units=built.units,
                  pipeline_decision=req.decision or found.decision, reduce_dtype=req.reduce_dtype)
    if req.pipe is not None:
        # data-parallel gradient sums of a pipelined step are deferred to its last microbatch
        plan = finish_pipeline(PipelinePlan(**fields, microbatches=req.pipe.microbatches), req.pipe, req.cost_model)
        if checkpoint:
            recompute_stages(plan)  # each stage program's blocks, by the same policy
    else:
        plan = Plan(**fields)
    if req.reduce_dtype is not None:
        widen_gradient_sums(program, req.reduce_dtype, req.param_dtype)
    if req.options.rewrite.strict and plan.unsharded:
        lapses = plan.unsharded
        raise LayoutError(f"strict: the layout is not carried out at {len(lapses)} place(s); first: {lapses[0]} "
                          f"(hint: give the op a rule, shard another dim, or see plan.unsharded with strict=False)")
    warn_idle_axes(plan, stacklevel=5)
    return plan


def warn_idle_axes(plan, stacklevel: int = 3) -> None:
    """One IdleAxisWarning naming every mesh axis the plan leaves idle (``cost.idle``). What
    using them would save and cost takes another rewrite, so plan.explain() and print(plan) say
    it when asked, not every plan."""
    axes = idle_axes(plan)
    if axes:
        many = len(axes) > 1
        warnings.warn(f"autoshard: the plan leaves mesh ax{'es' if many else 'is'} {', '.join(axes)} idle: "
                      f"{'their' if many else 'its'} ranks repeat each other's work (plan.explain() says what "
                      f"splitting the batch there would save and cost)", IdleAxisWarning, stacklevel=stacklevel)


def _refuse_stateful(cap, pipelined: bool, checkpoint) -> None:
    """UnsupportedModelError where forward's state would not come out as the unsharded
    model's: batch statistics over a pipeline's microbatches (not the batch), buffer updates
    run again by a recomputed block."""
    if pipelined and (cap.batch_statistics or cap.mutated):
        what = (f"normalizes with the batch's statistics in {cap.batch_statistics[0]} (BatchNorm in training mode)"
                if cap.batch_statistics else f"updates the buffer {cap.mutated[0]} in place")
        raise UnsupportedModelError(f"the model {what}: a pipeline runs it per microbatch, not on the whole batch "
                                    f"(hint: model.eval(), or plan without pipeline=)")
    if checkpoint and cap.mutated:
        raise UnsupportedModelError(f"the model updates the buffer {cap.mutated[0]} in place in forward: "
                                    f"checkpoint=True would update it again when backward recomputes the block "
                                    f"(hint: plan without checkpoint=True)")


@contextlib.contextmanager
def _heap_frozen():
    """Every object alive on entry moved out of the cyclic collector's reach until exit
    (``gc.freeze``): planning allocates enough to start full collections, and each would
    traverse the whole captured program again. Nothing is done when objects are frozen already
    (a caller's, or an outer plan's: they stay as they were) or the collector is off."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the frozen objects join the oldest generation, as long-lived ones would


def _batch_size(args, kwargs) -> int:
    """Dim 0 of the tensor inputs (the global batch a pipeline splits into microbatches)."""
    sizes = [t.shape[0] for t in pytree.tree_leaves((tuple(args), dict(kwargs or {})))
             if isinstance(t, torch.Tensor) and t.dim() >= 1]
    return min(sizes) if sizes else 1


def checkpointed_blocks(program, cap, forced=None) -> list:
    """Names of the repeated blocks of ``program`` that activation checkpointing can cut out."""
    users = {i.name for i in cap.inputs if i.kind == "user"}
    regions = block_regions(program.graph_module.graph, users)
    names = [block_name(r.key) for r in regions if not r.why_not]
    if forced and not names:
        why = "; ".join(f"{block_name(r.key)}: {r.why_not}" for r in regions) or "the model has no repeated blocks"
        raise ValueError(f"checkpoint=True: no block of the program can be recomputed ({why})")
    return names


def check_precision(precision: Optional[PrecisionOptions]):
    """``(param dtype, reduce dtype)`` from ``precision`` (None: both None).

    >>> check_precision(PrecisionOptions(param=torch.bfloat16))
    (torch.bfloat16, None)
    """
    if precision is None:
        return None, None
    out = []
    for key in ("param", "reduce"):
        d = getattr(precision, key)
        if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
            raise ValueError(f"precision[{key!r}] must be a floating torch dtype, not {d!r}")
        out.append(d)
    return tuple(out)


def cast_for_precision(model, args, kwargs, dtype):
    """A copy of ``model`` with floating parameters and buffers in ``dtype``, and floating
    example inputs cast alike (the user's model is left as it is)."""
    cast = copy.deepcopy(model).to(dtype)
    conv = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return cast, pytree.tree_map(conv, tuple(args)), pytree.tree_map(conv, dict(kwargs or {}))


def widen_gradient_sums(program, reduce_dtype, param_dtype) -> None:
    """Backward sums run in ``reduce_dtype``: their records carry its bytes."""
    src = torch.empty((), dtype=param_dtype or torch.float32).element_size()
    wide = torch.empty((), dtype=reduce_dtype).element_size()
    for c in program.collectives:
        if c.phase == "backward" and c.kind in ("all_reduce", "reduce_scatter") and wide != src:
            c.bytes = c.bytes * wide // src
            c.why += f" (summed in {str(reduce_dtype).replace('torch.', '')})"


def _moe_options(moe: ExpertOptions) -> dict:
    """The keywords of ``passes.experts.find_expert_regions`` that ``moe`` sets."""
    return {} if moe.capacity_factor is None else {"capacity_factor": moe.capacity_factor}


def _wants_search(layout, search, meshes, memory_limit) -> bool:
    if search is not None:
        if not search and (meshes is not None or memory_limit is not None):
            raise ValueError("Mesh.auto and memory_limit need the search; do not pass search=False with them")
        return bool(search)
    only_forbids = layout is None or all(v is None or v == () for v in layout.values())
    return only_forbids or meshes is not None or memory_limit is not None


def _constraints(layout, search, info) -> dict:
    """Search constraints from ``layout``: its entries are fixed. A layout that shards
    something and was not given with ``search=True`` is complete: the dims it leaves out stay
    whole (the search then only decides state sharding and checks memory)."""
    layout = dict(layout or {})
    shards = any(v not in (None, ()) for v in layout.values())
    if shards and not search:
        for name in set(info.names.values()):
            layout.setdefault(name, None)
    return layout


def _progress(verbose, msg):
    if verbose:
        print(f"[autoshard] {msg}", file=sys.stderr, flush=True)


def apply_dim_names(info, cap, dims) -> None:
    """Attach user names to logical dims. ``dims`` is a list (one entry per positional
    argument: space-separated names, ``-`` for a dim left unnamed, or None) or a dict whose keys
    are argument names or parameter/buffer FQN globs."""
    if dims is None:
        return
    by_target = {}
    for node in cap.graph.nodes:
        if node.op == "placeholder":
            by_target[node.name] = node
    targets = {i.target: by_target[i.name] for i in cap.inputs if i.name in by_target}
    # A tied parameter answers to every name it has (lm_head.weight for embed_tokens.weight).
    targets.update({alias: targets[kept] for alias, kept in cap.aliases.items() if kept in targets})
    if isinstance(dims, (list, tuple)):
        names = cap.arg_names
        items = {}
        for k, spec in enumerate(dims):
            if spec is None:
                continue
            key = names[k] if k < len(names) else f"args[{k}]"
            items[key] = spec
        dims = items
    first_use: dict = {}  # name -> (size, "target dim d") where it was first given
    for key, spec in dims.items():
        matched = [t for t in targets if t == key] or [t for t in targets if fnmatch.fnmatchcase(t, key)]
        if not matched:
            raise LayoutError(f"dims names {key!r}, which matches no argument, parameter or buffer; "
                              f"arguments are {[i.target for i in cap.user_inputs]}")
        for target in matched:
            node = targets[target]
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            words = spec.split() if isinstance(spec, str) else list(spec)
            if len(words) != val.dim():
                raise LayoutError(f"dims[{key!r}] gives {len(words)} names ({spec!r}) for {target}, "
                                  f"which has {val.dim()} dims {tuple(val.shape)}")
            for d, word in enumerate(words):
                if word in ("-", "_", None):
                    continue
                lv = info.leaves(info.of(node)[d])
                if not lv:
                    continue
                old = info.names.get(lv)
                if old is not None and old != word:
                    raise LayoutError(f"dim {d} of {target} is named {word!r}, but dataflow makes it the same "
                                      f"logical dim as {old!r}; use one name")
                info.names[lv] = word
                size = math.prod(info.table.size[a] for a in lv)
                seen = first_use.setdefault(word, (size, f"dim {d} of {target}"))
                if seen[0] != size:
                    raise LayoutError(f"dims name {word!r} is given to two unrelated dims of different sizes: "
                                      f"{seen[1]} (size {seen[0]}) and dim {d} of {target} (size {size}); a name is "
                                      f"one logical dim: give one of them another name (e.g. via a narrower glob "
                                      f"than {key!r})")


# an export over the check budget carries its checked model, planned as the plan was (block_check.py)
EXPORT_HOOKS.append(functools.partial(add_block_check, autoshard=autoshard))
