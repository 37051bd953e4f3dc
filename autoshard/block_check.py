"""A ``--check`` that scales: the plan checked one distinct block at a time, at the real widths.

The unsharded reference of a model that needs sharding does not fit one process (and a model
planned on the meta device has no weights to make one from). Its plan is still checkable: a
transformer is its non-repeated parts (embedding, head, loss) around repeated blocks that are
planned alike. :func:`export_block_check` therefore builds the *checked model*: the same model
with every repeated ``nn.ModuleList`` cut to one block of each distinct structure (the first of
each), at the real widths, with random weights where the model has none (meta). It plans it with
the whole plan's mesh, layout, ZeRO stage and the dim names the whole plan inferred, checks that
each kept block carries the same collectives as its block in the whole plan (else the check would
test another program: :class:`BlockCheckError`), and exports it, with its unsharded reference, as
the sub-directory ``checks/`` of the export. ``run.py --check`` then runs that export's check on
the same processes and prints each block's largest gradient difference and the non-repeated
parts' (``autoshard.runtime.export.block_check``).

Example::

    plan = autoshard.autoshard(meta_llama, (ids,), mesh=Mesh({"dp": 2, "tp": 2}), dims=..., layout=...)
    plan.export("out/llama", check_budget=2 << 30)   # over the budget: out/llama/checks/ instead
    # torchrun --nproc-per-node=4 out/llama/run.py --weights hf_dir/ --check
"""
from __future__ import annotations

import copy
import json
from dataclasses import replace
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from .options import PipelineOptions
from .passes.buffers import non_persistent_buffers, recompute_buffers
from .passes.export import PLAN_JSON

__all__ = ["BlockCheckError", "repeated_blocks", "checked_model", "export_block_check", "CHECKS_DIR"]

CHECKS_DIR = "checks"


class BlockCheckError(ValueError):
    """The plan cannot be checked block by block (one line saying why)."""


def _structure(m: nn.Module) -> tuple:
    return (type(m).__name__,
            tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))


def repeated_blocks(model: nn.Module, cuts=()) -> dict:
    """{ModuleList FQN: [(kept index, [indices of the blocks it stands for])]} for the outermost
    ModuleLists of two or more blocks (a list inside a block, e.g. a layer's experts, is part of
    that block: the router reads all of them). ``cuts``: a pipelined plan's module names where
    stages begin; a block named there starts a new group (the blocks of each stage are kept
    apart, and the first block of each stage is kept, so the stages can be cut alike).

    >>> import torch.nn as nn
    >>> m = nn.Module(); m.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU()])
    >>> repeated_blocks(m)
    {'layers': [(0, [0, 1]), (2, [2])]}
    >>> m.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    >>> repeated_blocks(m, cuts=["layers.2"])
    {'layers': [(0, [0, 1]), (2, [2, 3])]}
    """
    out = {}

    def walk(mod, prefix):
        for name, child in mod.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList) and len(child) >= 2:
                starts = {int(c[len(fqn) + 1:]) for c in cuts if c.startswith(fqn + ".") and c[len(fqn) + 1:].isdigit()}
                segments: list = []
                for i, block in enumerate(child):
                    if i == 0 or i in starts:
                        segments.append({})
                    segments[-1].setdefault(_structure(block), []).append(i)
                if any(len(g) > 1 for seg in segments for g in seg.values()):
                    out[fqn] = [(g[0], g) for seg in segments for g in seg.values()]
                    continue  # blocks are kept whole
            walk(child, f"{fqn}.")

    walk(model, "")
    return out


def _renamed(fqn: str, blocks: dict) -> str | None:
    """The checked model's name of the whole model's parameter ``fqn`` if it is kept, else None."""
    for lst, groups in blocks.items():
        if fqn.startswith(lst + "."):
            idx, dot, rest = fqn[len(lst) + 1:].partition(".")
            kept = [g[0] for g in groups]
            if not idx.isdigit() or int(idx) not in kept:
                return None
            return f"{lst}.{kept.index(int(idx))}{dot}{rest}"
    return fqn


def checked_model(model: nn.Module, blocks: dict, seed: int = 0) -> nn.Module:
    """A copy of ``model`` with each list of :func:`repeated_blocks` cut to its kept blocks, on
    the CPU; a model on the meta device gets random weights (normal, std 0.02, for matrices;
    uniform in [0.5, 1.5] for vectors such as norm scales and biases) and its non-persistent
    buffers recomputed as an export recomputes them. Only the kept blocks are copied."""
    saved = {}
    for lst, groups in blocks.items():
        ml = model.get_submodule(lst)
        saved[lst] = ml._modules
        ml._modules = {str(k): ml._modules[str(i)] for k, (i, _) in enumerate(groups)}
    try:
        small = copy.deepcopy(model)
    finally:
        for lst, mods in saved.items():
            model.get_submodule(lst)._modules = mods
    meta = [n for n, t in list(small.named_parameters()) + list(small.named_buffers()) if t.is_meta]
    if not meta:
        return small
    fresh = non_persistent_buffers(small)
    small.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in small.named_parameters():
            if p.is_floating_point():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=g)
                else:
                    p.uniform_(0.5, 1.5, generator=g)
        persistent = {n for n, _ in small.named_buffers()} - set(fresh)
        for name, b in small.named_buffers():
            if name in persistent:
                b.fill_(1.0 if name.endswith("running_var") else 0.0)
        for name, value in recompute_buffers(small, sorted(fresh)).items() if fresh else ():
            small.get_buffer(name).copy_(value)
    return small


def _dims_of(plan, rename) -> dict:
    """{argument / parameter FQN of the checked model: the whole plan's dim names} (``-`` where
    the whole plan has no user name), so the checked model is named as the whole plan was."""
    info, cap = plan.info, plan.captured
    nodes = {n.name: n for n in cap.graph.nodes if n.op == "placeholder"}
    dims = {}
    for i in cap.inputs:
        node = nodes.get(i.name)
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor) or not val.dim():
            continue
        words = [info.names.get(info.leaves(info.of(node)[d]), "-") for d in range(val.dim())]
        if all(w == "-" for w in words):
            continue
        key = i.target if i.kind == "user" else rename(i.target)
        if key is not None:
            dims[key] = " ".join(words)
    return dims


def _random_inputs(plan, vocab: int | None, seed: int):
    """Random example inputs of the planned shapes: floats normal, integers in [0, vocab)."""
    args, kwargs = plan.example_inputs or ((), {})
    g = torch.Generator().manual_seed(seed + 1)

    def fresh(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, generator=g)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, dtype=t.dtype)
        high = vocab or 2
        return torch.randint(0, high, t.shape, dtype=t.dtype, generator=g)

    meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in list(args) + list(kwargs.values()))
    if not meta:
        return tuple(args), dict(kwargs)
    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


def _block_collectives(plan, prefix: str) -> Counter:
    # the SPMD program's collectives: a pipelined plan's sends and receives are compared as
    # its boundaries (_boundaries), they belong to the stage, not to the block before the cut
    return Counter((c.kind, tuple(c.axes), c.phase) for c in plan.program.collectives
                   if c.where == prefix or c.where.startswith(prefix + "."))


def _boundaries(plan) -> list:
    """What a pipelined plan's stages send each other: (from stage, shape, dtype), in order."""
    return sorted((b.src_stage, tuple(b.shape), str(b.dtype), bool(b.requires_grad)) for b in plan.pipe.boundaries)


def _checked_cuts(cuts, blocks: dict) -> list:
    """A pipelined plan's cuts renamed for the checked model (a cut at a kept block, or at a
    module outside the repeated lists, such as the head); BlockCheckError for a cut inside a
    block, which the kept block would not stand for."""
    out = []
    for c in cuts:
        lst = next((name for name in blocks if c.startswith(name + ".")), None)
        renamed = _renamed(c, blocks)
        if lst is not None and ("." in c[len(lst) + 1:] or renamed is None):
            raise BlockCheckError(f"the pipeline cut {c} is inside the repeated block list {lst}: its blocks "
                                  f"cannot be checked one of each kind")
        out.append(renamed)
    return out


def _stage_of(plan, prefix: str):
    """The pipelined plan's stage that holds the parameters under ``prefix`` (None if flat)."""
    if getattr(plan, "pipe", None) is None:
        return None
    return next((st.index for st in plan.stages if any(t.startswith(prefix + ".") for t in st.params)), None)


def export_block_check(plan, path, *, plan_fn, steps: int = 2, lr: float = 1e-3, seed: int = 0) -> dict:
    """Write ``path/checks/`` (the checked model's export, with its references) and return the
    ``block_check`` entry of the whole export's plan.json. ``plan_fn(model, args, kwargs, dims,
    layout, cuts)`` plans the checked model as the whole plan was planned (``cuts``: where its
    pipeline stages begin; None for a plan that is not pipelined). A pipelined plan's checked
    model keeps one block of each kind per stage, cut into the same stages, so each stage
    program's blocks, sends and receives are checked under the same schedule. Raises
    :class:`BlockCheckError` where the model has no repeated blocks or a kept block would not be
    planned as its block in the whole plan."""
    pipe = getattr(plan, "pipe", None)
    blocks = repeated_blocks(plan.model, pipe.cuts if pipe is not None else ())
    if not blocks and pipe is not None:
        raise BlockCheckError(f"no pipeline stage (cut at {list(pipe.cuts)}) holds two blocks of one kind: "
                              f"cut to one block of each kind per stage, the model stays whole")
    if not blocks:
        raise BlockCheckError("the model has no repeated blocks (nn.ModuleList of identical modules) to check one at a time")
    doc = json.loads((Path(path) / PLAN_JSON).read_text())
    small = checked_model(plan.model, blocks, seed=seed)
    big_dtypes = {k: t.dtype for k, t in plan.captured.state.items() if isinstance(t, torch.Tensor)}
    with torch.no_grad():  # the whole plan's dtypes (a bf16 plan checks a bf16 model)
        for name, p in small.named_parameters():
            src = next((k for k in big_dtypes if _renamed(k, blocks) == name), None)
            if src is not None and p.dtype != big_dtypes[src]:
                p.data = p.data.to(big_dtypes[src])
    args, kwargs = _random_inputs(plan, doc.get("vocab"), seed)
    layout = {n: (axes[0] if len(axes) == 1 else axes) for n, axes in plan.layout.items() if axes}
    cuts = _checked_cuts(pipe.cuts, blocks) if pipe is not None else None
    try:
        sub = plan_fn(small, args, kwargs, _dims_of(plan, lambda f: _renamed(f, blocks)), layout, cuts)
    except Exception as e:  # noqa: BLE001 - said in one line: the export itself stands
        raise BlockCheckError(f"the model with its repeated blocks cut to one of each could not be planned "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    entries = []
    for lst, groups in blocks.items():
        for k, (i, stands_for) in enumerate(groups):
            mine, whole = f"{lst}.{k}", f"{lst}.{i}"
            got, want = _block_collectives(sub, mine), _block_collectives(plan, whole)
            if got != want:
                raise BlockCheckError(f"block {whole} is planned with other collectives when checked alone "
                                      f"({sorted((got - want).elements())[:2]} / {sorted((want - got).elements())[:2]})")
            entries.append({"name": mine, "block": whole, "stage": _stage_of(sub, mine),
                            "stands_for": [f"{lst}.{j}" for j in stands_for]})
    if pipe is not None and _boundaries(sub) != _boundaries(plan):
        raise BlockCheckError(f"the checked model's stages (cut at {cuts}) send other values than the whole "
                              f"plan's (cut at {list(pipe.cuts)})")
    sub.export(Path(path) / CHECKS_DIR, args, kwargs, reference=True, reference_steps=steps, lr=lr)
    return {"dir": CHECKS_DIR, "blocks": entries,
            "parameters": sum(p.numel() for p in small.parameters())}


def add_block_check(plan, path, options: dict, *, autoshard) -> None:
    """After ``export_plan``: an export written without references because the model is over
    the check budget or on the meta device gets ``checks/`` (:func:`export_block_check`) and a
    ``block_check`` entry in plan.json; where that cannot be done, plan.json's ``missing`` says
    why. A pipelined plan's checked model is pipelined alike (:func:`export_block_check`)."""
    if options.get("reference") is not None:  # asked for, or refused, explicitly
        return
    steps, lr = options.get("reference_steps", 2), options.get("lr", 1e-3)
    path = Path(path)
    doc = json.loads((path / PLAN_JSON).read_text())
    why = (doc.get("missing") or {}).get("reference") or ""  # ``autoshard``: the planner (api.py registers it)
    if doc.get("reference") or not ("check budget" in why or "meta device" in why):
        return
    try:
        if plan.example_inputs is None:
            raise BlockCheckError("the plan has no example inputs (their shapes are the checked model's)")
        doc["block_check"] = export_block_check(plan, path, plan_fn=_replan(plan, autoshard), steps=steps, lr=lr)
    except BlockCheckError as e:
        doc.setdefault("missing", {})["block_check"] = str(e)
    (path / PLAN_JSON).write_text(json.dumps(doc, indent=1) + "\n")


def _replan(plan, autoshard):
    """Plans a model as ``plan`` was planned: its options, with the mesh, layout, ZeRO stage and
    units the plan settled on (no search: the checked model must carry the same layout); a
    pipelined plan's axis, schedule, microbatches and virtual stages, with the cuts given."""
    opts = plan.options
    fixed = [replace(opts.training, zero_stage=plan.zero_stage if plan.train else None, units=plan.units),
             replace(opts.search, search=False, memory_limit=None)]
    rest = [o for o in opts.objects() if not isinstance(o, (type(opts.training), type(opts.search)))
            and o is not opts.pipeline]

    def plan_fn(model, args, kwargs, dims, layout, cuts=None):
        pipe = [] if cuts is None else [PipelineOptions(axis=plan.axis, microbatches=plan.microbatches,
                                                        schedule=plan.schedule_name, virtual=plan.virtual,
                                                        cuts=tuple(cuts))]
        return autoshard(model, args, kwargs=kwargs, mesh=plan.mesh, dims=dims, layout=layout,
                         options=fixed + rest + pipe)
    return plan_fn
