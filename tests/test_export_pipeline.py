"""Export of pipelined plans: a program file per stage, the schedule in plan.json, run.py
running each rank's actions (``--check`` included), its training loop (``--data``, clipping,
the lr schedule, checkpoints and ``--resume``) and the measured timeline (``--timeline``).

Fast tests run the exported directory on the simulated mesh (``simulate_export`` and
``simulate_run`` load the stage files, weights, inputs and token data exactly as run.py does)
and check what is written. Slow tests run it under real torchrun (gloo) with ``--check`` and
``--timeline``, and the training loop with a resume, comparing with the in-process runs.
"""
from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from autoshard.runtime import export as R  # noqa: E402
import autoshard  # noqa: E402
from autoshard.passes.export import simulate_export, simulate_run, torchrun_command  # noqa: E402
from autoshard.runtime.primitives.collectives import ADJOINTS  # noqa: E402
from autoshard.runtime.execution.schedules import (Action, check_schedule, dependencies, make_schedule, stage_rank)  # noqa: E402
from exactness import assert_training_within_spread  # noqa: E402
from test_pipeline import masked_batch, pipeline_plan  # noqa: E402
from test_train_loop import expected_lr  # noqa: E402

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


VOCAB = 64  # masked_batch's Llama
LOOP = ["--lr-schedule", "cosine", "--warmup", "2", "--clip-grad-norm", "1.0", "--lr", "1e-2"]


def token_file(tmp, args, batches: int, seed: int = 5):
    """A uint16 token file of ``batches`` global batches of the plan's shape (and a few more
    tokens), and the batches run.py --data reads from it, step by step, as model arguments."""
    b, s = args[0].shape
    tokens = torch.randint(0, VOCAB, (b * s * batches + 5,), generator=torch.Generator().manual_seed(seed))
    path = tmp / "tokens.bin"
    tokens.numpy().astype(np.uint16).tofile(path)

    def steps(n):
        out = []
        for k in range(n):
            start = (k % batches) * b * s  # the file holds `batches` whole batches, then wraps
            ids = tokens[start:start + b * s].view(b, s)
            out.append((ids, None, ids))  # labels are the token ids (the model shifts them)
        return out

    return path, steps


def assert_measured_trace(trace_path, plan):
    """The measured trace of a step: JSON with one row per rank; each row is every F, B (and
    W) of every microbatch of its stages, in its schedule's order, one after another; and no
    action ends before an action it depends on (on its pipeline peer) has started."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    mesh, axis = plan.mesh, plan.axis
    pp, n_stages = mesh.axes[axis], len(plan.pipe.stages)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names) == list(range(mesh.size)) and all(f"rank {r} " in n for r, n in names.items())
    split = any(a.kind == "W" for acts in plan.action_lists for a in acts)
    span = {}
    for rank in range(mesh.size):
        mine = [e for e in events if e["ph"] == "X" and e["tid"] == rank]
        coord = mesh.coords(rank)[axis]
        acts = [Action(e["args"]["kind"], e["args"]["mb"], e["args"]["stage"]) for e in mine]
        assert acts == plan.schedule[coord]
        assert sorted(acts) == sorted(Action(k, m, s) for k in ("FBW" if split else "FB")
                                      for m in range(plan.microbatches) for s in range(n_stages)
                                      if stage_rank(s, pp) == coord)
        assert all(x["ts"] + x["dur"] <= y["ts"] + 1e-3 for x, y in zip(mine, mine[1:]))
        for a, e in zip(acts, mine):
            span[(rank, a)] = (e["ts"], e["ts"] + e["dur"])
    for (rank, a), (start, end) in span.items():
        for d in dependencies(a, n_stages, split):
            peer = mesh.rank_of({**mesh.coords(rank), axis: stage_rank(d.stage, pp)})
            assert span[(peer, d)][0] <= end, (rank, a, d)


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


def test_a_nan_stops_pipelined_training_before_its_optimizer_step(zb, tmp_path):
    """A NaN weight on the first stage: the loss (last stage) and the norm over every stage are
    NaN on every rank, and all stop at step 1 (run.py --nan-policy stop, the default)."""
    _, _, model, src = zb
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["layers.0.input_layernorm.weight"][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    with pytest.raises(R.NonFiniteError, match=r"step 1: loss nan and gradient norm nan, not finite: stopped"):
        simulate_export(src, steps=2, weights=tmp_path / "nan.pt")


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
# the training loop: --data, clipping, the lr schedule, checkpoints, --resume; --timeline
# ------------------------------------------------------------------------------------------------

def test_data_steps_train_like_the_plan_and_single_device(zb, tmp_path):
    """run.py --data on the pipelined export: 4 steps over consecutive batches of the token
    file (the 4th wraps to the start) give the plan's simulate_train losses on the same batches
    bit for bit, and single-device training's losses and final parameters (the parameters read
    back from the checkpoint written at the end) within that training's own float32 spread
    (float32 against float64, per parameter tensor: tests/exactness.py)."""
    plan, args, model, path = zb
    data, batches = token_file(tmp_path, args, 3)
    res = simulate_run(path, "--steps", "4", "--data", str(data), "--ckpt", str(tmp_path / "ck"))
    losses, _ = plan.simulate_train(batches(4), optimizer=ADAMW)
    assert all(r["losses"] == losses for r in res)
    params = autoshard.consolidate(tmp_path / "ck" / "step-000004")
    ratios = assert_training_within_spread(losses, params, model, batches(4), ADAMW)
    assert set(params) == set(ratios) - {"losses"}
    assert res[0]["lines"][0].startswith("step 1/4  loss ") and "tokens/s" in res[0]["lines"][0]


def eager_clipped(model, batches, total):
    """Single-device AdamW with torch's clip_grad_norm_ and the cosine schedule written out
    (test_train_loop.expected_lr): the losses and the norms before clipping."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, norms = [], []
    for s, batch in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = expected_lr(s, total=total)
        loss = m(*batch)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("mesh,schedule", [("pp2xdp2", "zero_bubble"), ("pp2", "1f1b")])
def test_resume_continues_bit_exactly_and_clipping_is_single_devices(zb, tmp_path, mesh, schedule):
    """Clipping by the global norm over every stage (a tied embedding counted once), the cosine
    schedule, checkpoints every 2 steps and --resume: 2 + 2 resumed steps equal 4 straight bit
    for bit, and single-device training with torch's clipping (fp32, rtol 1e-5). The resumed
    run writes the measured timeline of its last step (--timeline)."""
    plan, args, model, path = zb if schedule == "zero_bubble" else export(tmp_path, mesh, schedule,
                                                                            tie_embeddings=True)
    data, batches = token_file(tmp_path, args, 4)
    opts = ["--data", str(data), *LOOP]
    straight = simulate_run(path, "--steps", "4", *opts)[0]
    ck = tmp_path / "ck"
    first = simulate_run(path, "--steps", "2", "--total-steps", "4", "--save-every", "2", "--ckpt", str(ck),
                         "--metrics", str(tmp_path / "m.jsonl"), *opts)[0]
    second = simulate_run(path, "--steps", "2", "--resume", str(ck), "--timeline", str(tmp_path / "t.json"), *opts)
    assert first["losses"] + second[0]["losses"] == straight["losses"]  # bit for bit
    assert first["grad_norms"] + second[0]["grad_norms"] == straight["grad_norms"]
    assert all(r["losses"] == second[0]["losses"] for r in second)  # every rank reports the step loss
    assert second[0]["lines"][0].startswith(f"resumed from {ck / 'step-000002'} at step 2")
    assert [json.loads(l)["loss"] for l in (tmp_path / "m.jsonl").read_text().splitlines()] == first["losses"]
    ref_losses, ref_norms = eager_clipped(model, batches(4), 4)
    assert straight["lrs"] == pytest.approx([expected_lr(s, total=4) for s in range(4)], rel=1e-12)
    torch.testing.assert_close(torch.tensor(straight["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(straight["grad_norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
    assert any(l.startswith("wrote the measured timeline") for l in second[0]["lines"])
    assert_measured_trace(tmp_path / "t.json", plan)


def test_each_rank_reads_its_block_of_every_microbatch(zb, tmp_path):
    """--data on pp2 x dp2 with 4 microbatches of 2 rows: the schedule splits the batch first,
    so dp rank d needs row d of every microbatch (rows d, 2 + d, ...), and reads nothing else."""
    plan, args, _, path = zb
    data, batches = token_file(tmp_path, args, 2)
    doc = R.read_plan(path)
    tokens = R.TokenData(data, "uint16", doc)
    want = batches(2)[1][0]
    m_rows = want.shape[0] // plan.microbatches
    for rank in range(plan.mesh.size):
        (ids, mask, labels), nxt = tokens.batch(want.numel(), plan.mesh, rank)
        assert nxt == 2 * want.numel() and mask is None and labels is ids
        mine = torch.zeros(want.shape[0], dtype=torch.bool)
        mine[plan.mesh.coords(rank)["dp"]::m_rows] = True  # this rank's row of each microbatch
        assert torch.equal(ids[mine], want[mine]) and not ids[~mine].any()


# ------------------------------------------------------------------------------------------------
# broken files
# ------------------------------------------------------------------------------------------------

def test_broken_files_are_named(zb, tmp_path, monkeypatch):
    _, _, _, src = zb
    monkeypatch.setenv("WORLD_SIZE", "4")
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
    training), the printed step losses are the plan's simulated ones, and --timeline writes the
    measured trace of the last step (every rank's actions, gathered to rank 0)."""
    plan, args, _, path = export(tmp_path, mesh, schedule)
    losses, _ = plan.simulate_train([args] * 2, optimizer=ADAMW)
    start = time.monotonic()
    proc = subprocess.run(torchrun_command(path, nproc, "--check", "--steps", "2", "--rtol", "1e-5", "--atol", "1e-6",
                                           "--timeline", str(tmp_path / "t.json")),
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=TORCHRUN_TIMEOUT)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.count("check passed") == 1, out  # rank 0 only
    assert "losses of 2 adamw steps match" in out and "parameters after 2 steps match" in out, out
    assert f"{plan.microbatches} microbatches per step" in out
    printed = [float(x) for x in re.findall(r"step \d/2  loss ([\d.]+)  time", out)]
    assert printed == pytest.approx(losses, abs=5e-7)  # printed with 6 decimals
    assert out.count("wrote the measured timeline") == 1, out
    assert_measured_trace(tmp_path / "t.json", plan)
    assert time.monotonic() - start < TORCHRUN_TIMEOUT


@pytest.mark.slow
def test_torchrun_training_loop_of_a_pipelined_export(tmp_path):
    """run.py's training loop on a pipelined export under torchrun (pp=2, 2 gloo processes,
    tied embeddings): 3 steps of --data with clipping, the cosine schedule and a checkpoint at
    step 2 give the in-process run's losses, norms and learning rates bit for bit, and step 3
    resumed from the checkpoint gives step 3 of the straight run bit for bit."""
    _, args, _, path = export(tmp_path, "pp2", "1f1b", tie_embeddings=True)
    data, _ = token_file(tmp_path, args, 2)
    opts = ["--data", str(data), *LOOP]
    ck = tmp_path / "ck"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda *argv: subprocess.run(torchrun_command(path, 2, *argv, *opts), env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT)
    a = run("--steps", "3", "--save-every", "2", "--ckpt", str(ck), "--metrics", str(tmp_path / "a.jsonl"))
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    b = run("--steps", "1", "--resume", str(ck / "step-000002"), "--metrics", str(tmp_path / "b.jsonl"))
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    read = lambda name: [json.loads(l) for l in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    ma, mb = read("a.jsonl"), read("b.jsonl")
    inproc = simulate_run(path, "--steps", "3", *opts)[0]
    assert [m["loss"] for m in ma] == inproc["losses"] and [m["grad_norm"] for m in ma] == inproc["grad_norms"]
    assert [m["lr"] for m in ma] == inproc["lrs"]
    assert [m["step"] for m in mb] == [3] and mb[0]["loss"] == ma[2]["loss"]  # bit for bit
    assert "step 1/3  loss " in a.stdout and f"saved checkpoint {ck / 'step-000002'}" in a.stdout
    assert f"resumed from {ck / 'step-000002'} at step 2" in b.stdout
