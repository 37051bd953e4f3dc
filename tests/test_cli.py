"""The command line: ``python -m autoshard plan|explain|export|run|calibrate``.

Most cases call ``autoshard.cli.main`` in this process (fast); one runs the module entry point
as a subprocess, and a slow one runs ``autoshard run`` end to end (export + torchrun, 4 gloo
processes, ``--check``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard import cli  # noqa: E402

MODELS = str(ROOT / "examples" / "models.py")
LLAMA = f"{MODELS}:llama_tiny"
DP_TP = ["--mesh", "dp=2,tp=2", "--layout", "batch=dp,heads=tp,ffn=tp"]


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_parse_mesh_and_layout():
    assert cli.parse_mesh("dp=2,tp=4") == {"dp": 2, "tp": 4}
    assert cli.parse_layout("batch=dp, heads=tp,seq=none,ffn=dp+tp") == {
        "batch": "dp", "heads": "tp", "seq": None, "ffn": ("dp", "tp")}
    assert cli.parse_layout("layers.*.mlp.gate_proj.weight:0=tp") == {"layers.*.mlp.gate_proj.weight:0": "tp"}
    assert cli.parse_factory_args(["with_labels=True", "batch=8", "name=x"]) == {
        "with_labels": True, "batch": 8, "name": "x"}
    for bad in ("dp2", "dp=0", "dp=2,dp=2", "", "1x=2"):
        with pytest.raises(cli.UsageError):
            cli.parse_mesh(bad)


def test_plan_prints_the_tables(capsys):
    rc, out, err = run_cli(capsys, "plan", LLAMA, *DP_TP, "--factory-arg", "with_labels=True")
    assert rc == 0, err
    for title in ("Named dims", "Inputs and parameters", "Activations",
                  "Collectives (6; forward only (train=False): the 25 backward collectives"):
        assert title in out
    assert "contracted dim ffn is sharded on tp in layers.0.mlp.down_proj -> partial sum" in out


def test_explain_is_compact(capsys):
    rc, out, err = run_cli(capsys, "explain", LLAMA, "--mesh", "tp=4", "--layout", "heads=tp,ffn=tp")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "Llama on Mesh(tp=4) (4 ranks)"
    assert lines[1] == "layout: ffn -> tp; heads -> tp"
    assert "layers.0.self_attn.q_proj.weight S(0)@tp" in out and "collectives:" in out
    assert "Activations" not in out


def test_export_writes_a_runnable_directory(capsys, tmp_path):
    out_dir = tmp_path / "llama"
    rc, out, err = run_cli(capsys, "export", LLAMA, str(out_dir), *DP_TP, "--factory-arg", "with_labels=True")
    assert rc == 0, err
    assert f"torchrun --standalone --nproc-per-node=4 {out_dir}/run.py --check" in out
    doc = json.loads((out_dir / "plan.json").read_text())
    assert doc["mesh"] == {"dp": 2, "tp": 2} and doc["reference"]
    rc, out, err = run_cli(capsys, "export", LLAMA, str(out_dir), *DP_TP)
    assert rc == 2 and "exists and is not empty" in err and "--force" in err
    rc, out, err = run_cli(capsys, "export", LLAMA, str(out_dir), *DP_TP, "--force", "--no-reference")
    assert rc == 0 and json.loads((out_dir / "plan.json").read_text())["reference"] is None


@pytest.mark.parametrize("argv,message", [
    (["plan", MODELS, "--mesh", "dp=2"], "expected FILE.py:FACTORY, got"),
    (["plan", "nowhere.py:f", "--mesh", "dp=2"], "no such file: nowhere.py"),
    (["plan", f"{MODELS}:nope", "--mesh", "dp=2"], "has no function 'nope' (hint: functions defined there:"),
    (["plan", LLAMA, "--mesh", "dp2"], "bad mesh axis 'dp2'"),
    (["plan", LLAMA, "--mesh", "dp=2", "--layout", "batsh=dp"], "layout names dim 'batsh', which no tensor has"),
    (["plan", LLAMA, "--mesh", "dp=2", "--layout", "batch=tp"], "names mesh axis 'tp'"),
    (["plan", LLAMA, "--mesh", "dp=3", "--layout", "batch=dp"], "cannot split evenly"),
    (["plan", LLAMA, "--mesh", "dp=2", "--factory-arg", "nope=1"], "calling"),
    (["plan", LLAMA, "--mesh", "dp=2", "--memory-limit", "lots"], "memory_limit 'lots'"),
    (["plan", LLAMA, "--mesh", "dp=2", "--recompute", "maybe"], "--recompute 'maybe'"),
    (["plan", LLAMA, "--mesh", "dp=2", "--precision", "bf17"], "unknown floating dtype 'bf17'"),
    (["plan", LLAMA, "--mesh", "dp=2", "--zero-stage", "5", "--train"], "--zero-stage '5' is not one of 0, 1, 2, 3"),
    (["plan", LLAMA, "--mesh", "dp=2", "--hardware", "h1000"], "'h1000' is neither a hardware preset"),
])
def test_user_mistakes_are_one_line_with_a_hint(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("autoshard: error: ") and "(hint: " in err, err
    assert message in err and "Traceback" not in err


def test_every_option_field_has_a_flag():
    """The planning commands take one flag per field of every option object of
    ``autoshard.options`` (so every option of ``autoshard.autoshard``, tests/test_options.py),
    its help the field's doc."""
    from autoshard.options import OPTION_TYPES, option_flag

    commands = cli.build_parser()._subparsers._group_actions[0].choices
    for command in ("plan", "explain", "export", "run"):
        helps = {s: a.help for a in commands[command]._actions for s in a.option_strings}
        for cls in OPTION_TYPES:
            for f in dataclasses.fields(cls):
                assert helps.get(option_flag(f)) == f.metadata["doc"], (command, cls.__name__, f.name)


def _cli_plan(*argv):
    return cli._make_plan(cli.build_parser().parse_args(["plan", *argv]))[0]


def test_a_cli_plan_equals_the_api_plan_with_the_same_options():
    import torch

    import autoshard
    from autoshard.options import (ContextOptions, PipelineOptions, PrecisionOptions, RecomputeOptions,
                                   RewriteOptions, SearchOptions, TrainingOptions)
    from examples.models import llama_tiny

    plan = _cli_plan(LLAMA, *DP_TP, "--factory-arg", "with_labels=True", "--train", "--zero-stage", "3",
                     "--bucket-mb", "1", "--units", "block", "--hardware", "h100", "--precision", "bf16",
                     "--reduce-precision", "fp32", "--recompute", "on", "--strict", "--disable-passes", "early_sums",
                     "--context-variant", "ring", "--search", "off")
    model, args, dims = llama_tiny(with_labels=True)
    api = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "tp": 2}), dims=dims,
                              layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, options=[
        TrainingOptions(train=True, zero_stage=3, bucket_mb=1.0, units="block"),
        SearchOptions(search=False, hardware="h100"), RewriteOptions(strict=True, disable_passes=("early_sums",)),
        PrecisionOptions(param=torch.bfloat16, reduce=torch.float32), RecomputeOptions(checkpoint=True),
        ContextOptions(variant="ring")])
    assert plan.options == api.options
    assert str(plan) == str(api) and plan.checkpoint == api.checkpoint and plan.cost == api.cost
    assert [p.name for p in plan.passes if not p.ran] == [p.name for p in api.passes if not p.ran]
    assert "early_sums" in [p.name for p in plan.passes if not p.ran]

    # a pipeline from flags: the same PipelinePlan as pipeline=PipelineOptions(...)
    plan = _cli_plan(LLAMA, "--mesh", "pp=2,dp=2", "--layout", "batch=dp", "--factory-arg", "with_labels=True",
                     "--train", "--pipeline", "pp", "--microbatches", "2", "--schedule", "gpipe")
    api = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"pp": 2, "dp": 2}), dims=dims,
                              layout={"batch": "dp"}, train=True,
                              pipeline=PipelineOptions(axis="pp", microbatches=2, schedule="gpipe"))
    assert plan.options == api.options and plan.schedule_name == "gpipe" and plan.microbatches == 2
    assert str(plan) == str(api)


def test_calibrate_rejects_a_bad_mesh_in_one_line(capsys):
    # A real calibration spawns gloo processes; tests/test_search.py runs one.
    rc, out, err = run_cli(capsys, "calibrate", "nonsense")
    assert rc == 2 and err.count("\n") == 1 and "mesh 'nonsense'" in err and "(hint: " in err


def test_module_entry_point():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "autoshard", "explain", LLAMA, "--mesh", "tp=2",
                           "--layout", "heads=tp,ffn=tp"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Llama on Mesh(tp=2) (2 ranks)")
    proc = subprocess.run([sys.executable, "-m", "autoshard", "plan", LLAMA, "--mesh", "x"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("autoshard: error: bad mesh axis 'x'")


@pytest.mark.slow
def test_run_exports_and_checks_on_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "autoshard", "run", LLAMA, *DP_TP, "--factory-arg",
                           "with_labels=True", "--steps", "2"], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "$ torchrun --standalone --nproc-per-node=4" in proc.stdout
    assert "step 2/2" in proc.stdout and "check passed" in proc.stdout
    # a rank count that does not fit the mesh: run.py's message, torchrun's traceback swallowed
    proc = subprocess.run([sys.executable, "-m", "autoshard", "run", LLAMA, *DP_TP, "--nproc", "2"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode != 0
    assert "run.py: error: this program is planned for Mesh(dp=2, tp=2), 4 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr and "autoshard: error: the exported program failed" in proc.stderr
