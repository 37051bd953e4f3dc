"""What one rank holds at the worst moment of a training step, measured: the bytes autograd
saves for backward (``recompute.SavedBytes``: distinct storages, parameters excluded; it sees a
recompute's working set and what ZeRO-3 releases) plus the parameters, gradients and optimizer
state the rank holds, sampled at the end of each backward (gradients complete, optimizer state
from the previous step). It is what the cost model predicts as ``activations`` + ``params`` +
``grads`` + ``optimizer``; the transient parts of its peak (ZeRO-3 parameters gathered for one
block, collective buffers) are neither sampled nor compared.

The process high-water mark (VmHWM in /proc/self/status) is not used: on a CPU it is dominated
by the interpreter, torch's libraries and the transport's buffers, none of which the plan
predicts, and it never goes down, so it cannot tell one step's activations from another's.

Example::

    meter = StepMemory(local, optimizer)      # inside the rank context: installs the tracker
    for batch in batches:
        local(*batch).backward()
        meter.sample()                        # before optimizer.step()
        optimizer.step(); optimizer.zero_grad()
    meter.peak, meter.parts                   # bytes, and {"activations": ..., "state": ...}
"""
from __future__ import annotations

import torch

from autoshard.runtime.transport.rank_context import current
from autoshard.runtime.primitives.recompute import SavedBytes


class StepMemory:
    """Peak (saved activations + held state) of one rank over training steps (module docstring)."""

    def __init__(self, local, optimizer=None):
        self.local, self.optimizer = local, optimizer
        self.tracker = SavedBytes(exclude=list(local.parameters()) + list(local.buffers()))
        current("StepMemory").saved_tracker = self.tracker
        self.peak, self.parts = 0, {}

    def sample(self) -> int:
        """Account the step that just ran backward; returns its peak and starts the next one."""
        held = self.local.held_bytes()
        opt = self.optimizer.state_bytes() if self.optimizer is not None else 0
        state = held["params"] + held["grads"] + opt
        total = self.tracker.peak + state
        if total > self.peak:
            self.peak = total
            self.parts = {"activations": self.tracker.peak, "params": held["params"], "grads": held["grads"],
                          "optimizer": opt}
        self.tracker.peak = self.tracker.live
        return total


def predicted_peak(cost: dict) -> float:
    """The cost model's counterpart of :class:`StepMemory`'s peak, from a plan's ``cost``
    (plan.json's): activations, parameters as stored, gradients, optimizer state.

    Example::

        predicted_peak(json.load(open("out/plan.json"))["cost"])
    """
    m = cost["memory"]
    return m.get("activations", 0.0) + m.get("params", 0.0) + m.get("grads", 0.0) + m.get("optimizer", 0.0)


def watch(rp) -> StepMemory:
    """A :class:`StepMemory` for run.py's rank program ``rp`` (a ``RankProgram`` or a
    ``PipelineProgram``), sampled at each of its optimizer steps (``rp.step``, which follows
    backward). Call inside the rank context, before the first step.

    Example::

        meter = watch(rp)      # then rp.train_step(...); rp.step() as run.py does
    """
    meter = StepMemory(rp.local)
    step = rp.step

    def measured_step():
        meter.optimizer = rp.opt
        meter.sample()
        step()

    rp.step = measured_step
    return meter


def report(meter: StepMemory, doc: dict, coords: dict, reduce_max) -> str:
    """run.py's ``--memory`` line from plan.json ``doc``: the largest measured peak over the
    ranks and the range of measured / predicted over them (``coords``: this rank's mesh
    coordinates; a pipeline rank's prediction is its own, plan.json's ``pipeline.memory``;
    ``reduce_max`` takes the maximum of a tensor over every rank, in place)."""
    cost, pipe = doc.get("cost") or {}, doc.get("pipeline") or {}
    per_rank = pipe.get("memory") if isinstance(pipe.get("memory"), list) else None
    if per_rank is not None:
        pred = per_rank[coords[pipe["axis"]]]["peak"]
    elif cost.get("memory"):
        pred = predicted_peak(cost)
    else:
        pred = None
    ratio = meter.peak / pred if pred else float("nan")
    t = torch.tensor([float(meter.peak), float(meter.parts.get("activations", 0)), ratio, -ratio],
                     dtype=torch.float64)
    reduce_max(t)
    peak, acts, hi, lo = t[0].item(), t[1].item(), t[2].item(), -t[3].item()
    if pred is None:
        return f"memory: measured peak {peak:.0f} B per rank (saved activations {acts:.0f} B); no prediction"
    return (f"memory: measured peak {peak:.0f} B on the fullest rank (saved activations {acts:.0f} B); "
            f"measured / predicted per rank {lo:.3f} to {hi:.3f}")
