"""The layout search over soft entries (sequence parallelism when activations do not fit) and over
parameter dims nobody named (Megatron found with only the inputs named)."""
import collections
import copy
import re

import pytest

import autoshard
from autoshard import Mesh
from autoshard.passes.param_names import module_label
from examples.models import llama_tiny
from tests.helpers.exactness import assert_exact, block_of

INPUTS_ONLY = {"input_ids": "batch seq", "labels": "batch seq"}


def _block(where):
    m = re.match(r"(?:layers|h)\.(\d+)(\.|$)", where)  # Llama's layers.N, GPT-2's h.N
    return int(m.group(1)) if m else None


def _forward_per_block(plan, axis="tp"):
    out = collections.defaultdict(collections.Counter)
    for c in plan.collectives:
        if c.phase == "forward" and c.axes == (axis,) and _block(c.where) is not None:
            out[_block(c.where)][c.kind] += 1
    return dict(out)


MEGATRON = {"heads": "tp", "kv_heads": "tp", "ffn": "tp"}


def _tp_and_sp(model, args, **kw):
    """The TP-only and the SP plan (Megatron without / with ``seq: tp?``), built as given."""
    tp = autoshard.autoshard(copy.deepcopy(model), args, layout=MEGATRON, search=False, **kw)
    sp = autoshard.autoshard(copy.deepcopy(model), args, layout=dict(MEGATRON, seq="tp?"), search=False, **kw)
    return tp, sp


def test_default_search_under_memory_limit_chooses_sequence_parallelism():
    """Soft entries are in the default space: under a memory limit that Megatron's activations
    exceed and SP's (token-wise activations at 1/tp) meet, the search picks heads/ffn on tp plus
    seq soft, with Megatron-SP's collectives, exact."""
    model, args, dims = llama_tiny(with_labels=True, batch=4, seq=128, hidden_size=128, intermediate_size=512,
                                   num_heads=8, num_kv_heads=4, vocab_size=128)
    kw = dict(mesh=Mesh({"tp": 4}), dims=dims, train=True, hardware="h100", zero_stage=0, checkpoint=False)
    tp, sp = _tp_and_sp(model, args, **kw)
    assert sp.cost.memory["activations"] < tp.cost.memory["activations"]
    limit = (tp.cost.memory["peak"] + sp.cost.memory["peak"]) / 2  # Megatron without SP does not fit
    assert sp.cost.memory["peak"] <= limit < tp.cost.memory["peak"]
    plan = autoshard.autoshard(copy.deepcopy(model), args, layout={"batch": None}, memory_limit=limit, **kw)
    assert plan.layout["seq"] == ("tp?",) and plan.layout["heads"] == plan.layout["ffn"] == ("tp",), plan.layout
    assert plan.cost.memory["peak"] <= limit
    assert _forward_per_block(plan) == {b: {"reduce_scatter": 2, "all_gather": 2} for b in range(2)}
    assert_exact(plan, model, args)
    # the hard-only space (SearchSpace(soft=False)) has nothing that fits with batch whole
    space = _space(model, args, kw["mesh"], dims, constraints={"batch": None}, memory_limit=limit, zero_stage=0,
                   checkpoint=False, soft=False)
    from autoshard.cost.search import search_layout
    hard = search_layout(space).best
    assert hard is None or hard.cost.step_time > plan.cost.step_time


def _space(model, args, mesh, dims, **kw):
    from autoshard.api import apply_dim_names
    from autoshard.cost.model import resolve_cost_model
    from autoshard.cost.search import SearchSpace
    from autoshard.passes.capture import capture
    from autoshard.passes.dims import infer_dims
    cap = capture(copy.deepcopy(model), args, None)
    info = infer_dims(cap.graph, {i.name: i.target for i in cap.inputs})
    apply_dim_names(info, cap, dims)
    return SearchSpace(cap.graph, cap.inputs, info, mesh, resolve_cost_model("h100"), train=True, **kw)


def test_without_memory_pressure_tp_or_sp_is_chosen_by_time():
    """No memory limit, every dim but seq fixed (Megatron on tp): the default search picks
    whichever of TP-only and SP the cost model predicts faster (ties: the lower peak)."""
    model, args, dims = llama_tiny(with_labels=True, batch=4, seq=128, hidden_size=128, intermediate_size=512,
                                   num_heads=8, num_kv_heads=4, vocab_size=128)
    kw = dict(mesh=Mesh({"tp": 4}), dims=dims, train=True, hardware="h100", zero_stage=0, checkpoint=False)
    tp, sp = _tp_and_sp(model, args, **kw)
    names = set(tp.layout) | set(tp.resolved.assignment)
    fixed = dict({n: None for n in names if n != "seq"}, **MEGATRON)
    plan = autoshard.autoshard(copy.deepcopy(model), args, layout=fixed, search=True, **kw)
    faster = min((tp, sp), key=lambda p: (p.cost.step_time, p.cost.memory["peak"]))
    assert plan.layout["seq"] == faster.layout["seq"], (plan.layout["seq"], tp.cost.step_time, sp.cost.step_time)
    assert plan.cost.step_time == pytest.approx(min(tp.cost.step_time, sp.cost.step_time), rel=1e-12)
    # SP moves the bytes of TP: each all-reduce becomes a reduce-scatter and an all-gather of the
    # same ring volume and latency steps; it computes the token-wise ops on 1/tp of the rows
    assert sp.cost.compute < tp.cost.compute


def test_forward_search_runs_the_unsplit_mlp_on_token_rows():
    """Forward only, compute-bound device, batch whole: attention on tp with the MLP on 1/tp of the
    token rows (seq soft, ffn whole) has the compute of Megatron-SP with one all-gather and one
    reduce-scatter per block instead of two of each, paid for in replicated MLP weights: predicted
    faster than Megatron and Megatron-SP, and exact. The search, with seq open, finds it or a
    plan predicted at least as fast (context parallelism: test_search_context.py)."""
    from autoshard.cost import DeviceSpec, Hardware, LinkSpec
    slow = Hardware("slow-compute", DeviceSpec("slow", {"fp32": 1e9}, mem_bandwidth=1e10, mem_capacity=1e12),
                    (LinkSpec(1e11, latency=1e-6, name="fast"),))
    model, args, dims = llama_tiny(with_labels=True, num_kv_heads=4, hidden_size=64, intermediate_size=256,
                                   seq=16, batch=2)
    kw = dict(mesh=Mesh({"tp": 4}), dims=dims, hardware=slow)
    rows = autoshard.autoshard(copy.deepcopy(model), args, layout={"batch": None, "heads": "tp", "kv_heads": "tp",
                                                                   "seq": "tp?"}, **kw)
    tp, sp = _tp_and_sp(model, args, **kw)
    assert rows.cost.step_time < sp.cost.step_time < tp.cost.step_time
    assert rows.cost.compute == pytest.approx(sp.cost.compute, rel=1e-9)  # same work, fewer collectives
    assert rows.cost.memory["params"] > sp.cost.memory["params"]  # the MLP weights on every rank
    assert _forward_per_block(rows) == {b: {"all_gather": 1, "reduce_scatter": 1} for b in range(2)}
    assert re.search(r"seq +16 +tp\? \(soft: where tp is free\)", str(rows))
    assert_exact(rows, model, args)
    searched = autoshard.autoshard(copy.deepcopy(model), args, layout={"batch": None}, **kw)
    assert searched.cost.step_time <= rows.cost.step_time * (1 + 1e-12)


def test_module_labels_drop_the_block_index():
    assert module_label("layers.11.mlp.down_proj.weight") == "mlp.down_proj"
    assert module_label("model.layers.0.self_attn.q_proj.weight") == "self_attn.q_proj"
    assert module_label("h.3.attn.c_attn.bias") == "attn.c_attn"
    assert module_label("lm_head.weight") == "lm_head"


def test_unannotated_llama_search_finds_megatron_and_is_exact():
    """Only the inputs named, batch whole, tp=4 on the H100 preset, a workload whose projections are
    worth splitting: attention and MLP sharded Megatron-style, named after their modules."""
    model, args, _ = llama_tiny(with_labels=True, batch=2, seq=128, vocab_size=256, hidden_size=512,
                                intermediate_size=2048, num_heads=8, num_kv_heads=4)
    plan = autoshard.autoshard(copy.deepcopy(model), args, mesh=Mesh({"tp": 4}), dims=INPUTS_ONLY,
                               layout={"batch": None}, train=True, hardware="h100")
    lay = plan.layout
    for name in ("self_attn.q_proj.out", "self_attn.k_proj.out", "self_attn.v_proj.out", "self_attn.o_proj.in",
                 "mlp.gate_proj.out"):
        assert lay[name] == ("tp",), (name, lay)
    assert lay["batch"] == () and lay["embed_tokens.out"] == ()  # the residual stream's hidden stays whole
    assert _forward_per_block(plan) == {b: {"all_reduce": 2} for b in range(2)}
    reasons = sorted(c.why.split(" in ")[1].split(" ->")[0] for c in plan.collectives
                     if c.phase == "forward" and c.kind == "all_reduce" and block_of(c.where) == 0)
    assert reasons == ["layers.0.mlp.down_proj", "layers.0.self_attn.o_proj"]
    text, why = str(plan), plan.explain()
    assert "self_attn.q_proj.out" in text and "mlp.gate_proj.out" in text
    assert "mlp.gate_proj.out" in why and "self_attn.q_proj.out" in why
    assert_exact(plan, model, args)


def test_unannotated_gpt2_search_shards_attention_and_mlp():
    """GPT-2 (Conv1D, fused QKV, tied head) with only the inputs named: the search splits c_attn's
    output, the heads of c_proj and the MLP on tp: 2 forward all-reduces per block plus the
    all-gather of the fused q|k|v before its split (README, known limits: no strided sharding)."""
    import torch
    from examples.models import gpt2_tiny
    from tests.helpers.exactness import assert_grads_within_spread
    model, args, _ = gpt2_tiny(with_labels=True, batch=2, seq=128, hidden_size=1024, intermediate_size=4096,
                               num_heads=16, max_seq_len=128)
    plan = autoshard.autoshard(copy.deepcopy(model), args, mesh=Mesh({"tp": 4}), dims=INPUTS_ONLY,
                               layout={"batch": None}, train=True, hardware="h100")
    lay = plan.layout
    assert lay["attn.c_proj.in"] == lay["mlp.c_fc.out"] == lay["attn.c_attn.out"] == ("tp",), lay
    assert _forward_per_block(plan) == {b: {"all_reduce": 2, "all_gather": 1} for b in range(2)}
    assert "attn.c_proj.in" in str(plan) and "mlp.c_fc.out" in plan.explain()
    out, grads = plan.simulate_grads(*args)
    # Row-parallel contractions (4096 ffn, 1024 heads) are summed as 4 partial sums by the
    # all-reduce, the reference sums them in one BLAS call: within the float32 spread of the
    # unsharded model's own gradients (float32 against float64, per tensor: tests/helpers/exactness.py)
    assert_grads_within_spread(out, grads, model, args)


def test_soft_options_in_the_default_space():
    """The default space holds soft entries, pruned: one name (the longest residual-stream dim the
    axis divides: seq here), never next to hard batch (it would change nothing), one per candidate."""
    model, args, dims = llama_tiny(with_labels=True, batch=2, seq=16)
    space = _space(model, args, Mesh({"dp": 2, "tp": 2}), dims)
    opts = space.axis_options("tp")
    softs = {n for s in opts for n in s if n.endswith("?")}
    assert softs == {"seq?"}
    assert frozenset({"heads", "ffn", "seq?"}) in opts and frozenset({"heads", "ffn"}) in opts
    assert not [s for s in opts if "seq?" in s and "batch" in s]
    assert all(sum(n.endswith("?") for _, s in c.axes for n in s) <= 1 for c in space.candidates())
    off = _space(model, args, Mesh({"dp": 2, "tp": 2}), dims, soft=False)
    assert not [s for s in off.axis_options("tp") if any(n.endswith("?") for n in s)]
    assert len(off.candidates()) < len(space.candidates())
