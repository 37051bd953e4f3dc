"""Mixed precision: bf16 parameters, activations and gathers, gradient sums in fp32, fp32 master
weights in the sharded optimizer; equal to a single-device run with the same casts, and the
bytes each rank holds equal plan.state_bytes()."""
import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard import Mesh
from autoshard.runtime import run_simulated

BF16 = {"param": torch.bfloat16, "reduce": torch.float32}
N = 8  # global batch


class MLP(nn.Module):
    """loss = sum of squares / N: each rank's part of the gradient is computed by the same ops
    as the reference's on the same half of the batch."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).sum() / N


def reference(model, x, steps, ranks=2, lr=1e-2):
    """Single device, the same casts: bf16 parameters; each half-batch's bf16 gradient cast to
    fp32 and summed in rank order, rounded to bf16; AdamW on fp32 masters; bf16 = master."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    masters = [nn.Parameter(p.detach().float()) for p in m.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr)
    losses = []
    for _ in range(steps):
        sums = [None] * len(masters)
        total = 0.0
        for part in x.to(torch.bfloat16).chunk(ranks):
            m.zero_grad()
            loss = m(part)
            loss.backward()
            total += loss.detach().float()
            for i, p in enumerate(m.parameters()):
                g = p.grad.float()
                sums[i] = g if sums[i] is None else sums[i] + g
        for mp, s in zip(masters, sums):
            mp.grad = s.to(torch.bfloat16).float()
        opt.step()
        with torch.no_grad():
            for p, mp in zip(m.parameters(), masters):
                p.copy_(mp)
        losses.append(total)
    return losses, dict(m.named_parameters())


@pytest.mark.parametrize("stage,reshard", [(0, None), (3, True)], ids=["ddp", "zero3"])
def test_bf16_with_fp32_masters_equals_single_device_with_the_same_casts(stage, reshard):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(N, 16)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch hidden"}, layout={"batch": "dp"},
                               train=True, zero_stage=stage, reshard_after_forward=reshard, precision=BF16)
    losses, params = plan.simulate_train([(x,)] * 3, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    ref_losses, ref_params = reference(model, x, 3)
    sums = [r for r in plan.last_trace[0] if r.axis == "dp" and r.phase == "backward"
            and r.kind in ("all_reduce", "reduce_scatter")]
    assert sums and all(r.dtype == torch.float32 for r in sums)  # gradient sums in fp32
    listed = {c.tag: c.bytes for c in plan.collectives if c.phase == "backward" and c.kind == sums[0].kind}
    assert all(listed[r.tag] == r.bytes for r in sums if r.tag in listed)  # the plan counts fp32 bytes
    gathers = [r for r in plan.last_trace[0] if r.kind == "all_gather" and r.axis == "dp"]
    assert all(r.dtype == torch.bfloat16 for r in gathers)  # parameters gathered in bf16
    # the loss itself is summed over ranks in bf16 (a forward sum), the reference in fp32
    assert losses == pytest.approx([float(v) for v in ref_losses], rel=1e-2)
    for name, p in ref_params.items():
        assert params[name].dtype == torch.bfloat16
        torch.testing.assert_close(params[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert model.up.weight.dtype == torch.float32  # the user's model is not cast


@pytest.mark.parametrize("stage", [0, 3])
def test_held_bytes_equal_state_bytes_with_masters(stage):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(N, 16)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch hidden"}, layout={"batch": "dp"},
                               train=True, zero_stage=stage, precision=BF16)

    def rank_fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        local(x).backward()
        held = local.held_bytes()
        opt.step()
        return {**held, "optimizer": opt.state_bytes()}

    predicted = plan.state_bytes(optimizer_states=2)
    assert all(h == predicted for h in run_simulated(plan.mesh, rank_fn))
    n = sum(p.numel() for p in model.parameters()) // (2 if stage == 3 else 1)
    # ZeRO's accounting (Rajbhandari et al., 2020): bf16 weights and gradients, fp32 master and
    # two fp32 Adam moments (2 + 2 + 12 bytes)
    assert predicted == {"params": 2 * n, "grads": 2 * n, "optimizer": 12 * n}
    assert plan.cost["memory"]["optimizer"] == 12 * n


def test_export_runs_in_bf16_and_checks_at_bf16_precision(tmp_path):
    from examples.models import llama_tiny
    from autoshard.passes.export import simulate_export
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"}, train=True,
                               zero_stage=3, precision=BF16)
    plan.export(tmp_path / "x", args)
    ranks = simulate_export(tmp_path / "x", steps=2, check=True)
    losses, _ = plan.simulate_train([args] * 2, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert all(r["ok"] for r in ranks) and ranks[0]["losses"] == losses


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision"):
        autoshard.autoshard(MLP(), (torch.randn(N, 16),), mesh=Mesh({"dp": 2}), dims={"x": "batch hidden"},
                            layout={"batch": "dp"}, train=True, precision={"params": torch.bfloat16})
