"""Grouped-query attention with fewer kv heads than tensor-parallel ranks (cost/gqa.py).

A Llama with 16 query heads and 2 kv heads on tp=4: attention may stay whole, split its query
heads with the k/v projections whole on every rank (kv replicated), or split the k/v projections
inside a kv head and gather them (kv split). The search holds all three; on a toy device whose
links have a per-step latency that makes the three trade places, it picks the one the cost model
prices fastest when each is built and costed on its own, the picked plan is exact, and
``plan.explain()`` says which variant won and why.
"""
import pytest

import autoshard
from autoshard import Mesh
from autoshard.cost import DeviceSpec, Hardware, LinkSpec
from autoshard.cost.gqa import VARIANTS, gqa_groups, gqa_variants, variant_of

from examples.models import llama_tiny
from tests.helpers.exactness import assert_grads_within_spread


def toy(latency: float) -> Hardware:
    """Slow device (splitting work pays) and links whose per-step latency decides between one
    all-reduce more (query heads split) and the k/v gathers (kv split)."""
    return Hardware("toy", DeviceSpec("toy", {"fp32": 1e9}, mem_bandwidth=1e10, mem_capacity=1e12),
                    (LinkSpec(1e11, latency=latency, name="link"),))


def gqa_model():
    return llama_tiny(with_labels=True, num_heads=16, num_kv_heads=2, hidden_size=64, intermediate_size=256,
                      batch=2, seq=16)


def searched(latency):
    model, args, dims = gqa_model()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, train=True, hardware=toy(latency),
                               layout={"batch": None, "seq": None}, search=True)
    return model, args, plan


def test_the_kv_heads_and_query_heads_are_one_group_on_tp4():
    model, args, dims = gqa_model()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, layout={"heads": "tp"})
    [g] = gqa_groups(plan.info, plan.mesh)
    assert (g.axis, g.ranks, g.kv_heads, g.query, g.kv) == ("tp", 4, 2, ("heads",), ("kv_heads",))
    assert variant_of(plan.layout, g) == "kv replicated"
    # on tp=2 the kv heads split whole: no group (the ordinary Megatron split)
    plan2 = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, layout={"heads": "tp"})
    assert gqa_groups(plan2.info, plan2.mesh) == []


def test_search_picks_the_variant_the_cost_model_prices_fastest():
    """Each variant rebuilt from the plan's layout and costed on its own (gqa_variants: the
    rewrite and cost model, nothing GQA-specific): the search's choice is the cheapest, and
    across three link latencies each variant wins once (so the choice is made, not fixed)."""
    winners = {}
    for latency in (2e-5, 6e-5, 1e-4):
        model, args, plan = searched(latency)
        [g] = gqa_groups(plan.info, plan.mesh)
        costs = gqa_variants(plan, g)
        assert set(costs) == set(VARIANTS)
        chosen = variant_of(plan.layout, g)
        times = {v: c.step_time for v, c in costs.items()}
        assert chosen == min(times, key=times.get), (latency, times, plan.search.best.candidate.describe())
        assert times[chosen] == pytest.approx(plan.cost["step_time"], rel=1e-9)
        winners[latency] = chosen
    assert set(winners.values()) == set(VARIANTS), winners


def test_kv_replicated_plan_is_exact_and_explained():
    model, args, plan = searched(6e-5)
    [g] = gqa_groups(plan.info, plan.mesh)
    assert variant_of(plan.layout, g) == "kv replicated"
    assert plan.layout["heads"] == ("tp",) and not plan.layout["kv_heads"]
    out, grads = plan.simulate_grads(*args)
    assert_grads_within_spread(out, grads, model, args)
    text = plan.explain()
    costs = gqa_variants(plan, g)
    line = next(l for l in text.splitlines() if l.startswith("Attention with 2 kv heads on tp (4 ranks)"))
    assert "kv replicated (query heads split, k/v projections whole on every rank" in line
    ms = lambda v: f"{costs[v].step_time * 1e3:.3f} ms"
    assert f"predicted {ms('kv replicated')}" in line
    assert f"kv split {ms('kv split')}" in line and f"attention whole {ms('attention whole')}" in line
    nxt = min(("kv split", "attention whole"), key=lambda v: costs[v].step_time)
    assert f"Against {nxt}:" in line


def test_no_gqa_sentence_when_the_user_fixed_the_heads():
    model, args, dims = gqa_model()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, train=True, hardware=toy(6e-5),
                               layout={"batch": None, "seq": None, "heads": "tp"}, search=True)
    assert "kv heads on tp" not in plan.explain()
