"""Each rank's measured peak next to the prediction (run.py's ``rank R: peak ...`` lines, ``--metrics``).

The prediction's terms are checked against sizes computed here from the model itself (its
parameter counts, fp32 AdamW's two moments per element), never against the code under test;
the torchrun test checks that every rank's line is printed and that the metrics hold the same
numbers as the lines.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

import autoshard
from autoshard.mesh import Mesh
from autoshard.ownership import Shard
from autoshard.runtime.export import memory as M
from autoshard.runtime.export import read_plan
from autoshard.runtime.transport.distributed import DistributedBackend
from autoshard.runtime.transport.shm import SharedMemoryGroup
from autoshard.passes.export import run_torchrun
from examples.models import llama_tiny

MiB = 1 << 20


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"},
                               train=True, zero_stage=3, reshard_after_forward=True, search=False)
    path = plan.export(tmp_path_factory.mktemp("memory") / "zero3", args, reference=False)
    return model, path


def test_the_prediction_counts_state_in_its_dtype_loading_and_the_process(zero3):
    model, path = zero3
    doc = read_plan(path)
    mesh = Mesh(doc["mesh"])
    n = sum(p.numel() for p in model.parameters())
    t = M.predicted_terms(doc, mesh, train=True, device_type="cpu", baseline=300 * MiB, shm_axes=["dp"])
    # ZeRO-3 over 2 ranks: each holds half of every fp32 parameter, its gradient, and AdamW's
    # two fp32 moments (8 bytes per element: the optimizer's own dtype, not a bf16 accounting)
    assert t["params"] == pytest.approx(4 * n / 2, rel=0.02)
    assert t["grads"] == pytest.approx(4 * n / 2, rel=0.02)
    assert t["optimizer"] == pytest.approx(8 * n / 2, rel=0.02)
    # loading: its blocks copied, and the file pages of its rows (dim-0 shards: no more)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert 4 * n / 2 <= t["loading"] / 2 <= 4 * n / 2 + buffers
    # the small payloads of this plan: one 1 MiB slot per rank and window, plus the control page
    assert t["shm_segments"] == 4096 + SharedMemoryGroup.WINDOW * 2 * MiB
    assert 0 < t["spare_buffers"] <= DistributedBackend.SPARE_BYTES
    assert t["total"] == 300 * MiB + t["shm_segments"] + max(t["loading"], t["training"])
    # a GPU's allocator starts at zero and has no segments or pool
    g = M.predicted_terms(doc, mesh, train=True, device_type="cuda", baseline=300 * MiB, shm_axes=["dp"])
    assert g["baseline"] == g["shm_segments"] == g["spare_buffers"] == 0


def test_column_blocks_touch_every_page_of_the_tensor():
    mesh = Mesh({"tp": 4})
    rows = {"shape": [64, 32], "_dtype": torch.float32, "_place": (Shard(0),)}
    cols = {"shape": [64, 32], "_dtype": torch.float32, "_place": (Shard(1),)}
    assert M._local_bytes(rows, mesh) == (64 * 32, 64 * 32)
    assert M._local_bytes(cols, mesh) == (64 * 32, 64 * 32 * 4)


def test_shared_memory_slots_depend_on_the_largest_payload_alone():
    assert SharedMemoryGroup.capacity_for(1, 64 * MiB) == MiB
    assert SharedMemoryGroup.capacity_for(3 * MiB, 64 * MiB) == 4 * MiB
    assert SharedMemoryGroup.capacity_for(40 * MiB, 64 * MiB) == 64 * MiB
    # gathers and all-to-alls of 4 ranks take 8 MiB slots at most: 128 MiB of segment
    assert SharedMemoryGroup.slot_bytes(4) == 8 * MiB


def test_the_spare_pool_stops_at_its_byte_bound():
    b = object.__new__(DistributedBackend)
    b._gloo, b._spares = True, {}
    b.SPARE_BYTES = 3 * 4096
    bufs = [torch.empty(1024) for _ in range(5)]  # 4 KiB each
    for x in bufs:
        b.recycle(x)
    assert b.spare_bytes() == 3 * 4096


def test_report_line():
    assert M.report_line(2, 1.5 * 2**30, 1.25 * 2**30) == "rank 2: peak 1.50 GiB measured, 1.25 GiB predicted"


@pytest.mark.slow
def test_torchrun_prints_every_ranks_peak_and_metrics_record_both(zero3, tmp_path):
    _, path = zero3
    metrics = tmp_path / "m.jsonl"
    proc = run_torchrun(path, 2, "--steps", "2", "--metrics", str(metrics), timeout=180, capture=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict((int(r), (float(m), float(p))) for r, m, p in re.findall(
        r"^rank (\d+): peak ([\d.]+) GiB measured, ([\d.]+) GiB predicted$", proc.stdout, re.M))
    assert sorted(lines) == [0, 1]
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) == 2 and "memory" not in steps[0]
    got = steps[-1]["memory"]
    assert [r["rank"] for r in got] == [0, 1]
    for r in got:
        m, p = lines[r["rank"]]
        assert r["measured_bytes"] / 2**30 == pytest.approx(m, abs=0.006)
        assert r["predicted_bytes"] / 2**30 == pytest.approx(p, abs=0.006)
        # the process itself (Python, torch) is part of both
        assert r["measured_bytes"] > steps[-1]["memory_terms"]["baseline"] > 0
