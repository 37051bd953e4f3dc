"""Pipelined plans' predicted memory per pipeline rank (cost/stage_memory.py) against what
the runtime holds, measured in-process the way ``run.py --memory`` does (saved activations +
parameters, gradients and optimizer state: autoshard.runtime.execution.step_memory), and the
per-microbatch copies term (cost/stage_copies.py) against the model's own sizes."""
import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.cost.stage_copies import region_copy_inputs
from autoshard.passes.recompute import block_regions
from autoshard.runtime import run_simulated
from autoshard.runtime.execution.step_memory import StepMemory

from examples.models import llama_tiny

BATCH, SEQ = 8, 32


@pytest.fixture(scope="module")
def block_1f1b():
    model, args, dims = llama_tiny(with_labels=True, batch=BATCH, seq=SEQ)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"pp": 2, "dp": 2}), dims=dims, layout={"batch": "dp"},
                               train=True, checkpoint="block", pipeline={"axis": "pp", "microbatches": 4})
    return model, args, plan


def test_a_checkpointed_block_keeps_its_weight_copies_and_rotary_tables(block_1f1b):
    """Stage 0's block (layers.0) reads every weight of the layer through a data-axis
    mark_varying, whose forward copies it, and the rotary cos / sin tables made from a buffer:
    the recompute keeps all of them per microbatch (none is an activation of cost/saved.py)."""
    model, _, plan = block_1f1b
    gm = plan.plain_stage_forwards[0]
    users = {n.name for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith(("p_", "b_"))}
    (region,) = block_regions(gm.graph, users)
    weights = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    head_dim = model.config.hidden_size // model.config.num_heads
    rotary = 2 * SEQ * head_dim * 4  # cos and sin, fp32, one row per position
    assert region_copy_inputs(gm.graph, users) == {region.key: weights + rotary}


def test_measured_peak_within_15_percent_of_stage_prediction(block_1f1b):
    """pp=2 x dp=2, 1F1B, block recompute, 2 AdamW steps on the simulated mesh: each rank's
    peak (as run.py --memory measures it) within 15% of its pipeline rank's prediction."""
    _, args, plan = block_1f1b
    predicted = [r["peak"] for r in plan.stage_memory()]

    def fn(rank):
        pipe = plan.build(rank)
        opt = plan.optimizer(pipe, torch.optim.AdamW, lr=1e-3)
        meter = StepMemory(pipe.local, opt)
        for _ in range(2):
            pipe.step(plan.split(args))
            meter.sample()
            opt.step()
            opt.zero_grad()
        return meter.peak

    for rank, peak in enumerate(run_simulated(plan.mesh, fn)):
        pred = predicted[plan.mesh.coords(rank)["pp"]]
        assert 0.85 * pred <= peak <= 1.15 * pred, (rank, peak, pred)
