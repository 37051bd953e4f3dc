"""The public entry point: ``autoshard.autoshard(model, args, mesh=..., dims=..., layout=...)``.

One function calling small steps in data-flow order: capture -> named dims -> layout -> SPMD
rewrite. The result is a :class:`~autoshard.plan.Plan`.

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

import fnmatch
import sys
import time
from typing import Optional

import torch

from .mesh import Mesh
from .plan import Plan
from autoshard.passes.capture import capture
from autoshard.passes.dims import infer_dims
from autoshard.passes.spmd import LayoutError, input_placements, resolve_layout, rewrite
from .training import bucket_collectives, choose_storage, data_axes, state_collectives


def autoshard(model: torch.nn.Module, args, kwargs=None, *, mesh, dims=None, layout=None, train: bool = False,
              zero_stage: Optional[int] = None, reshard_after_forward: Optional[bool] = None,
              memory_limit=None, bucket_mb: float = 25.0, verbose: bool = False) -> Plan:
    """Plan ``model(*args, **kwargs)`` on ``mesh``: name every dim, place every value, insert
    the collectives. ``layout`` maps dim names (or globs over inferred names) to mesh axes;
    dims it leaves out stay whole (replicated). With ``train=True``, data-parallel gradients of
    replicated parameters are all-reduced in buckets of ``bucket_mb`` MiB (0: one all-reduce per
    parameter, inside backward), launched as they fill so they overlap the rest of backward."""
    if zero_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (or None), not {zero_stage!r}")
    if (zero_stage or reshard_after_forward is not None) and not train:
        raise ValueError("zero_stage and reshard_after_forward shard training state: pass train=True")
    if reshard_after_forward is not None and zero_stage != 3:
        raise ValueError("reshard_after_forward applies to zero_stage=3 (parameters gathered for use)")
    if memory_limit is not None:
        raise NotImplementedError("memory_limit needs the layout search, which is not supported yet")
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    timings = {}
    t0 = time.perf_counter()
    cap = capture(model, args, kwargs)
    timings["capture"] = time.perf_counter() - t0
    _progress(verbose, f"captured {len(cap.graph.nodes)} nodes in {timings['capture']:.2f}s")

    t = time.perf_counter()
    origins = {i.name: i.target for i in cap.inputs}
    info = infer_dims(cap.graph, origins)
    apply_dim_names(info, cap, dims)
    timings["dims"] = time.perf_counter() - t
    _progress(verbose, f"named dims in {timings['dims']:.2f}s")

    t = time.perf_counter()
    resolved = resolve_layout(info, layout, mesh)
    grad_inputs = {i.name for i in cap.inputs if i.kind == "parameter" and i.trainable}
    stage = zero_stage or 0
    places = input_placements(cap.graph, info, resolved, mesh)
    axes = data_axes([(places[i.name], mesh.names) for i in cap.inputs if i.kind == "user" and i.name in places])
    if stage and not axes:
        raise LayoutError(f"zero_stage={stage} shards training state over the data-parallel axis, but no mesh axis "
                          f"splits an input: put the batch dim on a mesh axis in layout (e.g. {{'batch': 'dp'}})")
    params = {n.name: n.meta["val"] for n in cap.graph.nodes if n.op == "placeholder" and n.name in grad_inputs}
    storage = choose_storage(params, places, mesh, axes[0], stage,
                             True if reshard_after_forward is None else reshard_after_forward) if stage else {}
    display = {i.name: i.target for i in cap.inputs}
    bucketing = train and stage < 2 and axes and bucket_mb
    program = rewrite(cap.graph, info, resolved, mesh, grad_inputs, display, storage,
                      bucket_axis=axes[0] if bucketing else None,
                      bucket_candidates=[n for n in params if n not in storage] if bucketing else ())
    program.collectives += state_collectives(program, stage, axes, mesh, params, display)
    program.collectives += bucket_collectives(program, axes[0] if bucketing else None, params, display,
                                              int(bucket_mb * 2 ** 20) if bucketing else 0)
    timings["rewrite"] = time.perf_counter() - t
    _progress(verbose, f"rewrote for {mesh} in {timings['rewrite']:.2f}s")
    return Plan(model=model, mesh=mesh, captured=cap, info=info, resolved=resolved, program=program,
                train=train, timings=timings, zero_stage=stage, data_axes=axes)


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
    if isinstance(dims, (list, tuple)):
        names = cap.arg_names
        items = {}
        for k, spec in enumerate(dims):
            if spec is None:
                continue
            key = names[k] if k < len(names) else f"args[{k}]"
            items[key] = spec
        dims = items
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
