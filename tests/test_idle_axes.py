"""A plan that leaves a mesh axis idle says so: one IdleAxisWarning naming every idle axis, and a
sentence in plan.explain() and print(plan) (computed when asked: it costs another rewrite) with the compute that splitting the batch there would
save and the communication it would cost (the plan's cost model, in ms or us)."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import autoshard
from autoshard import Mesh


class TwoLayer(torch.nn.Module):
    """2 layers, hidden 32: too small for a split batch to pay for its gradient all-reduce."""

    def __init__(self, hidden=32):
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def _plan(**options):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.autoshard(TwoLayer(), (torch.randn(8, 32),), mesh=Mesh({"dp": 2, "tp": 2}),
                                   dims={"x": "batch hidden"}, train=True, **options)
    return plan, [w for w in caught if issubclass(w.category, autoshard.IdleAxisWarning)]


def _ms(text: str) -> float:
    value, unit = text.split()
    return float(value) * (1e-3 if unit == "ms" else 1e-6)


TIME = r"(-?[0-9.]+ (?:ms|us))"


def test_a_searched_plan_that_splits_nothing_names_its_idle_axes_with_their_price():
    plan, caught = _plan()
    assert plan.layout.get("batch") in (None, ())  # the search kept everything whole at this size
    assert len(caught) == 1 and "mesh axes dp, tp idle: their ranks repeat each other's work" in str(caught[0].message)
    for axis in ("dp", "tp"):
        m = re.search(rf"{axis} is idle \(its 2 ranks repeat the same work\): splitting batch on {axis} would save "
                      rf"{TIME} of compute per rank and cost {TIME} of communication on {axis} \(all_reduce x\d+\) "
                      rf"at this size\.", plan.explain())
        assert m, plan.explain()
        assert m.group(0) in str(plan)
        # the figures are the cost model's for the plan with the batch split there, planned here by the API
        alt = autoshard.autoshard(TwoLayer(), (torch.randn(8, 32),), mesh=Mesh({"dp": 2, "tp": 2}),
                                  dims={"x": "batch hidden"}, train=True, layout={"batch": axis})
        chosen = plan.cost
        saved = chosen["compute"] - alt.cost["compute"]
        comm = sum(t for (a, _), t in alt.cost["comm_total"].items() if a == axis)
        assert _ms(m.group(1)) == pytest.approx(saved, rel=1e-3, abs=1e-9)
        assert _ms(m.group(2)) == pytest.approx(comm, rel=1e-3, abs=1e-9)
        assert alt.cost["step_time"] >= chosen["step_time"]  # why the search left it idle
        assert comm > 0 and saved >= 0


def test_a_plan_that_uses_every_axis_says_nothing():
    plan, caught = _plan(layout={"batch": "dp", "up.weight:0": "tp"})
    assert caught == [] and "idle" not in plan.explain() and "Idle mesh axes" not in str(plan)


def test_a_given_layout_that_leaves_an_axis_idle_warns_for_that_axis_only():
    plan, caught = _plan(layout={"batch": "dp"}, zero_stage=3)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "mesh axis tp idle: its ranks" in text and "dp" not in text  # dp splits the batch (and ZeRO state)
    assert "tp is idle" in plan.explain() and "dp is idle" not in plan.explain()
    assert "Idle mesh axes\ntp is idle" in str(plan)
