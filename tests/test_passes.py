"""The program passes run from one ordered list (passes/manager.py): plan.passes records what
each did, disable_passes= switches passes off by name (and refuses unknown names), and the data
flow in docs/architecture.md lists them in the order they run."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import autoshard
from autoshard.passes.manager import PROGRAM_PASSES
from examples.models import llama_tiny

NAMES = [p.name for p in PROGRAM_PASSES]


def _plan(**options):
    model, args, dims = llama_tiny(with_labels=True)
    return autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, **options)


def test_plan_passes_records_every_pass_in_order_with_what_it_changed():
    plan = _plan()
    assert [r.name for r in plan.passes] == NAMES
    ran = {r.name: r for r in plan.passes if r.ran}
    # the token count's sum starts early, the loss is returned lazily, column-parallel input
    # gradients overlap their weight gradients, row-parallel sums go into their inputs
    assert set(ran) >= {"early_sums", "output_sums", "overlap_linear", "inplace_sums"}
    for r in ran.values():
        if r.collectives:
            assert r.nodes > 0, r
    for name, suffix in ((p.name, p.suffix) for p in PROGRAM_PASSES):
        marked = [c for c in plan.collectives if c.why.endswith(suffix) or suffix + ";" in c.why]
        assert (len({c.tag for c in marked}) >= 1) == bool(name in ran and ran[name].collectives), name


def test_disable_passes_switches_passes_off_by_name():
    plan = _plan(disable_passes=("overlap_linear", "early_sums"))
    off = {r.name: r for r in plan.passes if not r.ran}
    assert set(off) >= {"overlap_linear", "early_sums"} and off["early_sums"].why_not == "disabled"
    overlap = next(p for p in PROGRAM_PASSES if p.name == "overlap_linear")
    assert not any(overlap.suffix in c.why for c in plan.collectives)


def test_an_unknown_pass_name_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"disable_passes names \['overlap'\], which are not passes; the passes "
                                         r"are \['early_sums', 'output_sums', 'overlap_linear', 'inplace_sums', "
                                         r"'param_sums'\]"):
        _plan(disable_passes=("overlap",))


def test_the_architecture_data_flow_lists_the_passes_in_the_order_they_run():
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    flow = text[text.index("## Data flow"):]
    flow = flow[:flow.index("```", flow.index("```") + 3)]
    found = [m.group(1) for m in re.finditer(r"passes/(\w+)\.py", flow) if m.group(1) in NAMES]
    assert found == NAMES, found
