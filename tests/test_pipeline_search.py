"""The pipeline degree of ``Mesh.auto(n, ("pp", "dp", "tp"))`` is chosen by the cost model:
pp > 1 exactly when no plan without a pipeline fits ``memory_limit``.

The model is 70B-shaped in its widths (hidden 8192, 64 heads, 8 KV heads, ffn 28672, vocab
128256) with 4 layers instead of 80 on 16 devices instead of 64, so torch.export and the search take
seconds on this shared machine; the memory limits are scaled with it (benchmarks/search_70b.py
plans the 80 layers on 64 devices at 80 GB). The layout of the other axes is fixed Megatron-style (tp inside a stage, as
in Megatron-LM's 3D parallelism, Narayanan et al., 2021) with ZeRO off, so that the state per rank
only shrinks with tp or pp.
"""
import pytest

import autoshard
from autoshard.cost.memory import model_state_bytes
from autoshard.cost.pipeline_search import in_flight, stage_fraction
from autoshard.pipeline_plan import PipelinePlan
from examples.models import llama_8b_meta

LAYOUT = {"batch": "dp", "heads": "tp", "kv_heads": "tp", "ffn": "tp", "vocab": "tp"}


@pytest.fixture(scope="module")
def model70():
    model, args, dims = llama_8b_meta(with_labels=True, num_layers=4, hidden_size=8192, num_heads=64,
                                      num_kv_heads=8, intermediate_size=28672, batch=16, seq=256)
    return model, args, dims


def _plan(model70, limit, captured=None, checkpoint=None):
    model, args, dims = model70
    return autoshard.autoshard(model, args, mesh=autoshard.Mesh.auto(16, ("pp", "dp", "tp")), dims=dims,
                               layout=LAYOUT, train=True, zero_stage=0, hardware="h100", memory_limit=limit,
                               captured=captured, checkpoint=checkpoint)


def test_in_flight_per_schedule():
    # GPipe holds every microbatch (Huang et al., 2019), 1F1B at most the pipeline depth
    # (PipeDream-Flush, Narayanan et al., 2021)
    assert in_flight("gpipe", 2, 8) == 8
    assert in_flight("1f1b", 2, 8) == 2 and in_flight("1f1b", 4, 2) == 2
    assert in_flight("zero_bubble", 4, 8) <= 4
    assert in_flight("1f1b", 4, 8) < in_flight("interleaved", 4, 8, 2) < in_flight("gpipe", 4, 8)


def test_pp_only_when_nothing_fits_without_it(model70):
    model, args, dims = model70
    n = sum(p.numel() for p in model.parameters())
    embed = model.embed_tokens.weight.numel()
    layer = sum(p.numel() for p in model.layers[0].parameters())

    # 80 GB: the plan without a pipeline fits; no pp
    flat = _plan(model70, "80GB")
    assert type(flat) is autoshard.Plan and "pp" not in flat.mesh.axes
    assert flat.pipeline_decision.pp == 1 and flat.pipeline_decision.flat is not None
    assert flat.cost["memory"]["peak"] <= 80e9
    text = flat.explain()
    assert "Pipeline (pp): not used" in text and "fits memory_limit 80.0 GB" in text

    # 10 GB: the same search without a pp axis (the path that existed before; ZeRO off, every
    # mesh shape, activation checkpointing allowed) finds nothing that fits, so the planner
    # pipelines
    with pytest.raises(ValueError, match="no plan fits memory_limit"):
        autoshard.autoshard(model, args, mesh=autoshard.Mesh.auto(16, ("dp", "tp")), dims=dims, layout=LAYOUT,
                            train=True, zero_stage=0, hardware="h100", memory_limit="10GB", captured=flat.captured)
    plan = _plan(model70, "10GB", captured=flat.captured)
    assert isinstance(plan, PipelinePlan)
    d = plan.pipeline_decision
    assert d.flat is None and "no plan fits memory_limit" in d.flat_error
    assert plan.mesh.axes["pp"] == d.pp > 1
    c = d.chosen
    assert c.peak <= 10e9
    # the smallest degree that fits is taken: every smaller one was tried and did not fit
    assert [p for p, _ in d.tried][-1] == d.pp and all(isinstance(g, str) for p, g in d.tried if p < d.pp)
    # a stage's state: the first stage holds the embedding and half the layers, the last the
    # other half, the final norm and the head (pp = 2)
    tp = plan.mesh.axes["tp"]
    head = model.lm_head.weight.numel() + model.norm.weight.numel()
    if d.pp == 2:
        assert c.fraction == pytest.approx(max(embed + 2 * layer, 2 * layer + head) / n, rel=1e-9)
    expect = model_state_bytes(n * c.fraction, dp=1, zero_stage=0, tp=tp).total
    assert c.state == pytest.approx(expect, rel=0.05)  # norms and a few small weights stay whole
    assert c.activations > 0 and c.bubble > 0
    # the plan runs the chosen schedule on the chosen degree
    assert plan.schedule_name == c.schedule and plan.microbatches == c.microbatches
    assert len(plan.schedule) == d.pp and len(plan.stages) == d.pp * c.virtual
    text = plan.explain()
    assert f"pp={d.pp} because no plan without it fits memory_limit 10.0 GB" in text
    assert f"peak {c.peak / 1e9:.1f} GB per rank" in text and f"state {c.state / 1e9:.1f} GB" in text
    assert "Chosen:" in text


def test_stage_fraction_matches_counts(model70):
    model, args, dims = model70
    from types import SimpleNamespace as NS
    ins = [NS(name=f"p{k}", target=name, kind="parameter") for k, (name, _) in enumerate(model.named_parameters())]
    vals = {f"p{k}": p for k, (_, p) in enumerate(model.named_parameters())}
    n = sum(p.numel() for p in model.parameters())
    head = model.lm_head.weight.numel() + model.norm.weight.numel()
    layer = sum(p.numel() for p in model.layers[0].parameters())
    # pp = 4: one layer per stage; the last holds the head, the largest of the four here
    assert stage_fraction(ins, vals, 4) == pytest.approx((layer + head) / n, rel=1e-6)
    assert stage_fraction(ins, vals, 1) == pytest.approx(1.0)
