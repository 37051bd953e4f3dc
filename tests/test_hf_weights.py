"""``run.py --weights SRC`` from safetensors: a ``.safetensors`` file and a Hugging Face
``save_pretrained`` directory (one ``model.safetensors``, or shards with
``model.safetensors.index.json``), each rank reading only the regions it holds.

The expected values are never computed by the code under test: losses come from the export of
the same model built with real weights (its weights inside the export), and a rank's blocks from
``autoshard.ownership.local_piece`` on the real model's tensors. Exactness is bit for bit: the
same program on the same bits must give the same bits.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

import safetensors
import safetensors.torch

import autoshard
import autoshard.passes.export
from autoshard.runtime import export as R
from autoshard.passes.export import simulate_export, simulate_run
from autoshard.runtime.transport.simulated import run_simulated

from tests.helpers import hf_zoo
from transformers import AutoConfig, LlamaForCausalLM
from tests.helpers.hf_llama import DIMS, LAYOUT, MESH, Wrapped, hf_llama, plan_of, torchrun_losses, wrapped_dims

# the tiny Llama's largest tensors (embedding, head) are 8 KiB: shards of 20 KB hold a few each
SHARD_SIZE = "20KB"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The real model's export, the meta model's (no weights), and the real model saved by
    ``save_pretrained`` sharded and as one file."""
    tmp = tmp_path_factory.mktemp("hf_weights")
    real, kwargs = hf_llama()
    real.save_pretrained(tmp / "sharded", max_shard_size=SHARD_SIZE)
    real.save_pretrained(tmp / "single")
    real_path = plan_of(real, kwargs).export(tmp / "real", kwargs=kwargs)
    meta, meta_kwargs = hf_llama("meta")
    meta_path = plan_of(meta, meta_kwargs).export(tmp / "meta", kwargs=kwargs)
    return dict(real=real_path, meta=meta_path, sharded=tmp / "sharded", single=tmp / "single", model=real,
                tmp=tmp, want=simulate_export(real_path, steps=3))


def test_save_pretrained_wrote_shards_and_an_index(hf):
    shards = sorted(p.name for p in hf["sharded"].glob("model-*.safetensors"))
    assert len(shards) > 2 and (hf["sharded"] / "model.safetensors.index.json").is_file()
    assert [p.name for p in hf["single"].glob("*.safetensors")] == ["model.safetensors"]


@pytest.mark.parametrize("src", ["sharded", "single", "single/model.safetensors"])
def test_meta_export_from_hf_weights_trains_like_the_real_export_bit_for_bit(hf, src):
    want = hf["want"]
    got = simulate_export(hf["meta"], steps=3, weights=hf["tmp"] / src)
    assert len(want[0]["losses"]) == 3
    for g, w in zip(got, want, strict=True):
        assert g["losses"] == w["losses"]
        assert g["grads"].keys() == w["grads"].keys()
        assert all(torch.equal(g["grads"][k], w["grads"][k]) for k in w["grads"])


def test_run_py_options_take_a_hf_directory(hf, tmp_path):
    tokens = torch.randint(3, hf_zoo.DECODER["vocab_size"], (4096,), generator=torch.Generator().manual_seed(2))
    data = tmp_path / "tokens.bin"
    tokens.to(torch.int32).numpy().tofile(data)
    argv = ["--steps", "3", "--data", str(data)]
    want = simulate_run(hf["real"], *argv)
    got = simulate_run(hf["meta"], *argv, "--weights", str(hf["sharded"]))
    assert len(want[0]["losses"]) == 3 and got[0]["losses"] == want[0]["losses"]


def test_each_rank_reads_only_its_own_blocks(hf, monkeypatch):
    """Every region read from the files is a block the reading rank keeps (so a rank holds its
    shard and, while one is copied, one more block: never a whole sharded tensor), and the
    blocks are the real model's."""
    reads: dict = {}
    who = threading.local()
    real_open = safetensors.safe_open

    class Slice:
        def __init__(self, sl, key):
            self.sl, self.key = sl, key

        def __getitem__(self, index):
            t = self.sl[index]
            reads.setdefault(who.rank, []).append((self.key, t))
            return t

        def __getattr__(self, name):  # get_shape, get_dtype: the header, no data
            return getattr(self.sl, name)

    class Opened:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return Slice(self.f.get_slice(key), key)

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            reads.setdefault(who.rank, []).append((key, t))
            return t

    monkeypatch.setattr(safetensors, "safe_open", Opened)
    doc = R.read_plan(hf["meta"])
    weights = R.open_weights(hf["meta"], doc, hf["sharded"])
    assert not reads  # opening reads the headers only
    program = R.load_programs(hf["meta"], doc)
    mesh = autoshard.Mesh(doc["mesh"])

    def rank_fn(rank):
        who.rank = rank
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), True)
        return {rp.local.fqn_of[n]: p.detach() for n, p in rp.local.named_parameters()}

    kept = run_simulated(mesh, rank_fn)
    state = hf["model"].state_dict()
    sharded = 0
    for rank, params in enumerate(kept):
        got = reads[rank]
        assert sorted(k for k, _ in got) == sorted(params)  # one read per parameter, nothing else
        for key, t in got:
            assert torch.equal(t, params[key])
            sharded += t.numel() < state[key].numel()
    assert sharded  # tp shards some tensors: their reads are blocks, not the whole tensor
    read_bytes = sum(t.nbytes for got in reads.values() for _, t in got)
    kept_bytes = sum(p.nbytes for params in kept for p in params.values())
    assert read_bytes == kept_bytes


def test_missing_keys_are_one_line_before_the_process_group(hf, tmp_path, monkeypatch, capsys):
    state = {k: v.contiguous() for k, v in hf["model"].state_dict().items() if k != "model.norm.weight"}
    safetensors.torch.save_file(state, tmp_path / "partial.safetensors")
    doc = R.read_plan(hf["meta"])
    with pytest.raises(R.RunError, match=r"missing 1 parameter\(s\) \(model\.norm\.weight\)") as e:
        R.open_weights(hf["meta"], doc, tmp_path / "partial.safetensors")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert R.main(["--steps", "1", "--weights", str(tmp_path / "partial.safetensors")], root=hf["meta"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing 1 parameter(s) (model.norm.weight)" in err, err
    # a directory that is no HF checkpoint, and a shard its index lists but that is gone
    (tmp_path / "empty").mkdir()
    with pytest.raises(R.RunError, match=r"without model\.safetensors or model\.safetensors\.index\.json"):
        R.open_weights(hf["meta"], doc, tmp_path / "empty")


def test_weights_prefix_maps_a_wrapped_models_names_to_the_checkpoint(hf):
    real, kwargs = hf_llama()
    meta, meta_kwargs = hf_llama("meta")
    dims = wrapped_dims()
    plans = {name: autoshard.autoshard(Wrapped(m), (), kwargs=kw, mesh=autoshard.Mesh(MESH), dims=dims,
                                       layout=LAYOUT, train=True)
             for name, m, kw in (("real", real, kwargs), ("meta", meta, meta_kwargs))}
    real_path = plans["real"].export(hf["tmp"] / "wrapped_real", kwargs=kwargs)
    meta_path = plans["meta"].export(hf["tmp"] / "wrapped_meta", kwargs=kwargs)
    doc = R.read_plan(meta_path)
    with pytest.raises(R.RunError, match=r"--weights-prefix model\b") as e:
        R.open_weights(meta_path, doc, hf["sharded"])
    assert "\n" not in str(e.value)
    want = simulate_export(real_path, steps=3)
    for prefix in ("model", "model."):
        got = simulate_export(meta_path, steps=3, weights=hf["sharded"], weights_prefix=prefix)
        assert len(want[0]["losses"]) == 3 and got[0]["losses"] == want[0]["losses"]
    # the same at export: the checkpoint and its prefix recorded in plan.json, checked there
    with pytest.raises(autoshard.passes.export.ExportError, match=r"give weights_prefix='model'\)$"):
        plans["meta"].export(hf["tmp"] / "wrapped_bad", kwargs=kwargs, weights=hf["sharded"])
    pointed = plans["meta"].export(hf["tmp"] / "wrapped_src", kwargs=kwargs, weights=hf["sharded"],
                                   weights_prefix="model")
    assert R.read_plan(pointed)["weights"]["prefix"] == "model"
    got = simulate_export(pointed, steps=3)
    assert got[0]["losses"] == want[0]["losses"]


def test_a_float_checkpoint_of_another_dtype_converts_block_by_block(hf, tmp_path):
    """A bf16 plan from an fp32 checkpoint: each block converts as it is read, as the real
    bf16 model's export holds ``real.to(bfloat16)``'s weights."""
    real, kwargs = hf_llama(dtype=torch.bfloat16)
    want = simulate_export(plan_of(real, kwargs).export(tmp_path / "real", kwargs=kwargs), steps=2)
    meta, meta_kwargs = hf_llama("meta", dtype=torch.bfloat16)
    meta_path = plan_of(meta, meta_kwargs).export(tmp_path / "meta", kwargs=kwargs)
    got = simulate_export(meta_path, steps=2, weights=hf["sharded"])  # fp32 files
    assert len(want[0]["losses"]) == 2 and got[0]["losses"] == want[0]["losses"]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_stages_read_their_stored_blocks_from_the_files(hf, tmp_path, zero_stage):
    """ZeRO-3 stores each parameter sharded on the data axis too; ZeRO-2 keeps a full copy where
    it is used and a shard of it (its block is read at the use placement, then narrowed)."""
    paths = {}
    for name in ("real", "meta"):
        model, kw = hf_llama("meta" if name == "meta" else None)
        plan = autoshard.autoshard(model, (), kwargs=kw, mesh=autoshard.Mesh(MESH), dims=DIMS, layout=LAYOUT,
                                   train=True, zero_stage=zero_stage)
        paths[name] = plan.export(tmp_path / name, kwargs=hf_llama()[1])
    want = simulate_export(paths["real"], steps=3)
    got = simulate_export(paths["meta"], steps=3, weights=hf["sharded"])
    assert len(want[0]["losses"]) == 3 and [g["losses"] for g in got] == [w["losses"] for w in want]


@pytest.mark.slow
def test_torchrun_meta_export_from_a_sharded_hf_directory_equals_the_real_export(hf, tmp_path):
    """4 gloo processes, each opening the shards and reading its own blocks."""
    want = torchrun_losses(hf["real"], tmp_path / "real.jsonl", "--steps", "3")
    got = torchrun_losses(hf["meta"], tmp_path / "meta.jsonl", "--steps", "3", "--weights", str(hf["sharded"]))
    assert len(want) == 3 and got == want


def test_tied_embeddings_saved_once_are_found_under_either_name(tmp_path):
    """save_pretrained writes a tied head once (``model.embed_tokens.weight``); the plan's
    alias of the tied pair finds it."""
    cfg = AutoConfig.for_model("llama", **{**hf_zoo.DECODER, "tie_word_embeddings": True})
    models = {}
    for dev in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(dev):
            models[dev] = LlamaForCausalLM(cfg).eval()
    models["cpu"].save_pretrained(tmp_path / "hf", max_shard_size=SHARD_SIZE)
    _, kwargs = hf_llama()
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map
    want = simulate_export(plan_of(models["cpu"], kwargs).export(tmp_path / "real", kwargs=kwargs), steps=3)
    meta_kwargs = {k: v.to("meta") for k, v in kwargs.items()}
    meta_path = plan_of(models["meta"], meta_kwargs).export(tmp_path / "meta", kwargs=kwargs)
    got = simulate_export(meta_path, steps=3, weights=tmp_path / "hf")
    assert len(want[0]["losses"]) == 3 and got[0]["losses"] == want[0]["losses"]


_LOAD_RANK0 = """
import json, sys, torch
from pathlib import Path
import autoshard
from autoshard.runtime import export as R
from autoshard.runtime.transport.simulated import run_simulated
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
path, src = Path(sys.argv[1]), Path(sys.argv[2])
doc = R.read_plan(path); weights = R.open_weights(path, doc, src); program = R.load_programs(path, doc)
mesh = autoshard.Mesh(doc["mesh"])
run_simulated(mesh, lambda rank: torch.ones(64) @ torch.ones(64))  # the rank threads' first allocations
try:
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM back to the current RSS: the load's own peak
except OSError:
    pass
before, out = status("VmRSS"), {}
def fn(rank):
    if rank == 0:  # one rank's load, as one run.py process does it
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), True)
        out["kept"] = sum(t.nbytes for t in list(rp.local.parameters()) + list(rp.local.buffers()))
run_simulated(mesh, fn)
print(json.dumps({"kept": out["kept"], "grown": status("VmHWM") - before}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "dcp"])
def test_a_ranks_loading_peak_is_its_shard_plus_one_tensor(tmp_path, source):
    """The whole-process high-water mark (VmHWM: heap and mapped file pages) of a fresh process
    loading rank 0 of a tp=4 export from a sharded HF directory (or a DCP checkpoint: torch's
    own ``dcp.save``) grows by at most its own shard plus the largest tensor, plus 20 % for the
    allocator's and the reader's slack."""
    import subprocess
    # layers dominate (a small vocabulary), so a rank that read whole tensors would exceed the bound
    cfg = AutoConfig.for_model("llama", **{**hf_zoo.DECODER, "vocab_size": 1024, "hidden_size": 512,
                                           "intermediate_size": 2048, "num_hidden_layers": 8})
    if source == "hf":
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / source, max_shard_size="20MB")
    else:
        import torch.distributed.checkpoint as dcp
        with pytest.warns(UserWarning, match="single process"):
            dcp.save(LlamaForCausalLM(cfg).state_dict(), checkpoint_id=str(tmp_path / source), no_dist=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    ids = torch.randint(3, cfg.vocab_size, (hf_zoo.BATCH, hf_zoo.SEQ))
    plan = autoshard.autoshard(meta, (), kwargs={"input_ids": ids.to("meta"), "labels": ids.to("meta")},
                               mesh=autoshard.Mesh({"tp": 4}), dims=DIMS,
                               layout={"heads": "tp", "kv_heads": "tp", "ffn": "tp"}, train=True)
    path = plan.export(tmp_path / "meta", kwargs={"input_ids": ids, "labels": ids})
    # tensors above 64 KiB get their own mapping, returned to the system when freed: the
    # high-water mark is then what the loader held at its worst moment, not what the allocator's
    # heaps happened to keep of earlier (freed) tensors, which varies from run to run
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", _LOAD_RANK0, str(path), str(tmp_path / source)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = max(t.nbytes for t in meta.state_dict().values())
    total = sum(t.nbytes for t in meta.state_dict().values())
    bound = 1.2 * (got["kept"] + largest)
    assert bound < total / 2  # the check tells a rank's shard from the whole model
    assert got["grown"] <= bound, (got, largest, total)
