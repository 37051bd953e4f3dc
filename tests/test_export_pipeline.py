"""Export of pipelined plans: a program file per stage, the schedule in plan.json, run.py
running each rank's actions (``--check`` included).

Fast tests run the exported directory on the simulated mesh (``simulate_export`` loads the
stage files, weights and inputs exactly as run.py does) and check what is written. Slow tests
run it under real torchrun (gloo) with ``--check`` and compare the step losses with the plan's
in-process simulation.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from autoshard.passes import export_runner as R  # noqa: E402
from autoshard.passes.export import simulate_export, simulate_run, torchrun_command  # noqa: E402
from autoshard.runtime.collectives import ADJOINTS  # noqa: E402
from autoshard.runtime.schedules import Action, check_schedule, make_schedule  # noqa: E402
from test_pipeline import masked_batch, pipeline_plan  # noqa: E402

ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731 - run.py's default optimizer
CALL = re.compile(r"^\s+\w+ = (" + "|".join(ADJOINTS) + r")\(")
TORCHRUN_TIMEOUT = 150  # a hang is a failure


def export(tmp, mesh, schedule, m=4, zero=None, **kw):
    model, args, dims = masked_batch(batch=8, layers=4, **kw)
    plan = pipeline_plan(model, args, dims, mesh, schedule, m, zero)
    return plan, args, model, plan.export(tmp / f"{mesh}_{schedule}", args, reference_steps=2)


@pytest.fixture(scope="module")
def zb(tmp_path_factory):
    """pp=2 x dp=2, zero-bubble (B and W split), 4 microbatches."""
    return export(tmp_path_factory.mktemp("pp_export"), "pp2xdp2", "zero_bubble")


def _args(*argv):
    return R._parser().parse_args(list(argv))


# ------------------------------------------------------------------------------------------------
# what is written
# ------------------------------------------------------------------------------------------------

def test_stage_files_and_schedule_are_written(zb):
    plan, args, model, path = zb
    doc = json.loads((path / "plan.json").read_text())
    p = doc["pipeline"]
    assert not (path / "program.py").exists() and doc["program"] is None
    assert sorted(f.name for f in path.glob("*.py")) == ["normalizer.py", "run.py", "stage0.py", "stage1.py"]
    assert (p["axis"], p["schedule"], p["microbatches"]) == ("pp", "zero_bubble", 4)
    # the actions: the zero-bubble lists for pp=2, M=4, with W split off, and they run
    actions = [[Action(*a) for a in acts] for acts in p["actions"]]
    assert actions == make_schedule("zero_bubble", 2, 4)
    assert {a.kind for acts in actions for a in acts} == {"F", "B", "W"}
    check_schedule(actions, 2, 4)
    # user inputs: the step's global batch; stage programs see one microbatch
    users = [m for m in doc["inputs"] if m["kind"] == "user" and m.get("shape")]
    ids, _, labels = args
    assert [(m["target"], m["shape"], m["microbatch_shape"]) for m in users] == [
        ("input_ids", list(ids.shape), [ids.shape[0] // 4, ids.shape[1]]),
        ("labels", list(labels.shape), [labels.shape[0] // 4, labels.shape[1]])]
    # one boundary (the hidden state), this rank's block of one microbatch: batch / M / dp rows
    hidden = model.embed_tokens.weight.shape[1]
    assert [(b["src_stage"], b["shape"], b["requires_grad"]) for b in p["boundaries"]] == [
        (0, [ids.shape[0] // 4 // 2, ids.shape[1], hidden], True)]
    # every trainable parameter is read by exactly one stage (nothing tied in this model)
    trainable = {m["name"] for m in doc["inputs"] if m["kind"] == "parameter" and m["trainable"]}
    held = [n for st in p["stages"] for n in st["params"]]
    assert sorted(held) == sorted(trainable) and p["tied"] == {}
    assert p["stages"][0]["modules"].startswith("embed_tokens") and "lm_head" in p["stages"][1]["modules"]


def test_stage_programs_are_plain_modules(zb):
    plan, _, _, path = zb
    p = json.loads((path / "plan.json").read_text())["pipeline"]
    for st in p["stages"]:
        src = (path / st["file"]).read_text()
        compile(src, st["file"], "exec")
        mod = R.load_program(path, st["file"])
        params = list(inspect.signature(mod.forward).parameters)
        assert len(params) == len(st["inputs"])  # called positionally with the stage's arguments
        for (kind, ref), name in zip(st["inputs"], params):
            if kind == "slot":
                assert name == ref
            elif kind == "recv":
                b = p["boundaries"][st["recv"][ref]]
                assert name == "recv_" + b["name"]
                assert re.search(rf"{name},\s+# received from stage {st['index'] - 1} \(pp rank \d\): {b['name']}",
                                 src)
        # every collective (the data-axis ones of the stage) has its comment above it
        lines = src.splitlines()
        for i, line in enumerate(lines):
            if CALL.match(line):
                j = i - 1
                while lines[j].lstrip().startswith("#     "):
                    j -= 1
                assert lines[j].strip().startswith("# " + CALL.match(line).group(1) + " on "), line
        assert f"Stage {st['index']} of 2" in src
    assert "def forward(" in (path / "normalizer.py").read_text()


# ------------------------------------------------------------------------------------------------
# running it (simulated mesh, as run.py loads it)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh,schedule,zero", [("pp2xdp2", "zero_bubble", None), ("pp2xdp2", "gpipe", 3),
                                                ("pp2xtp2", "interleaved", None)])
def test_exported_pipeline_trains_like_the_plan(tmp_path, zb, mesh, schedule, zero):
    """2 AdamW steps of the export: losses equal the plan's simulation bit for bit (the same
    runtime runs them), and --check passes: first-step gradients, losses and every parameter
    after the steps against single-device training (fp32, rtol 1e-5 / atol 1e-6). pp alone
    (with tied embeddings) is below."""
    plan, args, model, path = zb if schedule == "zero_bubble" else export(tmp_path, mesh, schedule, zero=zero)
    per_rank = simulate_export(path, steps=2, check=True)
    losses, _ = plan.simulate_train([args] * 2, optimizer=ADAMW)
    ref = torch.load(path / "reference.pt", weights_only=True)
    for r in per_rank:
        assert r["ok"] and r["params_checked"], r["problems"]
        assert r["losses"] == losses  # every rank reports the step loss
        assert r["worst_grad"] <= 1e-6 and r["worst_param"] <= 1e-6
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    last = [r for r in per_rank if r["outputs"] is not None]
    assert len(last) == plan.mesh.size // 2  # the last stage's ranks hold the outputs, per microbatch
    assert all(sorted(r["outputs"]) == list(range(plan.microbatches)) for r in last)


def test_forward_only_check(zb):
    per_rank = simulate_export(zb[3], steps=0, check=True)
    assert all(r["ok"] and r["losses"] == [] for r in per_rank)


def test_synthetic_inputs_have_the_step_shapes(zb, monkeypatch):
    """run.py --synthetic draws one step's whole batch (the planned global shapes), which the
    schedule splits into microbatches."""
    plan, args, _, path = zb
    monkeypatch.setenv("WORLD_SIZE", "4")
    ctx = R.prepare(path, _args("--synthetic"))
    assert [None if x is None else tuple(x.shape) for x in ctx["user"]] == [
        None if a is None else tuple(a.shape) for a in args]
    per_rank = simulate_export(path, steps=1, inputs=ctx["user"])
    assert len({r["losses"][0] for r in per_rank}) == 1  # every rank reports the same step loss


def test_check_fails_on_wrong_results(zb, tmp_path):
    """--check is not vacuous: a reference that differs in the loss and one parameter fails,
    naming the microbatch-combined output and the parameter."""
    _, _, _, src = zb
    d = tmp_path / "bad"
    shutil.copytree(src, d)
    ref = torch.load(d / "reference.pt", weights_only=True)
    ref["outputs"][0] = ref["outputs"][0] + 1e-3
    fqn = "layers.0.mlp.down_proj.weight"
    ref["params"][fqn] = ref["params"][fqn].clone()
    ref["params"][fqn][0, 0] += 1e-3
    torch.save(ref, d / "reference.pt")
    per_rank = simulate_export(d, steps=2, check=True)
    problems = [msg for r in per_rank for msg in r["problems"]]
    assert not any(r["ok"] for r in per_rank if r["outputs"] is not None)
    assert any(msg.startswith("output 0: max abs diff 0.001") for msg in problems), problems
    assert any(msg.startswith(f"parameter {fqn} after the steps") for msg in problems), problems


def test_tied_embeddings_export(tmp_path):
    """Tied embedding and head on the first and last stage: plan.json lists the tie; the
    gradient sum across pipeline ranks runs in the export as in the plan."""
    plan, args, _, path = export(tmp_path, "pp2", "1f1b", tie_embeddings=True)
    p = json.loads((path / "plan.json").read_text())["pipeline"]
    assert list(p["tied"].values()) == [[0, 1]]
    per_rank = simulate_export(path, steps=2, check=True)
    losses, _ = plan.simulate_train([args] * 2, optimizer=ADAMW)
    assert all(r["ok"] and r["params_checked"] and r["losses"] == losses for r in per_rank), per_rank[0]["problems"]


# ------------------------------------------------------------------------------------------------
# what is not supported, and broken files
# ------------------------------------------------------------------------------------------------

def test_unsupported_options_and_broken_files_are_named(zb, tmp_path, monkeypatch):
    _, _, _, src = zb
    monkeypatch.setenv("WORLD_SIZE", "4")
    for opt in (["--data", "tokens.bin"], ["--ckpt", str(tmp_path / "ck")], ["--clip-grad-norm", "1.0"]):
        with pytest.raises(R.RunError, match=r"pipelined export .* training loop options \(--data, --ckpt"):
            R.prepare(src, _args("--steps", "2", *opt))
    with pytest.raises(R.RunError, match="training loop options"):
        simulate_run(src, "--steps", "2", "--ckpt", str(tmp_path / "ck"))
    doc = json.loads((src / "plan.json").read_text())
    cases = {
        "deadlock": lambda d, doc: doc["pipeline"]["actions"][1].reverse(),
        "missing_action": lambda d, doc: doc["pipeline"]["actions"][0].pop(),
        "axis": lambda d, doc: doc["pipeline"].update(axis="xx"),
        "argument": lambda d, doc: doc["pipeline"]["stages"][1]["inputs"].append(["slot", "nope"]),
        "stage_file": lambda d, doc: (d / "stage1.py").unlink(),
    }
    expect = {"deadlock": "schedule does not run: schedule deadlocks",
              "missing_action": "schedule does not run: .* incomplete",
              "axis": "pipeline axis 'xx' is not an axis", "argument": r"argument \['slot', 'nope'\]",
              "stage_file": "stage1.py is missing"}
    for name, breaker in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        broken = json.loads(json.dumps(doc))
        breaker(d, broken)
        (d / "plan.json").write_text(json.dumps(broken))
        with pytest.raises(R.RunError, match=expect[name]):
            R.prepare(d, _args("--check"))


# ------------------------------------------------------------------------------------------------
# torchrun
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mesh,schedule,nproc", [("pp2", "interleaved", 2), ("pp2xdp2", "1f1b", 4)])
def test_torchrun_check_of_a_pipelined_export(tmp_path, mesh, schedule, nproc):
    """The export under torchrun (gloo): --check passes at fp32 tolerances (outputs per
    microbatch, gradients, losses and parameters after 2 AdamW steps against single-device
    training) and the printed step losses are the plan's simulated ones."""
    plan, args, _, path = export(tmp_path, mesh, schedule)
    losses, _ = plan.simulate_train([args] * 2, optimizer=ADAMW)
    start = time.monotonic()
    proc = subprocess.run(torchrun_command(path, nproc, "--check", "--steps", "2", "--rtol", "1e-5", "--atol", "1e-6"),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=TORCHRUN_TIMEOUT)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.count("check passed") == 1, out  # rank 0 only
    assert "losses of 2 adamw steps match" in out and "parameters after 2 steps match" in out, out
    assert f"{plan.microbatches} microbatches per step" in out
    printed = [float(x) for x in re.findall(r"step \d/2  loss ([\d.]+)  time", out)]
    assert printed == pytest.approx(losses, abs=5e-7)  # printed with 6 decimals
    assert time.monotonic() - start < TORCHRUN_TIMEOUT
