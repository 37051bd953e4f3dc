"""Export of plans for torchrun: the generated program, plan.json, weights, run.py.

Fast tests run the exported directory on the simulated mesh (``simulate_export`` loads program,
weights and inputs exactly as run.py does). Slow tests run it under real torchrun with 4 gloo
processes and ``--check``, and check that wrong world sizes and broken files fail fast with a
clear message.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

ROOT = Path(__file__).resolve().parents[1]

import autoshard
from autoshard.runtime import export as R
from autoshard.passes.export import ExportError, simulate_export
from autoshard.runtime.primitives.collectives import ADJOINTS
from examples.models import gpt2_tiny, llama_tiny
from tests.helpers.torchrun import torchrun

DP_TP = dict(mesh={"dp": 2, "tp": 2}, layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, with_labels=True)
TP4 = dict(mesh={"tp": 4}, layout={"heads": "tp", "ffn": "tp"}, with_labels=False)


def make_plan(config, **options):
    model, args, dims = llama_tiny(with_labels=config["with_labels"])
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(config["mesh"]), dims=dims,
                               layout=config["layout"], **options)
    return plan, args


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{name: (plan, args, export dir)} for the tp=4 and dp=2 x tp=2 plans, and ZeRO-3 training."""
    base = tmp_path_factory.mktemp("exports")
    out = {}
    for name, config, options in [("tp4", TP4, {}), ("dp_tp", DP_TP, {}),
                                  ("zero3", DP_TP, dict(train=True, zero_stage=3, reshard_after_forward=True))]:
        plan, args = make_plan(config, **options)
        out[name] = (plan, args, plan.export(base / name, args))
    return out


# ------------------------------------------------------------------------------------------------
# the generated program
# ------------------------------------------------------------------------------------------------

CALL = re.compile(r"^\s+\w+ = (" + "|".join(ADJOINTS) + r")\((.*?)tag = (\d+)(, \w+ = \w+)*\)")


@pytest.mark.parametrize("name", ["tp4", "dp_tp", "zero3"])
def test_every_collective_has_a_comment_naming_module_and_reason(exports, name):
    plan, _, path = exports[name]
    lines = (path / "program.py").read_text().splitlines()
    by_tag = {c.tag: c for c in plan.collectives}
    calls = 0
    for i, line in enumerate(lines):
        m = CALL.match(line)
        if not m:
            continue
        calls += 1
        op, tag = m.group(1), int(m.group(3))
        j = i - 1
        while lines[j].lstrip().startswith("#     "):  # the comment's continuation lines
            j -= 1
        head = lines[j].strip()
        comment = " ".join(l.strip().lstrip("#").strip() for l in lines[j:i])
        assert head.startswith(f"# {op} on "), f"line {i + 1}: no comment above {line.strip()!r}"
        info = next(n.meta["autoshard"] for n in plan.graph_module.graph.nodes
                    if n.meta.get("autoshard", {}).get("tag") == tag)
        assert f"[#{tag}]" in comment and f"— {info['where'] or '<root>'}:" in comment
        assert " ".join(info["why"].split()) in comment, f"tag {tag}: reason missing from {comment!r}"
        fwd, bwd = ADJOINTS[op]
        assert f"(forward: {fwd}; backward: {bwd})" in comment
        assert any(c.why.removeprefix("adjoint: ") == info["why"] for c in plan.collectives if c.tag == tag) \
            or tag not in by_tag
    forward_calls = sum(1 for n in plan.graph_module.graph.nodes if n.meta.get("autoshard"))
    assert calls == forward_calls > 0


def test_program_is_a_plain_module_with_named_imports(exports):
    plan, _, path = exports["dp_tp"]
    src = (path / "program.py").read_text()
    assert "from autoshard.runtime.primitives.collectives import all_reduce, mark_varying" in src
    assert "aten = torch.ops.aten" in src and "torch.ops.aten." not in src
    assert "autoshard_runtime_primitives_collectives" not in src and not re.search(r"^\s+self,", src, re.M)
    # one parameter per program input, in placeholder order, each with its owner
    header = src.split("def forward(\n")[1].split("\n):")[0].splitlines()
    names = [l.split(",")[0].strip() for l in header]
    assert names == [n.name for n in plan.graph_module.graph.nodes if n.op == "placeholder"]
    assert "# parameter layers.0.mlp.down_proj.weight [32, 64] S(1)@tp -> local [32, 32]" in src
    assert "# input_ids [4, 8] S(0)@dp -> local [2, 8]" in src
    assert "device = DEVICE" in src  # created tensors follow the rank's device
    compile(src, "program.py", "exec")


@pytest.mark.parametrize("name", ["tp4", "dp_tp"])
def test_exec_of_program_equals_simulate(exports, name):
    plan, args, path = exports[name]
    per_rank = simulate_export(path)
    got = plan.assemble_outputs([r["outputs"] for r in per_rank])
    want = plan.simulate(*args)
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_plan_json_describes_mesh_owners_collectives(exports):
    plan, _, path = exports["dp_tp"]
    doc = json.loads((path / "plan.json").read_text())
    assert doc["format"] == "autoshard-export" and doc["mesh"] == {"dp": 2, "tp": 2} and doc["world_size"] == 4
    assert doc["layout"]["heads"] == ["tp"] and doc["layout"]["batch"] == ["dp"]
    owners = {m["target"]: m.get("placement") for m in doc["inputs"]}
    assert owners["layers.0.self_attn.q_proj.weight"] == ["R", "S(0)"]
    assert owners["layers.0.self_attn.o_proj.weight"] == ["R", "S(1)"]
    assert owners["input_ids"] == ["S(0)", "R"] and owners["norm.weight"] == ["R", "R"]
    ids = next(m for m in doc["inputs"] if m["target"] == "input_ids")
    assert ids["dtype"] == "int64" and ids["high"] <= 64
    assert len(doc["collectives"]) == len(plan.collectives)
    assert {"kind", "axes", "bytes", "phase", "where", "why", "tag"} <= set(doc["collectives"][0])
    assert doc["cost"]  # whatever the cost model reports, serialized
    assert doc["reference"]["grads"] and doc["reference"]["steps"] == 2
    # normalizer.py: the mean cross-entropy's count of valid labels (run.py --grad-accum)
    assert doc["accumulation"]["reduction"] == "count"
    assert sorted(p.name for p in path.iterdir()) == ["inputs.pt", "normalizer.py", "plan.json", "program.py",
                                                     "reference.pt", "run.py", "weights.pt"]


# ------------------------------------------------------------------------------------------------
# training plans and weights
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_exported_training_equals_simulate_train(tmp_path, zero_stage):
    plan, args = make_plan(DP_TP, train=True, zero_stage=zero_stage)
    path = plan.export(tmp_path / "out", args, reference_steps=3)
    per_rank = simulate_export(path, steps=3, check=True)
    losses, _ = plan.simulate_train([args] * 3, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    ref = torch.load(path / "reference.pt", weights_only=True)
    for r in per_rank:
        assert r["ok"], r["problems"]
        assert r["losses"] == pytest.approx(losses, rel=1e-6)
    assert ref["losses"] == pytest.approx(losses, rel=1e-5)  # single-device training


def test_weights_from_a_checkpoint_with_tied_aliases(tmp_path):
    model, args, dims = gpt2_tiny()
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=dims,
                               layout={"heads": "tp", "ffn": "tp"})
    assert plan.captured.aliases  # lm_head.weight is tied to wte.weight
    ckpt = {k: v.clone() for k, v in model.state_dict().items() if k != "wte.weight"}  # only the alias
    torch.save(ckpt, tmp_path / "ckpt.pt")
    path = plan.export(tmp_path / "out", args, weights=tmp_path / "ckpt.pt")
    assert not (path / "weights.pt").exists()  # parameters and buffers come from the checkpoint
    assert json.loads((path / "plan.json").read_text())["weights"]["checkpoint"] == "../ckpt.pt"
    per_rank = simulate_export(path, check=True)
    assert all(r["ok"] for r in per_rank)
    del ckpt["h.0.mlp.c_fc.weight"]
    torch.save(ckpt, tmp_path / "bad.pt")
    with pytest.raises(ExportError, match="h.0.mlp.c_fc.weight"):
        plan.export(tmp_path / "out2", args, weights=tmp_path / "bad.pt")
    assert not (tmp_path / "out2").exists()


def test_export_writes_nothing_that_looks_valid_on_failure(tmp_path, monkeypatch):
    plan, args = make_plan(TP4)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    with pytest.raises(ExportError, match="not empty"):
        plan.export(tmp_path / "busy", args)
    assert (tmp_path / "busy" / "x").read_text() == "keep"

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("autoshard.passes.export.make_reference", broken)
    with pytest.raises(OSError, match="disk full"):
        plan.export(tmp_path / "out", args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no out/, no temporary leftovers
    monkeypatch.undo()
    plan.export(tmp_path / "busy", args, overwrite=True)
    assert (tmp_path / "busy" / "plan.json").is_file() and not (tmp_path / "busy" / "x").exists()


def test_meta_model_exports_without_weights_and_run_py_asks_for_them(tmp_path, monkeypatch):
    from examples.models import llama_8b_meta

    model, args, dims = llama_8b_meta(num_layers=1, vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_heads=4, num_kv_heads=2, batch=2, seq=8)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=dims,
                               layout={"heads": "tp", "ffn": "tp"})
    path = plan.export(tmp_path / "out")
    assert not (path / "weights.pt").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(R.RunError, match=r"^this export has no weights: the model was planned on the meta device.*"
                                         r"--weights SRC"):
        R.prepare(path, _args("--synthetic"))


# ------------------------------------------------------------------------------------------------
# run.py's checks before any process group exists (in-process)
# ------------------------------------------------------------------------------------------------

def _args(*argv):
    return R._parser().parse_args(list(argv))


def test_world_size_mismatch_is_refused_before_init(exports, monkeypatch):
    _, _, path = exports["dp_tp"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(R.RunError, match=r"Mesh\(dp=2, tp=2\), 4 ranks, but torchrun started 2 processes"):
        R.prepare(path, _args("--check"))


def test_broken_exports_are_refused(exports, tmp_path, monkeypatch):
    import shutil

    _, _, src = exports["dp_tp"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    cases = {
        "truncated": lambda d: (d / "plan.json").write_text((src / "plan.json").read_text()[:500]),
        "version": lambda d: (d / "plan.json").write_text(
            (src / "plan.json").read_text().replace(f'"version": {R.VERSION}', '"version": 99')),
        "owner": lambda d: (d / "plan.json").write_text(
            (src / "plan.json").read_text().replace('"S(1)"', '"X(1)"')),
        "weights": lambda d: (d / "weights.pt").unlink(),
        "weights_garbage": lambda d: (d / "weights.pt").write_bytes(b"not a zip file"),
        "program": lambda d: (d / "program.py").write_text("def forward(:\n"),
        "inputs": lambda d: (d / "inputs.pt").unlink(),
    }
    expect = {"truncated": "plan.json is corrupted", "version": "format version 99", "owner": r"unknown owner 'X\(1\)'",
              "weights": "weights file .* is missing", "weights_garbage": "weights file .* cannot be read",
              "program": "program.py does not load", "inputs": "saved inputs file .* is missing"}
    for name, breaker in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        breaker(d)
        with pytest.raises(R.RunError, match=expect[name]):
            R.prepare(d, _args("--check"))


def test_synthetic_inputs_follow_the_planned_shapes(exports, monkeypatch):
    _, args, path = exports["dp_tp"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    ctx = R.prepare(path, _args("--synthetic"))
    ids, mask, labels = ctx["user"]
    assert ids.shape == args[0].shape and ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 64
    assert mask is None and labels.shape == args[2].shape
    with pytest.raises(R.RunError, match="--check compares with references"):
        R.prepare(path, _args("--synthetic", "--check"))


# ------------------------------------------------------------------------------------------------
# under torchrun: 4 gloo processes
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
# forward-only --check on tp4; dp x tp and ZeRO-3 check training, whose check compares the
# forward outputs too
@pytest.mark.parametrize("name,run_args", [("tp4", ["--check"]), ("dp_tp", ["--check", "--steps", "2"]),
                                           ("zero3", ["--check", "--steps", "2"])])
def test_torchrun_check_passes(exports, name, run_args):
    _, _, path = exports[name]
    proc, _ = torchrun(path, 4, *run_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("check passed") == 1, out  # printed by rank 0 only
    if "--steps" in run_args:
        assert re.search(r"step 1/2  loss 4\.39900\d  time [\d.]+ ms", out), out
        assert re.search(r"step 2/2  loss [\d.]+  time", out) and "losses of 2 adamw steps match" in out
        assert "outputs and gradients equal" in out
    else:
        assert "forward  time" in out


@pytest.mark.slow
def test_torchrun_failures_are_quick_and_clear(exports, tmp_path):
    import shutil

    _, _, src = exports["dp_tp"]
    missing, corrupt = tmp_path / "missing", tmp_path / "corrupt"
    shutil.copytree(src, missing)
    (missing / "weights.pt").unlink()
    shutil.copytree(src, corrupt)
    (corrupt / "plan.json").write_text((src / "plan.json").read_text()[:1000])
    for path, nproc, message in [(src, 2, "this program is planned for Mesh(dp=2, tp=2), 4 ranks, but torchrun started 2 processes"),
                                 (missing, 4, "weights file"), (corrupt, 4, "plan.json is corrupted")]:
        proc, seconds = torchrun(path, nproc, "--check")
        assert proc.returncode != 0
        assert re.search(r"^run\.py: error: .*" + re.escape(message), proc.stderr, re.M), proc.stderr
        assert proc.stderr.count("run.py: error:") == 1  # once per node, not once per process
        assert "check passed" not in proc.stdout and seconds < 60


@pytest.mark.slow
def test_quickstart_runs_end_to_end():
    """README's first command: plan, simulate, export, torchrun on 4 gloo processes with --check."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check passed: sharded plan equals the unsharded model" in proc.stdout
    assert "check passed: outputs and gradients equal the unsharded model's on all 4 ranks" in proc.stdout
    from autoshard.runtime.transport.shm import usable_here
    if usable_here():  # one host: run.py says its collectives go through shared memory
        assert "(4 gloo processes, collectives through shared memory)" in proc.stdout


# ------------------------------------------------------------------------------------------------
# export without args: the plan's own example inputs
# ------------------------------------------------------------------------------------------------

def test_export_without_args_saves_the_plans_example_inputs(tmp_path, monkeypatch):
    plan, args = make_plan(DP_TP, train=True, zero_stage=3)
    path = plan.export(tmp_path / "out")  # no args: the inputs the plan was made from
    saved = torch.load(path / "inputs.pt", weights_only=True)["inputs"]
    want = plan.captured.flatten_args(args, {})
    assert len(saved) == len(want)
    for s, w in zip(saved, want):
        assert (s is None and w is None) or torch.equal(s, w)
    monkeypatch.setenv("WORLD_SIZE", "4")
    R.prepare(path, _args("--check", "--steps", "2"))  # what run.py --check needs is all there
    per_rank = simulate_export(path, steps=2, check=True)
    assert all(r["ok"] for r in per_rank), [r["problems"] for r in per_rank]
    # the references come from eager single-device training on the same batch
    model, _, _ = llama_tiny(with_labels=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager = []
    for _ in range(2):
        loss = model(*args)
        loss.backward()
        opt.step()
        opt.zero_grad()
        eager.append(loss.item())
    assert per_rank[0]["losses"] == pytest.approx(eager, rel=1e-5)


def test_export_without_args_of_a_meta_model_says_what_to_pass(tmp_path, monkeypatch):
    from examples.models import llama_8b_meta

    model, args, dims = llama_8b_meta(num_layers=1, vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_heads=4, num_kv_heads=2, batch=2, seq=8)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=dims,
                               layout={"heads": "tp", "ffn": "tp"})
    torch.save({k: torch.zeros(v.shape) for k, v in model.state_dict().items()}, tmp_path / "w.pt")
    path = plan.export(tmp_path / "out", weights=tmp_path / "w.pt")
    assert not (path / "inputs.pt").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(R.RunError, match=r"no saved inputs: the plan's example inputs are on the meta device.*"
                                         r"plan\.export\(path, args\).*--synthetic"):
        R.prepare(path, _args())
    with pytest.raises(R.RunError, match=r"no references to check against: the model is on the meta device"):
        R.prepare(path, _args("--check"))  # no references at all comes first: no input would give any
    real = tuple(torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    path = plan.export(tmp_path / "real_inputs", real, weights=tmp_path / "w.pt")
    with pytest.raises(R.RunError, match="no references to check against: the model is on the meta device"):
        R.prepare(path, _args("--check"))


@pytest.mark.slow
def test_torchrun_check_of_an_export_without_args(tmp_path):
    plan, _ = make_plan(TP4)
    path = plan.export(tmp_path / "out")
    proc, _ = torchrun(path, 4, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check passed: outputs equal the unsharded model's on all 4 ranks" in proc.stdout


# ------------------------------------------------------------------------------------------------
# --check of 16-bit models
# ------------------------------------------------------------------------------------------------

HALF = [torch.bfloat16, torch.float16]


def _doc(dtype, world=4):
    """The parts of a read plan.json that --check's tolerance and summary read."""
    return {"inputs": [{"kind": "parameter", "_dtype": dtype}], "world_size": world,
            "reference": {"optimizer": "adamw", "lr": 1e-3}}


def test_check_compare_fails_on_nan_on_either_side_and_names_it():
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    nan = x.clone()
    nan[3, 4] = float("nan")
    for dtype in (torch.float32, *HALF):
        tol = R.check_tolerance(_doc(dtype), 1e-4, 1e-5)
        assert R.compare(x.to(dtype), x.to(dtype), tol)[0]
        ok, diff, why = R.compare(nan.to(dtype), x.to(dtype), tol)
        assert not ok and diff == float("inf") and why.startswith("non-finite in this run (1 of 64"), why
        ok, diff, why = R.compare(x.to(dtype), nan.to(dtype), tol)
        assert not ok and diff == float("inf") and why.startswith("non-finite in the unsharded reference"), why
    # the worst difference over tensors keeps the NaN (Python's max() drops it: max(0.0, nan) == 0.0)
    assert max(0.0, R._max_diff(nan, x)) == float("inf")


@pytest.mark.parametrize("dtype", HALF)
def test_check_tolerance_of_16bit_programs_follows_the_dtype(dtype):
    """A 16-bit value rounded once more per rank (what another summation order does) passes; a
    lost share of a sum (a wrong layout: half of a data-parallel gradient) fails; float32
    programs keep --rtol/--atol."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    tol = R.check_tolerance(_doc(dtype), 1e-4, 1e-5)
    assert tol["dtype"] is dtype and str(dtype).split(".")[1] in tol["text"]
    eps = torch.finfo(dtype).eps
    rounded = x
    for _ in range(4):  # one more rounding per rank of a 4-rank mesh, in the worst direction
        rounded = (rounded.float() * (1 + eps)).to(dtype)
    assert R.compare(rounded, x, tol)[0]
    assert not R.compare(x * 0.5, x, tol)[0]
    f32 = R.check_tolerance(_doc(torch.float32), 1e-4, 1e-5)
    assert (f32["rtol"], f32["atol"]) == (1e-4, 1e-5) and not R.compare(rounded.float(), x.float(), f32)[0]


@pytest.mark.parametrize("side", ["reference", "run"])
def test_check_summary_names_the_side_and_step_of_a_nan_loss(side):
    args = R._parser().parse_args(["--check", "--steps", "2"])
    good, bad = [4.4, 4.2], [4.4, float("nan")]
    ref, run = ({"losses": bad}, good) if side == "reference" else ({"losses": good}, bad)
    ok, line = R.summarize_check(_doc(torch.float16), ref, args, True, [0.0, 0.0], run, 4)
    want = "the unsharded reference's loss of step 2 is nan" if side == "reference" else "this run's loss of step 2 is nan"
    assert not ok and "\n" not in line and line.startswith("CHECK FAILED: " + want), line
    ok, line = R.summarize_check(_doc(torch.float16), {"losses": good}, args, False, [float("inf"), 0.0], good, 4)
    assert not ok and "non-finite" in line, line


def _half_export(tmp_path, dtype):
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model.to(dtype), args, mesh=autoshard.Mesh(DP_TP["mesh"]), dims=dims,
                               layout=DP_TP["layout"], train=True)
    return plan.export(tmp_path / str(dtype).split(".")[1], args)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_16bit_export_checks_against_a_reference_stepped_like_the_run(tmp_path, dtype):
    """The reference steps 16-bit parameters as run.py does (AdamW on float32 masters; torch's
    AdamW on float16 tensors went NaN at step 2), and two steps on the simulated mesh pass
    --check at the dtype's tolerance (bf16 gradients sit ~4 eps of the tensor's scale apart)."""
    path = _half_export(tmp_path, dtype)
    ref = torch.load(path / "reference.pt", weights_only=True)
    assert len(ref["losses"]) == 2 and all(math.isfinite(v) for v in ref["losses"]), ref["losses"]
    per_rank = simulate_export(path, steps=2, check=True)
    assert all(r["ok"] for r in per_rank), [r["problems"] for r in per_rank]
    args = R._parser().parse_args(["--check", "--steps", "2"])
    worst = [max(r["worst_out"] for r in per_rank), max(r["worst_grad"] for r in per_rank)]
    ok, line = R.summarize_check(R.read_plan(path), ref, args, True, worst, per_rank[0]["losses"], 4)
    assert ok and "losses of 2 adamw steps match" in line and f"{str(dtype).split('.')[1]} tolerance" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_torchrun_check_of_a_16bit_model(tmp_path, dtype):
    path = _half_export(tmp_path, dtype)
    proc, _ = torchrun(path, 4, "--check", "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("check passed") == 1 and "losses of 2 adamw steps match" in proc.stdout, proc.stdout
    assert f"{str(dtype).split('.')[1]} tolerance" in proc.stdout, proc.stdout
