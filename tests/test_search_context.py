"""The layout search proposes context parallelism: the sequence of attention on a mesh axis,
run as ring (or all-gather-KV) attention and costed as such (cost/context_parallel.py)."""
import re
import warnings

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.runtime.primitives.ring_attention import allgather_attention, ring_attention

from examples.models import llama_8b_meta, llama_tiny
from tests.helpers.exactness import assert_exact

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _targets(plan):
    return [n.target for n in plan.graph_module.graph.nodes if n.op == "call_function"]


def test_search_offers_seq_as_context_parallelism_where_it_meets_itself():
    # With a padding mask the sequence meets itself in one tensor ([b, 1, s, s]): without context
    # parallelism no axis could shard it; as CP it is offered (rows follow the queries).
    from autoshard.api import apply_dim_names
    from autoshard.cost.model import resolve_cost_model
    from autoshard.cost.search import SearchSpace
    from autoshard.passes.capture import capture
    from autoshard.passes.dims import infer_dims

    model, args, dims = llama_tiny(with_mask=True, with_labels=True, seq=16)
    cap = capture(model, args, None)
    info = infer_dims(cap.graph, {i.name: i.target for i in cap.inputs})
    apply_dim_names(info, cap, dims)
    space = SearchSpace(cap.graph, cap.inputs, info, Mesh({"cp": 2}), resolve_cost_model("h100"), train=True)
    assert space.context.names == {"seq"}
    assert "seq" in space._conflicts("cp")[1]            # it does meet itself ...
    assert frozenset({"seq"}) in space.axis_options("cp")  # ... and is offered all the same
    # the candidate is costed as the plan autoshard() builds: ring / all-gather attention, not SDPA
    cand = next(c for c in space.candidates() if c.axes == (("cp", frozenset({"seq"})),))
    assert space.evaluate(cand).step_time > 0


def test_search_chosen_context_parallel_plan_is_exact():
    # A memory limit only the sequence split meets forces the choice on a tiny model; every other
    # name is kept whole (tensor parallelism on the same axis holds fewer activations still)
    model, args, dims = llama_tiny(with_mask=True, with_labels=True, seq=16)
    kw = dict(mesh=Mesh({"cp": 2}), dims=dims, train=True, hardware="h100", checkpoint=False, zero_stage=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        hard = autoshard.autoshard(model, args, layout={"seq": "cp"}, **kw)
        # between the split plan's peak and the lowest peak of the other choices for seq
        others = [autoshard.autoshard(model, args, layout={"seq": v}, **kw).cost["memory"]["peak"] for v in ("cp?", None)]
        limit = (hard.cost["memory"]["peak"] + min(others)) / 2
        assert hard.cost["memory"]["peak"] < limit
        only_seq = {name: None for name in hard.layout if name != "seq"}
        plan = autoshard.autoshard(model, args, layout=only_seq, memory_limit=limit, **kw)
    assert plan.layout["seq"] == ("cp",)
    atts = plan.program.context.attention
    assert len(atts) == 2 and all(a.axis == "cp" and a.order == "zigzag" for a in atts)
    targets = _targets(plan)
    assert SDPA not in targets and (ring_attention in targets or allgather_attention in targets)
    assert_exact(plan, model, args)  # rtol 1e-5 / atol 1e-6
    text = plan.explain()
    assert "Context parallelism: seq is split on cp (2 ranks, zigzag order, 8 query positions per rank of 16)" in text
    assert "Variant by cost: ring" in text
    # why: kept whole, the same plan is over the limit
    m = re.search(r"Why split seq: the same plan with seq whole \(cp: nothing\) predicts [\d.]+ ms and peaks at "
                  r"([\d.]+) kB per rank, over memory_limit ([\d.]+) kB", text)
    assert m and float(m.group(1)) > float(m.group(2)), text


def test_8b_131072_tokens_search_chooses_context_parallelism():
    # Ring attention's long-context setting: the Llama-3-8B shape (32 layers, 32 heads, 8 kv heads, d=128,
    # vocab 128256, bf16) on meta, one sequence of 131072 tokens, 8 H100s, 80 GB each.
    model, args, dims = llama_8b_meta(batch=1, seq=131072)
    plan = autoshard.autoshard(model, args, mesh=Mesh.auto(8, ("tp", "cp")), dims=dims, hardware="h100",
                               memory_limit="80GB")
    seq_axes = plan.layout["seq"]
    assert seq_axes and len(seq_axes) == 1
    atts = plan.program.context.attention
    assert len(atts) == 32 and {(a.axis, a.variant, a.order) for a in atts} == {(seq_axes[0], "ring", "zigzag")}
    targets = _targets(plan)
    assert targets.count(ring_attention) == 32 and SDPA not in targets
    assert plan.cost["memory"]["peak"] <= 80e9
    R = plan.mesh.axes[seq_axes[0]]
    text = plan.explain()
    assert f"Context parallelism: seq is split on {seq_axes[0]} ({R} ranks, zigzag order, {131072 // R} query " \
           f"positions per rank of 131072); 32 attention(s) run as ring attention." in text
    assert "circulate rank i -> i+1" in text and "Variant by cost: ring" in text
    # one K/V block: 2 (K, V) x kv heads on this rank x positions per rank x 128 x 2 bytes
    G = 8 // plan.mesh.axes.get("tp", 1) if plan.layout["kv_heads"] else 8
    assert f"K/V blocks of {2 * G * (131072 // R) * 128 * 2 / 1e6:.1f} MB" in text
    # why: the same plan with the sequence whole is slower or over the limit
    m = re.search(r"Why split seq: .* predicts ([\d.]+) ms and peaks at ([\d.]+) GB per rank", text)
    assert m, text
    whole_ms, whole_gb = float(m.group(1)), float(m.group(2))
    assert whole_gb > 80 or whole_ms > plan.cost["step_time"] * 1e3
