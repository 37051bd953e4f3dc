"""Contrastive losses over ``[batch, batch]`` logits (CLIP / SigLIP-style image-text models),
data parallel. The logits hold the batch twice (image rows x text columns): a mesh axis splits
the rows and keeps the columns whole, so each rank scores its images against every text (the
text embeddings are gathered, ``all_gather_varying``, whose backward reduce-scatters their
gradient), and the transposed logits of the text-to-image loss change their split dim with one
all-to-all. Those collectives are the plan, so ``strict=True`` accepts it.

Exactness: the loss and every gradient against the single-device model
(``test_property.close``: fp32 bounds, and where they fail the fp64 reference decides, at most
10x the single-device fp32 error).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from tests.helpers.exactness import close


class Contrastive(nn.Module):
    """Two towers, L2-normalized embeddings, a learned temperature, the symmetric CE of CLIP."""

    def __init__(self, image=12, text=10, embed=8):
        super().__init__()
        self.image_proj, self.text_proj = nn.Linear(image, embed), nn.Linear(text, embed)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, image, text):
        i, t = self.image_proj(image), self.text_proj(text)
        i = i / i.pow(2).sum(-1, keepdim=True).sqrt()
        t = t / t.pow(2).sum(-1, keepdim=True).sqrt()
        logits = i @ t.t() * self.logit_scale.exp()
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def check_exact(plan, model, kwargs, loss=lambda out: out):
    def ref(m, kw):
        m.zero_grad()
        out = loss(m(**kw))
        out.backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    out32, grads32 = ref(model, kwargs)
    f64 = []

    def exact(grad=None):
        def get():
            if not f64:
                as64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
                f64.append(ref(copy.deepcopy(model).double(), as64))
            return f64[0][0] if grad is None else f64[0][1][grad]
        return get

    out, grads = plan.simulate_grads(**kwargs)
    close(loss(out), out32, "loss", exact())
    assert set(grads32) <= set(grads)
    for n, g in grads32.items():
        close(grads[n], g, f"gradient of {n}", exact(n))


@pytest.mark.parametrize("dp", [2, 4])
def test_contrastive_loss_runs_data_parallel(dp):
    torch.manual_seed(0)
    model = Contrastive()
    kwargs = {"image": torch.randn(8, 12), "text": torch.randn(8, 10)}
    plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"dp": dp}), dims={"image": "batch -", "text": "batch -"},
                               layout={"batch": "dp"}, train=True, strict=True)
    fwd = [c for c in plan.collectives if c.phase == "forward"]
    # the text embeddings gathered once (backward: reduce-scatter), the transposed logits' rows
    # exchanged once; the rest are the two losses' sums and counts
    assert sorted(c.op for c in fwd if c.kind != "all_reduce") == ["all_gather_varying", "all_to_all"], \
        [(c.kind, c.op, c.why) for c in fwd]
    assert [c.kind for c in plan.collectives if c.phase == "backward" and c.op == "all_gather_varying"] == \
        ["reduce_scatter"]
    check_exact(plan, model, kwargs)


transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
              patch_size=4, num_channels=3)


def hf_model(name):
    torch.manual_seed(0)
    if name == "clip":
        cfg = transformers.CLIPConfig(text_config=dict(TEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                                      vision_config=VISION, projection_dim=16)
        model = transformers.CLIPModel(cfg)
    else:
        model = transformers.SiglipModel(transformers.SiglipConfig(text_config=TEXT, vision_config=VISION))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (8, 6), generator=g)
    ids[:, -1] = 2  # CLIP pools the text at its end-of-sequence token
    return model.eval(), {"input_ids": ids, "pixel_values": torch.randn(8, 3, 16, 16, generator=g),
                          "return_loss": True}


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_hugging_face_image_text_models_run_data_parallel(name, dp):
    model, kwargs = hf_model(name)
    plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"dp": dp}),
                               dims={"input_ids": "batch seq", "pixel_values": "batch rgb height width"},
                               layout={"batch": "dp"}, train=True, strict=True)
    assert plan.unsharded == [] and plan.program.fallbacks == []  # every op has a rule; the gathers are the plan's
    assert any(c.op == "all_gather_varying" and c.phase == "forward" for c in plan.collectives)
    check_exact(plan, model, kwargs, loss=lambda out: out.loss)
