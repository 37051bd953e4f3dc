"""Property test: random small programs x random layouts, checked against one device.

Each case is a seeded random program (an ``nn.Module`` built from matmuls / linears / bmm,
broadcasting elementwise ops, reductions, split/merge reshapes, transposes, softmax and
embeddings) with every input and parameter dim named, planned under several random layouts on
the meshes {x: 2}, {x: 4} and {a: 2, b: 2}. For each (program, layout) pair:

- the generator predicts, independently of the library, whether the layout is valid: it knows
  which logical dims every tensor of the program holds and their sizes, so it knows which
  layouts ask one mesh axis to shard two dims of one tensor and which sizes do not divide;
- a rejected layout must raise ``autoshard.LayoutError`` of the predicted kind (message checked);
- an accepted layout must reproduce the single-device outputs and every parameter gradient
  (``simulate`` and ``simulate_grads``).

Reproduce one program with ``pytest tests/test_property.py -k seed_17`` (a failure prints the
program's source and the failing layouts); ``-s`` prints the predicted outcome counts of the
summary test. ``python -m tests.test_property 17`` (from the repository root) prints program 17,
its layouts and the predicted outcome of each. Open library bugs (``KNOWN_BUGS``) make their
programs xfail, recognised by their signature in the plan.
"""
from __future__ import annotations

import copy
import os
import random
import re
import sys
import warnings
from collections import Counter

import pytest
import torch

import autoshard
from autoshard import LayoutError, Mesh
from autoshard.ownership import Partial
from tests.helpers.exactness import close
from tests.helpers.programs import (Gen, Program, axes_of, make, make_args, predict, predict_units, program_source,
                                    random_layout, sharded_anything)

# More programs for a longer search: AUTOSHARD_PROPERTY_PROGRAMS=1000 pytest tests/test_property.py
N_PROGRAMS = int(os.environ.get("AUTOSHARD_PROPERTY_PROGRAMS", "120"))
LAYOUTS_PER_PROGRAM = 4

# Error kinds (documented messages of autoshard.LayoutError).
KIND_PATTERNS = {
    "two_dims": "would shard two dims of one tensor",
    "divisibility": "cannot split evenly",
    "unknown_axis": "names mesh axis",
    "unknown_dim": "which no tensor has",
    "repeat_axis": "repeats a mesh axis",
}


def kind_of(message: str) -> str | None:
    for kind, pattern in KIND_PATTERNS.items():
        if pattern in message:
            return kind
    return None


# =========================================================================== running a case


def reference(model, args):
    model.zero_grad(set_to_none=True)
    out = model(*args)
    out[0].backward()
    grads = {n: (q.grad.clone() if q.grad is not None else torch.zeros_like(q)) for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return tuple(o.detach() for o in out), grads


class Reference:
    """Single-device outputs and gradients in float32, and (only when needed) in float64."""

    def __init__(self, model, args):
        self.model, self.args = model, args
        self.out, self.grads = reference(model, args)
        self._f64 = None

    def f64(self):
        if self._f64 is None:
            m = copy.deepcopy(self.model).double()
            a = tuple(t.double() if t.is_floating_point() else t for t in self.args)
            self._f64 = reference(m, a)
        return self._f64


def check_case(p, model, args, ref, mesh_axes, layout, case_info) -> str:
    """Plan one layout and check it; returns the outcome, raises AssertionError on a mismatch."""
    expected, detail = predict(p, mesh_axes, layout)
    mesh = Mesh(dict(mesh_axes))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
            plan = autoshard.autoshard(model, make_args(p, p.seed + 20_000), mesh=mesh, dims=p.dims_arg(),
                                       layout=layout)
    except LayoutError as e:
        msg = str(e)
        kind = kind_of(msg)
        assert kind is not None, f"LayoutError of no documented kind: {msg}"
        assert expected is not None, f"valid layout rejected ({kind}): {msg}"
        assert kind == expected, f"expected a {expected} rejection ({detail}), got: {msg}"
        if kind == "two_dims":
            m = re.search(r"mesh axis '(\w+)' would shard two dims of one tensor, '([^']+)' \(dim \d+\) and "
                          r"'([^']+)' \(dim \d+\)", msg)
            assert m, msg
            axis, n1, n2 = m.groups()
            assert any(a == axis for a, _ in detail), (detail, msg)
            for n in (n1, n2):
                parts = n.split("*")
                if all(part in p.names() for part in parts):  # names of atoms nobody named are inferred
                    atoms = p.leaves(tuple(parts))
                    assert any(atoms[:len(u)] == u for u in predict_units(p, mesh_axes, layout)[axis]), (n, msg)
            if n1 == n2:  # one logical dim twice in one tensor (q @ k^T): a legitimate rejection
                return "rejected:two_dims (one dim twice)"
        elif kind == "divisibility":
            assert f"dim {detail!r} has size {p.sizes[detail]}" in msg, msg
        elif kind in ("unknown_axis", "unknown_dim"):
            assert repr(detail) in msg, msg
        return f"rejected:{kind}"
    assert expected is None, f"expected a {expected} rejection ({detail}), but it planned:\n{plan}"
    for name, v in layout.items():
        # axes that split one dim are reported (and nest) in mesh order
        assert plan.layout[name] == tuple(sorted(axes_of(v), key=list(mesh_axes).index)), (name, plan.layout)
    case_info["signatures"] = bug_signatures(plan)
    ref_out, ref_grads = ref.out, ref.grads
    assert {c.kind for c in plan.collectives} <= {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    for c in plan.collectives:
        assert c.phase in ("forward", "backward") and set(c.axes) <= set(mesh_axes) and c.why
    if not sharded_anything(layout):
        assert not plan.collectives, [c.why for c in plan.collectives]
    out = plan.simulate(*args)
    assert len(out) == len(ref_out)
    for k, (o, r) in enumerate(zip(out, ref_out)):
        close(o, r, f"simulate output {k}", lambda: ref.f64()[0][k])
    out, grads = plan.simulate_grads(*args)
    for k, (o, r) in enumerate(zip(out, ref_out)):
        close(o, r, f"simulate_grads output {k}", lambda: ref.f64()[0][k])
    assert set(ref_grads) <= set(grads), (set(ref_grads), set(grads))
    for name, g in ref_grads.items():
        close(grads[name], g, f"grad of {name}", lambda: ref.f64()[1][name])
    return "planned"


def layouts_for(seed: int, p: Program):
    r = random.Random(f"layouts-{seed}")
    return [random_layout(r, p) for _ in range(LAYOUTS_PER_PROGRAM)]


def run_program(seed: int):
    """Every layout of program ``seed``: (outcomes, failures, known-bug failures)."""
    p, model, args = make(seed)
    ref = Reference(model, args)
    outcomes, failures, known = [], [], []
    for i, (mesh_axes, layout) in enumerate(layouts_for(seed, p)):
        try:
            info = {}
            outcomes.append(check_case(p, model, args, ref, mesh_axes, layout, info))
        except Exception as e:  # noqa: BLE001 - every failure is reported with its case
            # A numeric mismatch in a plan that shows a bug's signature is named after the bug.
            sigs = info.get("signatures", set()) if isinstance(e, AssertionError) and "not close" in str(e) else set()
            text = f"layout #{i} on {mesh_axes}: {layout}\n  {type(e).__name__}: {e}"
            if sigs:
                text += "\n  the plan shows the signature of: " + "; ".join(f"{b} ({BUG_SIGNATURES[b]})" for b in sorted(sigs))
            if sigs and sigs <= KNOWN_BUGS:
                bug = ", ".join(sorted(sigs))
                known.append((bug, text))
                outcomes.append(f"known_bug:{bug}")
            else:
                failures.append((None, text))
                outcomes.append("FAILED")
    return p, outcomes, failures, known


# Library bugs this test found. A plan that shows a bug's signature and gets a wrong result
# fails with the bug named; bugs listed in KNOWN_BUGS (none at present) xfail instead, until
# they are fixed. Signature -> minimal reproducer.
BUG_SIGNATURES = {
    # Fixed in 34fe494: add.Tensor / sub.Tensor with a Python scalar let a Partial value through,
    # so the scalar was added once per rank.
    "scalar-add-on-partial": "(x @ W + 1.0).sum(), dims {'x': 'b k', 'W': 'k n'}, layout {'k': 'x'} on Mesh({'x': 2})",
    # Fixed in 34fe494: linear let a Partial input through but added the replicated bias on
    # every rank.
    "bias-on-partial-passthrough": "F.linear(x @ W1, W2, b2).sum(), layout {'k': 'x'} (k the contracted dim of "
                                   "x @ W1) on Mesh({'x': 2})",
}
KNOWN_BUGS: set = set()  # signatures of open bugs: their cases xfail
# Also found, now fixed: layout {"n": ("b", "a")} on Mesh({"a": 2, "b": 2}) was refused ("would
# reorder blocks") when a reshape split n; resolve_layout now puts a dim's axes in mesh order.


def bug_signatures(plan) -> set:
    """Which known-bug patterns the plan contains (read from its placements)."""
    aten = torch.ops.aten
    places = plan.program.placements
    found = set()
    for node in plan.captured.graph.nodes:
        if node.op != "call_function" or node.name not in places:
            continue
        out = places[node.name][0]
        partial = [i for i, o in enumerate(out) if isinstance(o, Partial)]
        if not partial:
            continue
        if node.target in (aten.add.Tensor, aten.sub.Tensor) and \
                any(not isinstance(a, torch.fx.Node) for a in node.args[:2]):
            found.add("scalar-add-on-partial")
        bias = {aten.linear.default: (0, 2), aten.addmm.default: (1, 0), aten.baddbmm.default: (1, 0)}.get(node.target)
        if bias and len(node.args) > max(bias) and isinstance(node.args[bias[1]], torch.fx.Node):
            x = node.args[bias[0]]
            if x.name in places and any(isinstance(places[x.name][0][i], Partial) for i in partial):
                found.add("bias-on-partial-passthrough")
    return found


@pytest.mark.parametrize("seed", range(N_PROGRAMS), ids=lambda s: f"seed_{s:0{len(str(N_PROGRAMS - 1))}d}")
def test_random_program(seed):
    p, outcomes, failures, known = run_program(seed)
    if failures:
        pytest.fail(f"program {seed}:\n{program_source(p)}\n\n" + "\n".join(t for _, t in failures))
    if known:
        pytest.xfail("known library bug(s): " + "; ".join(sorted({b for b, _ in known})))


def test_summary():
    """The (program, layout) cases cover every outcome the oracle knows: enough cases, most of
    them planned, and rejections of both main kinds. Each seed test asserts that the library's
    outcome (planned, or a LayoutError of the kind) is the predicted one, so these counts, taken
    from the generator and the oracle alone (no plan), are the outcome counts of the seed tests."""
    counts = Counter()
    for seed in range(N_PROGRAMS):
        p = Gen(seed).build()
        for mesh_axes, layout in layouts_for(seed, p):
            kind = predict(p, mesh_axes, layout)[0]
            counts["planned" if kind is None else f"rejected:{kind}"] += 1
    total = sum(counts.values())
    print(f"\nproperty test: {N_PROGRAMS} programs, {total} (program, layout) cases")
    for k, n in sorted(counts.items()):
        print(f"  {k:50s} {n}")
    assert total >= 200
    assert counts["planned"] >= 100, counts
    assert counts["rejected:two_dims"] > 0, counts
    assert counts["rejected:divisibility"] > 0, counts


if __name__ == "__main__":
    for s in [int(a) for a in sys.argv[1:]] or [0]:
        prog, _, _ = make(s)
        print(program_source(prog))
        for m, lay in layouts_for(s, prog):
            print("  layout", m, lay, "->", predict(prog, m, lay)[0])
