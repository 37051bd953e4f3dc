"""Sequence parallelism from a soft layout entry ({"seq": "tp?"}): exactness, Megatron's
collectives per block (2 reduce-scatters and 2 all-gathers on tp forward, no all-reduce), and the
activation memory of the norm regions at 1/tp (passes/soft.py)."""
import collections
import copy

import pytest
import torch

import autoshard
from autoshard import LayoutError
from autoshard.passes.soft import is_soft, split_soft
from examples.models import llama_tiny
from tests.helpers.exactness import assert_exact, block_of

SP = {"heads": "tp", "ffn": "tp", "seq": "tp?"}
MESHES = [{"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}]


def _plan(mesh, layout, **kw):
    model, args, dims = llama_tiny(with_labels=True, **kw)
    layout = dict(layout, **({"batch": "dp"} if "dp" in mesh else {}))
    plan = autoshard.autoshard(copy.deepcopy(model), args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout,
                               train=True)
    return plan, model, args


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_sequence_parallel_exact_and_megatron_collectives(mesh):
    plan, model, args = _plan(mesh, SP)
    assert_exact(plan, model, args)
    fwd_tp = [c for c in plan.collectives if c.phase == "forward" and c.axes == ("tp",)]
    per_block = collections.defaultdict(collections.Counter)
    for c in fwd_tp:
        per_block[block_of(c.where)][c.kind] += 1
    for b in range(2):
        assert per_block[b] == {"reduce_scatter": 2, "all_gather": 2}, (b, per_block[b])
    assert not [c for c in fwd_tp if c.kind == "all_reduce"]
    # the reduce-scatters follow the row-parallel projections; the gathers feed column-parallel ones
    rs = sorted(c.why.split(" in ")[1].split(" ->")[0] for c in fwd_tp if c.kind == "reduce_scatter"
                and block_of(c.where) == 0)
    assert rs == ["layers.0.mlp.down_proj", "layers.0.self_attn.o_proj"]
    assert sorted(c.where for c in fwd_tp if c.kind == "all_gather" and block_of(c.where) == 0) == [
        "layers.0.mlp.gate_proj", "layers.0.self_attn.q_proj"]
    # what ran is what the plan lists, on every rank
    listed = collections.Counter((c.kind, c.axes[0], c.phase) for c in plan.collectives)
    for trace in plan.last_trace:
        ran = collections.Counter((r.kind, r.axis, r.phase) for r in trace)
        assert ran == listed


def test_norm_activations_at_one_over_tp():
    sp, _, _ = _plan({"tp": 2}, SP)
    tp, _, _ = _plan({"tp": 2}, {"heads": "tp", "ffn": "tp"})

    def norms(plan):
        acts = plan.cost.activations_by_module
        return {m: b for m, b in acts.items() if m.endswith("norm")}

    n_sp, n_tp = norms(sp), norms(tp)
    assert set(n_sp) == set(n_tp) and len(n_sp) == 5  # 2 blocks x 2 norms + the final norm
    # batch 4 x seq 8 tokens, hidden 32, fp32: the norm's saved values are whole rows under TP
    for m in n_tp:
        assert n_sp[m] * 2 == n_tp[m], (m, n_sp[m], n_tp[m])
        assert n_tp[m] >= 4 * 8 * 32 * 4
    assert sp.cost.memory["activations"] < tp.cost.memory["activations"]


def test_tp4_gathers_once_for_whole_kv_projections():
    # 2 kv heads on tp=4: k_proj / v_proj stay whole and read the gather q_proj reads
    plan, _, _ = _plan({"tp": 4}, SP)
    code = plan.graph_module.code
    # one replicated read per block, shared by k_proj and v_proj, and one for the logits (the
    # shift slices seq, so the loss reads them whole)
    assert code.count("= autoshard_runtime_primitives_collectives_replicated_use(") == 3
    for b in range(2):
        for proj in ("k_proj", "v_proj"):
            line = next(ln for ln in code.splitlines() if f"p_layers_{b}_self_attn_{proj}_weight)" in ln)
            assert "linear.default(replicated_use" in line, line
    # 2 per block + logits; the MLP's, read only by linears, fused with them (overlap_linear)
    fused = [ln for ln in code.splitlines() if "= autoshard_runtime_primitives_overlap_linear_varying_linears(" in ln]
    assert code.count("= autoshard_runtime_primitives_collectives_all_gather_varying(") + len(fused) == 5
    assert len(fused) == 2 and all("gather_dim = 1" in ln for ln in fused), fused


def test_soft_entries_parse_and_hard_errors_stay():
    assert split_soft({"heads": "tp", "seq": "tp?", "batch": None}) == ({"heads": "tp", "batch": None},
                                                                          {"seq": ("tp",)})
    assert is_soft(("dp?", "tp?")) and not is_soft("tp")
    with pytest.raises(LayoutError, match="mixes hard and soft"):
        _plan({"tp": 2}, {"heads": "tp", "seq": ("tp?", "tp")})
    with pytest.raises(LayoutError, match="both a hard and a soft"):
        _plan({"tp": 2}, {"heads": "tp", "seq": "tp?", "s*q": None})  # the glob names seq too
    # a hard entry keeps its error: heads and hidden on one axis meet in q_proj.weight
    with pytest.raises(LayoutError, match="would shard two dims of one tensor"):
        _plan({"tp": 2}, {"heads": "tp", "hidden": "tp", "seq": "tp?"})
    with pytest.raises(LayoutError, match="cannot split evenly"):
        _plan({"tp": 4}, {"heads": "tp", "seq": "tp?"}, seq=6)


def test_replicated_use_keeps_the_whole_gradient_on_rank_zero():
    """Forward identity; backward: rank 0 keeps the (identical) gradient, the others zeros, so a
    reduce-scatter after it counts the gradient once."""
    from autoshard.runtime import run_simulated
    from autoshard.runtime.primitives.collectives import replicated_use
    x0 = torch.arange(6.0).reshape(2, 3)
    g = torch.full((2, 3), 0.5)

    def rank(r):
        x = x0.clone().requires_grad_()
        y = replicated_use(x, "tp")
        y.backward(g)
        return y.detach(), x.grad

    for r, (y, dx) in enumerate(run_simulated(autoshard.Mesh({"tp": 2}), rank)):
        assert torch.equal(y, x0)
        assert torch.equal(dx, g if r == 0 else torch.zeros_like(g))
