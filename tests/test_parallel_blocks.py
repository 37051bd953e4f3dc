"""Parallel attention + MLP blocks (GPT-J, GPT-NeoX with ``use_parallel_residual``, Falcon,
Phi): both branches read one input and their outputs are added to the residual, in any order
(``x + attn + mlp``, ``attn + mlp + x``, ``x + (attn + mlp)``). With heads and ffn on tp both
branches are pending sums, so a block needs one forward tp all-reduce, not one per branch: a
whole residual added to a pending sum that is itself added to the other is kept on rank 0
(``to_partial``) instead of summing the first branch early. Exactness: outputs and every
gradient against the single-device model (``test_property.close``: fp32 bounds, and where they
fail the fp64 reference decides, at most 10x the single-device fp32 error).
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

LAYERS = 2
DIMS = {"x": "batch seq hidden", "*.q.weight": "heads hidden", "*.q.bias": "heads", "*.o.weight": "hidden heads",
        "*.up.weight": "ffn hidden", "*.up.bias": "ffn", "*.down.weight": "hidden ffn"}
LAYOUT = {"heads": "tp", "ffn": "tp"}


class ParallelBlock(nn.Module):
    """One norm feeding self-attention and an MLP, summed with the residual in ``order``."""

    def __init__(self, order: str, hidden=16, ffn=32, heads=4):
        super().__init__()
        self.order, self.heads = order, heads
        self.ln = nn.LayerNorm(hidden)
        self.q, self.o = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        y = self.ln(x)
        b, t, h = y.shape
        q = self.q(y).view(b, t, self.heads, h // self.heads).transpose(1, 2)
        attn = self.o(F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, t, h))
        mlp = self.down(F.gelu(self.up(y)))
        if self.order == "residual + attn + mlp":
            return x + attn + mlp
        if self.order == "attn + mlp + residual":
            return attn + mlp + x
        if self.order == "residual + (attn + mlp)":
            return x + (attn + mlp)
        return mlp + x + attn  # "mlp + residual + attn"


class Stack(nn.Module):
    def __init__(self, order):
        super().__init__()
        self.layers = nn.Sequential(*[ParallelBlock(order) for _ in range(LAYERS)])

    def forward(self, x):
        return self.layers(x).square().mean()


def forward_tp_reduces(plan) -> int:
    return sum(1 for c in plan.collectives if c.phase == "forward" and c.kind == "all_reduce" and c.axes == ("tp",))


def check_exact(plan, model, args=(), kwargs=None, loss=lambda out: out):
    """Output (its loss) and every gradient of ``plan.simulate_grads`` against the model."""
    kwargs = kwargs or {}

    def ref(m, a, kw):
        m.zero_grad()
        out = loss(m(*a, **kw))
        out.backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    out32, grads32 = ref(model, args, kwargs)
    f64 = []

    def exact(grad=None):
        def get():
            if not f64:
                as64 = lambda v: v.double() if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
                f64.append(ref(copy.deepcopy(model).double(), tuple(map(as64, args)),
                               {k: as64(v) for k, v in kwargs.items()}))
            return f64[0][0] if grad is None else f64[0][1][grad]
        return get

    out, grads = plan.simulate_grads(*args, **kwargs)
    close(loss(out), out32, "loss", exact())
    for n, g in grads32.items():
        close(grads[n], g, f"gradient of {n}", exact(n))


@pytest.mark.parametrize("order", ["residual + attn + mlp", "attn + mlp + residual", "residual + (attn + mlp)",
                                   "mlp + residual + attn"])
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_parallel_block_one_all_reduce_per_layer(order, mesh):
    torch.manual_seed(0)
    model, x = Stack(order), torch.randn(4, 6, 16)
    layout = dict(LAYOUT, **({"batch": "dp"} if "dp" in mesh else {}))
    plan = autoshard.autoshard(model, (x,), mesh=Mesh(mesh), dims=DIMS, layout=layout, strict=True)
    assert forward_tp_reduces(plan) == LAYERS, [(c.where, c.why) for c in plan.collectives if c.phase == "forward"]
    check_exact(plan, model, (x,))


def test_sequential_block_keeps_two_all_reduces():
    """A sequential block (``h = x + attn(ln(x)); h + mlp(ln(h))``) needs each branch whole before
    the next norm: two all-reduces per layer, as before (the rule changes nothing there)."""

    class Sequential(ParallelBlock):
        def forward(self, x):
            b, t, h = x.shape
            q = self.q(self.ln(x)).view(b, t, self.heads, h // self.heads).transpose(1, 2)
            x = x + self.o(F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, t, h))
            return x + self.down(F.gelu(self.up(self.ln(x))))

    model = Stack("")
    model.layers = nn.Sequential(*[Sequential("") for _ in range(LAYERS)])
    x = torch.randn(4, 6, 16)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"tp": 2}), dims=DIMS, layout=LAYOUT, strict=True)
    assert forward_tp_reduces(plan) == 2 * LAYERS
    check_exact(plan, model, (x,))


transformers = pytest.importorskip("transformers")

HF = {
    # GPT-J: hidden = attn_output + feed_forward_hidden_states + residual
    "gptj": (dict(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, rotary_dim=4, use_cache=False,
                  bos_token_id=1, eos_token_id=2),
             {"*.q_proj.weight": "heads hidden", "*.k_proj.weight": "heads hidden", "*.v_proj.weight": "heads hidden",
              "*.out_proj.weight": "hidden heads", "*.fc_in.weight": "ffn hidden", "*.fc_in.bias": "ffn",
              "*.fc_out.weight": "hidden ffn"}),
    # GPT-NeoX with use_parallel_residual: hidden = mlp_output + attn_output + residual
    "gpt_neox": (dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, max_position_embeddings=64, use_cache=False, use_parallel_residual=True),
                 {"*.query_key_value.weight": "heads3 hidden", "*.attention.dense.weight": "hidden heads",
                  "*.dense_h_to_4h.weight": "ffn hidden", "*.dense_h_to_4h.bias": "ffn",
                  "*.dense_4h_to_h.weight": "hidden ffn"}),
}


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_parallel_residual_one_all_reduce_per_layer(name):
    config, dims = HF[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(name, **config)).eval()
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    with warnings.catch_warnings():
        # GPT-J's rotate_every_two stacks the rotated halves (aten.stack, a rule of its own): it
        # gathers there, which adds all-gathers but no all-reduce
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"dp": 2, "tp": 2}),
                                   dims={"input_ids": "batch seq", "labels": "batch seq", **dims},
                                   layout={"batch": "dp", **LAYOUT})
    assert forward_tp_reduces(plan) == LAYERS
    check_exact(plan, model, kwargs=kwargs, loss=lambda out: out.loss)
