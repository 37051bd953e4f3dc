"""Expert parallelism: MoE layers with dispatch / combine all-to-alls, against the unsharded model.

The project's MoE example in both shapes (stacked experts with grouped matmuls; a ModuleList of
expert MLPs) and Hugging Face's Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE built tiny from their
configs, under each experts implementation torch.export captures and with the experts dim
inferred or named by the user (router included); skewed routing, an expert nobody chooses, the
capacity policy against an independent reference, training steps.
"""
import collections
import copy
import math

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.cost import tokens_per_expert
from autoshard.runtime import run_simulated
from autoshard.runtime.primitives import experts as X

from examples.models import moe_tiny
from tests.helpers.exactness import assert_exact, assert_training_within_spread, reference, reference_train
from tests.helpers.hf_moe import HF_DIMS, CausalLMLoss, hf_moe

RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------- runtime

def _route_and_back(rank, x, idx, w, num_experts, capacity=None):
    """One MoE layer by hand on this rank: the runtime pieces around a grouped matmul."""
    xr = x[rank].clone().requires_grad_()
    pairs = X.assign_topk(idx[rank], num_experts, capacity, ("ep",))
    route = X.exchange_counts(pairs, "ep")
    mine = X.dispatch_rows(X.pair_rows(xr, pairs), route)
    per = num_experts // 2
    out = X.grouped_mm(mine, w[rank * per:(rank + 1) * per], X.expert_offsets(route))
    y = X.combine_topk(X.combine_rows(out, route), pairs, torch.ones(idx.shape[1:]))
    y.backward(torch.ones_like(y))
    return y.detach(), xr.grad, route.send_splits, route.recv_splits, route.expert_counts


def _by_hand(x, idx, w, keep=None):
    """out[t] = sum_j x[t] @ w[idx[t, j]] over kept choices, and d sum(out) / dx."""
    x = x.clone().requires_grad_()
    T, k = idx.shape
    y = torch.stack([sum((x[t] @ w[idx[t, j]]) * (1.0 if keep is None else float(keep[t][j]))
                         for j in range(k)) for t in range(T)])
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad


def test_dispatch_combine_skewed_and_empty():
    """Rank 0's tokens all go to rank 1's experts and rank 1's all to expert 0: one rank sends
    nothing to itself, experts 1 and 3 get no row, and outputs and gradients are exact."""
    torch.manual_seed(0)
    T, k, E, h = 6, 2, 4, 3
    x, w = torch.randn(2, T, h), torch.randn(E, h, h)
    idx = torch.stack([torch.full((T, k), 2), torch.zeros(T, k, dtype=torch.long)])
    results = run_simulated(Mesh({"ep": 2}), lambda r: _route_and_back(r, x, idx, w, E))
    assert [r[2] for r in results] == [[0, 12], [12, 0]]  # send splits
    assert [r[4] for r in results] == [[12, 0], [12, 0]]  # rows per local expert after dispatch
    for rank, (y, dx, *_rest) in enumerate(results):
        ref_y, ref_dx = _by_hand(x[rank], idx[rank], w)
        torch.testing.assert_close(y, ref_y, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(dx, ref_dx, rtol=RTOL, atol=ATOL)


def test_capacity_drops_in_global_token_order():
    """Capacity C = ceil(cf * pairs / E) per expert over the whole batch, served in token order:
    rank 1's tokens come after rank 0's, so they are the ones dropped; the result equals a
    one-device computation that drops the same pairs, and the dropped pairs are exactly those
    past the capacity in that order."""
    torch.manual_seed(1)
    T, k, E, h = 5, 2, 4, 3
    x, w = torch.randn(2, T, h), torch.randn(E, h, h)
    idx = torch.randint(0, E, (2, T, k))
    idx[:, :, 1] = (idx[:, :, 0] + 1) % E  # two distinct choices per token
    cf = 0.6
    results = run_simulated(Mesh({"ep": 2}), lambda r: _route_and_back(r, x, idx, w, E, cf))
    capacity = math.ceil(cf * 2 * T * k / E)
    taken = collections.Counter()
    keep = [[[False] * k for _ in range(T)] for _ in range(2)]
    for rank in range(2):  # the documented policy, written out: batch order, then choice order
        for t in range(T):
            for j in range(k):
                e = int(idx[rank, t, j])
                keep[rank][t][j] = taken[e] < capacity
                taken[e] += 1
    assert 0 < sum(not kj for kr in keep for kt in kr for kj in kt) < 2 * T * k  # some dropped, not all
    for rank, (y, dx, *_rest) in enumerate(results):
        ref_y, ref_dx = _by_hand(x[rank], idx[rank], w, keep[rank])
        torch.testing.assert_close(y, ref_y, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(dx, ref_dx, rtol=RTOL, atol=ATOL)
    # the same pairs survive on one device holding the whole batch
    whole = set(X.assign_topk(idx.reshape(2 * T, k), E, cf).order.tolist())
    split = run_simulated(Mesh({"ep": 2}), lambda r: X.assign_topk(idx[r], E, cf, ("ep",)).order.tolist())
    assert whole == {o + r * T * k for r in range(2) for o in split[r]}
    assert whole == {(r * T + t) * k + j for r in range(2) for t in range(T) for j in range(k) if keep[r][t][j]}


def test_tokens_per_expert_worked_example():
    """B * k / E: 64 experts, top-2 routing, 256 tokens -> 256 * 2 / 64 = 8 rows per expert."""
    assert tokens_per_expert(256, 2, 64) == 8


# --------------------------------------------------------------------------- the example model

def _moe_all_to_alls(plan):
    return collections.Counter((c.phase, c.kind, c.axes, c.op) for c in plan.collectives if c.kind == "all_to_all")


@pytest.mark.parametrize("experts,mesh,layout", [
    ("grouped", {"ep": 2}, {"batch": "ep", "experts": "ep"}),
    ("looped", {"ep": 4}, {"batch": "ep", "experts": "ep"}),
    ("grouped", {"dp": 2, "ep": 2}, {"batch": "dp", "experts": "ep"}),            # ep on its own axis
    ("looped", {"dp": 2, "ep": 2}, {"batch": ("dp", "ep"), "experts": "ep"}),    # ep on the data axis
    ("grouped", {"ep": 2, "tp": 2}, {"batch": "ep", "experts": "ep", "heads": "tp"}),
], ids=["grouped-ep2", "looped-ep4", "grouped-dp2xep2-own", "looped-dp2xep2-data", "grouped-ep2xtp2"])
def test_example_is_exact(experts, mesh, layout):
    model, args, dims = moe_tiny(experts=experts, with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout)
    assert_exact(plan, model, args)
    # per MoE layer: the count exchange, dispatch and combine forward; their two adjoints backward
    # (with ep on its own axis, each index also takes a slice of the tokens and the layer's
    # output is gathered where the residual stream needs it whole)
    layers = model.config.num_layers
    assert _moe_all_to_alls(plan) == {
        ("forward", "all_to_all", ("ep",), "exchange_counts"): layers,
        ("forward", "all_to_all", ("ep",), "dispatch_rows"): layers,
        ("forward", "all_to_all", ("ep",), "combine_rows"): layers,
        ("backward", "all_to_all", ("ep",), "dispatch_rows"): layers,
        ("backward", "all_to_all", ("ep",), "combine_rows"): layers}
    # what ran is what the plan lists, on every rank (kinds, axes, phases)
    listed = collections.Counter((c.kind, c.axes[0], c.phase) for c in plan.collectives)
    for trace in plan.last_trace:
        assert collections.Counter((r.kind, r.axis, r.phase) for r in trace) == listed
    # no expert output is all-reduced; expert gradients are summed only over replicas of the
    # same expert (never over ep); each rank holds only its experts
    in_experts = [c for c in plan.collectives if c.kind == "all_reduce" and "experts" in c.where]
    assert all(c.phase == "backward" and c.axes != ("ep",) and c.op == "mark_varying" for c in in_experts)
    ep = mesh["ep"]
    held = [n for n in model.state_dict() if ".experts." in n]
    assert held
    for name in held:
        place = plan.placement_of(name)
        assert str(place[list(mesh).index("ep")]) in ({"S(0)"} if experts == "grouped" else
                                                      {f"O({i})" for i in range(ep)}), (name, place)


def test_skewed_routing_and_unused_experts_are_exact():
    """A router that sends every token to experts 2 and 3 (both on ep index 1): index 0's experts
    get no row, index 1 gets every row; dp=2 x ep=2 still equals one device."""
    model, args, dims = moe_tiny(experts="grouped", with_labels=True)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate.weight.zero_()  # equal logits: topk picks experts 2 and 3 (CPU tie order)
    chosen = torch.topk(torch.full((3, 4), 0.25), 2).indices
    assert set(chosen.unique().tolist()) <= {2, 3}
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "ep": 2}), dims=dims,
                               layout={"batch": ("dp", "ep"), "experts": "ep"})
    assert_exact(plan, model, args)


def test_looped_experts_train_exactly_with_ep_on_the_data_axis():
    model, args, dims = moe_tiny(experts="looped", with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "ep": 2}), dims=dims,
                               layout={"batch": ("dp", "ep"), "experts": "ep"}, train=True)
    _train_exactly(plan, model, args)
    # each rank stores its own experts only: what it holds is what the plan predicts
    held = run_simulated(plan.mesh, lambda rank: plan.build(rank).held_bytes()["params"])
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert held == [plan.state_bytes()["params"]] * 4 == [total - expert_bytes // 2] * 4


def _as_float64(model):
    """A float64 copy of ``model``; Hugging Face's default experts (torch's grouped_mm) have no
    float64 kernel, so the copy computes the same per-expert products with batched_mm."""
    m = copy.deepcopy(model).double()
    for sub in m.modules():
        if hasattr(sub, "set_experts_implementation"):
            sub.set_experts_implementation("batched_mm")
            break
    return m


def _train_exactly(plan, model, args, steps=3):
    """AdamW steps equal single-device training within its own float32 spread (float32
    against float64, per parameter tensor: tests/helpers/exactness.py)."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    losses, params = plan.simulate_train([args] * steps, optimizer=make)
    assert_training_within_spread(losses, params, model, [args] * steps, make, as_float64=_as_float64)


def test_capacity_factor_matches_a_reference_dropping_the_same_pairs():
    """moe={"capacity_factor": 0.75} on ep=2 equals the model whose experts apply the documented
    policy on one device (written here independently, pair by pair)."""
    model, args, dims = moe_tiny(experts="grouped", with_labels=True)
    cf = 0.75
    plan = autoshard.autoshard(model, args, mesh=Mesh({"ep": 2}), dims=dims,
                               layout={"batch": "ep", "experts": "ep"}, moe={"capacity_factor": cf})
    ref = copy.deepcopy(model)
    dropped = []
    for layer in ref.layers:
        layer.mlp.experts.forward = _capacity_reference(layer.mlp.experts, cf, dropped)
    assert_exact(plan, ref, args)
    assert any(dropped)


def _capacity_reference(experts, cf, dropped):
    def forward(hidden, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        E = experts.num_experts
        capacity = math.ceil(cf * T * k / E)
        taken = collections.Counter()
        out = torch.zeros_like(hidden)
        n_dropped = 0
        for t in range(T):
            for j in range(k):
                e = int(top_k_index[t, j])
                taken[e] += 1
                if taken[e] > capacity:
                    n_dropped += 1
                    continue
                x = hidden[t]
                y = (torch.nn.functional.silu(x @ experts.gate_proj[e].T) * (x @ experts.up_proj[e].T)) @ experts.down_proj[e].T
                out = out.index_add(0, torch.tensor([t]), (y * top_k_weights[t, j])[None])
        dropped.append(n_dropped)
        return out
    return forward


# --------------------------------------------------------------------------- Hugging Face

def _hf(name):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    if name == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    elif name == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=32))
    else:
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2))
    return CausalLMLoss(model.eval()), (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)),)


EP2 = {"batch": "ep", "experts": "ep"}
EP4 = EP2
DATA = {"batch": ("dp", "ep"), "experts": "ep"}   # ep is (part of) the data axis
OWN = {"batch": "dp", "experts": "ep"}            # ep is its own axis
EPTP = {"batch": "ep", "experts": "ep", "heads": "tp", "kv_heads": "tp"}


@pytest.mark.parametrize("name,mesh,layout", [
    ("mixtral", {"ep": 2}, EP2), ("mixtral", {"ep": 4}, EP4), ("mixtral", {"dp": 2, "ep": 2}, DATA),
    ("mixtral", {"ep": 2, "tp": 2}, EPTP),
    ("olmoe", {"ep": 2}, EP2), ("olmoe", {"ep": 4}, EP4), ("olmoe", {"dp": 2, "ep": 2}, OWN),
    ("olmoe", {"ep": 2, "tp": 2}, EPTP),
    ("qwen2_moe", {"ep": 2}, EP2),
], ids=["mixtral-ep2", "mixtral-ep4", "mixtral-dp2xep2-data", "mixtral-ep2xtp2", "olmoe-ep2", "olmoe-ep4",
        "olmoe-dp2xep2-own", "olmoe-ep2xtp2", "qwen2_moe-ep2"])
def test_hugging_face_moe_is_exact(name, mesh, layout):
    """Outputs and every gradient (router included) equal the unsharded model; per MoE layer
    exactly the count exchange, dispatch and combine in forward and their two adjoints in
    backward, no all-reduce of expert outputs, and each rank holds only its experts."""
    model, args = _hf(name)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=HF_DIMS, layout=layout)
    assert len(plan.program.experts) == 2 and {p.region.form for p in plan.program.experts} == {"grouped"}
    assert_exact(plan, model, args)
    router = [n for n in dict(model.named_parameters()) if n.endswith("mlp.gate.weight")]
    assert len(router) == 2  # compared by assert_exact with every other gradient
    assert _moe_all_to_alls(plan) == {(phase, "all_to_all", ("ep",), op): 2 for phase, op in [
        ("forward", "exchange_counts"), ("forward", "dispatch_rows"), ("forward", "combine_rows"),
        ("backward", "dispatch_rows"), ("backward", "combine_rows")]}
    experts_reduced = [c for c in plan.collectives if c.kind == "all_reduce" and ".experts" in c.where
                       and (c.phase == "forward" or c.axes == ("ep",))]
    assert not experts_reduced, [(c.phase, c.axes, c.where, c.why) for c in experts_reduced]
    ep = list(mesh).index("ep")
    stacked = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert stacked and all(str(plan.placement_of(n)[ep]) == "S(0)" for n in stacked)


@pytest.mark.parametrize("name,layout", [("mixtral", OWN), ("olmoe", DATA)], ids=["mixtral-own", "olmoe-data"])
def test_hugging_face_moe_trains_exactly_on_dp2_x_ep2(name, layout):
    """3 AdamW steps on dp=2 x ep=2 equal single-device training (losses and every parameter)."""
    model, args = _hf(name)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "ep": 2}), dims=HF_DIMS, layout=layout, train=True)
    _train_exactly(plan, model, args)


# --------------------------------------------------------------------------- every implementation, both namings


def _namings():
    """The experts dim inferred (named ``experts`` by the pass), or named by the user on the stacked
    weights and on the router's weight as ``tests/helpers/hf_zoo.py`` does (``"*.mlp.gate.weight": "experts hidden"``)."""
    from tests.helpers.hf_zoo import EXPERTS_DIMS
    return {"inferred": HF_DIMS, "named": {**HF_DIMS, **EXPERTS_DIMS}}


def _reference64(model, args):
    """The unsharded loss and gradients in float64: the yardstick of float32 rounding."""
    m = copy.deepcopy(model).double()
    m.zero_grad()
    loss = m(*args)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def _assert_exact64(plan, model, args):
    """Loss and every gradient equal the unsharded model: each within 1e-5 of one device's float32
    result or, where a sum in another order (over ranks, over an expert's rows) lands further, at
    most 10x as far from the float64 result as one device's float32 result is
    (``test_property.close``): a bound set by the model's own rounding, on any CPU."""
    from tests.helpers.exactness import close
    ref_out, ref_grads = reference(model, args)
    f64 = []

    def exact(name=None):
        def get():
            if not f64:
                f64.append(_reference64(model, args))
            return f64[0][0] if name is None else f64[0][1][name]
        return get

    close(plan.simulate(*args), ref_out, "simulate", exact())
    out, grads = plan.simulate_grads(*args)
    close(out, ref_out, "simulate_grads", exact())
    assert set(ref_grads) <= set(grads)
    for name, g in ref_grads.items():
        close(grads[name], g, f"grad of {name}", exact(name))


IMPLS = ["grouped_mm", "batched_mm"]  # "eager" loops over the experts hit: torch.export refuses it (test_hf_models)


@pytest.mark.parametrize("naming", ["inferred", "named"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,mesh,layout", [
    ("mixtral", {"ep": 2}, EP2), ("olmoe", {"dp": 2, "ep": 2}, OWN), ("qwen2_moe", {"dp": 2, "ep": 2}, DATA),
    ("qwen3_moe", {"ep": 2, "tp": 2}, EPTP),
], ids=["mixtral-ep2", "olmoe-dp2xep2-own", "qwen2_moe-dp2xep2-data", "qwen3_moe-ep2xtp2"])
def test_every_implementation_and_naming_plans_readme_layout_strictly_and_exactly(name, mesh, layout, impl, naming):
    """README's EP layouts under both implementations torch.export captures and both ways of
    naming the experts dim: strict (nothing the layout splits is gathered), one MoE region per
    layer with the experts dim called ``experts``, the region's all-to-alls and nothing else on
    ep, expert weights split on ep and the router whole there (it scores every expert for this
    rank's tokens), exact."""
    model, args = hf_moe(name, impl)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=_namings()[naming], layout=layout, strict=True)
    form = {"grouped_mm": "grouped", "batched_mm": "batched"}[impl]
    assert [p.region.form for p in plan.program.experts] == [form, form]
    assert _moe_all_to_alls(plan) == {(phase, "all_to_all", ("ep",), op): 2 for phase, op in [
        ("forward", "exchange_counts"), ("forward", "dispatch_rows"), ("forward", "combine_rows"),
        ("backward", "dispatch_rows"), ("backward", "combine_rows")]}
    ep = list(mesh).index("ep")
    for n, _ in model.named_parameters():
        if ".experts." in n:
            assert str(plan.placement_of(n)[ep]) == "S(0)", n
        elif n.endswith("mlp.gate.weight"):
            assert str(plan.placement_of(n)[ep]) == "R", n
    experts_reduced = [c for c in plan.collectives if c.kind == "all_reduce" and ".experts" in c.where
                       and (c.phase == "forward" or c.axes == ("ep",))]
    assert not experts_reduced, [(c.phase, c.axes, c.where, c.why) for c in experts_reduced]
    _assert_exact64(plan, model, args)


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_biases_are_selected_per_row_on_the_experts_ranks(impl):
    """GPT-OSS's experts add per-expert biases, selected per row by the rows' expert ids (sorted
    ids in grouped_mm, the flattened top_k_index in batched_mm): on ep each rank selects from its
    own experts' biases with the rows' local ids. Router (weight and bias) named ``experts``."""
    model, args = hf_moe("gpt_oss", impl)
    dims = {**HF_DIMS, "*.mlp.router.weight": "experts hidden", "*.mlp.router.bias": "experts"}
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "ep": 2}), dims=dims, layout=DATA, strict=True)
    assert [p.region.form for p in plan.program.experts] == [impl.split("_")[0]] * 2
    biases = [n for n, _ in model.named_parameters() if n.endswith("_bias") and ".experts." in n]
    assert len(biases) == 4 and all(str(plan.placement_of(n)[1]) == "S(0)" for n in biases)
    assert all(str(plan.placement_of(n)[1]) == "R" for n, _ in model.named_parameters() if ".router." in n)
    _assert_exact64(plan, model, args)


@pytest.mark.parametrize("impl", IMPLS)
def test_batched_and_grouped_mm_train_exactly_with_the_router_named_experts(impl):
    """3 AdamW steps of Mixtral on dp=2 x ep=2 (ep on the data axis), the router's weight named
    ``experts hidden``: losses and every parameter equal single-device training, within 10x the
    float32-vs-float64 spread of that training (AdamW divides by sqrt(v) and magnifies rounding
    of near-zero gradients, so the bound comes from the run itself)."""
    from tests.helpers.exactness import close
    model, args = hf_moe("mixtral", impl)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "ep": 2}), dims=_namings()["named"], layout=DATA,
                               train=True, strict=True)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    ref_losses, ref_params = reference_train(model, [args] * 3, make)
    f64 = []

    def exact(name=None):
        def get():
            if not f64:
                f64.append(reference_train(copy.deepcopy(model).double(), [args] * 3, make))
            return torch.tensor(f64[0][0], dtype=torch.float64) if name is None else f64[0][1][name]
        return get

    losses, params = plan.simulate_train([args] * 3, optimizer=make)
    close(torch.tensor(losses), torch.tensor(ref_losses), "losses", exact())
    for name, p in ref_params.items():
        close(params[name], p, name, exact(name))


class _DenseMixture(torch.nn.Module):
    """Every expert on every token, weighted by the router's softmax: no per-token selection of
    experts, so not an MoE layer of passes/experts.py (its experts dim is an ordinary dim)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        probs = self.gate(x).softmax(-1)                      # [tokens, experts]
        y = torch.einsum("th,eoh->teo", x, self.w)            # [tokens, experts, out]
        return (y * probs[..., None]).sum(1).square().sum()


def test_experts_and_batch_on_one_axis_outside_an_moe_layer_is_refused_with_readmes_reason():
    """README's EP layout puts the batch and the experts on one axis; where no MoE layer is
    recognised that cannot work, and the error says so instead of only 'shard one of them on
    another axis'."""
    torch.manual_seed(0)
    with pytest.raises(autoshard.LayoutError, match=r"would shard two dims of one tensor.*'experts'.*experts share "
                                                    r"an axis with the tokens only in a Mixture-of-Experts layer"):
        autoshard.autoshard(_DenseMixture(), (torch.randn(6, 8),), mesh=Mesh({"ep": 2}),
                            dims={"x": "batch hidden", "gate.weight": "experts hidden", "w": "experts out hidden"},
                            layout={"batch": "ep", "experts": "ep"})


@pytest.mark.parametrize("experts", ["grouped", "looped"])
@pytest.mark.parametrize("mesh,layout", [({"tp": 2}, {"ffn": "tp"}),
                                         ({"ep": 2, "tp": 2}, {"batch": "ep", "experts": "ep", "ffn": "tp"})],
                         ids=["ffn-tp", "ep-and-ffn-tp"])
def test_a_layout_splitting_the_experts_inner_dims_is_refused(experts, mesh, layout):
    """An MoE layer's experts run their own code copied as written, each expert whole on the rank
    holding it: a layout splitting a dim of the expert weights other than the experts dim (their
    ffn dim on tp) would compute each expert's part as if it were the whole (a partial sum never
    summed: outputs off by 0.46 on this model). It is refused, naming the parameter, the dim and
    the axis."""
    model, args, dims = moe_tiny(experts=experts)
    with pytest.raises(autoshard.LayoutError, match=r"mesh axis 'tp' splits dim 'ffn' of expert parameter "
                                                    r"layers\.0\.mlp\.experts\..*\(tensor parallelism inside the "
                                                    r"experts is not supported\)"):
        autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout)


def test_hugging_face_experts_inner_dim_by_inferred_name_is_refused():
    """The same with Hugging Face's stacked experts and the inferred name of their fused
    gate/up projection's output dim (which the search may put on an axis too)."""
    model, args = _hf("qwen2_moe")
    with pytest.raises(autoshard.LayoutError, match=r"splits dim '.*mlp\.experts\.gate_up_proj:1' of expert parameter"):
        autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=HF_DIMS,
                            layout={"*.mlp.experts.gate_up_proj:1": "tp"})


def test_predicted_cost_counts_each_moe_layers_all_to_alls():
    """The cost model times an MoE layer's count exchange, dispatch and combine (forward) and the
    dispatch and combine adjoints (backward) as the collectives they are: each blocks the
    compute stream for its alpha-beta time. On Mixtral, ep=2, 2 layers: 6 forward and 4 backward
    all-to-alls on ep, and their time in the step."""
    from autoshard.cost.model import collective_seconds

    model, args = _hf("mixtral")
    plan = autoshard.autoshard(model, args, mesh=Mesh({"ep": 2}), dims=HF_DIMS, layout=EP2, train=True,
                               hardware="h100")
    from autoshard.cost.plan_cost import plan_cost
    cost = plan_cost(plan)
    assert cost.counts[("ep", "forward", "all_to_all")] == 6
    assert cost.counts[("ep", "backward", "all_to_all")] == 4
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 10
    # every all-to-all blocks: the step holds at least their time on top of nothing else
    assert cost.comm_total[("ep", "forward")] >= sum(
        collective_seconds(plan.cost_model, plan.mesh, c.kind, c.axes, c.bytes) for c in a2a if c.phase == "forward") > 0
