"""What an export writes of the weights, and where plan.json says they are.

``plan.export(path)`` of a real model writes its weights once (``weights.pt``);
``plan.export(path, weights=SRC)`` writes none (only the non-persistent buffers no checkpoint
has, to ``buffers.pt``) and records SRC relative to the export, so a second layout of the same
model points at the first export's weights, and the exports move with them. Expected losses
come from the export of the same layout with its own weights; bit for bit.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.runtime import export as R
from autoshard.passes.export import simulate_export

from tests.helpers.hf_llama import DIMS, hf_llama, plan_of


def zero3_dp4(model, kwargs):
    """A second layout of the same model: ZeRO-3 on dp=4."""
    return autoshard.autoshard(model, (), kwargs=kwargs, mesh=autoshard.Mesh({"dp": 4}), dims=DIMS,
                               layout={"batch": "dp"}, train=True, zero_stage=3)


def test_a_real_models_export_writes_its_weights_once(tmp_path):
    model, kwargs = hf_llama()
    path = plan_of(model, kwargs).export(tmp_path / "out", kwargs=kwargs)
    state = {k: v for k, v in model.state_dict().items()}
    # every parameter and persistent buffer, plus the non-persistent buffers (in no state dict)
    unique = sum(t.nbytes for t in {id(t): t for t in [*state.values(), *model.buffers()]}.values())
    size = (path / "weights.pt").stat().st_size
    assert unique <= size < unique + 64 * 1024, (unique, size)  # one copy plus torch.save's index
    assert not (path / "buffers.pt").exists()


def test_a_second_layout_points_at_the_first_exports_weights_relative_to_itself(tmp_path):
    model, kwargs = hf_llama()
    first = plan_of(model, kwargs).export(tmp_path / "exports" / "dp2_tp2", kwargs=kwargs)
    second = zero3_dp4(model, kwargs).export(tmp_path / "exports" / "dp4_zero3", kwargs=kwargs, weights=first)
    # the first export's weights.pt has every tensor (its non-persistent buffers too): nothing written
    assert not (second / "weights.pt").exists() and not (second / "buffers.pt").exists()
    text = (second / "plan.json").read_text()
    assert json.loads(text)["weights"] == {"file": None, "checkpoint": "../dp2_tp2", "buffers": None}
    assert str(tmp_path) not in text and str(tmp_path) not in (first / "plan.json").read_text()
    want = simulate_export(zero3_dp4(model, kwargs).export(tmp_path / "own", kwargs=kwargs), steps=3)
    # both exports moved to another directory together: the relative source still resolves
    moved = shutil.move(tmp_path / "exports", tmp_path / "elsewhere")
    got = simulate_export(Path(moved) / "dp4_zero3", steps=3, check=True)
    assert len(want[0]["losses"]) == 3 and [g["losses"] for g in got] == [w["losses"] for w in want]
    assert all(g["ok"] for g in got), got[0]["problems"]
    # the source gone: one line naming the recorded path and what to do, before the process group
    shutil.rmtree(Path(moved) / "dp2_tp2")
    with pytest.raises(R.RunError, match=r"^this export reads its weights from \.\./dp2_tp2 \(relative to .*\), "
                                         r"which does not exist \(hint: .*--weights SRC\)$"):
        R.open_weights(Path(moved) / "dp4_zero3", R.read_plan(Path(moved) / "dp4_zero3"))


def test_a_real_model_pointing_at_hf_weights_writes_only_the_buffers_no_checkpoint_has(tmp_path):
    model, kwargs = hf_llama()
    model.save_pretrained(tmp_path / "hf")
    path = plan_of(model, kwargs).export(tmp_path / "out", kwargs=kwargs, weights=tmp_path / "hf")
    doc = json.loads((path / "plan.json").read_text())
    assert doc["weights"]["checkpoint"] == "../hf" and doc["weights"]["file"] is None
    saved = torch.load(path / "buffers.pt", weights_only=True)
    assert sorted(saved) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert all(torch.equal(t, model.get_buffer(k)) for k, t in saved.items())
    want = simulate_export(plan_of(model, kwargs).export(tmp_path / "own", kwargs=kwargs), steps=3)
    got = simulate_export(path, steps=3)
    assert len(want[0]["losses"]) == 3 and got[0]["losses"] == want[0]["losses"]
