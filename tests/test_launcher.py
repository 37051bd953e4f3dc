"""The run.py an export gets is a short launcher of the installed runner (autoshard.runtime.export).

Every export's run.py (flat and pipelined) is the same few lines, runs ``--check`` as the runner
does, and refuses an export of another format with one line saying to export again: a plan.json
of another version, an installed runtime that reads another version, and the full copy of the
runner that exports of format 1 carried as run.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import autoshard  # noqa: E402
from autoshard.runtime import export as R  # noqa: E402
from autoshard.runtime.export.launcher import run_py_source  # noqa: E402
from examples.models import llama_tiny  # noqa: E402
from test_pipeline import masked_batch, pipeline_plan  # noqa: E402

MAX_LINES = 60
ONE_LINE = r"^run\.py: error: .*\(hint: export again with this autoshard\)\n$"
# The import block of format 1's run.py (a full copy of the runner, autoshard.passes.export_runner)
# as every export of that format has it: the run stops at its last line, where that copy imported
# its pipelined half from autoshard.passes, so these lines are what such a run.py runs here.
FORMAT_1_RUN_PY_IMPORTS = '''\
from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import threading
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.mesh import Mesh
from autoshard import ownership
from autoshard.ownership import ParamStorage, Replicate, Shard, local_piece
from autoshard.runtime import DistributedBackend, current, rank_context
from autoshard.runtime.execution.clip import clip_grad_norm_, global_grad_norm
from autoshard.runtime.transport.watchdog import Heartbeat, first_to_report, stalled_ranks, wake
from autoshard.passes import export_pipeline_runner
'''


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"flat": a one-rank llama export (runs without torchrun), "pipelined": pp=2 x dp=2}."""
    base = tmp_path_factory.mktemp("launcher")
    model, args, dims = llama_tiny(with_labels=True)
    flat = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 1}), dims=dims, layout={"batch": "dp"})
    out = {"flat": flat.export(base / "flat", args)}
    model, args, dims = masked_batch(batch=8, layers=4)
    piped = pipeline_plan(model, args, dims, "pp2xdp2", "1f1b", 4)
    out["pipelined"] = piped.export(base / "pipelined", args)
    return out


def python_run(path: Path, *argv: str) -> subprocess.CompletedProcess:
    """``python run.py ...`` (no torchrun: a one-rank mesh is a group of one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, str(path / "run.py"), *argv], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("kind", ["flat", "pipelined"])
def test_every_export_gets_the_short_launcher(exports, kind):
    text = (exports[kind] / "run.py").read_text()
    assert text == run_py_source()
    assert len(text.splitlines()) <= MAX_LINES
    assert f"VERSION = {R.VERSION}  #" in text
    assert json.loads((exports[kind] / "plan.json").read_text())["version"] == R.VERSION
    assert "from autoshard.runtime.export import VERSION as READS, main" in text


def test_the_launcher_runs_check(exports):
    """The launcher hands over to the runner: ``python run.py --check`` of a one-rank export."""
    res = python_run(exports["flat"], "--check")
    assert res.returncode == 0, res.stderr
    assert "check passed" in res.stdout


def _copy(exports, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(exports["flat"], d)
    return d


def _set_version(d: Path, version: int) -> None:
    doc = json.loads((d / "plan.json").read_text())
    doc["version"] = version
    (d / "plan.json").write_text(json.dumps(doc))


def test_a_plan_json_of_another_format_is_one_line(exports, tmp_path):
    d = _copy(exports, tmp_path, "old_plan")
    _set_version(d, 1)
    res = python_run(d, "--check")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "export format version 1" in res.stderr
    assert re.match(ONE_LINE, res.stderr), res.stderr


def test_an_installed_runtime_of_another_format_is_one_line(exports, tmp_path):
    """An export newer than the installed autoshard: plan.json and run.py agree on a format the
    runtime does not read."""
    d = _copy(exports, tmp_path, "newer")
    future = R.VERSION + 1
    _set_version(d, future)
    run_py = d / "run.py"
    run_py.write_text(run_py.read_text().replace(f"VERSION = {R.VERSION}  #", f"VERSION = {future}  #"))
    res = python_run(d, "--check")
    assert res.returncode == 2 and res.stdout == ""
    assert f"this export has format version {future}; the installed autoshard reads version {R.VERSION}" in res.stderr
    assert re.match(ONE_LINE, res.stderr), res.stderr


def test_the_full_copy_run_py_of_a_format_1_export_is_one_line(exports, tmp_path):
    d = _copy(exports, tmp_path, "format1")
    _set_version(d, 1)
    (d / "run.py").write_text(FORMAT_1_RUN_PY_IMPORTS)
    res = python_run(d, "--check")
    assert res.returncode == 2 and res.stdout == ""
    assert "is a copy of the runner of an older autoshard (export format 1)" in res.stderr
    assert re.match(ONE_LINE, res.stderr), res.stderr


def test_the_old_runner_names_elsewhere_say_where_it_is():
    """Outside an export's run.py the old names are an ImportError naming the new place."""
    with pytest.raises(ImportError, match="export_runner"):
        from autoshard.passes import export_runner  # noqa: F401
    with pytest.raises(AttributeError, match="autoshard.runtime.export"):
        autoshard.passes.export_pipeline_runner  # noqa: B018
