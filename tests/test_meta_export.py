"""A model planned on the meta device, exported without weights, trained from a checkpoint.

The export of a meta model holds no weights: its non-persistent buffers (RoPE's ``inv_freq``,
``original_inv_freq``: in no state dict) are recomputed on the CPU by the owning module's own
constructor (``passes/buffers.py``) into ``buffers.pt``, and ``run.py --weights SRC`` supplies
the rest. The expected values here are never computed by the code under test: they come from
the same model built with real weights (its buffers, and its own export's training losses).
Exactness is bit for bit: the same program on the same bits must give the same bits.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import autoshard  # noqa: E402
from autoshard.runtime import export as R  # noqa: E402
from autoshard.passes.buffers import non_persistent_buffers, recompute_buffers  # noqa: E402
from autoshard.passes.export import ExportError, run_torchrun, simulate_export, simulate_run  # noqa: E402

import hf_zoo  # noqa: E402
from transformers import AutoConfig, LlamaForCausalLM  # noqa: E402

MESH = {"dp": 2, "tp": 2}
LAYOUT = {"batch": "dp", "heads": "tp", "kv_heads": "tp", "ffn": "tp"}
DIMS = {**hf_zoo.TOKENS, **hf_zoo.LLAMA_DIMS}


def hf_llama(device=None, dtype=None):
    """(tiny HF Llama with seeded weights, or on ``device`` (meta), example kwargs)."""
    cfg = AutoConfig.for_model("llama", **hf_zoo.DECODER)
    torch.manual_seed(0)
    if device is not None:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (hf_zoo.BATCH, hf_zoo.SEQ), generator=g)
    kwargs = {"input_ids": ids, "labels": torch.roll(ids, 1, dims=1)}
    if device is not None:
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
    return model.eval(), kwargs


def plan_of(model, kwargs):
    return autoshard.autoshard(model, (), kwargs=kwargs, mesh=autoshard.Mesh(MESH), dims=DIMS, layout=LAYOUT,
                               train=True)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The real model's export (its weights inside), the meta model's (none), and the real
    model's state dict saved with torch.save (what a user passes as --weights)."""
    tmp = tmp_path_factory.mktemp("meta_export")
    real, kwargs = hf_llama()
    torch.save(real.state_dict(), tmp / "ckpt.pt")
    real_path = plan_of(real, kwargs).export(tmp / "real", kwargs=kwargs)
    meta, meta_kwargs = hf_llama("meta")
    meta_plan = plan_of(meta, meta_kwargs)
    meta_path = meta_plan.export(tmp / "meta", kwargs=kwargs)  # real example inputs, no weights
    bare = meta_plan.export(tmp / "bare")  # no inputs either
    return dict(real=real_path, meta=meta_path, bare=bare, ckpt=tmp / "ckpt.pt", model=real, tmp=tmp)


# ------------------------------------------------------------------------------------------------
# recomputed buffers: the real model's bits
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_recomputed_buffers_are_the_real_models_bits(dtype):
    real, _ = hf_llama(dtype=dtype)
    meta, _ = hf_llama("meta", dtype=dtype)
    names = non_persistent_buffers(meta)
    assert names == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    got = recompute_buffers(meta, sorted(names))
    for name in names:
        want = real.get_buffer(name)
        assert got[name].device.type == "cpu" and got[name].dtype == want.dtype
        assert torch.equal(got[name], want), name


def test_every_zoo_models_buffers_are_recomputed_exactly_or_refused_by_name():
    """Each tiny HF architecture of the zoo, built on meta and with real weights: every
    non-persistent buffer is the real model's bits, or one line naming it (Gemma's embed_scale
    and BERT's position ids live in modules that keep no constructor arguments)."""
    from autoshard.passes.buffers import RecomputeError

    rebuilt = set()
    for arch in hf_zoo.ARCHS.values():
        real, _ = arch.build()
        with torch.device("meta"):
            meta, _ = arch.build()
        for name in sorted(non_persistent_buffers(meta)):
            try:
                got = recompute_buffers(meta, [name])[name]
            except RecomputeError as e:
                assert str(e).startswith(f"buffer {name} of ") and "\n" not in str(e), str(e)
                continue
            assert torch.equal(got, real.get_buffer(name)), (arch.name, name)
            rebuilt.add(arch.name)
    rope = {a.name for a in hf_zoo.ARCHS.values() if any("rotary" in n for n, _ in a.build()[0].named_buffers())}
    assert rope and rope <= rebuilt, rope - rebuilt  # every RoPE decoder's inv_freq is recomputed


def test_example_meta_llama_buffers_are_the_real_models_bits():
    from examples.models import LLAMA_8B, Llama, llama_8b_meta

    small = dict(num_layers=1, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
    meta, _, _ = llama_8b_meta(**small)
    real = Llama(replace(LLAMA_8B, **small)).to(torch.bfloat16)  # what llama_8b_meta builds, with data
    got = recompute_buffers(meta, ["rotary_emb.inv_freq"])
    assert got["rotary_emb.inv_freq"].dtype == torch.bfloat16
    assert torch.equal(got["rotary_emb.inv_freq"], real.rotary_emb.inv_freq)


class _Rope(nn.Module):
    """RoPE written as plain-PyTorch training code writes it: arguments kept as attributes."""

    def __init__(self, dim: int, base: float = 10000.0, device=None):
        super().__init__()
        self.dim, self.base = dim, base
        theta = 1.0 / (base ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
        self.register_buffer("theta", theta, persistent=False)


def test_a_module_that_keeps_its_constructor_arguments_is_rebuilt_from_them():
    real = nn.ModuleDict({"rope": _Rope(16, base=500000.0)})
    with torch.device("meta"):
        meta = nn.ModuleDict({"rope": _Rope(16, base=500000.0)})
    got = recompute_buffers(meta, ["rope.theta"])["rope.theta"]
    assert torch.equal(got, real["rope"].theta)


class _Scaled(nn.Module):
    """A module whose non-persistent buffer no config describes."""

    def __init__(self, n: int, scale: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.register_buffer("scale", torch.full((n,), scale), persistent=False)

    def forward(self, x):
        return (x * self.w * self.scale).sum()


def test_a_buffer_that_cannot_be_recomputed_is_one_line_at_export(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(_Scaled(8, 0.5))
        x = torch.randn(4, 8)
    plan = autoshard.autoshard(model, (x,), mesh=autoshard.Mesh({"dp": 2}), dims={"input": "batch hidden"},
                               layout={"batch": "dp"})
    with pytest.raises(ExportError, match=r"^buffer 0\.scale of 0 \(_Scaled\) is on the meta device and in no "
                                          r"state dict, and _Scaled keeps no attribute for its constructor "
                                          r"argument\(s\) n, scale") as e:
        plan.export(tmp_path / "out")
    assert "\n" not in str(e.value) and "buffers={'0.scale': tensor}" in str(e.value)
    assert not (tmp_path / "out").exists()
    # the value given by the caller: checked, then the export runs like the real model's
    with pytest.raises(ExportError, match=r"buffers=\{'0\.scale': \.\.\.\} is \[4\] float32; the program reads a "
                                          r"\[8\] float32 tensor"):
        plan.export(tmp_path / "out", buffers={"0.scale": torch.ones(4)})
    path = plan.export(tmp_path / "out", buffers={"0.scale": torch.full((8,), 0.5)})
    real = nn.Sequential(_Scaled(8, 0.5))
    with torch.no_grad():
        real[0].w.copy_(torch.arange(8.0))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch.save(real.state_dict(), tmp_path / "ckpt.pt")
    got = simulate_export(path, inputs=[x], weights=tmp_path / "ckpt.pt")
    real_plan = autoshard.autoshard(real, (x,), mesh=autoshard.Mesh({"dp": 2}), dims={"input": "batch hidden"},
                                    layout={"batch": "dp"})
    want = simulate_export(real_plan.export(tmp_path / "real", (x,)))
    assert len(got) == 2 and all(torch.equal(g["outputs"][0], w["outputs"][0]) for g, w in zip(got, want))


# ------------------------------------------------------------------------------------------------
# the meta export: what it writes, and what run.py says without --weights
# ------------------------------------------------------------------------------------------------

def test_a_meta_export_writes_no_weights_and_says_where_they_come_from(exports):
    path = exports["meta"]
    assert not (path / "weights.pt").exists() and (path / "buffers.pt").is_file()
    doc = json.loads((path / "plan.json").read_text())
    assert doc["weights"] == {"file": None, "checkpoint": None, "buffers": "buffers.pt"}
    assert "--weights" in doc["missing"]["weights"]
    saved = torch.load(path / "buffers.pt", weights_only=True)
    assert sorted(saved) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    for name, t in saved.items():
        assert torch.equal(t, exports["model"].get_buffer(name)), name
    real_doc = json.loads((exports["real"] / "plan.json").read_text())
    assert real_doc["missing"]["weights"] is None and real_doc["weights"]["file"] == "weights.pt"


def test_run_py_without_weights_on_a_meta_export_exits_2_with_one_line(exports, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for argv in ([], ["--steps", "3"], ["--synthetic"]):
        assert R.main(argv, root=exports["meta"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err, err
        assert err.startswith("run.py: error: this export has no weights: the model was planned on the meta "
                              "device") and "--weights SRC" in err, err
    # --check: there are no references to check against (with or without --weights)
    for argv in (["--check"], ["--check", "--weights", str(exports["ckpt"])]):
        assert R.main(argv, root=exports["meta"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "no references to check against: the model is on the meta device" in err, err


def test_a_meta_tensor_in_the_weights_is_refused_before_the_process_group(exports, tmp_path, monkeypatch):
    # a checkpoint saved from the meta model itself: shapes, no data
    meta, _ = hf_llama("meta")
    torch.save(meta.state_dict(), tmp_path / "meta_ckpt.pt")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(R.RunError, match=r"the weights hold \d+ tensor\(s\) on the meta device \(shapes, no data\): "
                                         r"lm_head\.weight, model\.embed_tokens\.weight"):
        R.prepare(exports["meta"], R._parser().parse_args(["--weights", str(tmp_path / "meta_ckpt.pt")]))


# ------------------------------------------------------------------------------------------------
# training: the meta export with --weights equals the real export, bit for bit
# ------------------------------------------------------------------------------------------------

def test_meta_export_trains_like_the_real_export_bit_for_bit(exports):
    real = simulate_export(exports["real"], steps=3)
    meta = simulate_export(exports["meta"], steps=3, weights=exports["ckpt"])
    assert len(real[0]["losses"]) == 3
    for r, m in zip(real, meta):
        assert m["losses"] == r["losses"]
        assert r["grads"].keys() == m["grads"].keys()
        for k in r["grads"]:
            assert torch.equal(m["grads"][k], r["grads"][k]), k


def test_meta_export_through_run_py_options_bit_for_bit(exports, tmp_path):
    """simulate_run parses run.py's own options, --weights included (the training loop)."""
    real = simulate_run(exports["real"], "--steps", "3", "--metrics", str(tmp_path / "real.jsonl"))
    meta = simulate_run(exports["meta"], "--steps", "3", "--metrics", str(tmp_path / "meta.jsonl"),
                        "--weights", str(exports["ckpt"]))
    assert len(real[0]["losses"]) == 3 and meta[0]["losses"] == real[0]["losses"]


def test_example_llama_8b_meta_exports_and_trains_like_the_real_model(tmp_path):
    from examples.models import LLAMA_8B, LLAMA_PARAM_DIMS, Llama, init_weights, llama_8b_meta

    small = dict(num_layers=1, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
    meta, meta_args, dims = llama_8b_meta(batch=2, seq=8, with_labels=True, **small)
    real = init_weights(Llama(replace(LLAMA_8B, **small))).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    args = (ids, None, ids.clone())
    mesh, layout = autoshard.Mesh({"tp": 2}), {"heads": "tp", "ffn": "tp"}
    plan = autoshard.autoshard(meta, meta_args, mesh=mesh, dims=dims, layout=layout, train=True)
    path = plan.export(tmp_path / "meta", args)
    assert not (path / "weights.pt").exists()
    torch.save(real.state_dict(), tmp_path / "ckpt.pt")
    real_path = autoshard.autoshard(real, args, mesh=mesh, dims=dims, layout=layout, train=True).export(
        tmp_path / "real", args)
    want = simulate_export(real_path, steps=3)
    got = simulate_export(path, steps=3, weights=tmp_path / "ckpt.pt")
    assert len(want[0]["losses"]) == 3 and got[0]["losses"] == want[0]["losses"]


@pytest.mark.slow
def test_torchrun_meta_export_from_weights_equals_the_real_export(exports, tmp_path):
    losses = {}
    for name, extra in (("real", []), ("meta", ["--weights", str(exports["ckpt"])])):
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_torchrun(exports[name], 4, "--steps", "3", "--metrics", str(metrics), *extra, timeout=180,
                            capture=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["real"]) == 3
    assert losses["meta"] == losses["real"]
