"""The optimizer step's and the gradient norm's temporaries (``optimizer_temps``,
``grad_norm_temps`` of run.py's memory prediction), measured in a fresh process.

A child process fixes the C allocator's mmap threshold as run.py does (every tensor here is its
own mapping, unmapped when freed), resets its high-water mark (``/proc/self/clear_refs``), runs
one AdamW step or one global gradient norm (after a first one: it makes the optimizer state and
touches the kernels' code pages, as a run's first step does), and reports how far
``VmHWM`` rose above the resident set before. The prediction is computed from a plan-like
description of the same parameters. The tolerance: the tensors' bytes are exact in both; the
measurement adds page rounding (4 KiB per mapping) and the small objects the step makes
(Python frames, 0-d tensors, malloc's headers), which 1 MiB bounds with room against the
16-64 MiB being measured; a missing or extra temporary of the smallest parameter (8 MiB)
would fail it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autoshard.mesh import Mesh
from autoshard.ownership import Replicate
from autoshard.runtime.export.memory import step_temporaries

MiB = 1 << 20
SIZES = [16, 32, 8, 24]  # MiB of fp32 per parameter, in the optimizer's order

CHILD = r'''
import json, sys, types
import torch
from autoshard.runtime.execution.malloc import fixed_mmap_threshold
from autoshard.runtime.export.memory import process_bytes
from autoshard.mesh import Mesh
from autoshard.ownership import Replicate
from autoshard.runtime import rank_context
from autoshard.runtime.transport.backend import Backend
from autoshard.runtime.execution.clip import global_grad_norm

assert fixed_mmap_threshold()
torch.set_num_threads(1)
sizes = json.loads(sys.argv[1])
ps = [torch.nn.Parameter(torch.randn(s << 18)) for s in sizes]  # s MiB of fp32
for p in ps:
    p.grad = torch.randn_like(p)

def rise(fn):
    before = process_bytes()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    fn()
    return process_bytes()["VmHWM"] - before

opt = torch.optim.AdamW(ps, lr=1e-3)
opt.step()  # makes the state: the next step is a training step's
out = {"adamw": rise(opt.step)}
class One(Backend):  # a group of one: a sum over it is the tensor itself
    def all_reduce(self, x, axis):
        return x

mesh = Mesh({"dp": 1})
slots = [types.SimpleNamespace(name=f"p{i}", placement=(Replicate(),), storage=None) for i in range(len(ps))]
local = types.SimpleNamespace(spec=types.SimpleNamespace(mesh=mesh, slots=slots), rank=0,
                              named_parameters=lambda: [(f"p{i}", p) for i, p in enumerate(ps)])
with rank_context(mesh, 0, One()):
    global_grad_norm(local)  # its kernels' code pages are touched once, as at a run's first step
    out["norm"] = rise(lambda: global_grad_norm(local))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def measured() -> dict:
    """{"adamw": bytes, "norm": bytes} from one child process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SIZES)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def doc():
    return {"inputs": [{"name": f"p{i}", "kind": "parameter", "trainable": True, "shape": [s << 18],
                        "_dtype": torch.float32, "_place": (Replicate(),)} for i, s in enumerate(SIZES)]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_adamw_step_temporaries_are_measured(measured):
    opt, _ = step_temporaries(doc(), Mesh({"dp": 1}), "adamw")
    assert opt == pytest.approx(measured["adamw"], abs=MiB)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_gradient_norm_temporaries_are_measured(measured):
    _, norm = step_temporaries(doc(), Mesh({"dp": 1}), "adamw")
    assert norm == pytest.approx(measured["norm"], abs=MiB)


def test_sgd_steps_in_place():
    assert step_temporaries(doc(), Mesh({"dp": 1}), "sgd")[0] == 0
