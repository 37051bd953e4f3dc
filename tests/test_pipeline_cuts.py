"""Pipeline cuts chosen by the cost model: a heavy head gets fewer blocks, and on small
graphs the chosen cuts are the brute-force optimum of the cost model's objective.

The brute force below enumerates every set of cut points and scores it with its own code
(slowest stage's forward+backward compute, then boundary bytes, then earliest cuts, as
documented in ``autoshard.cost.pipeline.cut_key``); it shares only the per-unit costs (the
cost model's op times) with the planner."""
import itertools
import math
import random

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.cost.model import resolve_cost_model
from autoshard.cost.pipeline import choose_cuts, unit_seconds
from autoshard.passes.pipeline import cut_profile
from autoshard.pipeline_plan import best_cuts

from examples.models import gpt2_tiny, llama_tiny


def brute_force(units, nbytes, allowed, stages):
    """Every choice of ``stages - 1`` allowed cut indices; the best by (slowest stage, bytes, cuts)."""
    best = None
    for cuts in itertools.combinations([j for j, ok in enumerate(allowed) if ok], stages - 1):
        bounds = [0, *[c + 1 for c in cuts], len(units)]
        slowest = max(3 * math.fsum(units[a:b]) for a, b in zip(bounds, bounds[1:]))
        key = (slowest, sum(nbytes[c] for c in cuts), cuts)
        best = key if best is None or key < best else best
    return list(best[2])


def test_dynamic_program_equals_brute_force_on_random_profiles():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 9)
        units = [rng.choice([0.0, 1.0, 2.0, rng.random()]) for _ in range(n + 1)]  # ties on purpose
        nbytes = [rng.choice([4, 8, 16]) for _ in range(n)]
        allowed = [rng.random() > 0.2 for _ in range(n)]
        stages = rng.randint(1, sum(allowed) + 1)
        assert choose_cuts(units, nbytes, allowed, stages) == brute_force(units, nbytes, allowed, stages), \
            (units, nbytes, allowed, stages)


def captured_plan(make, captured=None, pipeline=None, **config):
    model, args, dims = make(with_labels=True, batch=4, **config)
    if make is llama_tiny:
        args = (args[0], None, args[2])
    return autoshard.autoshard(model, args, mesh=Mesh({"pp": 2}), dims=dims, layout={"batch": None}, train=True,
                               pipeline={"microbatches": 2, **(pipeline or {})}, captured=captured)


# 8 graphs x 2-3 stage counts: 20 cut problems on real programs
GRAPHS = [
    (llama_tiny, dict(num_layers=4)),
    (llama_tiny, dict(num_layers=6, vocab_size=512)),
    (llama_tiny, dict(num_layers=8, vocab_size=4096, hidden_size=16, num_heads=4, num_kv_heads=2)),
    (llama_tiny, dict(num_layers=5, tie_embeddings=True, intermediate_size=256)),
    (llama_tiny, dict(num_layers=3, vocab_size=2048)),
    (gpt2_tiny, dict(num_layers=4)),
    (gpt2_tiny, dict(num_layers=6, vocab_size=1024)),
    (gpt2_tiny, dict(num_layers=3, hidden_size=64, num_heads=4)),
]


@pytest.mark.parametrize("make,config", GRAPHS, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(GRAPHS)])
def test_chosen_cuts_are_the_brute_force_optimum(make, config):
    plan = captured_plan(make, **config)
    prof = cut_profile(plan.program, plan.captured.inputs)
    units = unit_seconds(prof, resolve_cost_model(None))
    assert plan.pipe.cuts == [prof.candidates[j] for j in brute_force(units, prof.cut_bytes, prof.allowed, 2)]
    for stages in (3, 4):
        if sum(prof.allowed) >= stages - 1 and stages <= len(prof.candidates):
            want = [prof.candidates[j] for j in brute_force(units, prof.cut_bytes, prof.allowed, stages)]
            assert best_cuts(plan, "pp", stages) == want


def test_heavy_head_gets_fewer_blocks():
    """Large vocabulary, small hidden: the output projection and loss outweigh blocks, so the
    last stage takes fewer blocks than the first (equal layer counts do not imply equal
    stage times); with a small vocabulary the blocks split evenly."""
    def blocks(plan):
        return [sum(1 for p in s.params if p.startswith("layers.") and p.endswith("q_proj.weight"))
                for s in plan.stages]

    config = dict(num_layers=8, vocab_size=8192, hidden_size=16, num_heads=4, num_kv_heads=2)
    heavy = captured_plan(llama_tiny, **config)
    first, last = blocks(heavy)
    assert first + last == 8 and last < first
    light = captured_plan(llama_tiny, num_layers=8)
    assert blocks(light) == [4, 4]
    # the chosen cuts are also faster by the predicted timeline than even ones
    even = captured_plan(llama_tiny, captured=heavy.captured, pipeline={"cuts": ["layers.4"]}, **config)
    span = lambda p: max(e for row in p.predicted_timeline(transfers=False).values() for _, _, e in row)  # noqa: E731
    assert span(heavy) < span(even)
