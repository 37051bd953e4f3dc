"""run.py --grad-accum 2 under torchrun (2 gloo processes, dp=2 ZeRO-3): 3 SGD steps of two
accumulated microbatches whose padded labels leave different counts of valid tokens (per
microbatch and per rank) train like single-device training on the batch of both, within the
float32 spread bound. The simulated version, every ZeRO stage: test_grad_accum.py."""
import json
import os
import subprocess

import pytest
import torch

import autoshard
from autoshard.passes.export import torchrun_command
from examples.models import llama_tiny
from tests.helpers.exactness import assert_training_within_spread
from tests.helpers.grad_accum import B, K, OPTIMIZERS, S, STEPS, padded_batch

pytestmark = pytest.mark.slow


def test_torchrun_grad_accum_trains_like_one_big_batch(tmp_path):
    model, args, dims = llama_tiny(with_labels=True, batch=B, seq=S)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"},
                               train=True, zero_stage=3)
    path = plan.export(tmp_path / "out", args)
    ids, labels = padded_batch(K * B)
    torch.save([ids, None, labels], tmp_path / "big.pt")
    proc = subprocess.run(torchrun_command(path, 2, "--steps", str(STEPS), "--grad-accum", str(K), "--inputs",
                                           str(tmp_path / "big.pt"), *OPTIMIZERS["sgd"][0], "--ckpt", str(tmp_path / "ck"),
                                           "--metrics", str(tmp_path / "m.jsonl")),
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gradient accumulation: 2 microbatches per optimizer step" in proc.stdout
    losses = [json.loads(l)["loss"] for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    params = autoshard.consolidate(tmp_path / "ck" / f"step-{STEPS:06d}")
    assert_training_within_spread(losses, params, model, [(ids, None, labels)] * STEPS, OPTIMIZERS["sgd"][1])
