"""Exports with activation recompute under torchrun (4 gloo processes): a ZeRO-3 plan and a
pipelined plan train as the unsharded model (--check), and run.py --memory measures each
rank's peak (saved activations + parameters + gradients + optimizer state: see
autoshard.runtime.step_memory for why not the process high-water mark) against the plan's
prediction."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autoshard
from autoshard import Mesh
from autoshard.passes.export import torchrun_command

from examples.models import llama_tiny

TIMEOUT = 300


def _run(path, nproc=4):
    proc = subprocess.run(torchrun_command(path, nproc, "--check", "--steps", "2", "--memory"),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("check passed") == 1, proc.stdout
    m = re.search(r"measured / predicted per rank ([\d.]+) to ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    return float(m.group(1)), float(m.group(2)), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["selective", "block"])
def test_zero3_export_with_recompute_under_torchrun(tmp_path, policy):
    """dp=2 x tp=2, ZeRO-3, recompute: exact, and every rank's measured peak within 15% of
    the predicted one."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, zero_stage=3,
                               checkpoint=policy)
    plan.export(tmp_path / "exp", args)
    lo, hi, out = _run(tmp_path / "exp")
    assert 0.85 <= lo <= hi <= 1.15, out


@pytest.mark.slow
@pytest.mark.parametrize("policy,schedule", [("selective", "1f1b"), ("block", "1f1b"), ("selective", "interleaved"),
                                             ("block", "interleaved")])
def test_pipelined_export_with_recompute_under_torchrun(tmp_path, policy, schedule):
    """pp=2 x dp=2 over 4 microbatches (1F1B: 2 stages; interleaved: 4 stages of one layer,
    2 per rank), recompute in each stage program: exact, and the measured peak of every
    pipeline rank within 15% of its own prediction (plan.json's pipeline memory: the
    microbatches in flight by the schedule, each keeping its activations and the weight copies
    and rotary tables its forward made, plus the recompute's working set during a backward)."""
    layers = 4 if schedule == "interleaved" else 2
    model, args, dims = llama_tiny(with_labels=True, batch=8, seq=32, num_layers=layers)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"pp": 2, "dp": 2}), dims=dims, layout={"batch": "dp"},
                               train=True, checkpoint=policy,
                               pipeline={"axis": "pp", "microbatches": 4, "schedule": schedule})
    assert plan.checkpoint == [f"layers.{i}" for i in range(layers)]
    plan.export(tmp_path / "exp", args)
    assert "recompute_layers_0" in (tmp_path / "exp" / "stage0.py").read_text()
    assert f"recompute_layers_{layers - 1}" in (tmp_path / "exp" / f"stage{layers - 1}.py").read_text()
    lo, hi, out = _run(tmp_path / "exp")
    assert 0.85 <= lo <= hi <= 1.15, out
