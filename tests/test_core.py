"""Core acceptance: capture -> named dims -> SPMD rewrite, exact on the simulated mesh."""
import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import LayoutError, Mesh, UnsupportedOpWarning
from autoshard.ownership import local_piece

from tests.helpers.exactness import assert_exact, block_of
from examples.models import gpt2_tiny, llama_tiny

TP = {"heads": "tp", "ffn": "tp"}
DP_TP = {"batch": "dp", "heads": "tp", "ffn": "tp"}


# --------------------------------------------------------------------------- worked examples


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(2, 4, bias=False)
        self.up = nn.Linear(2, 4, bias=False)
        self.down = nn.Linear(4, 2, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_swiglu_two_rank_trace():
    """Megatron-LM's MLP split (Shoeybi et al., 2019) on a SwiGLU block: column-split gate/up,
    row-split down, one all-reduce; two ranks with small hand-written matrices."""
    rank_gate = [[[1, -1], [0, 0]], [[0, 2], [0, 0]]]  # [d, h/2] per rank, rows listed
    rank_up = [[[2, 3], [0, 0]], [[4, 1], [0, 0]]]
    rank_down = [[[1, 0], [0, 1]], [[1, 1], [1, -1]]]  # [h/2, d]
    m = SwiGLU()
    with torch.no_grad():
        m.gate.weight.copy_(torch.cat([torch.tensor(g, dtype=torch.float32) for g in rank_gate], 1).T)
        m.up.weight.copy_(torch.cat([torch.tensor(u, dtype=torch.float32) for u in rank_up], 1).T)
        m.down.weight.copy_(torch.cat([torch.tensor(v, dtype=torch.float32) for v in rank_down], 0).T)
    x = torch.tensor([[1.0, 0.0]])
    mesh = Mesh({"tp": 2})
    plan = autoshard.autoshard(m, (x,), mesh=mesh,
                               dims={"x": "tokens hidden", "gate.weight": "ffn hidden", "up.weight": "ffn hidden",
                                     "down.weight": "hidden ffn"}, layout={"ffn": "tp"})
    # Each rank holds exactly the matrices written above.
    for rank in range(2):
        held = local_piece(m.gate.weight.detach(), plan.placement_of("gate.weight"), mesh, rank)
        assert torch.equal(held.T, torch.tensor(rank_gate[rank], dtype=torch.float32))
        held = local_piece(m.down.weight.detach(), plan.placement_of("down.weight"), mesh, rank)
        assert torch.equal(held.T, torch.tensor(rank_down[rank], dtype=torch.float32))
    z = plan.simulate(x)
    expected = torch.tensor([[3.223711, -2.568418]])
    torch.testing.assert_close(z, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(m(x).detach(), expected, rtol=0, atol=1e-6)
    fwd = [c for c in plan.collectives if c.phase == "forward"]
    assert [(c.kind, c.axes) for c in fwd] == [("all_reduce", ("tp",))]
    assert "ffn" in fwd[0].why and "partial" in fwd[0].why
    # Executed on every rank, exactly once.
    assert all([r.kind for r in trace] == ["all_reduce"] for trace in plan.last_trace)


class MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


def test_contraction_partial_then_one_all_reduce():
    """C[I,K] = sum_J A[I,J] B[J,K]; J sharded leaves each rank a partial sum, one all-reduce."""
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    plan = autoshard.autoshard(MatMul(), (a, b), mesh=Mesh({"x": 2}), dims={"a": "I J", "b": "J K"},
                               layout={"J": "x"})
    assert [str(o) for o in plan.program.placements["matmul"][0]] == ["P"]
    assert [(c.kind, c.phase) for c in plan.collectives] == [("all_reduce", "forward")]
    torch.testing.assert_close(plan.simulate(a, b), a @ b, rtol=1e-5, atol=1e-6)


def test_contraction_rejects_I_and_K_on_one_axis():
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    with pytest.raises(LayoutError, match=r"two dims of one tensor.*'I'.*'K'"):
        autoshard.autoshard(MatMul(), (a, b), mesh=Mesh({"x": 2}), dims={"a": "I J", "b": "J K"},
                            layout={"I": "x", "K": "x"})


def test_layout_errors_name_the_problem():
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    kw = dict(mesh=Mesh({"x": 4}), dims={"a": "I J", "b": "J K"})
    with pytest.raises(LayoutError, match=r"'J' has size 6.*cannot split evenly"):
        autoshard.autoshard(MatMul(), (a, b), layout={"J": "x"}, **kw)
    with pytest.raises(LayoutError, match=r"mesh axis 'tp'.*axes \['x'\]"):
        autoshard.autoshard(MatMul(), (a, b), layout={"J": "tp"}, **kw)
    with pytest.raises(LayoutError, match=r"'Q', which no tensor has"):
        autoshard.autoshard(MatMul(), (a, b), layout={"Q": "x"}, **kw)
    with pytest.raises(LayoutError, match=r"gives 3 names"):
        autoshard.autoshard(MatMul(), (a, b), mesh=Mesh({"x": 2}), dims={"a": "I J Z"})


# --------------------------------------------------------------------------- example models


@pytest.mark.parametrize("mesh,layout", [({"tp": 2}, TP), ({"tp": 4}, TP), ({"dp": 2, "tp": 2}, DP_TP)],
                         ids=["tp2", "tp4", "dp2xtp2"])
@pytest.mark.parametrize("mask", [False, True], ids=["causal", "mask"])
def test_llama_exact(mesh, layout, mask):
    model, args, dims = llama_tiny(with_labels=True, with_mask=mask)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout)
    assert not plan.program.fallbacks
    assert_exact(plan, model, args)


def test_llama_tied_embeddings_exact():
    model, args, dims = llama_tiny(with_labels=True, tie_embeddings=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, layout=DP_TP)
    assert_exact(plan, model, args)


@pytest.mark.parametrize("mesh,layout", [({"tp": 2}, TP), ({"dp": 2, "tp": 2}, DP_TP)], ids=["tp2", "dp2xtp2"])
def test_gpt2_exact(mesh, layout):
    model, args, dims = gpt2_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout)
    assert not plan.program.fallbacks
    assert_exact(plan, model, args)


def test_llama_collective_counts_megatron_and_ddp():
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, layout=DP_TP)
    colls = plan.collectives
    n_layers = len(model.layers)
    # tp: per block exactly 2 all-reduces forward (attention out, MLP out) and 2 backward
    # (gradient of the block's two replicated inputs); nothing else on tp anywhere.
    tp = [c for c in colls if c.axes == ("tp",)]
    per_block = collections.Counter((block_of(c.where), c.phase, c.kind) for c in tp)
    expected = collections.Counter()
    for i in range(n_layers):
        expected[(i, "forward", "all_reduce")] = 2
        expected[(i, "backward", "all_reduce")] = 2
    assert per_block == expected
    # dp: every parameter's gradient all-reduced exactly once, in backward.
    names = {i.name: i.target for i in plan.captured.inputs}
    dp_bwd = collections.Counter(names.get(c.node) for c in colls if c.axes == ("dp",) and c.phase == "backward")
    assert dp_bwd == collections.Counter({fqn: 1 for fqn, _ in model.named_parameters()})
    assert all(c.kind == "all_reduce" for c in colls if c.axes == ("dp",))
    # Forward on dp: the global count of valid tokens for the mean loss (int64) and the loss
    # itself (the sum of the ranks' partial losses, returned whole on every rank).
    dp_fwd = [c for c in colls if c.axes == ("dp",) and c.phase == "forward"]
    assert sorted(c.bytes for c in dp_fwd) == [4, 8]
    # What ran on each rank is exactly what the plan lists.
    plan.simulate_grads(*args)
    listed = collections.Counter((c.kind, c.axes[0], c.phase) for c in colls)
    for trace in plan.last_trace:
        assert collections.Counter((r.kind, r.axis, r.phase) for r in trace) == listed


def test_llama_tp4_gqa_replicates_kv_heads():
    """2 kv heads on 4 ranks: k/v projections stay whole and each rank slices its query
    heads' kv head after repeat_kv (backward gathers that slice's gradient)."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, layout=TP)
    assert str(plan.placement_of("layers.0.self_attn.k_proj.weight")[0]) == "R"
    assert str(plan.placement_of("layers.0.self_attn.q_proj.weight")[0]) == "S(0)"
    extra = [c for c in plan.collectives if c.kind == "all_gather"]
    assert len(extra) == 2 * len(model.layers) and all(c.phase == "backward" for c in extra)


def test_print_plan_lists_dims_owners_and_reasons():
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, layout=DP_TP, train=True,
                               bucket_mb=0)  # backward rows print for training plans; one sync per parameter
    text = str(plan)
    for needle in ["Named dims", "heads", "ffn", "layers.0.mlp.down_proj.weight", "S(1)@tp", "Collectives",
                   "is sharded on tp in layers.0.mlp.down_proj -> partial sum",
                   "replicated layers.0.mlp.gate_proj.weight feeds per-rank work on dp", "backward sums its gradient", "layers.0.self_attn.q_proj"]:
        assert needle in text, needle
    assert plan.layout["heads"] == ("tp",) and plan.layout["batch"] == ("dp",) and plan.layout["hidden"] == ()


def test_inferred_names_are_stable():
    def names():
        model, args, dims = llama_tiny()
        plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=None)
        return sorted(plan.info.all_names())

    first = names()
    assert first == names()
    # A search names unnamed parameter dims after their module, block index dropped (one name
    # for every layer's q_proj output).
    assert "self_attn.q_proj.out" in first
    assert not any(name.startswith("layers.0.self_attn.q_proj.weight") for name in first)


def test_layout_by_inferred_glob():
    """Unnamed dims can be laid out by their inferred names (globs work)."""
    model, args, _ = llama_tiny(with_labels=True)
    layout = {"layers.*.mlp.gate_proj.weight:0": "tp"}
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=None, layout=layout)
    assert str(plan.placement_of("layers.1.mlp.down_proj.weight")[0]) == "S(1)"
    assert_exact(plan, model, args)


def test_user_module_not_modified():
    model, args, dims = llama_tiny(with_labels=True)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, layout=DP_TP)
    plan.simulate_grads(*args)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- fallback


@torch.library.custom_op("autoshard_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor) -> torch.Tensor:
    """Scales each column by a position-dependent factor: no sharding rule knows this op."""
    return x * torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype)


@row_scale.register_fake
def _(x):
    return torch.empty_like(x)


def _row_scale_backward(ctx, grad):
    return grad * torch.linspace(0.5, 1.5, grad.shape[-1], dtype=grad.dtype)


row_scale.register_autograd(_row_scale_backward)


class WithCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return torch.tanh(self.down(row_scale(self.up(x)))).sum()


def test_fallback_warns_with_module_and_stays_exact():
    torch.manual_seed(0)
    model, x = WithCustomOp(), torch.randn(4, 8)
    with pytest.warns(UnsupportedOpWarning, match=r"autoshard_test\.row_scale.*module 'up'|autoshard_test\.row_scale"):
        plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2, "tp": 2}),
                                   dims={"x": "batch hidden", "up.weight": "ffn hidden", "down.weight": "hidden ffn"},
                                   layout={"batch": "dp", "ffn": "tp"})
    assert len(plan.program.fallbacks) == 1
    op, module, line = plan.program.fallbacks[0]
    assert "row_scale" in op and line.startswith("test_core.py:")
    assert "Ops without a rule" in str(plan)
    assert_exact(plan, model, (x,))


def test_meta_model_plans_but_refuses_to_simulate():
    with torch.device("meta"):
        model = nn.Linear(8, 8)
        x = torch.randn(4, 8)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"tp": 2}), dims={"input": "batch hidden"})
    assert "Collectives" in str(plan)
    with pytest.raises(ValueError, match="meta device"):
        plan.simulate(x)


def test_keyword_arguments_are_captured_and_named():
    model, (ids, mask, labels), dims = llama_tiny(with_labels=True, with_mask=True)
    kwargs = {"attention_mask": mask, "labels": labels}
    plan = autoshard.autoshard(model, (ids,), kwargs, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, layout=DP_TP)
    assert str(plan.placement_of("attention_mask")[0]) == "S(0)"
    model.zero_grad()
    ref = model(ids, **kwargs)
    ref.backward()
    out, grads = plan.simulate_grads(ids, **kwargs)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
