"""Regression fingerprint of the SPMD rewrite: the per-rank programs of a fixed set of plans
hash to recorded values.

This is not a correctness test (the exactness tests are): it pins the programs *exactly as the
code builds them*, so a refactor of the rewriter (``passes/spmd.py``, its placement-change
table, the lowerings of ``passes/vocab_parallel.py``, ``passes/context_parallel.py``,
``passes/experts.py``) can show it changed nothing: the same ops in the same order, the same
collectives with the same kinds, axes, phases, tags, bytes and reasons. The expected hashes
were computed on the code before such a refactor; a refactor keeps them.

When a change is *meant* to change programs (a new collective, a better reason text), check
that the change is the intended one (``AUTOSHARD_PROGRAM_TEXT=dir`` writes each plan's
canonical text to ``dir/<plan>.txt``, to diff against the text of the previous code), then
regenerate the hashes deliberately::

    AUTOSHARD_PROGRAM_HASH_PRINT=1 python -m pytest -q -s tests/test_program_hash.py

and paste the printed ``EXPECTED`` into this file.

The canonical text is independent of the run: nodes are listed in graph order with their
arguments written by name (functions by qualified name, never ``repr`` with an address),
keyword arguments sorted, local shapes and dtypes from the metadata; collectives are listed in
program order. Nothing in it depends on the CPU (no timing, the default ``cpu-gloo`` preset is
a fixed table, search is off, every variant is fixed), on dict or set iteration order of the
run, or on paths (source lines are file basenames).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import fx

import autoshard
from autoshard import Mesh
from examples.models import llama_tiny, moe_tiny

LLAMA_TP = {"heads": "tp", "kv_heads": "tp", "ffn": "tp"}


def _llama(**kw):
    return llama_tiny(with_labels=True, **kw)


# name -> (model builder, mesh axes, layout, autoshard options); every choice the planner could
# make by cost is fixed here, so the programs depend on the rewrite alone.
PLANS = {
    "zero0": (_llama, {"dp": 2}, {"batch": "dp"}, dict(train=True, zero_stage=0, bucket_mb=0)),
    "zero0-buckets": (_llama, {"dp": 2}, {"batch": "dp"}, dict(train=True, zero_stage=0)),
    "zero1": (_llama, {"dp": 2}, {"batch": "dp"}, dict(train=True, zero_stage=1)),
    "zero2": (_llama, {"dp": 2}, {"batch": "dp"}, dict(train=True, zero_stage=2)),
    "zero3": (_llama, {"dp": 2}, {"batch": "dp"}, dict(train=True, zero_stage=3, units="block")),
    "zero3-param": (_llama, {"dp": 2}, {"batch": "dp"},
                    dict(train=True, zero_stage=3, units="param", reshard_after_forward=False)),
    "dp-tp": (_llama, {"dp": 2, "tp": 2}, {"batch": "dp", **LLAMA_TP}, dict(train=True, zero_stage=0)),
    "dp-tp-zero2": (_llama, {"dp": 2, "tp": 2}, {"batch": "dp", **LLAMA_TP}, dict(train=True, zero_stage=2)),
    "tp-vocab": (_llama, {"tp": 2}, {**LLAMA_TP, "vocab": "tp"}, dict(train=True)),
    "sequence": (_llama, {"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp", "seq": "tp?"},
                 dict(train=True, zero_stage=0)),
    "context-ring-zigzag": (lambda: _llama(seq=16, with_mask=True), {"cp": 2, "tp": 2}, {"seq": "cp", **LLAMA_TP},
                            dict(train=True, context={"order": "zigzag", "variant": "ring"})),
    "context-allgather": (lambda: _llama(seq=16), {"dp": 2, "cp": 2}, {"seq": "cp", "batch": "dp"},
                          dict(train=True, zero_stage=3, context={"order": "contiguous", "variant": "allgather"})),
    "experts": (lambda: moe_tiny(experts="grouped", with_labels=True), {"dp": 2, "ep": 2},
                {"batch": "dp", "experts": "ep"}, dict(train=True, zero_stage=0)),
    "experts-data-axis": (lambda: moe_tiny(experts="looped", with_labels=True), {"dp": 2, "ep": 2},
                          {"batch": ("dp", "ep"), "experts": "ep"}, dict(train=True, zero_stage=0)),
    "pipeline": (lambda: _llama(batch=8, num_layers=4), {"pp": 2, "dp": 2}, {"batch": "dp"},
                 dict(train=True, zero_stage=0, pipeline={"microbatches": 4, "schedule": "1f1b",
                                                          "cuts": ["layers.2"]})),
}

EXPECTED = {
    "context-allgather": "42f176ba16bfbb65",
    "context-ring-zigzag": "bc3b4e2b71352357",
    "dp-tp-zero2": "407041cc23d4f23c",
    "dp-tp": "017f6fccab29c087",
    "experts-data-axis": "51a570a778ea0565",
    "experts": "244da90ffd1dae46",
    "pipeline": "ef60785a33c989ea",
    "sequence": "2d3e6d3ecbefdb4e",
    "tp-vocab": "bb520a158764a6c8",
    "zero0-buckets": "780b5d1a19997f7b",
    "zero0": "272b25bee3a3f319",
    "zero1": "fc233f710f2038c1",
    "zero2": "31a44f8e56055c38",
    "zero3-param": "4dd678f51a82d35e",
    "zero3": "fa04e119dc372022",
}


def _fmt(a) -> str:
    """An argument, written without anything of this run (no addresses, no ids)."""
    if isinstance(a, fx.Node):
        return "%" + a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(b) for b in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_fmt(a[k])}" for k in sorted(a, key=str)) + "}"
    if isinstance(a, torch.Tensor):
        return f"tensor{tuple(a.shape)}:{a.dtype}"
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(a)
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, (int, bool, str, type(None), slice)):
        return repr(a)
    if callable(a):
        return _target(a)
    return type(a).__name__ + ":" + str(a)


def _target(t) -> str:
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", "") or ""
    name = getattr(t, '__qualname__', getattr(t, '__name__', type(t).__name__))
    # autoshard's own runtime functions by name alone: the fingerprint is of the program, not of
    # the package layout the functions live in (moving a module changes no program)
    return f"autoshard:{name}" if mod.startswith("autoshard.") else f"{mod}.{name}"


def _meta(node) -> str:
    v = node.meta.get("val")
    vs = v if isinstance(v, (tuple, list)) else [v]
    return " ".join(f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else _fmt(x) for x in vs)


def graph_text(gm) -> str:
    """One line per node: name, op, target, arguments, local shapes."""
    lines = []
    for n in gm.graph.nodes:
        lines.append(f"{n.op} {n.name} = {_target(n.target)}({_fmt(tuple(n.args))}, {_fmt(dict(n.kwargs))}) "
                     f"-> {_meta(n)}")
    return "\n".join(lines)


def collectives_text(collectives) -> str:
    return "\n".join(f"{c.kind} {c.axes} {c.phase} bytes={c.bytes} tag={c.tag} op={c.op} node={c.node} "
                     f"where={c.where} line={c.line} params={list(c.params)} why={c.why}" for c in collectives)


def canonical_text(plan) -> str:
    """The plan's per-rank program(s) and collectives as text (see the module docstring)."""
    parts = []
    pipe = getattr(plan, "pipe", None)
    if pipe is not None:
        for st in pipe.stages:
            parts.append(f"== stage {st.index} inputs={_fmt(list(st.inputs))} n_outputs={st.n_outputs}")
            parts.append(graph_text(st.forward))
    else:
        parts.append(graph_text(plan.graph_module))
    prog = plan.program
    parts.append("== program")
    parts += [f"placements {k}: {v}" for k, v in sorted(prog.placements.items())]
    parts += [f"use {k}: {v}" for k, v in sorted(prog.use_placements.items())]
    parts.append(f"placeholders {_fmt(list(prog.placeholders))}")
    parts.append(f"reshard_tags {sorted(prog.reshard_tags)}")
    parts.append(f"bucketed {_fmt(list(prog.bucketed))}")
    parts.append(f"buckets {_fmt(list(getattr(prog, 'buckets', [])))}")
    parts.append(f"units {_fmt(list(getattr(prog, 'units', [])))}")
    parts.append("== collectives")
    parts.append(collectives_text(plan.collectives))
    return "\n".join(parts) + "\n"


def build(name):
    make, mesh, layout, options = PLANS[name]
    model, args, dims = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout, search=False, **options)


def program_hash(name) -> tuple:
    text = canonical_text(build(name))
    out = os.environ.get("AUTOSHARD_PROGRAM_TEXT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.txt").write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()[:16], text


@pytest.mark.parametrize("name", sorted(PLANS))
def test_program_hash_unchanged(name):
    digest, text = program_hash(name)
    if os.environ.get("AUTOSHARD_PROGRAM_HASH_PRINT"):
        print(f"    {name!r}: {digest!r},")
    assert "== collectives" in text and text.count("\n") > 50  # a real program was written
    assert digest == EXPECTED.get(name), (
        f"the per-rank program of plan {name!r} changed (hash {digest}); if that is intended, regenerate "
        f"the hashes as the module docstring says")


def test_canonical_text_is_independent_of_the_run():
    # another process, with another string hash seed (so another set iteration order), writes the
    # same text; and the text holds no address and no path of this checkout
    here = program_hash("zero3")[1]
    code = ("import sys; from tests import test_program_hash as t; "
            "sys.stdout.write(t.program_hash('zero3')[1])")
    root = Path(__file__).resolve().parent.parent
    other = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="12345")).stdout
    assert other == here
    assert " at 0x" not in here and str(root) not in here
