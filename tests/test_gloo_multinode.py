"""A job on two "nodes" of this host: two torchrun agents (--nnodes 2 --nproc-per-node 2, c10d
rendezvous), as on two machines. The export passes --check; training saves checkpoints into the
shared --ckpt and a second two-node job resumes from them, with the losses of the same steps run
straight; nodes that are given different --ckpt directories stop before training with one
line naming the ranks that do not see rank 0's."""
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import autoshard
from autoshard.passes.export import simulate_run
from examples.models import llama_tiny

pytestmark = pytest.mark.slow


def two_nodes(path, *run_args, node_args=((), ()), cwd=None):
    """Two torchrun agents of one job (2 processes each) on this host; returns their finished
    processes (stdout and stderr as text). ``node_args``: extra run.py options per node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                               str(path / "run.py"), *run_args, *extra],
                              env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in node_args]
    for p in procs:
        p.out, p.err = p.communicate(timeout=300)
    return procs


def losses(text: str) -> list:
    return [float(x) for x in re.findall(r"^step \d+/\d+  loss (\S+)", text, re.M)]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    base = tmp_path_factory.mktemp("nodes")
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, zero_stage=3)
    tokens = torch.randint(0, 64, (500,), generator=torch.Generator().manual_seed(3))
    tokens.numpy().astype(np.uint16).tofile(base / "tokens.bin")
    return plan.export(base / "out", args), base


def test_two_nodes_check_and_resume(export):
    path, base = export
    procs = two_nodes(path, "--steps", "2", "--check")
    assert [p.returncode for p in procs] == [0, 0], "".join(p.err[-2000:] for p in procs)
    out = "".join(p.out for p in procs)  # rank 0 prints, on whichever node it is
    assert "on Mesh(dp=2, tp=2), ZeRO-3 (4 gloo processes" in out
    assert re.search(r"^check passed: outputs and gradients equal the unsharded model's on all 4 ranks .* losses of 2 "
                     r"adamw steps match single-device training", out, re.M), out

    data = ["--data", str(base / "tokens.bin"), "--lr", "1e-2"]
    ck = base / "ck"
    metrics = ["--metrics", str(base / "m.jsonl")]
    first = two_nodes(path, "--steps", "2", "--total-steps", "4", "--save-every", "1", "--ckpt", str(ck), *data,
                      *metrics)
    assert [p.returncode for p in first] == [0, 0], "".join(p.err[-2000:] for p in first)
    assert sorted(p.name for p in ck.iterdir()) == [".autoshard-lock", "step-000001", "step-000002"]  # no probe left
    second = two_nodes(path, "--steps", "2", "--resume", str(ck), *data, *metrics)
    assert [p.returncode for p in second] == [0, 0], "".join(p.err[-2000:] for p in second)
    out = "".join(p.out for p in second)
    assert f"resumed from {ck / 'step-000002'} at step 2" in out
    got = [json.loads(l)["loss"] for l in (base / "m.jsonl").read_text().splitlines()]
    assert len(got) == 4 and got[:2] == pytest.approx(losses("".join(p.out for p in first)), abs=1e-6)
    straight = simulate_run(path, "--steps", "4", *data)[0]["losses"]
    assert got == straight, (got, straight)


def test_nodes_with_other_ckpt_dirs_stop_before_training(export):
    path, base = export
    procs = two_nodes(path, "--steps", "2", "--data", str(base / "tokens.bin"),
                      node_args=(("--ckpt", str(base / "ck_a")), ("--ckpt", str(base / "ck_b"))))
    assert all(p.returncode != 0 for p in procs)
    err = "".join(p.err for p in procs)
    lines = [l for l in err.splitlines() if l.startswith("run.py: error:")]
    assert len(lines) == 1, err[-3000:]
    assert re.match(r"run\.py: error: --ckpt \S+ck_[ab] on ranks 2 \(host [^)]+\), 3 \(host [^)]+\) is not the "
                    r"directory rank 0 \(host [^)]+\) writes its checkpoints to", lines[0]), lines[0]
    assert "shared" in lines[0]
    assert not losses("".join(p.out for p in procs))  # no step ran
    for d in ("ck_a", "ck_b"):
        assert not [p.name for p in (base / d).iterdir() if p.name != ".autoshard-lock"]
