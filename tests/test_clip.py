"""Gradient clipping by the global norm over every shard and mesh axis equals
torch.nn.utils.clip_grad_norm_ on the unsharded model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.runtime import run_simulated  # noqa: E402
from autoshard.runtime.execution.clip import clip_grad_norm_  # noqa: E402
from examples.models import llama_tiny  # noqa: E402

DP_TP = dict(mesh={"dp": 2, "tp": 2}, layout={"batch": "dp", "heads": "tp", "ffn": "tp"})


def make_plan(**options):
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(DP_TP["mesh"]), dims=dims,
                               layout=DP_TP["layout"], train=True, **options)
    return plan, args


def reference(args, max_norm):
    model, _, _ = llama_tiny(with_labels=True)
    model(*args).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("options,max_norm", [
    (dict(zero_stage=3, reshard_after_forward=True), 0.5), (dict(zero_stage=3), 1e6), (dict(zero_stage=0), 0.5),
    (dict(zero_stage=1), 0.5), (dict(zero_stage=2), 0.5), (dict(zero_stage=0, bucket_mb=0.01), 0.5)],
    ids=["zero3", "zero3-below", "zero0", "zero1", "zero2", "ddp-buckets"])
def test_clip_grad_norm_equals_single_device(options, max_norm):
    plan, args = make_plan(**options)

    def rank_fn(rank):
        local = plan.build(rank)
        local(*args).backward()
        norm = clip_grad_norm_(local, max_norm)
        return norm, {local.fqn_of[n]: p.grad.clone() for n, p in local.named_parameters()}

    results = run_simulated(plan.mesh, rank_fn)
    ref_norm, ref_grads = reference(args, max_norm)
    assert ref_norm > 0.5  # so "clips" clips
    for norm, _ in results:
        assert norm == results[0][0]  # one value on every rank
        assert norm == pytest.approx(ref_norm, rel=1e-6)
    grads = plan.assemble_grads([r[1] for r in results])
    for fqn, g in ref_grads.items():
        torch.testing.assert_close(grads[fqn], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")


def test_only_the_two_norm_is_supported():
    plan, args = make_plan(zero_stage=3)
    with pytest.raises(ValueError, match="norm_type=inf is not supported"):
        run_simulated(plan.mesh, lambda r: clip_grad_norm_(plan.build(r), 1.0, norm_type=float("inf")))


def test_simulate_train_clips_like_single_device():
    plan, args = make_plan(zero_stage=3)
    losses, params = plan.simulate_train([args] * 3, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                         clip_grad_norm=0.5)
    model, _, _ = llama_tiny(with_labels=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager = []
    for _ in range(3):
        loss = model(*args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        eager.append(loss.item())
    assert losses == pytest.approx(eager, rel=1e-5)
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(params[fqn], p.detach(), rtol=1e-5, atol=1e-6)
