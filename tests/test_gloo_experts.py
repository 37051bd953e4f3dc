"""Expert parallelism on real processes: the MoE example and Hugging Face's Mixtral with
``experts_implementation="batched_mm"`` (its router's weight named ``experts hidden``) on
dp=2 x ep=2 (ep on the data axis) trained on 4 gloo processes equal the simulated mesh bit for
bit (losses, trained parameters, and the collectives each rank ran, the variable-split
all-to-alls included), and an exported EP plan runs under torchrun with ``run.py --check``."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.runtime import DistributedBackend, rank_context  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from autoshard.passes.export import torchrun_command  # noqa: E402
from examples.models import moe_tiny  # noqa: E402
from exactness import train_steps  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 3
LAYOUT = {"batch": ("dp", "ep"), "experts": "ep"}


def make_plan(experts="grouped"):
    if experts == "batched_mm":  # Hugging Face Mixtral, the router named as tests/hf_zoo.py names it
        from hf_zoo import EXPERTS_DIMS
        from test_experts import HF_DIMS, _hf_impl
        (model, args), dims = _hf_impl("mixtral", "batched_mm"), {**HF_DIMS, **EXPERTS_DIMS}
    else:
        model, args, dims = moe_tiny(experts=experts, with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "ep": 2}), dims=dims, layout=LAYOUT,
                               train=True)
    return plan, args


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def train_worker(rank, world_size, experts="grouped"):
    plan, args = make_plan(experts)
    with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)) as ctx:
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        losses = train_steps(local, opt, [args] * STEPS)
    return losses, local.full_parameters(), [(r.kind, r.axis, r.phase, r.tag, r.op) for r in ctx.trace]


@pytest.mark.parametrize("experts", ["grouped", "batched_mm"])
def test_dp2_x_ep2_training_on_gloo_equals_simulation_bit_for_bit(experts):
    results = spawn(train_worker, 4, experts, timeout=240)
    plan, args = make_plan(experts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each gloo process runs: CPU kernels then sum in the same order
    try:
        sim_losses, sim_params = plan.simulate_train([args] * STEPS, optimizer=make_optimizer)
    finally:
        torch.set_num_threads(threads)
    for rank, (losses, _, trace) in enumerate(results):
        # all-to-alls move rows, and every sum is over 2 ranks (order-free in fp32): bit for bit
        assert losses == sim_losses
        assert trace == [(r.kind, r.axis, r.phase, r.tag, r.op) for r in plan.last_trace[rank]]
        # per MoE layer and step: count exchange, dispatch, combine; the two adjoints in backward
        a2a = [(phase, axis) for kind, axis, phase, tag, op in trace if kind == "all_to_all"]
        assert sorted(a2a) == sorted([("forward", "ep")] * 3 * 2 * STEPS + [("backward", "ep")] * 2 * 2 * STEPS)
    for fqn, full in sim_params.items():
        got = autoshard.ownership.assemble([r[1][fqn] for r in results], plan.placement_of(fqn), plan.mesh)
        torch.testing.assert_close(got, full, rtol=0, atol=0, msg=lambda m: f"{fqn}: {m}")


def test_exported_ep_plan_runs_under_torchrun_with_check(tmp_path):
    """The looped (ModuleList) shape, so both shapes run on real processes."""
    plan, args = make_plan("looped")
    path = plan.export(tmp_path / "moe", args)
    proc = subprocess.run(torchrun_command(path, 4, "--check", "--steps", "2"), capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("check passed") == 1, proc.stdout
    assert "outputs and gradients equal" in proc.stdout and "losses of 2 adamw steps match" in proc.stdout
