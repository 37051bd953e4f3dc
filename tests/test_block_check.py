"""--check of an export over the check budget: one block of each kind, at the real widths.

A model planned on the meta device (or whose state is over ``check_budget``) has no unsharded
reference; its export carries ``checks/``, the model with its repeated blocks cut to one of each
kind, planned the same way, with references. ``run.py --check`` checks that program and prints
a verdict per block. The tolerance is run.py's --check tolerance (the same as any export's). A
pipelined plan's checked model keeps one block of each kind per stage and is pipelined alike.
"""
import json
import re
import subprocess

import pytest
import torch
from torch import nn

import autoshard
from autoshard import Mesh
from autoshard.block_check import BlockCheckError, _checked_cuts, checked_model, repeated_blocks
from autoshard.passes.export import torchrun_command

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
DIMS = {"input_ids": "batch seq", "labels": "batch seq", "*.q_proj.weight": "heads hidden",
        "*.k_proj.weight": "kv_heads hidden", "*.v_proj.weight": "kv_heads hidden", "*.o_proj.weight": "hidden heads",
        "*.gate_proj.weight": "ffn hidden", "*.up_proj.weight": "ffn hidden", "*.down_proj.weight": "hidden ffn"}
LAYOUT = {"batch": "dp", "heads": "tp", "kv_heads": "tp", "ffn": "tp"}


def _llama(meta: bool):
    cfg = transformers.AutoConfig.for_model("llama", **CONFIG)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _plan(model):
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    return autoshard.autoshard(model, (), kwargs={"input_ids": ids, "labels": ids}, mesh=Mesh({"dp": 2, "tp": 2}),
                               dims=DIMS, layout=LAYOUT, train=True)


def test_repeated_blocks_keep_one_of_each_kind_and_leave_inner_lists_whole():
    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.out = nn.Linear(4, width)

    m = nn.Module()
    m.layers = nn.ModuleList([Block(4), Block(4), Block(8), Block(4)])
    assert repeated_blocks(m) == {"layers": [(0, [0, 1, 3]), (2, [2])]}  # experts: part of each block
    small = checked_model(m, repeated_blocks(m))
    assert len(small.layers) == 2 and small.layers[1].out.out_features == 8
    assert len(m.layers) == 4  # the model itself is unchanged
    single = nn.Module()
    single.layers = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    assert repeated_blocks(single) == {}  # nothing repeats


def test_a_meta_model_gets_random_weights_and_its_own_rotary_buffers():
    meta, real = _llama(True), _llama(False)
    small = checked_model(meta, repeated_blocks(meta))
    assert len(small.model.layers) == 1 and len(meta.model.layers) == 4
    assert not any(t.is_meta for t in list(small.parameters()) + list(small.buffers()))
    assert all(torch.isfinite(p).all() for p in small.parameters())
    # a non-persistent buffer is recomputed by its module's own code: the real model's bits
    assert torch.equal(small.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)


def test_an_export_over_the_check_budget_carries_the_checked_model(tmp_path):
    plan = _plan(_llama(False))
    out = plan.export(tmp_path / "x", check_budget="1KB")
    doc = json.loads((out / "plan.json").read_text())
    assert doc["reference"] is None and "check budget" in doc["missing"]["reference"]
    entry = doc["block_check"]
    assert entry["dir"] == "checks" and [b["name"] for b in entry["blocks"]] == ["model.layers.0"]
    assert entry["blocks"][0]["stands_for"] == [f"model.layers.{i}" for i in range(4)]
    sub = json.loads((out / "checks" / "plan.json").read_text())
    assert sub["reference"]["steps"] == 2
    # the kept block carries the whole plan's block collectives: the export compared them
    block = lambda cs, b: sorted((c["kind"], c["phase"]) for c in cs if c["where"].startswith(b))
    assert block(sub["collectives"], "model.layers.0") == block(doc["collectives"], "model.layers.0")
    assert block(doc["collectives"], "model.layers.0") == block(doc["collectives"], "model.layers.3")


def _export_meta(tmp_path):
    out = _plan(_llama(True)).export(tmp_path / "meta")
    weights = tmp_path / "w.pt"
    torch.save(_llama(False).state_dict(), weights)
    return out, weights


def _torchrun(out, *args):
    return subprocess.run(torchrun_command(out, 4, *args), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_check_of_a_meta_planned_export_reports_each_block(tmp_path):
    out, weights = _export_meta(tmp_path)
    r = _torchrun(out, "--weights", str(weights), "--check", "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check passed" in r.stdout
    assert re.search(r"check block model\.layers\.0 \(standing for model\.layers\.0-3, \d+ parameters.*: ok", r.stdout)
    assert re.search(r"check the non-repeated parts .*: ok", r.stdout)
    assert "step 2/2" in r.stdout.split("autoshard export meta")[-1]  # then the whole model trains


@pytest.mark.slow
def test_check_of_the_blocks_fails_on_a_wrong_block_program(tmp_path):
    out, weights = _export_meta(tmp_path)
    program = out / "checks" / "program.py"
    src = program.read_text()
    # drop the block's first row-parallel sum on tp: each rank keeps its partial sum
    wrong, n = re.subn(r"all_reduce\((\w+), 'tp', tag = \d+, consume = True\)", r"\1", src, count=1)
    assert n == 1
    program.write_text(wrong)
    r = _torchrun(out, "--weights", str(weights), "--check", "--steps", "1")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "CHECK FAILED" in r.stdout
    assert re.search(r"check block model\.layers\.0 .*: FAILED", r.stdout)


def test_the_command_line_exports_the_checked_model_over_its_budget(tmp_path):
    from autoshard import cli

    plan = _plan(_llama(False))
    ns = type("NS", (), dict(weights=None, weights_prefix=None, no_reference=False, force=False, check_budget="1KB"))
    out = cli._export(plan, *plan.example_inputs, tmp_path / "cli", ns)
    assert json.loads((out / "plan.json").read_text())["block_check"]["dir"] == "checks"


# ---------------------------------------------------------------- pipelined plans
# A pipelined plan's checked model keeps one block of each kind per stage and is cut into the
# same stages (the first block of each stage), with the whole plan's schedule and microbatches:
# its stage programs are checked, sends and receives included.

def _pipelined(tmp_path):
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    plan = autoshard.autoshard(_llama(False), (), kwargs={"input_ids": ids, "labels": ids},
                               mesh=Mesh({"pp": 2, "tp": 2}), dims=DIMS,
                               layout={"heads": "tp", "kv_heads": "tp", "ffn": "tp"}, train=True,
                               pipeline={"microbatches": 2, "cuts": ["model.layers.2"]})
    return plan, plan.export(tmp_path / "pp", check_budget="1KB")


def test_repeated_blocks_of_a_pipelined_plan_are_kept_per_stage():
    m = nn.Module()
    m.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(6)])
    assert repeated_blocks(m, cuts=["layers.2", "head"]) == {"layers": [(0, [0, 1]), (2, [2, 3, 4, 5])]}
    with pytest.raises(BlockCheckError, match="pipeline cut layers.3.weight is inside"):
        _checked_cuts(["layers.3.weight"], repeated_blocks(m, cuts=["layers.3.weight"]))
    assert _checked_cuts(["layers.2", "head"], repeated_blocks(m, cuts=["layers.2"])) == ["layers.1", "head"]
    assert repeated_blocks(m, cuts=[f"layers.{i}" for i in range(1, 6)]) == {}  # one block per stage: nothing to cut


def test_a_pipelined_export_over_the_check_budget_carries_a_pipelined_checked_model(tmp_path):
    plan, out = _pipelined(tmp_path)
    doc = json.loads((out / "plan.json").read_text())
    assert "block_check" not in (doc.get("missing") or {})
    entry = doc["block_check"]
    assert [(b["name"], b["block"], b["stage"], b["stands_for"]) for b in entry["blocks"]] == [
        ("model.layers.0", "model.layers.0", 0, ["model.layers.0", "model.layers.1"]),
        ("model.layers.1", "model.layers.2", 1, ["model.layers.2", "model.layers.3"])]
    sub = json.loads((out / "checks" / "plan.json").read_text())
    assert sub["reference"]["steps"] == 2
    p, q = doc["pipeline"], sub["pipeline"]
    assert q["cuts"] == ["model.layers.1"] and p["cuts"] == ["model.layers.2"]
    for key in ("axis", "schedule", "microbatches", "virtual"):
        assert q[key] == p[key]
    sends = lambda pipe: [(b["src_stage"], b["shape"], b["dtype"]) for b in pipe["boundaries"]]
    assert sends(q) == sends(p)  # the same values cross the stages
    assert sorted(f for f in (out / "checks").iterdir() if f.name.startswith("stage")) == \
        [out / "checks" / "stage0.py", out / "checks" / "stage1.py"]


@pytest.mark.slow
def test_check_of_a_pipelined_export_reports_each_stage_block(tmp_path):
    _, out = _pipelined(tmp_path)
    r = _torchrun(out, "--check", "--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check passed" in r.stdout
    for block, stage, stands in (("0", 0, "model.layers.0, model.layers.1"), ("2", 1, "model.layers.2, model.layers.3")):
        assert re.search(rf"check block model\.layers\.{block} \(stage {stage}, standing for {stands}, [1-9]\d* "
                         rf"parameters.*: ok", r.stdout), r.stdout
    assert re.search(r"check the non-repeated parts .*: ok", r.stdout)
    assert "step 1/1" in r.stdout.split("autoshard export pp")[-1]  # then the whole pipeline trains


@pytest.mark.slow
def test_check_of_a_pipelined_export_fails_on_a_wrong_stage_program(tmp_path):
    _, out = _pipelined(tmp_path)
    program = out / "checks" / "stage0.py"
    # the first stage's first sum of gradients on tp dropped (backward only): the first stage's
    # block and the embedding get each rank's partial gradient; the second stage is untouched
    wrong, n = re.subn(r"= mark_varying\((\w+), 'tp', tag = \d+\)", r"= \1", program.read_text(), count=1)
    assert n == 1
    program.write_text(wrong)
    r = _torchrun(out, "--check", "--steps", "1")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "CHECK FAILED" in r.stdout
    assert re.search(r"check block model\.layers\.0 \(stage 0, .*: FAILED", r.stdout), r.stdout
    assert re.search(r"check block model\.layers\.2 \(stage 1, .*: ok", r.stdout), r.stdout
    assert re.search(r"check the non-repeated parts .*: FAILED", r.stdout), r.stdout
