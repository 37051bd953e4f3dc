"""A tiny Hugging Face Llama (seeded weights, or on the meta device) and its dp=2 x tp=2 training plan,
shared by the tests of exports with and without weights."""
from __future__ import annotations

import torch
from transformers import AutoConfig, LlamaForCausalLM

import autoshard
from tests.helpers import hf_zoo

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
    """The dp=2 x tp=2 training plan of :func:`hf_llama`'s model (Megatron layout)."""
    return autoshard.autoshard(model, (), kwargs=kwargs, mesh=autoshard.Mesh(MESH), dims=DIMS, layout=LAYOUT,
                               train=True)
