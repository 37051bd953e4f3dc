"""The exported run.py's training loop on the simulated mesh (``simulate_run`` loads everything
as run.py does): token data, the cosine schedule with warmup, clipping by the global norm,
checkpoints every N steps and bit-exact resume. The torchrun version: test_gloo_train_loop.py."""
from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest
import torch

import autoshard
from autoshard.mesh import Mesh
from autoshard.runtime import export as R
from autoshard.passes.export import simulate_run
from examples.models import llama_tiny
from tests.helpers.train_loop import expected_lr

B, S, VOCAB = 4, 8, 64
LOOP = ["--lr-schedule", "cosine", "--warmup", "2", "--clip-grad-norm", "1.0", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    base = tmp_path_factory.mktemp("loop")
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, zero_stage=3)
    path = plan.export(base / "out")
    tokens = torch.randint(0, VOCAB, (B * S * 5 + 3,), generator=torch.Generator().manual_seed(7))
    tokens.numpy().astype(np.uint16).tofile(base / "tokens.bin")
    return path, tokens, base


def eager(tokens, steps, total):
    """Single-device training on the same batches with torch's own clipping: the reference."""
    model, _, _ = llama_tiny(with_labels=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = expected_lr(s, total=total)
        start = s * B * S
        if start + B * S > len(tokens):
            start = 0
        ids = tokens[start:start + B * S].view(B, S)
        loss = model(ids, None, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_schedule_clipping_and_data_follow_single_device(export):
    path, tokens, base = export
    res = simulate_run(path, "--steps", "6", "--data", str(base / "tokens.bin"), *LOOP)
    assert [r["losses"] == res[0]["losses"] for r in res] == [True] * 4
    assert res[0]["lrs"] == pytest.approx([expected_lr(s) for s in range(6)], rel=1e-12)
    assert all(n is not None and n > 0 for n in res[0]["grad_norms"])
    # 6 steps read 6 consecutive batches: the 6th wraps to the start (the file holds 5 and a bit)
    assert res[0]["losses"] == pytest.approx(eager(tokens, 6, 6), rel=1e-4)
    lines = res[0]["lines"]
    assert any(l.startswith("step 1/6  loss ") and "tokens/s" in l and "grad-norm" in l for l in lines), lines
    assert lines[-1].startswith("done: 6 steps in")


def test_resume_continues_bit_exactly(export, tmp_path):
    path, _, base = export
    data = ["--data", str(base / "tokens.bin")]
    straight = simulate_run(path, "--steps", "6", *data, *LOOP)[0]["losses"]
    first = simulate_run(path, "--steps", "4", "--total-steps", "6", "--save-every", "2", "--ckpt",
                         str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl"), *data, *LOOP)[0]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".autoshard-lock", "step-000002", "step-000004"]
    assert (tmp_path / "ck" / ".autoshard-lock").read_text() == ""  # released at the end of the run
    second = simulate_run(path, "--steps", "2", "--resume", str(tmp_path / "ck"), *data, *LOOP)[0]
    assert first["losses"] + second["losses"] == straight  # bit for bit
    assert second["lines"][0].startswith(f"resumed from {tmp_path / 'ck' / 'step-000004'} at step 4, token 128")
    assert [json.loads(l)["loss"] for l in (tmp_path / "m.jsonl").read_text().splitlines()] == first["losses"]
    # an earlier checkpoint resumes too: 4 steps from step 2
    again = simulate_run(path, "--steps", "4", "--resume", str(tmp_path / "ck" / "step-000002"), *data, *LOOP)
    assert first["losses"][:2] + again[0]["losses"] == straight
    # the checkpoint is a plain state dict for the model class
    model, _, _ = llama_tiny(with_labels=True)
    model.load_state_dict(autoshard.consolidate(tmp_path / "ck" / "step-000004"), strict=True)


def test_token_file_formats_agree(export, tmp_path):
    path, tokens, base = export
    np.save(tmp_path / "t.npy", tokens.numpy().astype(np.uint32))
    tokens.numpy().astype(np.uint32).tofile(tmp_path / "t32.bin")
    torch.save(tokens.to(torch.int32), tmp_path / "t.pt")
    want = simulate_run(path, "--steps", "2", "--data", str(base / "tokens.bin"), *LOOP)[0]["losses"]
    for f, extra in [("t.npy", []), ("t32.bin", ["--data-dtype", "uint32"]), ("t.pt", [])]:
        got = simulate_run(path, "--steps", "2", "--data", str(tmp_path / f), *extra, *LOOP)[0]["losses"]
        assert got == want, f


def test_each_rank_reads_only_its_block(export):
    path, tokens, base = export
    doc = R.read_plan(path)
    data = R.TokenData(base / "tokens.bin", "uint16", doc)
    mesh = Mesh(doc["mesh"])
    want = tokens[B * S:2 * B * S].view(B, S)
    for rank in range(4):
        (ids, mask, labels), nxt = data.batch(B * S, mesh, rank)
        dp = mesh.coords(rank)["dp"]
        rows = slice(dp * B // 2, (dp + 1) * B // 2)
        assert nxt == 2 * B * S and mask is None and labels is ids
        assert torch.equal(ids[rows], want[rows]) and ids.dtype == torch.int64
        others = torch.ones(B, dtype=torch.bool)
        others[rows] = False
        assert not ids[others].any()  # the other dp block was never read


def test_loop_options_are_checked_before_running(export, tmp_path, monkeypatch):
    path, _, base = export
    monkeypatch.setenv("WORLD_SIZE", "4")
    (tmp_path / "short.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    (tmp_path / "ck" / ".step-000002.partial").mkdir(parents=True)
    cases = [(["--steps", "2", "--save-every", "1"], "--save-every needs --ckpt"),
             (["--data", str(base / "tokens.bin")], r"need --steps N > 0"),
             (["--steps", "2", "--data", str(tmp_path / "short.bin")], "has 10 tokens, fewer than one global batch"),
             (["--steps", "2", "--data", str(tmp_path / "none.bin")], "does not exist"),
             (["--steps", "2", "--resume", str(tmp_path / "ck")], "only incomplete checkpoints"),
             (["--steps", "2", "--data", str(base / "tokens.bin"), "--check"], "--check compares"),
             (["--steps", "2", "--timeline", str(tmp_path / "t.json")], "this export is not pipelined")]
    for argv, message in cases:
        with pytest.raises(R.RunError, match=message):
            R.prepare(path, R._parser().parse_args(argv))


def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_what_it_skipped(export, tmp_path, capsys):
    """A newest checkpoint with a manifest but a data file cut short (disk trouble) is skipped,
    with the reason, for the newest complete one; consolidate() and --weights of the directory
    do the same and say so alike."""
    path, _, base = export
    data = ["--data", str(base / "tokens.bin")]
    straight = simulate_run(path, "--steps", "6", *data, *LOOP)[0]["losses"]
    ck = tmp_path / "ck"
    simulate_run(path, "--steps", "4", "--total-steps", "6", "--save-every", "2", "--ckpt", str(ck), *data, *LOOP)
    torn = next(f for f in (ck / "step-000004").iterdir() if f.suffix == ".distcp")
    torn.write_bytes(torn.read_bytes()[:100])
    res = simulate_run(path, "--steps", "4", "--resume", str(ck), *data, *LOOP)[0]
    assert re.fullmatch(rf"warning: --resume skipped step-000004: checkpoint {re.escape(str(ck / 'step-000004'))} "
                        rf"is incomplete: {torn.name} is 100 bytes, the save wrote \d+ bytes", res["lines"][0])
    assert res["lines"][1].startswith(f"resumed from {ck / 'step-000002'} at step 2")
    assert straight[:2] + res["losses"] == straight  # bit for bit from step 2
    capsys.readouterr()
    whole = autoshard.consolidate(ck)
    said = res["lines"][0].replace("--resume", "consolidate")
    assert capsys.readouterr().err.splitlines() == [said]
    autoshard.consolidate(ck, out=tmp_path / "hf")  # written as save_pretrained writes it: the same line
    assert capsys.readouterr().err.splitlines() == [said]
    assert all(torch.equal(whole[k], v) for k, v in autoshard.consolidate(ck / "step-000002").items())
    weights = R.open_weights(path, R.read_plan(path), str(ck))  # run.py --weights ck: step-000002's tensors
    assert ["warning: " + w for w in weights.warnings] == [res["lines"][0].replace("--resume", "--weights")]
    assert {t.source.path for t in weights.sources[0].values()} == {ck / "step-000002"}


def test_resume_with_other_data_or_optimizer_is_said(export, tmp_path):
    path, tokens, base = export
    ck = tmp_path / "ck"
    simulate_run(path, "--steps", "2", "--ckpt", str(ck), "--data", str(base / "tokens.bin"), *LOOP)
    other = tmp_path / "other.bin"
    (tokens.flip(0)).numpy().astype(np.uint16).tofile(other)
    res = simulate_run(path, "--steps", "1", "--resume", str(ck), "--data", str(other), *LOOP)[0]
    assert re.fullmatch(rf"warning: --resume: --data {re.escape(str(other))} \(\d+ bytes\) is not the file "
                        rf"{re.escape(str(ck / 'step-000002'))}'s run read \(tokens.bin, \d+ bytes\): training goes on "
                        rf"from token 64 of another file", res["lines"][0]), res["lines"][0]
    res = simulate_run(path, "--steps", "1", "--resume", str(ck), *LOOP)[0]
    assert res["lines"][0].startswith(f"warning: --resume: {ck / 'step-000002'}'s run read --data tokens.bin (to "
                                      f"token 64); this one has no --data"), res["lines"][0]
    res = simulate_run(path, "--steps", "1", "--resume", str(ck), "--data", str(base / "tokens.bin"), *LOOP)[0]
    assert not any(l.startswith("warning:") for l in res["lines"])  # the same file: nothing to say
    with pytest.raises(R.RunError, match=r"^--resume: \S+step-000002 was trained with --optimizer adamw; its "
                                         r"optimizer state does not apply to --optimizer sgd \(hint: --optimizer adamw\)$"):
        simulate_run(path, "--steps", "1", "--resume", str(ck), "--optimizer", "sgd", *LOOP)


def test_a_ckpt_directory_is_held_by_one_job_and_a_dead_holder_is_taken_over(tmp_path):
    import subprocess
    import textwrap

    from autoshard.runtime.execution import checkpoint as ckpt

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from autoshard.runtime.execution.checkpoint import DirectoryLock
        DirectoryLock.take({str(tmp_path)!r})
        print("held", flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ckpt.DirectoryHeld, match=rf"^{re.escape(str(tmp_path))} is in use by another job: pid "
                                                      rf"{holder.pid} on \S+ since .*\(hint: let it finish"):
            ckpt.DirectoryLock.take(tmp_path)
    finally:
        holder.kill()  # SIGKILL: no handler runs, the kernel drops its lock
        holder.wait()
    lock, dead = ckpt.DirectoryLock.take(tmp_path)
    assert dead["pid"] == holder.pid
    lock.release()
    lock, dead = ckpt.DirectoryLock.take(tmp_path)
    assert dead is None  # a released lock leaves no record
    lock.release()


# ---- --nan-policy: a step whose loss or gradient norm is not finite -----------------------------

def nan_weights(tmp_path):
    """The export's weights (the same model) with one NaN in a norm's weight: every position's
    hidden state, hence the loss and every gradient, becomes NaN from step 1 on."""
    model, _, _ = llama_tiny(with_labels=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[next(k for k in state if k.endswith("norm.weight"))][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    return str(tmp_path / "nan.pt")


def _finite(state) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def test_a_nan_loss_stops_the_run_before_its_optimizer_step(export, tmp_path):
    path, _, base = export
    ck = tmp_path / "ck"
    with pytest.raises(R.NonFiniteError, match=r"step 1: loss nan and gradient norm nan, not finite: stopped "
                                               r"before its optimizer step \(--nan-policy stop"):
        simulate_run(path, "--steps", "3", "--data", str(base / "tokens.bin"), "--weights", nan_weights(tmp_path),
                     "--ckpt", str(ck), "--save-every", "1")
    assert list(ck.glob("*step-*")) == []  # no checkpoint of NaN weights, not even a partial one


def test_a_diverging_run_stops_and_keeps_only_finite_checkpoints(export, tmp_path):
    """--lr 1e6: the first steps are finite, a later one is not; the checkpoints before it are
    written and finite, none from it on (--resume then finds the newest finite one)."""
    path, _, base = export
    ck = tmp_path / "ck"
    with pytest.raises(R.NonFiniteError) as failed:
        simulate_run(path, "--steps", "8", "--data", str(base / "tokens.bin"), "--lr", "1e6", "--ckpt", str(ck),
                     "--save-every", "1")
    stopped = int(re.search(r"step (\d+): ", str(failed.value)).group(1))
    assert stopped >= 2, str(failed.value)
    saved = sorted(ck.glob("*step-*"))
    assert [p.name for p in saved] == [f"step-{s:06d}" for s in range(1, stopped)]
    assert all(_finite(autoshard.consolidate(p)) for p in saved)


def test_skip_step_skips_the_step_on_every_rank_when_one_rank_has_a_nan(export, tmp_path, monkeypatch):
    """A NaN in rank 3's gradient block of a tensor-parallel weight at step 2: the global norm is
    NaN on every rank, all skip that optimizer step (the parameters after step 2 are those after
    step 1), and train on."""
    path, _, base = export
    train_step, calls = R.RankProgram.train_step, {}

    def poisoned(self, user):
        loss = train_step(self, user)
        calls[self.rank] = calls.get(self.rank, 0) + 1
        if self.rank == 3 and calls[self.rank] == 2:
            self.params["layers.0.self_attn.q_proj.weight"].grad.view(-1)[0] = float("nan")  # rank 3's own block
        return loss

    monkeypatch.setattr(R.RankProgram, "train_step", poisoned)
    ck = tmp_path / "ck"
    res = simulate_run(path, "--steps", "3", "--data", str(base / "tokens.bin"), "--ckpt", str(ck), "--save-every",
                       "1", "--nan-policy", "skip-step")
    assert [r["skipped"] for r in res] == [[2]] * 4
    assert all(math.isfinite(v) for v in res[0]["losses"])
    line = next(l for l in res[0]["lines"] if l.startswith("step 2/3"))
    assert line.endswith("skipped: gradient norm nan, not finite (--nan-policy skip-step: no optimizer step)"), line
    after = [autoshard.consolidate(ck / f"step-{s:06d}") for s in (1, 2, 3)]
    assert all(torch.equal(after[0][k], after[1][k]) for k in after[0])  # step 2 changed nothing
    assert not all(torch.equal(after[1][k], after[2][k]) for k in after[1])  # step 3 trained


def test_nan_policy_ignore_trains_on_as_before(export, tmp_path):
    path, _, base = export
    ck = tmp_path / "ck"
    res = simulate_run(path, "--steps", "2", "--data", str(base / "tokens.bin"), "--weights", nan_weights(tmp_path),
                       "--ckpt", str(ck), "--nan-policy", "ignore")
    assert all(math.isnan(v) for v in res[0]["losses"]) and res[0]["skipped"] == []
    assert not _finite(autoshard.consolidate(ck / "step-000002"))  # no check: saved as it is


def test_a_nan_stops_the_plain_training_steps_too(export, tmp_path):
    """run.py --steps N without loop options (rank_loop) follows the same policy."""
    from autoshard.passes.export import simulate_export
    path, _, _ = export
    with pytest.raises(R.NonFiniteError, match=r"step 1: loss nan and gradient norm nan, not finite"):
        simulate_export(path, steps=2, weights=nan_weights(tmp_path))
