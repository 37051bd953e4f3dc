"""Training plans: data parallelism, ZeRO-1/2/3, sharded optimizers, loss normalization and
gradient accumulation, each checked against single-device training."""
import collections

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard import Mesh
from autoshard.cost import collective_bytes, model_state_bytes
from autoshard.ownership import local_piece
from autoshard.runtime import run_simulated

from examples.models import llama_tiny
from tests.helpers.exactness import SPREAD_FACTOR, assert_training_within_spread, reference_train

LEVELS = [(0, None), (1, None), (2, None), (3, True), (3, False)]
LEVEL_IDS = ["ddp", "zero1", "zero2", "zero3-reshard", "zero3-keep"]
MESHES = [({"dp": 2}, {"batch": "dp"}), ({"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"})]


def plan_for(model, args, dims, mesh, layout, stage, reshard):
    return autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout, train=True,
                               zero_stage=stage, reshard_after_forward=reshard)


# --------------------------------------------------------------------------- worked example


class Contribution(nn.Module):
    """loss = mean over the batch of <p, c_row>: the gradient is the mean of the rows."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))

    def forward(self, c):
        return (c * self.p).sum(-1).mean()


def test_fsdp_momentum_update():
    """From gradient shards to updated parameters: two ranks, fully sharded, p = [1, 2, 3, 4],
    mean gradient g = [2, 4, 6, 8], PyTorch SGD lr 0.1 momentum 0.9 from v = [0.5, -0.5, 1, -1]:
    v' = 0.9 v + g = [2.45, 3.55, 6.9, 7.1], p' = p - 0.1 v' = [0.755, 1.645, 2.31, 3.29]."""
    model = Contribution()
    c = torch.tensor([[1.0, 2.0, 3.0, 4.0], [3.0, 6.0, 9.0, 12.0]])  # one row per data rank
    plan = autoshard.autoshard(model, (c,), mesh=Mesh({"dp": 2}), dims={"c": "batch d", "p": "d"},
                               layout={"batch": "dp"}, train=True, zero_stage=3)
    assert str(plan.placement_of("p")[0]) == "S(0)"
    momentum = torch.tensor([0.5, -0.5, 1.0, -1.0])

    def rank_fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.SGD, lr=0.1, momentum=0.9)
        (shard,) = local.parameters()
        held = shard.detach().clone()
        opt.inner.state[shard]["momentum_buffer"] = local_piece(momentum, plan.placement_of("p"), plan.mesh, rank)
        local(c).backward()
        grad = shard.grad.clone()
        opt.step()
        return held, grad, opt.inner.state[shard]["momentum_buffer"].clone(), shard.detach().clone()

    (p0, g0, v0, new0), (p1, g1, v1, new1) = run_simulated(plan.mesh, rank_fn)
    assert p0.tolist() == [1, 2] and p1.tolist() == [3, 4]
    torch.testing.assert_close(torch.cat([g0, g1]), torch.tensor([2.0, 4.0, 6.0, 8.0]))
    torch.testing.assert_close(torch.cat([v0, v1]), torch.tensor([2.45, 3.55, 6.9, 7.1]))
    torch.testing.assert_close(torch.cat([new0, new1]), torch.tensor([0.755, 1.645, 2.31, 3.29]))


# --------------------------------------------------------------------------- exact training


@pytest.mark.parametrize("stage,reshard", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("mesh,layout", MESHES, ids=["dp2", "dp2xtp2"])
def test_adamw_training_matches_single_device(mesh, layout, stage, reshard):
    model, args, dims = llama_tiny(with_labels=True)
    plan = plan_for(model, args, dims, mesh, layout, stage, reshard)
    lr = 1e-3
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1)  # noqa: E731
    losses, params = plan.simulate_train([args] * 3, optimizer=make_opt)
    # Adam divides by sqrt(v) + eps: an element whose gradient is a few eps turns a rounding-level
    # difference of the gradient (another summation order: ranks, or another CPU's BLAS kernel)
    # into a visible one of the update. The bound is the float32 spread of single-device training
    # itself (float32 against float64, per parameter tensor; tests/helpers/exactness.py says how).
    assert_training_within_spread(losses, params, model, [args] * 3, make_opt)


def test_the_spread_bound_accepts_float32_rounding_and_refuses_a_lost_gradient_sum():
    """The bound of the tests above: single-device float32 training itself is at most one spread
    from float64 (1 / SPREAD_FACTOR of the bound); what a data-parallel rank trains without the
    gradient sum (its half of the batch) is far outside it, in losses and parameters."""
    model, args, dims = llama_tiny(with_labels=True)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)  # noqa: E731
    steps = [args] * 3
    ratios = assert_training_within_spread(*reference_train(model, steps, make_opt), model, steps, make_opt)
    assert max(ratios.values()) <= 1 / SPREAD_FACTOR + 1e-12, ratios
    half = tuple(a[:a.shape[0] // 2] if isinstance(a, torch.Tensor) else a for a in args)
    lost_losses, lost_params = reference_train(model, [half] * 3, make_opt)
    with pytest.raises(AssertionError, match="^losses: .* beyond the float32 spread bound"):
        assert_training_within_spread(lost_losses, lost_params, model, steps, make_opt)
    with pytest.raises(AssertionError, match="beyond the float32 spread bound"):
        assert_training_within_spread(reference_train(model, steps, make_opt)[0], lost_params, model, steps, make_opt)


@pytest.mark.parametrize("stage,reshard", LEVELS, ids=LEVEL_IDS)
def test_sgd_momentum_training_is_exact(stage, reshard):
    """SGD is linear in the gradient: the parameters carry the gradients' rounding unamplified,
    within the float32 spread of single-device training (tests/helpers/exactness.py)."""
    model, args, dims = llama_tiny(with_labels=True)
    mesh, layout = MESHES[1]
    plan = plan_for(model, args, dims, mesh, layout, stage, reshard)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
    losses, params = plan.simulate_train([args] * 3, optimizer=make_opt)
    assert_training_within_spread(losses, params, model, [args] * 3, make_opt)


# --------------------------------------------------------------------------- schedules


def dp_schedule(plan):
    """{(kind, phase): count} of data-axis collectives one rank ran in one training step,
    loss/token-count all-reduces excluded."""
    per_param = collections.Counter()
    param_tags = {c.tag for c in plan.collectives if c.node in {i.name for i in plan.captured.inputs if i.kind == "parameter"}}
    for r in plan.last_trace[0]:
        if r.axis == "dp" and (r.tag in param_tags or r.phase == "optimizer"):
            per_param[(r.kind, r.phase)] += 1
    return per_param


# ZeRO's stages (Rajbhandari et al., 2020), per parameter and step: DDP all-reduces gradients; ZeRO-1 all-reduces
# them and all-gathers updated slices; ZeRO-2 reduce-scatters them and all-gathers updated
# slices; ZeRO-3 gathers before forward (and again before backward when it resharded) and
# reduce-scatters gradients.
SCHEDULE = {
    (0, None): {("all_reduce", "backward"): 1},
    (1, None): {("all_reduce", "backward"): 1, ("all_gather", "optimizer"): 1},
    (2, None): {("reduce_scatter", "backward"): 1, ("all_gather", "optimizer"): 1},
    (3, True): {("all_gather", "forward"): 1, ("all_gather", "backward"): 1, ("reduce_scatter", "backward"): 1},
    (3, False): {("all_gather", "forward"): 1, ("reduce_scatter", "backward"): 1},
}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return torch.tanh(self.down(torch.relu(self.up(x)))).pow(2).mean()


@pytest.mark.parametrize("stage,reshard", LEVELS, ids=LEVEL_IDS)
def test_collective_schedule_per_level(stage, reshard):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    # bucket_mb=0: one gradient all-reduce per parameter, to count per parameter as the table does
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch hidden"},
                               layout={"batch": "dp"}, train=True, zero_stage=stage, reshard_after_forward=reshard,
                               bucket_mb=0)
    plan.simulate_train([(x,)], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    n_params = len(list(model.parameters()))
    expected = {k: v * n_params for k, v in SCHEDULE[(stage, reshard)].items()}
    if reshard:
        # Gathered again only what backward reads: down.weight (to pass the gradient into up's
        # output). Biases are never read by backward, nor is up.weight (its input x needs no
        # gradient), so they are not gathered a second time.
        expected[("all_gather", "backward")] = 1
    assert dp_schedule(plan) == expected


def moved_bytes(plan, fqn, ranks):
    """Ring bytes one rank sends for one parameter's data-axis collectives in a step (payload =
    the logical tensor: the gathered size for all-gathers)."""
    node = next(i.name for i in plan.captured.inputs if i.target == fqn)
    tags = {c.tag for c in plan.collectives if c.node == node and c.axes == ("dp",)}
    total = 0.0
    for r in plan.last_trace[0]:
        if r.tag in tags:
            logical = r.bytes * ranks if r.kind == "all_gather" else r.bytes
            total += collective_bytes(r.kind, logical, ranks)
    return total


def test_full_sharding_moves_one_and_a_half_times_ddp():
    """Full sharding (ZeRO-3, Rajbhandari et al., 2020) costs about 1.5x plain data parallelism (gather for forward,
    gather again for backward, reduce-scatter vs one all-reduce), per parameter that backward
    reads; keeping the gathered parameter through backward removes the second gather."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    moved = {}
    for stage, reshard in [(0, None), (3, True), (3, False)]:
        plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 4}), dims={"x": "batch hidden"},
                                   layout={"batch": "dp"}, train=True, zero_stage=stage, reshard_after_forward=reshard,
                                   bucket_mb=0)
        plan.simulate_grads(x)
        moved[(stage, reshard)] = moved_bytes(plan, "down.weight", 4)
    assert moved[(3, True)] / moved[(0, None)] == pytest.approx(1.5)
    assert moved[(3, False)] / moved[(0, None)] == pytest.approx(1.0)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("stage,reshard", LEVELS, ids=LEVEL_IDS)
def test_held_state_equals_prediction_and_seed_formula(stage, reshard):
    model, args, dims = llama_tiny(with_labels=True)
    mesh, layout = MESHES[1]
    plan = plan_for(model, args, dims, mesh, layout, stage, reshard)

    def rank_fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        local(*args).backward()
        held = local.held_bytes()
        opt.step()  # creates the optimizer state
        return {**held, "optimizer": opt.state_bytes()}

    predicted = plan.state_bytes(optimizer_states=2)
    held = run_simulated(plan.mesh, rank_fn)
    assert all(h == predicted for h in held), (held, predicted)
    # Seed formula (fp32 weights and grads, two fp32 Adam moments, no master copy): with every
    # parameter divisible by dp, per-rank bytes follow 4 + 4 + 8 bytes per local parameter.
    n_local = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() // 2 for n, p in model.named_parameters() if "proj" in n)  # tp halves the projections
    seed = model_state_bytes(n_local, dp=2, zero_stage=stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert (predicted["params"], predicted["grads"], predicted["optimizer"]) == (seed.params, seed.grads, seed.optimizer)


# --------------------------------------------------------------------------- loss normalization


def test_masked_loss_with_unequal_valid_tokens_per_rank():
    model, (ids, mask, labels), dims = llama_tiny(with_labels=True)
    labels = labels.clone()
    labels[0, :7] = -100  # dp rank 0 holds rows 0-1: far fewer valid tokens than rank 1
    labels[1, 2:] = -100
    args = (ids, mask, labels)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"}, train=True)
    model.zero_grad()
    ref = model(*args)
    ref.backward()
    out, grads = plan.simulate_grads(*args)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
    # The loss is a global sum over a global count: no averaging collective anywhere.
    assert all(c.kind != "all_reduce" or "mean" not in c.why for c in plan.collectives)


def test_gradient_accumulation_communicates_only_in_the_last_microbatch():
    model, args, dims = llama_tiny(with_labels=True, batch=8)
    ids, mask, labels = args
    mbs = [(ids[i:i + 2], None, labels[i:i + 2]) for i in range(0, 8, 2)]  # 4 microbatches of 2
    plan = autoshard.autoshard(model, mbs[0], mesh=Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    losses, params = plan.simulate_train([mbs, mbs], optimizer=make_opt, microbatches=4)
    assert_training_within_spread(losses, params, model, [mbs, mbs], make_opt, microbatches=4)  # float32 spread
    # Per step: each gradient bucket is all-reduced once on dp (not four times), after the last
    # microbatch's forward; every parameter is in exactly one bucket.
    trace = plan.last_trace[0]
    dp_bwd = [i for i, r in enumerate(trace) if r.axis == "dp" and r.phase == "backward"]
    n_buckets = len(plan.program.buckets)
    assert n_buckets >= 1 and len(dp_bwd) == 2 * n_buckets
    in_buckets = sorted(n for _, names in plan.program.buckets for n in names)
    assert in_buckets == sorted(i.name for i in plan.captured.inputs if i.kind == "parameter")
    forwards = [i for i, r in enumerate(trace) if r.phase == "forward" and r.axis == "tp"]
    per_mb = len(forwards) // 8
    last_fwd_of_step1 = forwards[4 * per_mb - 1]
    assert all(i > last_fwd_of_step1 for i in dp_bwd[:n_buckets])


def test_gradient_buckets_fill_in_backward_order_and_overlap_backward():
    """Small buckets: several all-reduces, filled in the order gradients become ready (last
    layer first), the same on every rank, each started before backward is over (the tensor-
    parallel all-reduces of earlier layers' backward still follow)."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, bucket_mb=0.01)
    assert len(plan.program.buckets) > 3
    names = {i.name: i.target for i in plan.captured.inputs}
    first = [names[n] for n in plan.program.buckets[0][1]]
    last = [names[n] for n in plan.program.buckets[-1][1]]
    assert "lm_head.weight" in first and "embed_tokens.weight" in last
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    losses, params = plan.simulate_train([args], optimizer=make_opt)
    assert_training_within_spread(losses, params, model, [args], make_opt)  # float32 spread (tests/helpers/exactness.py)
    tags = [tag for tag, _ in plan.program.buckets]
    for trace in plan.last_trace:
        order = [r.tag for r in trace if r.op == "grad_bucket"]
        assert order == tags
        first_bucket = next(i for i, r in enumerate(trace) if r.op == "grad_bucket")
        last_tp_bwd = max(i for i, r in enumerate(trace) if r.axis == "tp" and r.phase == "backward")
        assert first_bucket < last_tp_bwd


def test_non_elementwise_optimizer_is_refused_on_sharded_state():
    model, args, dims = llama_tiny(with_labels=True)
    plan = plan_for(model, args, dims, *MESHES[0], 3, True)
    with pytest.raises(ValueError, match="LBFGS does not update each element independently"):
        plan.simulate_train([args], optimizer=lambda ps: torch.optim.LBFGS(ps))


def test_zero_needs_a_data_axis():
    model, args, dims = llama_tiny(with_labels=True)
    with pytest.raises(autoshard.LayoutError, match="no mesh axis splits an input"):
        autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, layout={"heads": "tp"}, train=True,
                            zero_stage=1)


@pytest.mark.parametrize("stage,reshard", LEVELS, ids=LEVEL_IDS)
def test_plan_lists_what_one_step_runs(stage, reshard):
    """plan.collectives (forward, backward, optimizer) is what a training step executes; a
    resharded parameter's second gather is listed and runs only where backward reads it."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = plan_for(model, args, dims, *MESHES[1], stage, reshard)
    plan.simulate_train([args], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    listed = collections.Counter((c.kind, c.axes[0], c.phase) for c in plan.collectives)
    ran = collections.Counter((r.kind, r.axis, r.phase) for r in plan.last_trace[0])
    if reshard:
        key = ("all_gather", "dp", "backward")
        assert 0 < ran[key] <= listed[key]
        # Only the embedding table is not read by backward (its gradient needs the indices only).
        assert listed[key] - ran[key] == 1
        listed.pop(key), ran.pop(key)
    assert listed == ran
    assert any("ZeRO" in c.why for c in plan.collectives) == (stage > 0)
