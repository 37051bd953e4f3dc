"""The search's space taken lazily (cost/lazy_search.py, cost/lazy_product.py).

- ``LazyProduct`` yields every combination once, in order of the sum of its values.
- The bound of a combination is at most the search's own lower bound (compute + optimizer +
  communication) of each of its candidates, on every candidate of a two-axis training space
  with every ZeRO stage: so the combinations the lazy order never takes are bounded out. So is
  the combination's own bound, which counts the floor of options with fragile names where the
  others hold none of them (HF Llama with grouped-query attention).
- On Hugging Face models with only the inputs named, the lazy order returns the same plans as the
  whole enumeration, having taken a small part of the product.
(Optimality against brute force, both ways: tests/test_search_exhaustive.py.)
"""
import itertools
import random
import sys

import pytest

import autoshard
from autoshard import Mesh
from autoshard.cost import load_hardware
from autoshard.cost.lazy_product import LazyProduct
from autoshard.cost.lazy_search import LazyCandidates, product_size
from autoshard.cost.model import CostModel
from autoshard.cost.search import SearchSpace, search_layout

from tests.helpers import plain_models
from tests.helpers.search_cases import hf_planned, inputs_only, prepared


@pytest.mark.parametrize("seed", range(30))
def test_lazy_product_yields_each_combination_once_in_order_of_its_sum(seed):
    r = random.Random(seed)
    lists = [sorted(r.choice([0.0, 0.5, 1.0, 2.5, 4.0]) for _ in range(r.randint(1, 6)))
             for _ in range(r.randint(1, 4))]
    got = list(LazyProduct(lists))
    sums = [s for s, _ in got]
    assert sums == sorted(sums)
    assert sorted(idx for _, idx in got) == list(itertools.product(*(range(len(v)) for v in lists)))
    assert all(s == sum(v[i] for v, i in zip(lists, idx)) for s, idx in got)


def test_lazy_product_refuses_unsorted_values():
    with pytest.raises(ValueError, match="sorted"):
        LazyProduct([[1.0, 0.0]])




def test_a_combinations_bound_is_at_most_each_of_its_candidates_own_bound():
    """Every candidate (each ZeRO stage) of the plain GPT with only its inputs named on
    dp=2 x tp=2: the lazy bound <= compute bound + optimizer phase + communication bound, the
    bound the search itself stops on. The one-axis records are rewritten whole (no budget)."""
    cap, info = prepared(*inputs_only(plain_models.gpt()))
    space = SearchSpace(cap.graph, cap.inputs, info, Mesh({"dp": 2, "tp": 2}), CostModel(load_hardware("h100")),
                        train=True)
    lazy = LazyCandidates(space)
    checked = 0
    for c in space.space():
        try:
            own = space.compute_bound(c) + space.optimizer_bound(c) + space.comm_bound(c)
        except autoshard.LayoutError:
            continue
        # both sides are float sums of the same non-negative terms or smaller ones, in other orders
        # (a few hundred terms): a rounding slack of that many ulps, nothing more
        assert lazy.bound(c) <= own * (1 + 512 * sys.float_info.epsilon), (c.describe(), lazy.bound(c), own)
        checked += 1
    assert checked > 1000
    # and it is not vacuous: most combinations carry a positive communication floor
    assert sum(v > 0 for v in lazy.floor.values()) > len(lazy.floor) / 2


def test_a_combinations_own_bound_is_at_most_each_of_its_candidates_own_bound():
    """HF Llama (2 kv heads for 4 query heads) with only its inputs named, dp=2 x tp=2: options
    holding a head name are fragile (split inside the head when the name is on both axes), floor
    0 in the lazy order. A combination putting none of their names on the other axis counts their
    own floor (``LazyCandidates.combination_bound``): still at most each candidate's own bound, on
    1,500 combinations drawn at random, every ZeRO stage; and above the order's bound on many."""
    _, space = hf_planned("llama", {"dp": 2, "tp": 2})
    lazy = LazyCandidates(space)
    r = random.Random(0)
    slack = 1 + 512 * sys.float_info.epsilon  # (sums of the same terms in other orders)
    checked = lifted = 0
    opts = space.per_axis_options()
    for _ in range(1500):
        got = space.combination(tuple(r.choice(o) for o in opts))
        if got is None:
            continue
        refined = lazy.combination_bound(got[0].axes)
        for z, rs in space._stage_options:
            c = type(got[0])(got[0].axes, z, rs)
            try:
                own = space.compute_bound(c) + space.optimizer_bound(c) + space.comm_bound(c)
            except autoshard.LayoutError:
                continue
            assert lazy.bound(c) <= refined * slack and refined <= own * slack, (c.describe(), refined, own)
            checked += 1
        lifted += refined > lazy.bound(got[0]) * slack
    assert checked > 400 and lifted > 20, (checked, lifted)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_lazy_order_returns_the_plans_of_the_whole_enumeration(arch):
    """autoshard() takes these spaces (products of tens of thousands) lazily; the whole
    enumeration of the same space returns the same candidates with the same costs."""
    plan, space = hf_planned(arch, {"dp": 2, "tp": 2})
    lazy = plan.search
    assert lazy.taken is not None
    eager = search_layout(space, lazy=False)
    assert eager.taken is None
    assert [e.candidate for e in [eager.best] + eager.alternatives] == [e.candidate for e in [lazy.best] + lazy.alternatives]
    assert [e.cost.step_time for e in [eager.best] + eager.alternatives] == \
        [e.cost.step_time for e in [lazy.best] + lazy.alternatives]
    assert lazy.taken < product_size(space) / 20
