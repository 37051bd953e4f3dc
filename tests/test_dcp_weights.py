"""``run.py --weights SRC`` from a torch.distributed.checkpoint directory: an autoshard checkpoint,
a training run's ``--ckpt`` directory (its newest complete checkpoint), and a plain
``torch.distributed.checkpoint.save`` directory (a state dict saved as it is, or under
``"model"``), each rank reading only the regions it holds.

The expected values are never computed by the code under test: losses come from the export of
the same model built with real weights (its weights inside the export); the checkpoints are
written by torch's own ``dcp.save`` or by autoshard's ``save`` under another layout (ZeRO-3).
Exactness is bit for bit: the same program on the same bits must give the same bits.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autoshard
from autoshard.runtime import export as R
from autoshard.passes.export import simulate_export
from autoshard.runtime.transport.simulated import run_simulated

from tests.helpers.hf_llama import autoshard_save, dcp_save, hf_llama, plan_of, torchrun_losses


@pytest.fixture(scope="module")
def dcps(tmp_path_factory):
    """The real model's export and the meta model's (no weights); the real model's weights as
    a plain DCP save (flat and under "model"), and as an autoshard checkpoint written under
    ZeRO-3 (other blocks than the meta export's) inside a --ckpt directory."""
    tmp = tmp_path_factory.mktemp("dcp_weights")
    real, kwargs = hf_llama()
    real_path = plan_of(real, kwargs).export(tmp / "real", kwargs=kwargs)
    meta, meta_kwargs = hf_llama("meta")
    meta_path = plan_of(meta, meta_kwargs).export(tmp / "meta", kwargs=kwargs)
    state = {k: v.detach().clone() for k, v in real.state_dict().items()}
    dcp_save(state, tmp / "plain")
    dcp_save({"model": state, "optim": {"step": torch.tensor(3.0)}, "epoch": 2}, tmp / "nested")
    zero3 = plan_of(real, kwargs, zero_stage=3).export(tmp / "zero3", kwargs=kwargs)
    autoshard_save(zero3, tmp / "ck" / "step-000000")
    (tmp / "ck" / ".step-000001.partial").mkdir()  # a newer save, interrupted: not chosen
    return dict(real=real_path, meta=meta_path, model=real, tmp=tmp, want=simulate_export(real_path, steps=3))


@pytest.mark.parametrize("src", ["plain", "nested", "ck", "ck/step-000000"])
def test_meta_export_from_a_dcp_checkpoint_trains_like_the_real_export_bit_for_bit(dcps, src):
    want = dcps["want"]
    got = simulate_export(dcps["meta"], steps=3, weights=dcps["tmp"] / src)
    assert len(want[0]["losses"]) == 3
    for g, w in zip(got, want, strict=True):
        assert g["losses"] == w["losses"]
        assert g["grads"].keys() == w["grads"].keys()
        assert all(torch.equal(g["grads"][k], w["grads"][k]) for k in w["grads"])


@pytest.mark.parametrize("src", ["plain", "ck"])
def test_each_rank_reads_only_its_own_regions(dcps, src, monkeypatch):
    """Every region a rank asks DCP for lies in a block it keeps: the elements requested equal
    the elements kept (no rank requests a whole tensor it shards), and opening reads no data."""
    requested: dict = {}
    who = threading.local()
    real_read = dcp.FileSystemReader.read_data

    def read_data(self, plan, planner):
        for item in plan.items:
            requested.setdefault(who.rank, []).append((item.dest_index.fqn, math.prod(item.lengths)))
        return real_read(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", read_data)
    doc = R.read_plan(dcps["meta"])
    weights = R.open_weights(dcps["meta"], doc, dcps["tmp"] / src)
    assert not requested  # the metadata only
    program, mesh = R.load_programs(dcps["meta"], doc), autoshard.Mesh(doc["mesh"])

    def fn(rank):
        who.rank = rank
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), True)
        target = {s.name: s.target for s in rp.local.spec.slots}
        return {target[n]: t.numel() for n, t in [*rp.local.named_parameters(), *rp.local.named_buffers()]}

    # what the source has (an autoshard checkpoint has the buffers too, plain DCP the state dict)
    available = set(R.read_checkpoint(dcps["tmp"] / src))
    kept = [{k: n for k, n in params.items() if k in available} for params in run_simulated(mesh, fn)]
    state = {**dict(dcps["model"].named_parameters()), **dict(dcps["model"].named_buffers())}
    sharded = 0
    for rank, params in enumerate(kept):
        got: dict = {}
        for key, n in requested[rank]:
            key = key.removeprefix("model.") if src == "ck" else key  # autoshard's model.<FQN>
            got[key] = got.get(key, 0) + n
        assert got == params
        sharded += sum(n < state[k].numel() for k, n in params.items())
    assert sharded  # tp shards some tensors: their requests are blocks, not whole tensors


def test_missing_and_unexpected_keys_are_one_line_before_the_process_group(dcps, tmp_path, monkeypatch, capsys):
    state = {k: v.detach().clone() for k, v in dcps["model"].state_dict().items() if k != "model.norm.weight"}
    state["value_head.weight"] = torch.zeros(2, 2)
    dcp_save(state, tmp_path / "partial")
    doc = R.read_plan(dcps["meta"])
    with pytest.raises(R.RunError, match=r"missing 1 parameter\(s\) \(model\.norm\.weight\); unexpected key\(s\) "
                                         r"\(value_head\.weight\)") as e:
        R.open_weights(dcps["meta"], doc, tmp_path / "partial")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert R.main(["--steps", "1", "--weights", str(tmp_path / "partial")], root=dcps["meta"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing 1 parameter(s) (model.norm.weight)" in err, err
    # a --ckpt directory whose only checkpoint was interrupted
    (tmp_path / "ck" / ".step-000002.partial").mkdir(parents=True)
    with pytest.raises(R.RunError, match=r"holds only incomplete checkpoints .*its save was interrupted"):
        R.open_weights(dcps["meta"], doc, tmp_path / "ck")


def test_export_checks_a_dcp_source_from_its_metadata(dcps):
    meta, meta_kwargs = hf_llama("meta")
    _, kwargs = hf_llama()
    path = plan_of(meta, meta_kwargs).export(dcps["tmp"] / "pointed", kwargs=kwargs, weights=dcps["tmp"] / "ck")
    got = simulate_export(path, steps=3)
    assert got[0]["losses"] == dcps["want"][0]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("src", ["plain", "ck"])
def test_torchrun_meta_export_from_a_dcp_checkpoint_equals_the_real_export(dcps, src, tmp_path):
    """4 gloo processes, each reading its own regions of the DCP checkpoint."""
    want = torchrun_losses(dcps["real"], tmp_path / "real.jsonl", "--steps", "3")
    got = torchrun_losses(dcps["meta"], tmp_path / "meta.jsonl", "--steps", "3", "--weights", str(dcps["tmp"] / src))
    assert len(want) == 3 and got == want
