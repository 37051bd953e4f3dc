"""Fuzz test: "exact or refused" on random programs with the features that once gave silently
wrong results.

Each program is a random property-test program (``tests/test_property.py``: its generator,
module and oracle) wrapped with a random mix of
- a cross-entropy loss with probability targets (``[N, C]`` or ``[N, C, L]``),
- a division by an input's size (``x.shape[0]``), a Python scalar argument and a Python bool,
- an in-place update of a buffer (a call counter),
- a custom ``torch.autograd.Function``, applied to a value that needs gradients or to the input,
- dropout, in training mode (p > 0) or inactive (eval mode, or p = 0),
- an in-place write into a clone of the program's first output along one of its dims (an index,
  a slice with or without a step, a mask, a scatter or scatter_add, ``copy_`` into a slice,
  ``fill_``, an index_put, an update read through a view taken before it), with that dim split
  on a simulated mesh of each kind and left whole in the other layouts.

The generator predicts each case's outcome without the library: a Function on a value that
needs gradients must be refused at capture (``UnsupportedModelError``); a buffer update must come
back into the model after each simulated call, as the model's own call makes it; active
dropout must warn (``DropoutWarning``); everything else must reproduce the single-device outputs
and every gradient (``simulate`` and ``simulate_grads``) on two small simulated meshes; and a
call with another batch size, dtype, scalar or flag than planned must raise
``InputMismatchError`` naming that input. Every (program, check) pair is one case; a CI run
makes at least 300 (``AUTOSHARD_FUZZ_PROGRAMS`` programs, 60 by default), at least 200 of them
planned programs with an in-place write, each exact or refused with a ``LayoutError``.

Reproduce one program with ``pytest tests/test_fuzz_exact.py -k fuzz_17``.
"""
from __future__ import annotations

import copy
import os
import random
import warnings
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from tests.helpers.exactness import close
from tests.helpers.programs import (MESHES, ProgX, ProgXIdx, Gen, make_args, predict, program_source, random_layout,
                                    run_steps)

N_PROGRAMS = int(os.environ.get("AUTOSHARD_FUZZ_PROGRAMS", "60"))
CLASSES = 6


class Times2(torch.autograd.Function):
    """Doubles; its backward scales by 7, so a dropped backward changes every gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 7


@dataclass
class Features:
    soft_ce: bool = False
    div_shape: bool = False
    scale: float | None = None
    flag: bool | None = None
    buffer: bool = False
    function: str | None = None  # "grad" (on an activation) | "input" (on x: no gradient flows)
    dropout: tuple | None = None  # (p, training)
    write: tuple | None = None  # (family, dim, i, start, length): see apply_write
    outcome: str = "exact"  # exact | refused | warned

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in vars(self).items() if v not in (None, False) and k != "outcome")


def draw_features(r: random.Random) -> Features:
    f = Features(soft_ce=r.random() < 0.5, div_shape=r.random() < 0.5,
                 scale=r.choice([0.5, 2.0, 3.0]) if r.random() < 0.5 else None,
                 flag=r.choice([True, False]) if r.random() < 0.4 else None,
                 buffer=r.random() < 0.12,
                 function=r.choice(["grad", "input"]) if r.random() < 0.3 else None,
                 dropout=(r.choice([0.0, 0.3, 0.3]), r.choice([True, False])) if r.random() < 0.3 else None)
    # the oracle: what the library must do with this program
    if f.function == "grad":
        f.outcome = "refused"
    elif f.dropout is not None and f.dropout[0] > 0 and f.dropout[1]:
        f.outcome = "warned"
    return f


class Fuzz(nn.Module):
    """A property-test program plus the drawn features (see the module docstring)."""

    def __init__(self, prog, feats: Features, xdims: int, hidden: int):
        super().__init__()
        self.body = (ProgXIdx if "idx" in prog.inputs else ProgX)(prog)
        self.f = feats
        if feats.soft_ce:
            self.head = nn.Linear(hidden, CLASSES)
        if feats.buffer:
            self.register_buffer("calls", torch.zeros(()))
        self.xdims = xdims

    def forward(self, x, idx=None, target=None, scale=None, flag=None):
        f = self.f
        if f.function == "input":
            x = Times2.apply(x)
        outs = run_steps(self.body, self.body.prog, x, idx)
        if f.write is not None:
            w = apply_write(outs[1], f.write)
            outs = (outs[0] + (w * w).mean(), w, *outs[2:])
        loss, first = outs[0], outs[1]
        if f.function == "grad":
            first = Times2.apply(first)
            loss = loss + first.mean()
        if f.dropout is not None:
            loss = loss + F.dropout(first, f.dropout[0], training=f.dropout[1]).sum() * 0.1
        if f.soft_ce:
            logits = self.head(x)  # [..., C]
            if logits.dim() == 3:
                logits = logits.transpose(1, 2)  # [N, C, L]: one loss per position
            loss = loss + F.cross_entropy(logits, target)
        if scale is not None:
            loss = loss * scale
        if flag is not None:
            loss = loss + (first.mean() if flag else first.sum() * 0.01)
        if f.buffer:
            self.calls.add_(1)
            loss = loss * self.calls
        if f.div_shape:
            loss = loss / x.shape[0]
        return (loss, *outs[1:])


WRITES = ["index", "index_src", "slice", "slice_step", "mask", "scatter", "scatter_add", "copy", "fill",
          "index_put", "alias"]


def draw_write(seed: int, shape: list) -> tuple | None:
    """(family, dim, i, start, length) of a write into a tensor of ``shape`` (from its own
    stream, so the other features of a seed do not change)."""
    r = random.Random(f"fuzz-write-{seed}")
    dims = [k for k, n in enumerate(shape) if n >= 2]
    if not dims:
        return None
    d = r.choice(dims)
    n = shape[d]
    start = r.randrange(n - 1)
    return r.choice(WRITES), d, r.randrange(n), start, r.randint(1, n - start - 1) if n - start > 1 else 1


def apply_write(v, spec):
    """A clone of ``v`` written in place as ``spec`` says, plus a view of it taken before the
    write (which must see the write) read after it."""
    fam, d, i, start, length = spec
    n = v.shape[d]
    at = lambda k: (slice(None),) * d + (k,)  # noqa: E731
    z = torch.sin(v)
    y = v.clone()
    before = y.select(d, i)
    if fam == "index":
        y[at(i)] = 0.75
    elif fam == "index_src":
        y[at(i)] = z.select(d, (i + 1) % n) * 2
    elif fam == "slice":
        y[at(slice(start, start + length))] = z.narrow(d, n - length, length)
    elif fam == "slice_step":
        y[at(slice(start, None, 2))] = z.narrow(d, 0, len(range(start, n, 2)))
    elif fam == "mask":
        y.masked_fill_(z.detach() > 0.3, -0.5)
    elif fam == "scatter":
        y.scatter_(d, z.detach().argsort(dim=d), z * 0.5)
    elif fam == "scatter_add":
        y.scatter_add_(d, (z.detach() * 7).long().remainder(n), z)
    elif fam == "copy":
        y.narrow(d, 1, n - 1).copy_(z.narrow(d, 0, n - 1))
    elif fam == "fill":
        y.narrow(d, start, length).fill_(1.25)
    elif fam == "index_put":
        y[at(torch.tensor([i, (i + 1) % n]))] = z.narrow(d, 0, 2) + 1
    else:  # "alias": an update of the whole tensor, read through the view taken before it
        y.mul_(z)
    return y + before.unsqueeze(d) * 0.1


@dataclass
class Case:
    prog: object
    feats: Features
    model: Fuzz
    args: tuple
    kwargs: dict
    dims: dict
    outcomes: list = field(default_factory=list)


def make_case(seed: int) -> Case:
    r = random.Random(f"fuzz-{seed}")
    prog = Gen(50_000 + seed).build()
    feats = draw_features(r)
    feats.write = draw_write(seed, prog.shape(prog.syms[prog.outputs[0]].dims))
    xshape = prog.shape(prog.inputs["x"])
    torch.manual_seed(seed)
    model = Fuzz(prog, feats, len(xshape), xshape[-1])
    args = make_args(prog, 60_000 + seed)
    kwargs = {"idx": args[1]} if len(args) > 1 else {}
    dims = prog.dims_arg()
    dims = {("body." + k if k not in prog.inputs else k): v for k, v in dims.items()}
    g = torch.Generator().manual_seed(seed)
    if feats.soft_ce:
        if len(xshape) == 3:
            tshape = [xshape[0], CLASSES, xshape[1]]
            dims["target"] = f"{dims['x'].split()[0]} cls {dims['x'].split()[1]}"
        else:
            tshape = [xshape[0], CLASSES] if len(xshape) == 2 else [CLASSES]
            dims["target"] = " ".join(dims["x"].split()[:-1] + ["cls"])
        kwargs["target"] = torch.softmax(torch.randn(tshape, generator=g), 1 if len(tshape) > 1 else 0)
        dims["head.weight"] = f"cls {dims['x'].split()[-1]}"
        dims["head.bias"] = "cls"
    if feats.scale is not None:
        kwargs["scale"] = feats.scale
    if feats.flag is not None:
        kwargs["flag"] = feats.flag
    return Case(prog, feats, model, (args[0],), kwargs, dims)


def reference(model, args, kwargs):
    """Single-device outputs and parameter gradients (a copy of the model: buffers untouched)."""
    m = copy.deepcopy(model)
    out = m(*args, **kwargs)
    out[0].backward()
    return tuple(o.detach() for o in out), {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                                            for n, p in m.named_parameters()}


def reference64(model, args, kwargs):
    as64 = lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    return reference(copy.deepcopy(model).double(), tuple(map(as64, args)), {k: as64(v) for k, v in kwargs.items()})


def layouts(c: Case, r: random.Random) -> list:
    """Two (mesh, layout) pairs the generator predicts valid: the batch (x's first dim) on a
    data axis where it divides, and a random valid layout of the program's dims."""
    p = c.prog
    first = p.inputs["x"][0][0]
    out = []
    mesh = r.choice(MESHES)
    axis = next(iter(mesh))
    out.append((mesh, {first: axis} if p.sizes[first] % mesh[axis] == 0 and predict(p, mesh, {first: axis})[0] is None
                else {}))
    for _ in range(20):
        mesh, lay = random_layout(r, p)
        if predict(p, mesh, lay)[0] is None and lay:
            out.append((mesh, lay))
            break
    return out


def write_layouts(c: Case, r: random.Random) -> list:
    """(mesh, layout) pairs that split the written dim: one per mesh kind of the property suite
    (on {a: 2, b: 2} with a random other dim on the other axis, and split on both axes), and on
    {x: 2} one that leaves it whole and splits another dim; those the generator predicts valid."""
    p, w = c.prog, c.feats.write
    if w is None:
        return []
    leaves = p.leaves(p.syms[p.outputs[0]].dims[w[1]])
    name = leaves[0] if leaves and leaves[0] in p.names() else None
    if name is None:
        return []
    out = []
    for mesh in MESHES:
        axes = list(mesh)
        lay = {name: axes[0]}
        others = [n for n in p.names() if n != name]
        if len(axes) > 1 and others:
            lay[r.choice(others)] = axes[1]
        if predict(p, mesh, lay)[0] is not None:
            lay = {name: axes[0]}
        tries = [lay] + ([{name: tuple(axes)}] if len(axes) > 1 else [])  # and split on both axes
        if mesh == {"x": 2} and others:  # and whole, another dim split
            tries.append({r.choice(others): "x"})
        out += [(mesh, t) for t in tries if predict(p, mesh, t)[0] is None]
    return out


def mismatched_calls(c: Case) -> list:
    """(what, args, kwargs, input name) calls that differ from the planned one in one input."""
    x = c.args[0]
    calls = [("batch", (torch.randn((x.shape[0] * 2, *x.shape[1:])),), "x"),
             ("dtype", (x.double(),), "x")]
    calls = [(w, a, dict(c.kwargs), n) for w, a, n in calls]
    if "idx" in c.kwargs:
        calls.append(("index dtype", c.args, {**c.kwargs, "idx": c.kwargs["idx"].int()}, "idx"))
    if c.feats.scale is not None:
        calls.append(("scale", c.args, {**c.kwargs, "scale": c.feats.scale + 1.0}, "scale"))
        calls.append(("scale type", c.args, {**c.kwargs, "scale": int(c.feats.scale) or 1}, "scale"))
    if c.feats.flag is not None:
        calls.append(("flag", c.args, {**c.kwargs, "flag": not c.feats.flag}, "flag"))
    if c.feats.soft_ce:
        t = c.kwargs["target"]
        calls.append(("target dtype", c.args, {**c.kwargs, "target": t.double()}, "target"))
    return calls


def plan_for(c: Case, mesh, layout, captured=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        return autoshard.autoshard(c.model, c.args, c.kwargs, mesh=Mesh(dict(mesh)), dims=c.dims, layout=layout,
                                   captured=captured)


def draw(seed: int) -> tuple:
    """Program ``seed``: its case and its (mesh, layout) pairs."""
    c = make_case(seed)
    r = random.Random(f"fuzz-calls-{seed}")
    return c, layouts(c, r) + write_layouts(c, random.Random(f"fuzz-write-layouts-{seed}"))


def expected_outcomes(seed: int) -> list:
    """The outcomes ``run_case(seed)`` records when it passes, from the generator alone (no plan):
    a refusal or a warning, or one per (mesh, layout) pair (the first two exact; a later one,
    which splits the written dim, exact or refused) and one refusal per mismatched call."""
    c, pairs = draw(seed)
    if c.feats.outcome in ("refused", "warned"):
        return [c.feats.outcome]
    exact = "exact" if c.feats.write is None else "exact: write"
    return ([exact if i < 2 else "exact or refused: write" for i in range(len(pairs))]
            + ["refused: " + what for what, *_ in mismatched_calls(c)])


def run_case(seed: int) -> Case:
    c, pairs = draw(seed)
    feats = c.feats
    before = {n: b.clone() for n, b in c.model.named_buffers()}
    if feats.outcome == "refused":
        with pytest.raises(autoshard.UnsupportedModelError) as e:
            plan_for(c, *pairs[0])
        msg = str(e.value)
        assert "\n" not in msg
        assert "Times2" in msg, msg
        for n, b in c.model.named_buffers():
            assert torch.equal(b, before[n]), n
        c.outcomes.append("refused")
        return c
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", autoshard.DropoutWarning)
        first = plan_for(c, *pairs[0])
    dropout_warnings = [w for w in seen if issubclass(w.category, autoshard.DropoutWarning)]
    if feats.outcome == "warned":
        assert len(dropout_warnings) == 1 and "dropout in training mode" in str(dropout_warnings[0].message)
        c.outcomes.append("warned")
        return c
    assert not dropout_warnings, [str(w.message) for w in dropout_warnings]
    ref_out, ref_grads = reference(c.model, c.args, c.kwargs)
    f64 = []

    def exact(k, grad=None):
        def get():
            if not f64:
                f64.append(reference64(c.model, c.args, c.kwargs))
            return f64[0][0][k] if grad is None else f64[0][1][grad]
        return get

    once = copy.deepcopy(c.model)
    once(*c.args, **c.kwargs)
    after = dict(once.named_buffers())  # the buffers as one call of the model leaves them

    def fresh_call(run, what):
        """One simulated call from the planned buffers; it leaves them as the model's call does."""
        with torch.no_grad():
            for n, b in c.model.named_buffers():
                b.copy_(before[n])
        result = run(*c.args, **c.kwargs)
        for n, b in c.model.named_buffers():
            assert torch.equal(b, after[n]), f"{what}: buffer {n} is {b}, the model's call leaves {after[n]}"
        return result

    for i, (mesh, layout) in enumerate(pairs):
        try:
            plan = first if i == 0 else plan_for(c, mesh, layout, captured=first.captured)
        except autoshard.LayoutError as e:
            # exact or refused: a layout of the written dim may be refused, in one line naming the node
            # and module (a pending sum split on two axes cannot become a two-axis split in this order)
            msg = str(e)
            assert i >= 2 and "\n" not in msg and "node " in msg and " in module '" in msg, msg
            c.outcomes.append("refused: write")
            continue
        if i < 2:  # the layouts that split the written dim check the outputs of simulate_grads alone
            out = fresh_call(plan.simulate, f"{mesh} {layout}: simulate")
            for k, (o, ref) in enumerate(zip(out, ref_out)):
                close(o, ref, f"{mesh} {layout}: simulate output {k}", exact(k))
        out, grads = fresh_call(plan.simulate_grads, f"{mesh} {layout}: simulate_grads")
        for k, (o, ref) in enumerate(zip(out, ref_out)):
            close(o, ref, f"{mesh} {layout}: simulate_grads output {k}", exact(k))
        for n, g in ref_grads.items():
            close(grads[n], g, f"{mesh} {layout}: grad of {n}", exact(0, n))
        c.outcomes.append("exact" if feats.write is None else "exact: write")
    for what, args, kwargs, name in mismatched_calls(c):
        with pytest.raises(autoshard.InputMismatchError, match=rf"^input {name} ") as e:
            first.simulate(*args, **kwargs)
        assert "\n" not in str(e.value)
        c.outcomes.append("refused: " + what)
    return c


@pytest.mark.parametrize("seed", range(N_PROGRAMS), ids=lambda s: f"fuzz_{s}")
def test_fuzz_program(seed):
    try:
        c = run_case(seed)
    except Exception as e:
        c = make_case(seed)
        raise AssertionError(f"fuzz program {seed} ({c.feats.describe()}; expected {c.feats.outcome}):\n"
                             f"{program_source(c.prog)}\n{type(e).__name__}: {e}") from e
    expected = expected_outcomes(seed)
    assert len(c.outcomes) == len(expected) and all(o == e or e == "exact or refused: write" and o.endswith(": write")
                                                    for o, e in zip(c.outcomes, expected)), (c.outcomes, expected)


def test_fuzz_summary():
    """At least 300 checked cases, with every outcome kind represented. Each seed test asserts
    that its outcomes are the expected ones, so these counts, taken from the generator alone
    (``expected_outcomes``: no plan), are the outcome counts of the seed tests."""
    outcomes = {seed: expected_outcomes(seed) for seed in range(N_PROGRAMS)}
    counts = Counter(o.split(":")[0] for outs in outcomes.values() for o in outs)
    print(f"\nfuzz: {N_PROGRAMS} programs, {sum(counts.values())} cases: {dict(Counter(o for v in outcomes.values() for o in v))}")
    writes = Counter(o for outs in outcomes.values() for o in outs if o.endswith(": write"))
    assert sum(counts.values()) >= 300, counts
    assert counts["exact"] >= 50 and counts["refused"] >= 100 and counts["warned"] >= 1, counts
    # planned programs with an in-place write, each exact or refused (LayoutError)
    assert sum(writes.values()) >= 200 * N_PROGRAMS // 60, writes
