"""Activation checkpointing: blocks recomputed in backward train exactly like the unsharded
model, the runtime holds fewer saved-activation bytes, and the search turns checkpointing on
when only the recomputing plan fits ``memory_limit``."""

import pytest
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

import autoshard
from autoshard import Mesh
from autoshard.runtime import run_simulated
from autoshard.runtime.transport.rank_context import current
from autoshard.runtime.primitives.recompute import SavedBytes, recompute

from examples.models import llama_tiny
from tests.helpers.exactness import assert_training_within_spread
from tests.helpers.recompute import measure

DP = ({"dp": 2}, {"batch": "dp"})
DPTP = ({"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"})


def plan_for(model, args, dims, mesh, layout, stage=0, reshard=None, **kw):
    return autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout, train=True,
                               zero_stage=stage, reshard_after_forward=reshard, **kw)


def test_recompute_function_is_exact_and_saves_only_inputs():
    """recompute(fn, x, w): same output and gradients as fn, and autograd keeps only the
    inputs (the intermediate tanh output is not saved until backward recomputes it)."""
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def fn(x, w):
        h = torch.tanh(x @ w)
        return (torch.nn.functional.dropout(h, 0.5, training=True) * h,)

    torch.manual_seed(1)
    (ref,) = fn(x, w)
    ref.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    tracker = SavedBytes(exclude=[w])
    torch.manual_seed(1)
    with tracker.hooks():
        (out,) = recompute(fn, x, w)
    assert tracker.live == x.numel() * 4  # x only (w is excluded as state)
    out.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
    assert tracker.live == 0


@pytest.mark.parametrize("stage,reshard", [(0, None), (2, None), (3, True), (3, False)],
                         ids=["ddp", "zero2", "zero3-reshard", "zero3-keep"])
@pytest.mark.parametrize("mesh,layout", [DP, DPTP], ids=["dp2", "dp2xtp2"])
def test_checkpointed_training_is_exact(mesh, layout, stage, reshard):
    """3 AdamW steps with every block recomputed: equal to the same plan without
    checkpointing bit for bit (the recompute runs the same kernels on the same inputs), and to
    single-device training within its own float32 spread (float32 against float64 training of
    the unsharded model, per parameter tensor: tests/helpers/exactness.py), which covers Adam's
    amplification of rounding in tiny gradients on any CPU's kernels."""
    model, args, dims = llama_tiny(with_labels=True)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)  # noqa: E731
    on = plan_for(model, args, dims, mesh, layout, stage, reshard, checkpoint=True)
    off = plan_for(model, args, dims, mesh, layout, stage, reshard, checkpoint=False)
    assert on.checkpoint == ["layers.0", "layers.1"] and off.checkpoint == []
    losses, params = on.simulate_train([args] * 3, optimizer=make_opt)
    plain_losses, plain_params = off.simulate_train([args] * 3, optimizer=make_opt)
    assert losses == plain_losses
    assert all(torch.equal(params[k], plain_params[k]) for k in plain_params)
    assert_training_within_spread(losses, params, model, [args] * 3, make_opt)


def test_recompute_reruns_block_collectives_in_backward():
    """With dp x tp, each block's forward tensor-parallel all-reduces run again in backward
    (the recompute), and nothing else changes in the schedule."""
    model, args, dims = llama_tiny(with_labels=True)
    traces = {}
    for ck in (False, True):
        plan = plan_for(model, args, dims, *DPTP, checkpoint=ck)
        traces[ck] = measure(plan, args, steps=1)[0][2]
    count = lambda tr, phase: sum(1 for r in tr if r.axis == "tp" and r.kind == "all_reduce" and r.phase == phase)  # noqa: E731
    fwd = count(traces[False], "forward")
    in_blocks = 4  # 2 blocks x (attention output, MLP output): Megatron's layout
    assert count(traces[True], "forward") == fwd
    assert count(traces[True], "backward") == count(traces[False], "backward") + in_blocks


def test_search_turns_checkpointing_on_within_memory_limit():
    """A memory_limit between the checkpointed and the plain predicted peak: the search
    turns checkpointing on; the peak the runtime measures (saved tensors + held state) is below
    the limit and below the plain plan's measured peak. A generous limit leaves it off; one
    below the checkpointed peak is refused."""
    model, args, dims = llama_tiny(with_labels=True, batch=8, seq=32)  # activations dominate
    off = plan_for(model, args, dims, *DP, checkpoint=False)
    on = plan_for(model, args, dims, *DP, checkpoint=True)
    peak_off, peak_on = off.cost["memory"]["peak"], on.cost["memory"]["peak"]
    assert peak_on < 0.8 * peak_off
    limit = (peak_on + peak_off) / 2
    chosen = plan_for(model, args, dims, *DP, memory_limit=limit)
    assert chosen.checkpoint == ["layers.0", "layers.1"]
    assert chosen.cost["memory"]["peak"] <= limit
    measured_on = measure(chosen, args)
    measured_off = measure(off, args)
    for (worst, acts, _), (worst_off, acts_off, _) in zip(measured_on, measured_off):
        assert worst < limit
        assert acts < 0.6 * acts_off and worst < worst_off
    assert plan_for(model, args, dims, *DP, memory_limit=2 * peak_off).checkpoint == []
    with pytest.raises(ValueError, match="no plan fits memory_limit"):
        plan_for(model, args, dims, *DP, memory_limit=0.9 * peak_on)


def test_checkpoint_needs_training():
    model, args, dims = llama_tiny(with_labels=True)
    with pytest.raises(ValueError, match="train=True"):
        autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"}, checkpoint=True)


def test_the_checkpointed_copy_of_a_lazily_built_program_is_generated_before_ranks_call_it():
    """The final build rewrites lazily when it starts forward sums early, and the checkpointed
    copy of a lazy program is lazy too: the rank spec generates its code once, before the
    simulated ranks (threads) call it (fx's code generation is not thread-safe)."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = plan_for(model, args, dims, *DP, checkpoint=True)
    assert plan.checkpoint
    forward = plan.rank_spec().forward
    assert forward is not plan.program.graph_module
    assert not (isinstance(forward, _LazyGraphModule) and type(forward)._needs_recompile())
