"""Checkpoints on 4 real gloo processes (dp=2 x tp=2): resume is bit-exact (4 steps straight vs
2 steps, save, load into fresh ranks, 2 steps) for ZeRO-0 and ZeRO-3, and the ZeRO-3 checkpoint
loads under tp=4 in the same processes with every parameter equal to the consolidated one."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.ownership import assemble  # noqa: E402
from autoshard.runtime import DistributedBackend, rank_context  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from examples.models import llama_tiny  # noqa: E402
from exactness import train_steps  # noqa: E402

pytestmark = pytest.mark.slow
LR = 1e-2
CONFIGS = {"zero0": dict(zero_stage=0), "zero3": dict(zero_stage=3, reshard_after_forward=True)}


def make_plan(mesh, layout, **options):
    model, args, dims = llama_tiny(with_labels=True)
    return autoshard.autoshard(model, args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout, train=True,
                               **options)


def dp_tp(config):
    return make_plan({"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"}, **CONFIGS[config])


def data(n=4):
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (4, 8), generator=gen) for _ in range(n)]
    return [(i, None, i.clone()) for i in ids]


def worker(rank, world_size, config, path):
    plan, batches = dp_tp(config), data()
    fresh = lambda p: (lambda l: (l, p.optimizer(l, torch.optim.AdamW, lr=LR, weight_decay=0.1)))(p.build(rank))  # noqa: E731
    out = {}
    with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)):
        local, opt = fresh(plan)
        out["straight"] = train_steps(local, opt, batches), local.full_parameters()
        local, opt = fresh(plan)
        first = train_steps(local, opt, batches[:2])
        out["saved"] = local.full_parameters()
        plan.save_checkpoint(local, opt, path, step=2)
        local, opt = fresh(plan)
        step = plan.load_checkpoint(local, opt, path)["step"]
        out["resumed"] = first + train_steps(local, opt, batches[step:]), local.full_parameters()
    if config == "zero3":
        tp4 = make_plan({"tp": 4}, {"heads": "tp", "ffn": "tp"})
        with rank_context(tp4.mesh, rank, DistributedBackend(tp4.mesh)):
            local, opt = fresh(tp4)
            tp4.load_checkpoint(local, opt, path)
            out["tp4"] = local.full_parameters()
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_and_reshard_on_gloo(tmp_path, config):
    path = tmp_path / "ckpt"
    results = spawn(worker, 4, config, str(path), timeout=180)
    for r in results:
        (l_straight, p_straight), (l_resumed, p_resumed) = r["straight"], r["resumed"]
        assert l_resumed == l_straight  # bit for bit, on every rank
        for fqn in p_straight:
            assert torch.equal(p_resumed[fqn], p_straight[fqn]), fqn
    plan = dp_tp(config)
    state = autoshard.consolidate(path)
    for fqn in results[0]["saved"]:
        saved = assemble([r["saved"][fqn] for r in results], plan.placement_of(fqn), plan.mesh)
        assert torch.equal(state[fqn], saved), fqn
    if config == "zero3":
        tp4 = make_plan({"tp": 4}, {"heads": "tp", "ffn": "tp"})
        for fqn in results[0]["tp4"]:
            got = assemble([r["tp4"][fqn] for r in results], tp4.placement_of(fqn), tp4.mesh)
            assert torch.equal(got, state[fqn]), fqn
