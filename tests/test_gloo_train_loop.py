"""The exported run.py's training loop under torchrun (2 gloo processes, dp=2 ZeRO-3): 20 of 30
scheduled steps with checkpoints every 10, then --resume for the last 10, gives the same losses
bit for bit as 30 steps straight (data position, schedule, clipping and optimizer state restored)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard.passes.export import torchrun_command  # noqa: E402
from examples.models import llama_tiny  # noqa: E402

pytestmark = pytest.mark.slow


def torchrun(path, *run_args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun_command(path, 2, *run_args), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def dp2_export(tmp_path, tokens: int = 700, **options):
    """The tiny Llama planned for training on dp=2 (``options``: zero_stage=...), exported, and a
    token file of ``tokens`` ids: (model, export path, token file)."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"},
                               train=True, **options)
    ids = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(3))
    ids.numpy().astype(np.uint16).tofile(tmp_path / "tokens.bin")
    return model, plan.export(tmp_path / "out"), tmp_path / "tokens.bin"


def start_ranks(path, *run_args, nproc: int = 2, **popen):
    """The processes of a job as torchrun starts them (RANK, WORLD_SIZE, ... set), without its
    launcher, so the test can signal each and read its exit code."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(path / "run.py"), *run_args]
    return [subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r),
                                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), text=True, **popen)
            for r in range(nproc)]


def test_torchrun_resume_gives_the_same_losses_as_straight(tmp_path):
    model, path, _ = dp2_export(tmp_path, 700, zero_stage=3)
    opts = ["--data", str(tmp_path / "tokens.bin"), "--lr-schedule", "cosine", "--warmup", "5",
            "--clip-grad-norm", "1.0", "--lr", "1e-2"]
    ck = tmp_path / "ck"
    out_a = torchrun(path, "--steps", "20", "--total-steps", "30", "--save-every", "10", "--ckpt", str(ck),
                     "--metrics", str(tmp_path / "a.jsonl"), *opts)
    assert sorted(p.name for p in ck.iterdir()) == [".autoshard-lock", "step-000010", "step-000020"]
    out_b = torchrun(path, "--resume", str(ck), "--steps", "10", "--metrics", str(tmp_path / "b.jsonl"), *opts)
    torchrun(path, "--steps", "30", "--metrics", str(tmp_path / "c.jsonl"), *opts)
    read = lambda name: [json.loads(l) for l in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    a, b, c = read("a.jsonl"), read("b.jsonl"), read("c.jsonl")
    assert [m["step"] for m in a + b] == [m["step"] for m in c] == list(range(1, 31))
    assert [m["loss"] for m in a + b] == [m["loss"] for m in c]  # bit for bit
    assert [m["lr"] for m in a + b] == [m["lr"] for m in c]
    assert [m["grad_norm"] for m in a + b] == [m["grad_norm"] for m in c]
    assert "step 1/20  loss " in out_a and "tokens/s" in out_a and "saved checkpoint" in out_a
    assert f"resumed from {ck / 'step-000020'} at step 20, token 640" in out_b and "step 30/30  loss" in out_b
    assert "done: 10 steps in" in out_b


def test_a_second_job_on_a_held_ckpt_directory_stops_before_its_first_step(tmp_path):
    """One job per --ckpt directory: a second job exits non-zero before training with one line
    naming the holder; every checkpoint the first job marked complete loads and resumes to the
    losses that job went on to print."""
    import signal

    model, path, _ = dp2_export(tmp_path, 700)
    ck, opts = tmp_path / "ck", ["--data", str(tmp_path / "tokens.bin"), "--lr", "1e-2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(torchrun_command(path, 2, "--steps", "100000", "--save-every", "3", "--ckpt", str(ck),
                                              "--metrics", str(tmp_path / "a.jsonl"), *opts),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        saved = 0
        for line in first.stdout:  # the first job holds the directory and has saved
            saved += line.startswith("saved checkpoint")
            if saved == 2:
                break
        second = subprocess.run(torchrun_command(path, 2, "--steps", "4", "--save-every", "1", "--ckpt", str(ck),
                                                 *opts), env=env, capture_output=True, text=True, timeout=300)
    finally:  # (the first job went on saving while the second started and stopped)
        first.send_signal(signal.SIGTERM)  # torchrun passes it to its workers
        first.communicate(timeout=120)
    assert second.returncode != 0 and "step 1/" not in second.stdout, second.stdout[-2000:]
    lines = [l for l in second.stderr.splitlines() if l.startswith("run.py: error:")]
    assert len(lines) == 1 and re.match(rf"run\.py: error: --ckpt {re.escape(str(ck))} is in use by another job: "
                                        rf"pid [0-9]+ on \S+ since ", lines[0]), second.stderr[-3000:]
    losses = []
    for l in (tmp_path / "a.jsonl").read_text().splitlines():
        try:
            losses.append(json.loads(l)["loss"])
        except json.JSONDecodeError:  # the last line, cut by the kill
            break
    complete = [p for p in sorted(ck.glob("step-*")) if (p / "autoshard.json").is_file()]
    assert len(complete) >= 2, sorted(p.name for p in ck.iterdir())
    for p in complete:
        assert sorted(autoshard.consolidate(p)) == sorted(model.state_dict()), p  # every one loads
    k = int(complete[1].name.split("-")[1])  # a checkpoint the first job trained past
    assert len(losses) >= k + 2, (k, len(losses))
    out = torchrun(path, "--resume", str(complete[1]), "--steps", "2", "--metrics", str(tmp_path / "b.jsonl"), *opts)
    assert [json.loads(l)["loss"] for l in (tmp_path / "b.jsonl").read_text().splitlines()] == losses[k:k + 2], out


def test_torchrun_a_nan_loss_exits_4_on_every_process_and_skip_step_trains_on(tmp_path):
    """A NaN weight: under --nan-policy stop (the default) both processes exit 4 before step 1's
    optimizer step, after one line naming the step, and no checkpoint is written; under
    skip-step every step is skipped, said on its line, and the run ends normally."""
    import re
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"},
                               train=True, zero_stage=3)
    path = plan.export(tmp_path / "out")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["layers.0.input_layernorm.weight"][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    ck = tmp_path / "ck"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun_command(path, 2, "--steps", "3", "--weights", str(tmp_path / "nan.pt"), "--ckpt",
                                           str(ck), "--save-every", "1"),
                          env=env, capture_output=True, text=True, timeout=300)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("run.py: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("run.py: error: step 1: loss nan and gradient norm nan, not finite: stopped "
                                "before its optimizer step (--nan-policy stop"), errors
    # torchrun's list of the ranks' exit codes: 4; it SIGTERMs the others once one has exited, and
    # on a loaded machine one may still be leaving the process group then (-15)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+) ", proc.stderr)
    assert len(codes) == 2 and "4" in codes and set(codes) <= {"4", "-15"}, proc.stderr[-3000:]
    assert "step 1/3" not in proc.stdout and list(ck.glob("*step-*")) == []
    out = torchrun(path, "--steps", "2", "--weights", str(tmp_path / "nan.pt"), "--nan-policy", "skip-step")
    steps = [l for l in out.splitlines() if l.startswith("step ")]
    assert len(steps) == 2 and all(l.endswith("skipped: loss nan and gradient norm nan, not finite "
                                              "(--nan-policy skip-step: no optimizer step)") for l in steps), out


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signalled_job_saves_its_step_and_resumes_bit_for_bit(tmp_path, sig):
    """SIGTERM (what a scheduler sends before SIGKILL) or SIGINT to the whole job: every process
    finishes its step, the job saves that step's checkpoint and each process exits 128 + the
    signal; resuming from it gives the losses of an uninterrupted run, bit for bit."""
    import signal

    model, path, _ = dp2_export(tmp_path, 700, zero_stage=3)
    ck, opts = tmp_path / "ck", ["--data", str(tmp_path / "tokens.bin"), "--lr", "1e-2", "--total-steps", "1000"]
    ranks = start_ranks(path, "--steps", "1000", "--ckpt", str(ck), "--metrics", str(tmp_path / "a.jsonl"), *opts,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # each one's exit code is seen
    try:
        for line in ranks[0].stdout:
            if line.startswith("step 4/"):
                for p in ranks:  # every process of the job, as a scheduler signals it
                    p.send_signal(getattr(signal, sig))
                break
        (out, err), (_, err1) = ranks[0].communicate(timeout=60), ranks[1].communicate(timeout=60)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    stop = [l for l in out.splitlines() if l.startswith(f"stopping on {sig} after step ")]
    assert len(stop) == 1, out[-2000:] + err[-3000:]
    k = int(stop[0].split("after step ")[1].split(":")[0])
    assert [p.returncode for p in ranks] == [128 + getattr(signal, sig)] * 2, (err[-2000:], err1[-2000:])
    assert "Traceback" not in err + err1, err[-2000:] + err1[-2000:]
    saved = autoshard.runtime.execution.checkpoint.resolve(ck)
    assert saved.name == f"step-{k:06d}" and not list(ck.glob(".step-*"))
    first = [json.loads(l)["loss"] for l in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(first) == k
    torchrun(path, "--resume", str(ck), "--steps", "3", "--metrics", str(tmp_path / "b.jsonl"), *opts)
    torchrun(path, "--steps", str(k + 3), "--metrics", str(tmp_path / "c.jsonl"), *opts)
    read = lambda name: [json.loads(l)["loss"] for l in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    assert first + read("b.jsonl") == read("c.jsonl")  # bit for bit


def test_a_job_killed_and_resumed_five_times_trains_like_one_that_never_stopped(tmp_path):
    """1000 steps with a checkpoint every 50, the whole job killed (SIGKILL: no handler runs) 5
    times at seeded random moments and resumed each time from its --ckpt directory: the losses
    of the steps that count (each resumed run's, from its checkpoint on) are an uninterrupted
    run's, bit for bit, and nothing of the jobs is left in /dev/shm."""
    import random
    import signal
    import time

    model, path, _ = dp2_export(tmp_path, 1000)
    steps, ck = 1000, tmp_path / "ck"
    opts = ["--data", str(tmp_path / "tokens.bin"), "--lr", "1e-3", "--total-steps", str(steps), "--lr-schedule",
            "cosine", "--warmup", "20", "--save-every", "50", "--ckpt", str(ck)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shm_before = {f for f in os.listdir("/dev/shm") if f.startswith("autoshard")}
    rng = random.Random(0)
    losses: dict = {}  # step -> loss of the run that last trained it
    done, interrupted = 0, 0
    for run in range(6):
        resume = ["--resume", str(ck)] if done else []
        metrics, log = tmp_path / f"m{run}.jsonl", tmp_path / f"out{run}.txt"
        with open(log, "w") as out:
            ranks = start_ranks(path, "--steps", str(steps - done), "--metrics", str(metrics), *resume, *opts,
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            if run < 5:
                t0 = time.monotonic()
                while not (metrics.is_file() and metrics.stat().st_size) and ranks[0].poll() is None \
                        and time.monotonic() - t0 < 120:  # training has started (a line per step, flushed)
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.5))  # a random moment of the training
                for p in ranks:
                    p.kill()  # SIGKILL to every process of the job
            for p in ranks:
                p.wait(timeout=300)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        assert metrics.is_file(), log.read_text()[-3000:]
        for line in metrics.read_text().splitlines():
            try:
                m = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                break
            losses[m["step"]] = m["loss"]
        if run == 5:
            assert [p.returncode for p in ranks] == [0, 0], log.read_text()[-3000:]
        try:
            done = int(autoshard.runtime.execution.checkpoint.resolve(ck).name.split("-")[1])  # the newest verified one
        except autoshard.runtime.execution.checkpoint.CheckpointError:
            done = 0  # killed before its first checkpoint: the next run starts over
        interrupted += run < 5 and done < steps
    assert interrupted == 5 and done == steps and sorted(losses) == list(range(1, steps + 1))
    torchrun(path, "--steps", str(steps), "--metrics", str(tmp_path / "straight.jsonl"), *opts[:-4])
    straight = [json.loads(l)["loss"] for l in (tmp_path / "straight.jsonl").read_text().splitlines()]
    assert [losses[s] for s in range(1, steps + 1)] == straight  # bit for bit
    assert {f for f in os.listdir("/dev/shm") if f.startswith("autoshard")} <= shm_before
