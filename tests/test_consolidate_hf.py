"""Trained weights back to Hugging Face: ``autoshard.consolidate(CKPT, out=OUT, like=HF_DIR)``
and ``autoshard consolidate CKPT OUT`` write a ``save_pretrained``-style directory that
``from_pretrained`` loads, one tensor in memory at a time.

Expected values never come from the code under test: the weights are the real model's (the
checkpoint written by an export's ranks under ZeRO-3) or, after training under torchrun, what
torch's own ``dcp.load`` reads from the checkpoint; the file names and index are compared with
what ``save_pretrained`` itself writes. Exactness is bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]

import autoshard
from autoshard import cli
from autoshard.runtime import export as R
from autoshard.runtime.execution import checkpoint as ckpt
from autoshard.runtime.transport.simulated import run_simulated

from tests.helpers import hf_zoo
from tests.helpers.hf_llama import (LAYOUT, MESH, Wrapped, autoshard_save, dcp_save, hf_llama, plan_of,
                        torchrun_losses, wrapped_dims)
from transformers import AutoConfig, LlamaForCausalLM

SHARD_SIZE = "20KB"  # the tiny Llama's largest tensors are 8 KiB: several shards


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The real model, its save_pretrained directory (sharded: the names and index HF writes),
    and an autoshard checkpoint of it written by the ranks of a ZeRO-3 dp=2 x tp=2 export."""
    tmp = tmp_path_factory.mktemp("consolidate_hf")
    model, kwargs = hf_llama()
    model.save_pretrained(tmp / "hf", max_shard_size=SHARD_SIZE)
    export = plan_of(model, kwargs, zero_stage=3).export(tmp / "export", kwargs=kwargs)
    autoshard_save(export, tmp / "ck" / "step-000000")
    return dict(model=model, tmp=tmp, hf=tmp / "hf", ck=tmp / "ck")


@pytest.mark.parametrize("max_shard_size", [SHARD_SIZE, "5GB"])
def test_consolidate_writes_what_from_pretrained_loads_bit_for_bit(trained, tmp_path, max_shard_size):
    out = autoshard.consolidate(trained["ck"], out=tmp_path / "out", format="safetensors", like=trained["hf"],
                                max_shard_size=max_shard_size)
    loaded = LlamaForCausalLM.from_pretrained(out)
    assert_same_state(loaded.state_dict(), trained["model"].state_dict())
    assert (out / "config.json").read_text() == (trained["hf"] / "config.json").read_text()
    assert (out / "generation_config.json").is_file()
    if max_shard_size == "5GB":  # one file, no index: save_pretrained's small-model layout
        assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
        assert not (out / "model.safetensors.index.json").exists()
    else:  # the names and the index save_pretrained writes at the same shard size
        mine = json.loads((out / "model.safetensors.index.json").read_text())
        theirs = json.loads((trained["hf"] / "model.safetensors.index.json").read_text())
        assert mine["weight_map"].keys() == theirs["weight_map"].keys()
        assert sorted(set(mine["weight_map"].values())) == sorted(set(theirs["weight_map"].values()))
        assert mine["metadata"]["total_size"] == sum(t.nbytes for t in trained["model"].state_dict().values())


def test_every_reader_takes_a_ckpt_directorys_newest_complete_checkpoint(trained, tmp_path):
    """consolidate, load (plan.load_checkpoint) and load_global on a healthy --ckpt directory
    read its newest complete checkpoint, as --resume does, instead of calling it incomplete."""
    ck = tmp_path / "ck"
    shutil.copytree(trained["ck"] / "step-000000", ck / "step-000003")
    (ck / ".step-000004.partial").mkdir()  # a newer save, interrupted
    want = trained["model"].state_dict()
    assert_same_state(autoshard.consolidate(ck), want)
    whole = {k.removeprefix("model."): v for k, v in ckpt.load_global(ck, "model.").items()}
    assert_same_state({k: whole[k] for k in want}, want)  # (it holds the non-persistent buffers too)
    export = trained["tmp"] / "export"
    doc = R.read_plan(export)
    program, mesh = R.load_programs(export, doc), autoshard.Mesh(doc["mesh"])
    weights = R.open_weights(export, doc)

    def fn(rank):
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), True)
        return ckpt.load(rp.local, None, ck)["step"]

    assert run_simulated(mesh, fn) == [0] * mesh.size


def test_tied_embeddings_are_written_once_as_save_pretrained_writes_them(tmp_path):
    model, kwargs = hf_llama(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    export = plan_of(model, kwargs).export(tmp_path / "export", kwargs=kwargs)
    autoshard_save(export, tmp_path / "ck")
    out = autoshard.consolidate(tmp_path / "ck", out=tmp_path / "out", like=tmp_path / "hf",
                                max_shard_size=SHARD_SIZE)
    mine = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in mine and mine.keys() == theirs.keys()
    loaded = LlamaForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied again
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_weights_prefix_is_removed_from_the_keys(tmp_path):
    model, kwargs = hf_llama()
    model.save_pretrained(tmp_path / "hf")
    plan = autoshard.autoshard(Wrapped(model), (), kwargs=kwargs, mesh=autoshard.Mesh(MESH), dims=wrapped_dims(),
                               layout=LAYOUT, train=True)
    autoshard_save(plan.export(tmp_path / "export", kwargs=kwargs), tmp_path / "ck")
    out = autoshard.consolidate(tmp_path / "ck", out=tmp_path / "out", like=tmp_path / "hf", weights_prefix="model")
    assert_same_state(LlamaForCausalLM.from_pretrained(out).state_dict(), model.state_dict())
    with pytest.raises(autoshard.CheckpointError, match=r"weights_prefix 'lm_head': \d+ key\(s\) .* are not under it"):
        autoshard.consolidate(tmp_path / "ck", out=tmp_path / "bad", weights_prefix="lm_head")
    assert not (tmp_path / "bad").exists()


def test_the_command_line_and_its_errors(trained, tmp_path, capsys):
    rc = cli.main(["consolidate", str(trained["ck"]), str(tmp_path / "out"), "--format", "safetensors",
                   "--like", str(trained["hf"]), "--max-shard-size", SHARD_SIZE])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith(f"wrote {tmp_path / 'out'}/ (") and "from_pretrained(" in out, err
    assert_same_state(LlamaForCausalLM.from_pretrained(tmp_path / "out").state_dict(), trained["model"].state_dict())
    capsys.readouterr()  # from_pretrained's progress bar
    cases = [([str(trained["ck"]), str(tmp_path / "out")], "exists and is not empty"),
             ([str(trained["ck"]), str(tmp_path / "o2"), "--max-shard-size", "lots"], "is not a size"),
             ([str(trained["ck"]), str(tmp_path / "o3"), "--like", str(tmp_path)], "has no config.json"),
             ([str(tmp_path / "nothing"), str(tmp_path / "o4")], "does not exist (hint: check the path)")]
    for argv, message in cases:
        assert cli.main(["consolidate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("autoshard: error: ") and message in err, err


_CONSOLIDATE = """
import json, sys
import autoshard
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
import autoshard.runtime.execution.hf_consolidate, safetensors, torch.distributed.checkpoint  # imports before the baseline
before = status("VmRSS")
autoshard.consolidate(sys.argv[1], out=sys.argv[2], max_shard_size="50MB")
print(json.dumps({"grown": status("VmHWM") - before}))
"""


@pytest.mark.slow
def test_consolidating_holds_one_tensor_at_a_time(tmp_path):
    """The whole-process high-water mark (VmHWM) of a fresh process consolidating a model is
    bounded by a few copies of the largest tensor, whatever the model's size: for 124 and
    244 MiB models (8 and 16 layers, the largest tensor 4 MiB in both), at most 8 largest
    tensors. While one tensor is read, DCP's reader holds the saved piece's bytes, a copy of
    them in a BytesIO and the tensor loaded from it, and copies that into the tensor being
    written; the allocator keeps some of it (measured 13 or 25 MiB, for either model)."""
    for layers in (8, 16):
        cfg = AutoConfig.for_model("llama", **{**hf_zoo.DECODER, "vocab_size": 1024, "hidden_size": 512,
                                               "intermediate_size": 2048, "num_hidden_layers": layers})
        state = LlamaForCausalLM(cfg).state_dict()
        largest, total = max(t.nbytes for t in state.values()), sum(t.nbytes for t in state.values())
        dcp_save(state, tmp_path / f"dcp{layers}")
        del state
        proc = subprocess.run([sys.executable, "-c", _CONSOLIDATE, str(tmp_path / f"dcp{layers}"),
                               str(tmp_path / f"out{layers}")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                              # tensors above 64 KiB mapped on their own: the mark is what was held, not
                              # what the allocator kept of freed tensors
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
        assert proc.returncode == 0, proc.stderr
        grown = json.loads(proc.stdout.strip().splitlines()[-1])["grown"]
        assert largest == 4 << 20 and 8 * largest < total / 3  # the bound tells one tensor from the model
        assert grown <= 8 * largest, (layers, grown, largest, total)
    assert len(list((tmp_path / "out16").glob("model-*.safetensors"))) == 6  # 244 MiB in 50 MB shards


@pytest.mark.slow
def test_torchrun_training_with_ckpt_consolidates_to_the_trained_parameters(tmp_path):
    """3 AdamW steps on 4 gloo processes with --ckpt; consolidate of the --ckpt directory (its
    newest checkpoint) loads with from_pretrained into exactly what torch's dcp.load reads from
    that checkpoint, and training changed every parameter."""
    model, kwargs = hf_llama()
    model.save_pretrained(tmp_path / "hf")
    export = plan_of(model, kwargs).export(tmp_path / "export", kwargs=kwargs)
    losses = torchrun_losses(export, tmp_path / "m.jsonl", "--steps", "3", "--save-every", "2",
                             "--ckpt", str(tmp_path / "ck"))
    assert len(losses) == 3 and sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == \
        ["step-000002", "step-000003"]
    out = autoshard.consolidate(tmp_path / "ck", out=tmp_path / "out", like=tmp_path / "hf")
    state = model.state_dict()
    want = {"model." + k: torch.empty_like(v) for k, v in state.items()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(want, checkpoint_id=str(tmp_path / "ck" / "step-000003"), no_dist=True)
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert_same_state(loaded, {k[len("model."):]: v for k, v in want.items()})
    assert all(not torch.equal(loaded[k], v) for k, v in state.items())  # every parameter trained
    assert_same_state(autoshard.consolidate(tmp_path / "ck"), loaded)  # the in-memory state dict agrees
