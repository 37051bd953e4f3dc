"""A tiny Hugging Face Llama (seeded weights, or on the meta device) and its dp=2 x tp=2 training plan,
shared by the tests of exports with and without weights; the checkpoints they write of it
(torch's own DCP save, autoshard's save by an export's ranks) and the torchrun runner they share:
an export's per-step losses from ``run.py --metrics`` under 4 gloo processes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from transformers import AutoConfig, LlamaForCausalLM

import autoshard
from autoshard.passes.export import run_torchrun
from autoshard.runtime import export as R
from autoshard.runtime.execution import checkpoint as ckpt
from autoshard.runtime.transport.simulated import run_simulated
from tests.helpers import hf_zoo

MESH = {"dp": 2, "tp": 2}
LAYOUT = {"batch": "dp", "heads": "tp", "kv_heads": "tp", "ffn": "tp"}
DIMS = {**hf_zoo.TOKENS, **hf_zoo.LLAMA_DIMS}


def hf_llama(device=None, dtype=None, **config):
    """(tiny HF Llama with seeded weights, or on ``device`` (meta), example kwargs); ``config``
    overrides the zoo's decoder config (``tie_word_embeddings=True``)."""
    cfg = AutoConfig.for_model("llama", **{**hf_zoo.DECODER, **config})
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


def plan_of(model, kwargs, **options):
    """The dp=2 x tp=2 training plan of :func:`hf_llama`'s model (Megatron layout); ``options``
    go to ``autoshard.autoshard`` (``zero_stage=3``)."""
    return autoshard.autoshard(model, (), kwargs=kwargs, mesh=autoshard.Mesh(MESH), dims=DIMS, layout=LAYOUT,
                               train=True, **options)


def torchrun_losses(path, metrics: Path, *argv: str, nproc: int = 4, timeout: float = 180) -> list:
    """The per-step losses rank 0 records (``--metrics``) when ``run.py`` of the export ``path``
    runs ``argv`` on ``nproc`` gloo processes; asserts the job succeeded."""
    proc = run_torchrun(path, nproc, *argv, "--metrics", str(metrics), timeout=timeout, capture=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in Path(metrics).read_text().splitlines()]


def dcp_save(state: dict, path: Path) -> Path:
    """torch's own single-process DCP save (no process group)."""
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def autoshard_save(export: Path, out: Path) -> Path:
    """An autoshard checkpoint of an export's weights, written by its ranks (simulated) as
    run.py's --ckpt writes one."""
    doc = R.read_plan(export)
    program, mesh = R.load_programs(export, doc), autoshard.Mesh(doc["mesh"])
    weights = R.open_weights(export, doc)
    info = {"model": doc["model"], "aliases": doc["aliases"], "state_dict_keys": doc["state_dict_keys"]}

    def fn(rank):
        rp = R.rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), True)
        ckpt.save(rp.local, None, out, step=0, info=info)

    run_simulated(mesh, fn)
    return out


class Wrapped(nn.Module):
    """A training module that holds the HF model as an attribute: the plan's FQNs are the
    checkpoint's keys under ``model.``."""

    def __init__(self, inner):
        super().__init__()
        self.model = inner

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def wrapped_dims() -> dict:
    """DIMS for :class:`Wrapped`: the parameter patterns under ``model.``."""
    return {k if k.startswith("*") or k in hf_zoo.TOKENS else "model." + k: v for k, v in DIMS.items()}
