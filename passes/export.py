"""Export: write a plan out as a directory that ``torchrun`` runs on real machines.

``export_plan(plan, path, args)`` (what :meth:`autoshard.Plan.export` calls) writes::

    path/
      program.py     the per-rank program as Python, generated from the rewritten FX graph;
                     a comment above every collective names its module and why it is there
      plan.json      mesh, layout, every input's owner per mesh axis, collectives, cost
      run.py         the launcher: torchrun --nproc-per-node=N path/run.py [--check] [--steps K];
                     it calls the installed runner, autoshard.runtime.export
      weights.pt     parameters and buffers the program reads (torch.save, loaded with mmap),
                     written once; not written with weights=SRC (plan.json points at SRC,
                     relative to the export), so several layouts can share one source
      buffers.pt     instead of weights.pt for a model on the meta device, or with weights=SRC:
                     the tensors no checkpoint has (non-persistent buffers; a meta model's
                     recomputed on the CPU); parameters come from SRC or run.py --weights
      inputs.pt      the example inputs (when given)
      normalizer.py  a masked-mean loss's count of valid tokens, for run.py --grad-accum K
                     (passes/loss_count.py; absent for other losses)
      reference.pt   outputs, gradients and training losses of the unsharded model (when given)

The directory appears only when everything is written (it is assembled next to ``path`` and
renamed at the end), so a failed export never leaves something that looks runnable.

Example::

    >>> plan.export("out/llama_dp2_tp2", args)          # doctest: +SKIP
    $ torchrun --nproc-per-node=4 out/llama_dp2_tp2/run.py --check

The exported directory needs the installed autoshard runtime (the collectives and
``DistributedBackend``), not the planner.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional

import torch
from torch import fx
from torch.fx.graph import _custom_builtins
from torch.utils import _pytree as pytree

from autoshard import ownership
from autoshard.mesh import Mesh
from autoshard.ownership import describe, local_shape, slice_dim_for
from autoshard.runtime.primitives import collectives as C
from autoshard.runtime import run_simulated
from autoshard.runtime.execution.local import LOW_PRECISION
from autoshard.runtime.primitives.overlap_linear import varying_linears
from autoshard.runtime import export as runner  # the export runner, which run.py calls
from autoshard.runtime.export import FORMAT, VERSION
from autoshard.runtime.export.launcher import run_py_source

from . import loss_count as LC
from . import export_recompute

from .buffers import RecomputeError, non_persistent_buffers, recompute_buffers
from .dims import module_of, source_line
from .overlap_linear import SUM

PROGRAM, PLAN_JSON, RUNNER = "program.py", "plan.json", "run.py"
WEIGHTS, INPUTS, REFERENCE = "weights.pt", "inputs.pt", "reference.pt"
BUFFERS = "buffers.pt"  # a meta model's export: the tensors no checkpoint has
# References (a copy of the model run forward, backward and a few optimizer steps) are made at
# export only for models up to this size; bigger ones are exported without --check data.
REFERENCE_LIMIT_BYTES = 2 << 30


class ExportError(ValueError):
    """The plan cannot be exported as asked (missing weights, meta model without a checkpoint, ...)."""


# ------------------------------------------------------------------------------------------------
# placements as strings: "S(0)", "R", "P", one per mesh axis
# ------------------------------------------------------------------------------------------------

def autoshard_version() -> str:
    """The installed autoshard's version (recorded in plan.json)."""
    try:
        return importlib.metadata.version("autoshard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def placement_to_str(place) -> list:
    return [str(o) for o in place]


# ------------------------------------------------------------------------------------------------
# program.py: FX code generation with a comment above every collective
# ------------------------------------------------------------------------------------------------

class _Literal:
    """An argument printed as a bare name in generated code (FX prints unknown objects by repr)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


class _ProgramCodeGen(fx.graph.CodeGen):
    """FX's code generation, with collectives imported by their own names and a ``forward``
    whose parameters (one per line) say what each one is and which block a rank holds."""

    def __init__(self, arg_comments: list, names: dict, fn_name: str = "forward"):
        super().__init__()
        self.arg_comments = arg_comments
        self.names = names  # object -> the global name it should have
        self.fn_name = fn_name

    def _gen_python_code(self, nodes, root_module, namespace, **kwargs):
        for obj, name in self.names.items():
            namespace.create_name(name, obj)  # claims the name before any node can take it
        return super()._gen_python_code(nodes, root_module, namespace, **kwargs)

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def=False):
        if not free_vars:
            return f"def {self.fn_name}():"
        width = max(len(v) for v in free_vars) + 1
        lines = [f"def {self.fn_name}("]
        for var, comment in zip(free_vars, self.arg_comments):
            lines.append(f"    {(var + ','):<{width}}  # {comment}" if comment else f"    {var},")
        lines.append(f"){maybe_return_annotation}:")
        return "\n".join(lines)


def _collective_comment(node: fx.Node, width: int = 96, op: Optional[str] = None, info: Optional[dict] = None) -> list:
    info = node.meta.get("autoshard", {}) if info is None else info
    op = op or node.target.__name__
    axis = next((a for a in node.args if isinstance(a, str)), "?")
    fwd, bwd = C.ADJOINTS[op] if op in C.ADJOINTS else ("?", "?")
    where = info.get("where") or "<root>"
    head = f"{op} on {axis} [#{info.get('tag', '?')}] (forward: {fwd}; backward: {bwd}) — {where}: "
    text = head + (info.get("why") or "")
    return textwrap.wrap(text, width=width, initial_indent="# ", subsequent_indent="#     ",
                         break_long_words=False, break_on_hyphens=False)


def _arg_comment(inp, place, mesh) -> str:
    if inp is None:
        return ""
    val_shape = inp.get("shape")
    if val_shape is None:
        return f"{inp['target']}: {inp.get('value')!r} at export (not a tensor)"
    what = inp["target"] if inp["kind"] == "user" else f"{inp['kind']} {inp['target']}"
    owner = describe(place, mesh.names)
    loc = tuple(local_shape(val_shape, place, mesh))
    shape = tuple(val_shape)
    return f"{what} {list(shape)} {owner}" + (f" -> local {list(loc)}" if loc != shape else "")


def generate_program(plan, inputs_meta: list) -> str:
    """The per-rank program of ``plan`` as a standalone Python module (source text); with
    activation recompute, its recomputed regions as functions of their own (export_recompute)."""
    gm = plan.rank_spec().forward if getattr(plan, "checkpoint", None) else plan.graph_module
    return generate_module(gm, plan.mesh, inputs_meta, _program_header(plan))


def generate_module(gm, mesh, inputs_meta: list, header: str, arg_notes: Optional[dict] = None) -> str:
    """An FX program (the per-rank program, or one pipeline stage of it) as a standalone Python
    module defining ``forward``: ``header`` (a docstring) first, each argument commented with
    its owner (``inputs_meta`` by placeholder name, else ``arg_notes[name]``), a comment above
    every collective.

    Example::

        src = generate_module(plan.graph_module, plan.mesh, inputs_meta, header="# my program\\n")
        exec(compile(src, "program.py", "exec"), ns := {}); ns["forward"]
    """
    graph = fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    # recomputed regions (passes/recompute.py) become functions of the file, called through
    # the runtime's recompute (export_recompute.py)
    regions = export_recompute.region_calls(gm, graph, _Literal)
    pieces = [_module_body(sub, mesh, [], {}, name) for name, sub in regions]
    main_globals, main_src = _module_body(None, mesh, inputs_meta, arg_notes, "forward", graph=graph)
    globals_ = dict(main_globals)
    for g, _ in pieces:
        for name, obj in g.items():
            if globals_.setdefault(name, obj) is not obj:
                raise ExportError(f"program.py: the name {name!r} stands for two objects in its functions")
    src = "\n\n".join([body for _, body in pieces] + [main_src])
    collective_fns = {fn: fn.__name__ for fn in [*C.COLLECTIVES.values(), *C.PROGRAM_HELPERS]}
    imports = _imports(globals_, src, collective_fns)
    return header + imports + "\n\n" + src


def _module_body(gm, mesh, inputs_meta: list, arg_notes: Optional[dict], fn_name: str, graph=None) -> tuple:
    """``(globals, source)`` of one function ``fn_name`` generated from ``gm`` (or ``graph``)."""
    if graph is None:
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
    device = _Literal("DEVICE")

    def swap_device(a):
        return device if isinstance(a, torch.device) else a

    for node in graph.nodes:
        if node.op == "call_function":
            node.args = fx.node.map_aggregate(node.args, swap_device)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap_device)
    # collectives (commented) and the runtime helpers programs call, imported by their names
    collective_fns = {fn: fn.__name__ for fn in [*C.COLLECTIVES.values(), *C.PROGRAM_HELPERS]}
    names = {**collective_fns, varying_linears: varying_linears.__name__,  # the latter imported from their modules
             **{fn: fn.__name__ for fn in export_recompute.RUNTIME_FUNCTIONS}}
    by_name = {m["name"]: m for m in inputs_meta}
    place_by_name = {m["name"]: ownership.parse(m["placement"]) for m in inputs_meta if m.get("placement")}
    comments = []
    for node in graph.nodes:
        if node.op == "placeholder":
            m = by_name.get(node.name)
            comments.append(_arg_comment(m, place_by_name.get(node.name), mesh) if m
                            else (arg_notes or {}).get(node.name, ""))
    graph.set_codegen(_ProgramCodeGen(comments, names, fn_name))
    code = graph.python_code("self")
    nodes = list(graph.nodes)
    lines = code.src.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith(f"def {fn_name}("))
    body, seen, last_module = [], set(), None
    for i, line in enumerate(lines):
        if i < start:
            continue
        idx = code._lineno_map.get(i - start) if code._lineno_map else None
        node = nodes[idx] if idx is not None and idx < len(nodes) else None
        indent = line[: len(line) - len(line.lstrip())]
        if node is not None and node.op == "call_function" and node not in seen:
            seen.add(node)
            if node.target in collective_fns and node.target.__name__ in C.COLLECTIVES:
                body.extend(indent + c for c in _collective_comment(node))
            elif node.target is varying_linears:  # the collective it absorbed, with its reason
                info = node.meta[SUM]["autoshard"]
                op = "mark_varying" if node.kwargs.get("gather_dim") is None else "all_gather_varying"
                body.extend(indent + c for c in _collective_comment(node, op=op, info=info))
            else:
                mod = module_of(node)
                if mod != last_module:
                    last_module = mod
                    where = source_line(node)
                    body.append(f"{indent}# {mod or '<root>'}" + (f" ({where})" if where else ""))
        body.append(line)
    src = "\n".join(body).rstrip() + "\n"
    src = re.sub(r"\btorch\.ops\.aten\.", "aten.", src)
    return code.globals, src


def _imports(globals_: dict, src: str, collective_fns: dict) -> str:
    used = lambda name: re.search(rf"(?<![\w.]){re.escape(name)}\b", src) is not None  # noqa: E731
    lines = ["import torch"]
    coll = sorted(n for fn, n in collective_fns.items() if n in globals_ and globals_[n] is fn and used(n))
    others = []
    for name, obj in sorted(globals_.items()):
        if name in ("torch", "device") or name in coll or not used(name):
            continue
        if name in _custom_builtins:
            others.append(_custom_builtins[name].import_str)
        elif getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
            mod, qual = obj.__module__, obj.__qualname__
            if mod == "_operator":
                mod = "operator"
            others.append(f"from {mod} import {qual}" + (f" as {name}" if name != qual else ""))
        else:
            raise ExportError(f"the program refers to {obj!r} as {name!r}, which cannot be imported by name")
    if coll:
        lines.append("from autoshard.runtime.primitives.collectives import " + ", ".join(coll))
    lines.extend(others)
    lines += ["", "aten = torch.ops.aten",
              "# Tensors the program creates (arange, zeros, ...) go here; run.py sets this rank's device.",
              'DEVICE = torch.device("cpu")']
    return "\n".join(lines) + "\n"


def _program_header(plan) -> str:
    mesh = plan.mesh
    lay = ", ".join(f"{k} -> {'+'.join(v)}" for k, v in plan.layout.items() if v) or "everything replicated"
    counts: dict = {}
    for c in plan.collectives:
        key = f"{c.phase} {c.kind} on {','.join(c.axes)}"
        counts[key] = counts.get(key, 0) + 1
    summary = "\n".join(f"  {v:3d} x {k}" for k, v in sorted(counts.items())) or "  none"
    buckets = plan.program.buckets
    if buckets:
        n = sum(len(names) for _, names in buckets)
        summary += (f"\nThe data-parallel gradient sum of {n} replicated parameters is not in this file: run.py\n"
                    f"attaches {len(buckets)} gradient bucket(s) whose all-reduces overlap backward (plan.json).")
    return (f'"""Per-rank program of an autoshard plan on {mesh} ({mesh.size} ranks).\n\n'
            f"Generated by autoshard from the model's torch.export graph. Every rank runs this same\n"
            f"function on its own blocks of the parameters and inputs (who owns what is listed next\n"
            f"to each argument and in plan.json); the autoshard collectives move data between ranks,\n"
            f"and each one's backward is its adjoint, so autograd through this function is exact.\n"
            f"A comment above every collective says which module needs it and why.\n\n"
            f"Layout: {lay}\n"
            f"Collectives (forward calls in this file; backward ones run inside autograd):\n{summary}\n\n"
            f"Run it with run.py (torchrun), which sets up the process groups and the rank context.\n"
            f'"""\n')


# ------------------------------------------------------------------------------------------------
# plan.json
# ------------------------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else "/".join(map(str, k)) if isinstance(k, tuple) else str(k)): _jsonable(v)
                for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _dtype_str(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _int_bound(plan, node_name: str, example) -> Optional[int]:
    """Exclusive upper bound for synthetic values of an integer input: the example's max + 1,
    else the rows of the embedding table it indexes."""
    if isinstance(example, torch.Tensor) and example.numel() and not example.is_meta:
        return int(example.max().item()) + 1
    return _embedding_rows(plan, node_name)


def _embedding_rows(plan, node_name: str) -> Optional[int]:
    """Rows of the (smallest) embedding table an integer input indexes directly: the ids it may
    hold (run.py's --data refuses a token outside them, naming the file and position)."""
    rows = []
    for node in plan.captured.graph.nodes:
        if node.op == "placeholder" and node.name == node_name:
            for user in node.users:
                if user.target == torch.ops.aten.embedding.default and user.args[1] is node:
                    w = user.args[0].meta.get("val")
                    if isinstance(w, torch.Tensor):
                        rows.append(int(w.shape[0]))
    return min(rows) if rows else None


def _placeholders(plan):
    """(placeholder name, kind, index into captured.inputs) of the per-rank program, in order."""
    return list(plan.program.placeholders)


def _inputs_meta(plan, user_examples: Optional[list]) -> list:
    """One entry per argument of the per-rank program: what it is, its global shape, and how
    each rank holds it (``placement`` as stored; for parameters also where it is used and, with
    ZeRO, how it is stored between uses)."""
    prog, mesh = plan.program, plan.mesh
    meta = []
    users = iter(user_examples) if user_examples is not None else None
    nodes = {n.name: n for n in plan.captured.graph.nodes if n.op == "placeholder"}
    storage = prog.storage
    uses = prog.use_placements
    zero, axes = plan.zero_stage, list(plan.data_axes)
    for name, kind, index in _placeholders(plan):
        inp = plan.captured.inputs[index]
        place = prog.input_placements[index]
        val = nodes[inp.name].meta.get("val") if inp.name in nodes else None
        entry = {"name": name, "kind": inp.kind, "target": inp.target, "trainable": bool(inp.trainable)}
        if kind == "full":
            # ZeRO-2: the persistent full copy of a parameter, held in its use placement
            place = uses[inp.name]
            entry.update(role="full", of=inp.name)
        example = next(users) if (users is not None and kind == "input" and inp.kind == "user") else None
        if isinstance(val, torch.Tensor):
            entry.update(shape=list(val.shape), dtype=_dtype_str(val.dtype), placement=placement_to_str(place),
                         owner=describe(place, mesh.names), local_shape=list(local_shape(val.shape, place, mesh)))
            if kind == "input" and inp.kind == "parameter":
                use = uses.get(inp.name)
                if use is not None and tuple(use) != tuple(place):
                    entry["use_placement"] = placement_to_str(use)
                st = storage.get(inp.name)
                if st is not None:
                    entry["use_placement"] = placement_to_str(use)
                    entry["storage"] = {"mode": st.mode, "axis": st.axis, "dim": st.dim, "stage": st.stage,
                                        "reshard": bool(st.reshard)}
                if zero == 1 and axes and inp.trainable:
                    d = slice_dim_for(uses.get(inp.name, place), val.shape, mesh, axes[0])
                    if d is not None:
                        entry["zero1"] = {"axis": axes[0], "dim": d}
            if inp.kind == "user" and not val.dtype.is_floating_point and val.dtype != torch.bool:
                entry["high"] = _int_bound(plan, inp.name, example)
                entry["vocab"] = _embedding_rows(plan, inp.name)
        else:
            entry.update(shape=None, value=_jsonable(example) if example is not None else None)
        meta.append(entry)
    return meta


def _grad_buckets(plan):
    """Data-parallel gradient buckets of a training plan (the sync the program leaves to hooks)."""
    buckets = plan.program.buckets
    axes = plan.data_axes
    if not buckets or not axes:
        return None
    return {"axis": axes[0], "buckets": [{"tag": tag, "params": list(names)} for tag, names in buckets]}


def plan_json(plan, inputs_meta, *, weights_file, checkpoint, has_inputs, reference, buffers_file=None) -> dict:
    out_meta = []
    outs = plan.graph_module.graph.find_nodes(op="output")[0].args[0]
    for place, o in zip(plan.program.output_placements, outs):
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        out_meta.append({"placement": placement_to_str(place) if place is not None else None,
                         "local_shape": list(v.shape) if isinstance(v, torch.Tensor) else None,
                         "dtype": _dtype_str(v.dtype) if isinstance(v, torch.Tensor) else None})
    try:
        out_spec = pytree.treespec_dumps(plan.captured.out_spec)
    except Exception:  # noqa: BLE001 - a custom output type: the flat outputs still run
        out_spec = None
    try:
        cost = _jsonable(plan.cost)
    except Exception as e:  # noqa: BLE001 - the cost model is optional for running
        cost = {"error": f"{type(e).__name__}: {e}"}
    zero = plan.zero_stage
    return {
        "format": FORMAT,
        "version": VERSION,
        "autoshard_version": autoshard_version(),
        "torch_version": torch.__version__,
        "model": type(plan.model).__name__,
        "mesh": dict(plan.mesh.axes),
        "world_size": plan.mesh.size,
        "layout": {k: list(v) for k, v in plan.layout.items()},
        "train": bool(plan.train),
        "zero_stage": zero,
        "data_axes": list(plan.data_axes),
        "program": PROGRAM,
        "inputs": inputs_meta,
        "outputs": out_meta,
        "out_spec": out_spec,
        "loss_output": plan.loss_index(),
        "aliases": dict(plan.captured.aliases),
        "state_dict_keys": list(plan.model.state_dict().keys()),  # checkpoints: consolidate's keys
        "reshard_tags": sorted(plan.program.reshard_tags),
        "reduce_dtype": str(plan.reduce_dtype).replace("torch.", "") if plan.reduce_dtype is not None else None,
        "grad_buckets": _grad_buckets(plan),
        "weights": {"file": weights_file, "checkpoint": checkpoint, "buffers": buffers_file},
        "example_inputs": INPUTS if has_inputs else None,
        "reference": reference,
        "collectives": [_jsonable(c) for c in plan.collectives],
        # activation recompute: which blocks, how (program.py calls them through the runtime's recompute)
        "recompute": ({"policy": plan.checkpoint_policy, "blocks": list(plan.checkpoint)}
                      if getattr(plan, "checkpoint", None) else None),
        "cost": cost,
    }


# ------------------------------------------------------------------------------------------------
# references: the unsharded model's outputs, gradients and a few training steps
# ------------------------------------------------------------------------------------------------

def make_reference(plan, args, kwargs, *, steps: int = 2, lr: float = 1e-3) -> dict:
    """Outputs and gradients of the unsharded model (a copy of it) on ``args``, and its losses
    over ``steps`` AdamW steps on that batch and its trainable parameters after them. The loss is
    the output run.py seeds backward with (``plan.loss_index()``), summed if it is not a scalar.
    16-bit parameters step as run.py steps them (``ShardedOptimizer``): AdamW on a float32 master
    copy, written back rounded. (torch's AdamW on the 16-bit tensors themselves is another
    algorithm: in float16 its eps of 1e-8 rounds to 0, and an element whose squared gradient
    underflows divides 0 by 0.)"""
    model = copy.deepcopy(plan.model)
    model.zero_grad(set_to_none=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    trainable = [i.target for i in plan.captured.inputs if i.kind == "parameter" and i.trainable]
    k = plan.loss_index()
    masters = {t: torch.nn.Parameter(params[t].detach().float()) for t in trainable if params[t].dtype in LOW_PRECISION}
    opt = torch.optim.AdamW([masters.get(t, params[t]) for t in trainable], lr=lr)
    outputs, grads, losses = None, None, []
    for step in range(max(steps, 1)):
        flat = pytree.tree_leaves(model(*args, **(kwargs or {})))
        loss = flat[k]
        loss.sum().backward()
        losses.append(loss.detach().double().sum().item())
        if step == 0:
            outputs = [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in flat]
            grads = {t: (params[t].grad.detach().clone() if params[t].grad is not None
                         else torch.zeros_like(params[t])) for t in trainable}
        if steps:
            for t, m in masters.items():
                m.grad = None if params[t].grad is None else params[t].grad.float()
            opt.step()
            with torch.no_grad():
                for t, m in masters.items():
                    params[t].copy_(m)
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    trained = {t: params[t].detach().clone() for t in trainable} if steps else None  # after every step
    return {"outputs": outputs, "grads": grads, "losses": losses[:steps], "params": trained, "optimizer": "adamw",
            "lr": lr}


# ------------------------------------------------------------------------------------------------
# the export itself
# ------------------------------------------------------------------------------------------------

def _state_bytes(plan) -> int:
    return sum(t.numel() * t.element_size() for t in plan.captured.state.values() if isinstance(t, torch.Tensor))


KEYS_HINT = "keys must be the model's parameter names"


def _check_checkpoint(path: Path, plan, inputs_meta, needed: set, prefix=None) -> tuple:
    """(names the program needs that the checkpoint lacks (aliases of tied weights accepted):
    its parameters, and ``needed`` (a meta model's persistent buffers); the hint for a prefix
    that would fix them, or ''; the names of the program's tensors the checkpoint has). The
    checkpoint is read as run.py reads it (a safetensors or DCP source: its headers only)."""
    try:
        state = runner.read_checkpoint(path, prefix)
    except runner.RunError as e:
        raise ExportError(str(e)) from None
    reverse: dict = {}
    for alias, kept in plan.captured.aliases.items():
        reverse.setdefault(kept, []).append(alias)
    missing = []
    for m in inputs_meta:
        if m["kind"] == "parameter" or m["target"] in needed:
            names = [m["target"]] + reverse.get(m["target"], [])
            hit = next((n for n in names if n in state), None)
            if hit is None:
                missing.append(m["target"])
            elif list(state[hit].shape) != m["shape"]:
                raise ExportError(f"checkpoint {path}: {hit} has shape {list(state[hit].shape)}, the model "
                                  f"has {m['shape']}")
    known = {n for m in inputs_meta for n in [m["target"]] + reverse.get(m["target"], [])}
    fix = runner._common_prefix_fix([k for k in state if k not in known], missing, "give weights_prefix={!r}")
    has = {m["target"] for m in inputs_meta if any(n in state for n in [m["target"]] + reverse.get(m["target"], []))}
    return missing, fix, has


def recorded_source(checkpoint: Path, path: Path) -> str:
    """``weights=SRC`` as plan.json records it: relative to the export directory (run.py
    resolves it against its own directory), so that no absolute path of the exporting machine
    is written and the export moves with its weights; ``run.py --weights`` overrides it.

    Example::

        recorded_source(Path("/data/llama-hf"), Path("/data/exports/tp4"))   # "../../llama-hf"
    """
    return os.path.relpath(checkpoint, Path(path).resolve())


WHY_NO_WEIGHTS = ("the model was planned on the meta device: its parameters must come from run.py --weights SRC "
                  "(a state dict of the same model with real weights)")


def _meta_model_buffers(plan, inputs_meta, given: Optional[dict]) -> dict:
    """What a meta model's export holds itself (``buffers.pt``): its non-persistent buffers,
    recomputed on the CPU by the owning modules' own code (or ``given`` by the caller), and any
    tensor the program reads that has data already. Parameters and persistent buffers are left
    to the checkpoint; a meta tensor no checkpoint has and nothing can recompute is an
    ExportError naming it."""
    transient = non_persistent_buffers(plan.model)
    given = dict(given or {})
    planned = {m["target"]: m for m in inputs_meta if m["kind"] == "buffer" and m.get("role") != "full"}
    unknown = sorted(set(given) - set(planned))
    if unknown:
        raise ExportError(f"buffers= names {unknown[:3]}, which are not buffers the program reads "
                          f"(it reads {sorted(planned)[:4]}{', ...' if len(planned) > 4 else ''})")
    out, recompute = {}, []
    for m in inputs_meta:
        if m["kind"] == "user" or m.get("role") == "full":
            continue
        t = plan.captured.state[m["target"]]
        if not isinstance(t, torch.Tensor) or m["kind"] == "parameter":
            continue
        if m["target"] in given:
            v = given[m["target"]]
            if not isinstance(v, torch.Tensor) or v.is_meta or list(v.shape) != m["shape"] or \
                    _dtype_str(v.dtype) != m["dtype"]:
                got = f"{list(v.shape)} {_dtype_str(v.dtype)}{' on meta' if v.is_meta else ''}" \
                    if isinstance(v, torch.Tensor) else type(v).__name__
                raise ExportError(f"buffers={{{m['target']!r}: ...}} is {got}; the program reads a "
                                  f"{m['shape']} {m['dtype']} tensor with data")
            out[m["target"]] = v.detach().cpu().contiguous()
        elif not t.is_meta:
            out[m["target"]] = t.detach().contiguous()
        elif m["kind"] == "buffer" and m["target"] in transient:
            recompute.append(m["target"])
        elif m["kind"] != "buffer":  # a lifted constant: in no state dict, made by no constructor
            raise ExportError(f"{m['kind']} {m['target']} of the model is on the meta device and in no state dict, "
                              f"so neither a checkpoint nor the export can supply it (hint: create it on the CPU "
                              f"in the model's code, or plan the model with real weights)")
    try:
        out.update(recompute_buffers(plan.model, recompute))
    except RecomputeError as e:
        raise ExportError(f"{e} (hint: plan.export(..., buffers={{{e.fqn!r}: tensor}}) gives its value, "
                          f"or plan the model with real weights)") from None
    return out


def export_plan(plan, path, args=None, kwargs=None, *, weights=None, reference: Optional[bool] = None,
                check_budget: int = REFERENCE_LIMIT_BYTES,
                reference_steps: int = 2, lr: float = 1e-3, overwrite: bool = False,
                buffers: Optional[dict] = None, weights_prefix: Optional[str] = None) -> Path:
    """Write ``plan`` to the directory ``path`` (see the module docstring); returns its path.

    - ``args``/``kwargs``: example inputs, saved for ``run.py`` and used for references; without
      them run.py needs ``--synthetic`` (random inputs of the planned shapes) or ``--inputs``.
    - ``weights``: None exports the model's parameters and buffers to ``weights.pt``; a path
      names a checkpoint (a state dict by parameter FQN, loadable with ``weights_only=True``,
      a ``.safetensors`` file, a Hugging Face ``save_pretrained`` directory, a DCP checkpoint
      or ``--ckpt`` directory, or another export's directory: its ``weights.pt``) that run.py
      slices instead: no weights are written (buffers it lacks go to ``buffers.pt``), and
      plan.json records SRC relative to the export. A model on the meta
      device writes no weights: its non-persistent buffers are recomputed on the CPU
      (:mod:`autoshard.passes.buffers`) into ``buffers.pt``, and parameters and persistent
      buffers come from ``weights`` or ``run.py --weights SRC``.
    - ``weights_prefix``: with ``weights``, the FQN under which the checkpoint's keys live in
      the planned module (prepended to them: ``"model"`` when it holds the HF model as
      ``self.model``), as ``run.py --weights-prefix``; recorded in plan.json.
    - ``buffers``: for a meta model, ``{FQN: tensor}`` values of non-persistent buffers that
      cannot be recomputed (their owner keeps no constructor arguments); shape and dtype checked.
    - ``reference``: save the unsharded model's outputs, gradients and ``reference_steps``
      AdamW(lr) losses for ``run.py --check``; default: when inputs are given and the model is
      real and its state within ``check_budget`` bytes (default 2 GiB). Beyond it, ``Plan.export``
      checks the plan one distinct block at a time instead (``autoshard/block_check.py``).
    - ``overwrite``: replace an existing directory; otherwise a non-empty ``path`` is an error.
    """
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if not overwrite:
            raise ExportError(f"{path} exists and is not empty (hint: choose a new directory, or replace it with overwrite=True / --force)")
    has_inputs = args is not None or kwargs is not None
    flat_user = plan.captured.flatten_args(args or (), kwargs or {}) if has_inputs else None
    meta_model = any(isinstance(t, torch.Tensor) and t.is_meta for t in plan.captured.state.values())
    # why run.py will lack saved inputs / references (its error messages say so, and what to pass)
    why_no_inputs = None if has_inputs else "the export was made without example inputs and the plan had none"
    if flat_user is not None and any(isinstance(t, torch.Tensor) and t.is_meta for t in flat_user):
        flat_user, has_inputs, args, kwargs = None, False, None, None  # shapes only; nothing to save
        why_no_inputs = ("the plan's example inputs are on the meta device (shapes only); pass real ones: "
                         "plan.export(path, args)")
    checkpoint, has = None, set()
    if weights is not None:
        checkpoint = Path(weights).resolve()
        if not checkpoint.exists():
            raise ExportError(f"weights checkpoint {weights} does not exist")
    elif weights_prefix:
        raise ExportError("weights_prefix applies to weights=SRC (the checkpoint whose keys it prefixes)")
    if reference is None:
        reference = has_inputs and not meta_model and _state_bytes(plan) <= check_budget
    why_no_reference = None if reference else (
        "the model is on the meta device: references need a model with real weights" if meta_model else
        why_no_inputs if not has_inputs else
        f"the model's state is over the check budget of {check_budget / 2 ** 30:.3g} GiB (references skipped)"
        if _state_bytes(plan) > check_budget else
        "the export was made with reference=False")
    if reference and (not has_inputs or meta_model):
        raise ExportError("references need example inputs and a model with real weights")

    inputs_meta = _inputs_meta(plan, flat_user)
    # a meta model: the tensors no checkpoint has, computed now (an error names one that cannot be)
    exported = _meta_model_buffers(plan, inputs_meta, buffers) if meta_model else None
    if buffers and not meta_model:
        raise ExportError("buffers= gives the non-persistent buffers of a model on the meta device; this model "
                          "has its own")
    if checkpoint is not None:
        needed = {m["target"] for m in inputs_meta if m["kind"] == "buffer"} - set(exported) if meta_model else set()
        missing, fix, has = _check_checkpoint(checkpoint, plan, inputs_meta, needed, weights_prefix)
        if missing:
            raise ExportError(f"checkpoint {checkpoint} has no tensor for {len(missing)} parameter(s), e.g. "
                              f"{missing[:3]} (hint: {fix or KEYS_HINT})")
    pipelined = XP.is_pipelined(plan)
    if pipelined:  # a program file per stage; inputs described by the step's global batch
        XP.check_exportable(plan)
        sources = XP.stage_sources(plan, inputs_meta)
        inputs_meta = XP.step_inputs(plan, inputs_meta)
    else:
        sources = {PROGRAM: generate_program(plan, inputs_meta)}
        acc = LC.loss_accumulation(plan.program, plan.captured.inputs, plan.loss_index())  # run.py --grad-accum
        if acc.normalizer is not None:
            sources[LC.NORMALIZER] = generate_module(acc.normalizer, plan.mesh, inputs_meta, LC.NORMALIZER_HEADER)
    for name, src in sources.items():
        compile(src, str(path / name), "exec")  # a codegen bug fails here, not under torchrun

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        for name, src in sources.items():
            (tmp / name).write_text(src)
        (tmp / RUNNER).write_text(run_py_source())  # a launcher: the runner is the installed core
        own = None  # with weights=SRC, the export holds itself: what SRC lacks
        if meta_model:
            own = exported
            torch.save(exported, tmp / BUFFERS)
        else:
            state = {}
            for m in inputs_meta:
                if m["kind"] == "user" or m.get("role") == "full" or m["target"] in has:
                    continue
                t = plan.captured.state[m["target"]]
                if isinstance(t, torch.Tensor):
                    state[m["target"]] = t.detach().contiguous()
            if checkpoint is None:
                torch.save(state, tmp / WEIGHTS)
            elif state:  # the non-persistent buffers, in no checkpoint
                own = state
                torch.save(state, tmp / BUFFERS)
        if has_inputs:
            torch.save({"inputs": [t.detach() if isinstance(t, torch.Tensor) else t for t in flat_user]},
                       tmp / INPUTS)
        ref_meta = None
        if reference:
            ref = make_reference(plan, args or (), kwargs or {}, steps=reference_steps, lr=lr)
            torch.save(ref, tmp / REFERENCE)
            ref_meta = {"file": REFERENCE, "grads": bool(ref["grads"]), "optimizer": "adamw", "lr": lr,
                        "steps": len(ref["losses"])}
        doc = plan_json(plan, inputs_meta, weights_file=None if meta_model or checkpoint else WEIGHTS,
                        checkpoint=recorded_source(checkpoint, path) if checkpoint else None,
                        has_inputs=has_inputs, reference=ref_meta, buffers_file=BUFFERS if meta_model or own else None)
        if weights_prefix:
            doc["weights"]["prefix"] = weights_prefix
        doc["missing"] = {"inputs": None if has_inputs else why_no_inputs, "reference": why_no_reference,
                          "weights": WHY_NO_WEIGHTS if meta_model else None}
        if pipelined:
            doc.update(program=None, pipeline=XP.pipeline_json(plan))
        else:
            doc["accumulation"] = LC.accumulation_json(acc)
        (tmp / PLAN_JSON).write_text(json.dumps(doc, indent=1) + "\n")
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ------------------------------------------------------------------------------------------------
# running an export: torchrun locally, or every rank as a thread of this process
# ------------------------------------------------------------------------------------------------

def torchrun_command(path, nproc: int, *run_args: str) -> list:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N path/run.py ...``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(Path(path) / RUNNER), *run_args]


def run_torchrun(path, nproc: Optional[int] = None, *run_args: str, timeout: Optional[float] = None,
                 capture: bool = False) -> subprocess.CompletedProcess:
    """Launch ``run.py`` of an export on ``nproc`` local processes (default: the mesh size) with
    torchrun (gloo on CPU). One intra-op thread per process. Returns the finished process."""
    if nproc is None:
        nproc = json.loads((Path(path) / PLAN_JSON).read_text())["world_size"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(torchrun_command(path, nproc, *run_args), env=env, timeout=timeout,
                          capture_output=capture, text=True)


def load_program(path):
    """The ``program`` module of an export directory (``forward`` is the per-rank program)."""
    return runner.load_program(Path(path))


def simulate_export(path, *, steps: int = 0, optimizer: str = "adamw", lr: float = 1e-3, check: bool = False,
                    inputs=None, weights=None, allow_partial: bool = False, weights_prefix=None) -> list:
    """Run an exported directory on a simulated mesh (ranks as threads of this process), loading
    the program, weights and inputs exactly as run.py does: forward only, or ``steps`` training
    steps. Returns one dict per rank: ``outputs`` (flat, local; of the first step), ``grads``
    ({FQN: local gradient} of the first step), ``losses``, and with ``check`` the comparison
    with the saved references (``ok``, ``worst_out``, ``worst_grad``, ``problems``). A pipelined
    export runs its schedule: ``outputs`` is ``{microbatch: flat local outputs}`` on the last
    stage's ranks (None elsewhere) and ``losses`` the step losses on every rank."""
    R = runner
    path = Path(path)
    doc = R.read_plan(path)
    program = R.load_programs(path, doc)
    mesh = Mesh(doc["mesh"])
    user = inputs if inputs is not None else R.load_inputs(path, doc, synthetic=False)
    weights = R.open_weights(path, doc, weights, allow_partial, weights_prefix)  # run.py's --weights(-prefix)
    ref = torch.load(path / doc["reference"]["file"], weights_only=True) if check else None

    def rank_fn(rank):
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), steps > 0)
        if doc.get("pipeline"):
            return R._pipeline().rank_loop(rp, user, steps=steps, optimizer=optimizer, lr=lr, ref=ref, R=R)
        return R.rank_loop(rp, user, steps=steps, optimizer=optimizer, lr=lr, ref=ref)

    return run_simulated(mesh, rank_fn)


def simulate_run(path, *argv: str) -> list:
    """Run an export's training loop (``run.py --steps N --data ... --ckpt ...``, the same
    options, ``--timeline`` of a pipelined export too) on a simulated mesh: ranks as threads of
    this process, loading program, weights, data and checkpoints as run.py does. Returns one
    dict per rank (``losses``, ``grad_norms``, ``lrs``); rank 0's progress lines are in ``lines``.

    Example::

        simulate_run("out", "--steps", "4", "--data", "tokens.bin", "--ckpt", "ck", "--save-every", "2")
    """
    R = runner
    path = Path(path)
    args = R._parser().parse_args(list(argv))
    doc = R.read_plan(path)
    program = R.load_programs(path, doc)
    mesh = Mesh(doc["mesh"])
    loop = R.prepare_training(path, doc, args)
    if not loop:
        raise ExportError("simulate_run runs the training loop: give --steps N and a loop option (--data, --ckpt, ...)")
    user = None if loop.get("data") else R.load_step_inputs(path, doc, args)
    weights = R.open_weights(path, doc, args.weights, args.allow_partial, args.weights_prefix)
    lines: list = []

    def rank_fn(rank):
        say = lines.append if rank == 0 else (lambda msg: None)
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), train=True)
        res = R.train_loop(rp, user, loop, args, say=say)
        if args.timeline:
            R._pipeline().write_timeline(rp, args.timeline, say)
        res["lines"] = lines if rank == 0 else []
        return res

    try:
        return run_simulated(mesh, rank_fn)
    finally:
        if loop.get("lock"):
            loop["lock"].release()


# pipelined plans (a program file per stage); imported last: it builds on this module
from . import export_pipeline as XP  # noqa: E402
