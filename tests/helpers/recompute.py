"""Measuring a plan's saved activations and held state in the simulated mesh (recompute tests)."""
import torch

from autoshard.runtime.primitives.recompute import SavedBytes
from autoshard.runtime import run_simulated
from autoshard.runtime.transport.rank_context import current


def measure(plan, args, steps=2):
    """Per rank: the largest (saved activations + held state) over ``steps`` AdamW steps,
    the peak saved-activation bytes alone, and the trace."""
    def fn(rank):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        tracker = SavedBytes(exclude=list(local.parameters()) + list(local.buffers()))
        current().saved_tracker = tracker
        worst = acts = 0
        for _ in range(steps):
            tracker.peak = tracker.live
            local(*args).backward()
            held = local.held_bytes()
            # gradients are counted whole for the whole step: an upper bound of the moment
            worst = max(worst, tracker.peak + held["params"] + held["grads"] + opt.state_bytes())
            acts = max(acts, tracker.peak)
            opt.step()
            opt.zero_grad()
        assert tracker.live == 0  # backward freed every saved tensor, the tracker saw it
        return worst, acts, list(current().trace)
    return run_simulated(plan.mesh, fn)
