"""Activation recompute by policy (whole block, selective), in pipelined plans and in exports,
and the activation-memory model it is priced with.

The memory model (cost/saved.py) is checked three ways on a GPT-style layer: against the
closed form of Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models", 2022: 34 s b h + 5 a s^2 b bytes per layer in 16-bit with dropout), against what
autograd actually keeps (runtime.recompute.SavedBytes in an eager run), and on the tiny Llama
against the per-rank measurement of a plan."""
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autoshard
from autoshard import Mesh
from autoshard.cost.model import activations_by_module, program_events, resolve_cost_model
from autoshard.runtime.primitives.recompute import SavedBytes, keep, recompute, recompute_selective

from examples.models import llama_tiny
from tests.helpers.exactness import assert_training_within_spread
from tests.helpers.recompute import measure

LIN = torch.ops.aten.linear.default


def test_selective_keeps_matmul_outputs_and_recomputes_the_rest():
    """recompute_selective: the kept linears run once (forward), the pointwise op between them
    twice (forward and the rerun); values and gradients equal the plain function's bit for
    bit; between forward and backward autograd holds the inputs and the kept outputs only."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    w1, w2 = torch.randn(32, 8, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    calls = {"linear": 0, "tanh": 0}

    def counted_linear(*a):
        calls["linear"] += 1
        return LIN(*a)

    def fn(x, w1, w2):
        h = keep(counted_linear, x, w1)
        calls["tanh"] += 1
        return (keep(counted_linear, torch.tanh(h), w2),)

    (ref,) = fn(x, w1, w2)
    ref.sum().backward()
    grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    calls.update(linear=0, tanh=0)
    tracker = SavedBytes(exclude=[w1, w2])
    with tracker.hooks():
        (out,) = recompute_selective(fn, x, w1, w2)
    # x, and the two kept outputs (16 x 32 and 16 x 8 floats); tanh's output is not held
    assert tracker.live == (16 * 8 + 16 * 32 + 16 * 8) * 4
    out.sum().backward()
    assert calls == {"linear": 2, "tanh": 2}
    assert torch.equal(out, ref) and all(torch.equal(t.grad, g) for t, g in zip((x, w1, w2), grads))
    assert tracker.live == 0
    # whole-block recompute of the same function runs the linears again
    calls.update(linear=0, tanh=0)
    recompute(fn, x, w1, w2)[0].sum().backward()
    assert calls == {"linear": 4, "tanh": 2}


def test_selective_reruns_dropout_with_the_forward_mask():
    """A kept op between two random ones: the rerun skips it, and the second dropout still
    draws the forward's mask (the random state after each kept op is restored)."""
    torch.manual_seed(0)
    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)

    def fn(x, w):
        h = torch.nn.functional.dropout(x, 0.5)
        h = keep(torch.ops.aten.native_dropout.default, keep(LIN, h, w), 0.5, True)[0]
        return (torch.nn.functional.dropout(h, 0.5) * 3,)

    torch.manual_seed(1)
    (ref,) = fn(x, w)
    ref.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.manual_seed(1)
    (out,) = recompute_selective(fn, x, w)
    out.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, gx) and torch.equal(w.grad, gw)


DP3 = ({"dp": 2}, {"batch": "dp"}, 3)
TP0 = ({"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"}, 0)


@pytest.mark.parametrize("mesh,layout,stage", [DP3, TP0], ids=["dp2-zero3", "dp2xtp2"])
def test_selective_training_is_exact(mesh, layout, stage):
    """3 AdamW steps with checkpoint='selective': bit for bit those of the plan without
    recompute (the kept ops are not run again, the rest reruns the same kernels), and within
    single-device training's float32 spread."""
    model, args, dims = llama_tiny(with_labels=True)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)  # noqa: E731
    plans = {ck: autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout, train=True,
                                     zero_stage=stage, checkpoint=ck) for ck in ("selective", False)}
    assert plans["selective"].checkpoint == ["layers.0", "layers.1"]
    assert plans["selective"].checkpoint_policy == "selective"
    (losses, params), (plain_losses, plain_params) = (plans[k].simulate_train([args] * 3, optimizer=make_opt)
                                                      for k in ("selective", False))
    assert losses == plain_losses and all(torch.equal(params[k], plain_params[k]) for k in plain_params)
    assert_training_within_spread(losses, params, model, [args] * 3, make_opt)


def test_recompute_policy_is_checked():
    model, args, dims = llama_tiny(with_labels=True)
    with pytest.raises(ValueError, match="'selective'"):
        autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"}, train=True,
                            checkpoint="some")


@pytest.mark.parametrize("policy", ["selective", "block"])
def test_pipelined_recompute_is_exact(policy):
    """A pipelined plan (pp=2 x tp=2, 1F1B) recomputes the blocks of each stage program, and
    trains bit for bit as without recompute."""
    model, args, dims = llama_tiny(with_labels=True)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    runs = {}
    for ck in (policy, False):
        plan = autoshard.autoshard(model, args, mesh=Mesh({"pp": 2, "tp": 2}), dims=dims,
                                   layout={"heads": "tp", "ffn": "tp"}, train=True, checkpoint=ck,
                                   pipeline={"axis": "pp", "microbatches": 2})
        recomputed = [n for st in plan.pipe.stages for n, _ in st.forward.named_children()]
        assert len(recomputed) == (2 if ck else 0)  # one block per stage
        runs[ck] = plan.simulate_train([args] * 2, optimizer=make_opt)
    (losses, params), (plain_losses, plain_params) = runs[policy], runs[False]
    assert losses == plain_losses and all(torch.equal(params[k], plain_params[k]) for k in plain_params)


def test_recompute_refuses_split_backward_schedules():
    model, args, dims = llama_tiny(with_labels=True)
    with pytest.raises(ValueError, match="zero_bubble schedule"):
        autoshard.autoshard(model, args, mesh=Mesh({"pp": 2}), dims=dims, train=True, checkpoint=True,
                            pipeline={"axis": "pp", "microbatches": 2, "schedule": "zero_bubble"})


@pytest.mark.parametrize("policy", ["selective", "block"])
def test_export_carries_recompute(tmp_path, policy):
    """program.py writes each recomputed block as a function called through the runtime's
    recompute; plan.json names them; the export (simulated ranks, as run.py loads it) trains
    as the unsharded model."""
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True, zero_stage=3,
                               checkpoint=policy)
    out = tmp_path / "exp"
    plan.export(out, args)
    src = (out / "program.py").read_text()
    call = "recompute_selective" if policy == "selective" else "recompute"
    assert f"= {call}(recompute_layers_0, " in src and f"= {call}(recompute_layers_1, " in src
    assert ("keep(aten.linear.default, " in src) == (policy == "selective")
    import json
    assert json.loads((out / "plan.json").read_text())["recompute"] == {"policy": policy,
                                                                       "blocks": ["layers.0", "layers.1"]}
    from autoshard.passes.export import simulate_export
    res = simulate_export(out, steps=2, check=True)
    assert all(r["ok"] for r in res), [r["problems"] for r in res]


# ---------------------------------------------------------------------------- the memory model

class GPTLayer(nn.Module):
    """The transformer layer of Korthikanti et al.: LayerNorm, attention with an explicit
    softmax and dropout on it, 4h GeLU MLP, dropout after attention and MLP."""

    def __init__(self, h, a, p=0.1, fused=False):
        super().__init__()
        self.a, self.p, self.fused = a, p, fused
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.a, h // self.a).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1))
        if self.fused:
            o = nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            att = (q @ k.transpose(-2, -1)) * (h // self.a) ** -0.5
            o = nn.functional.dropout(att.softmax(-1), self.p, self.training) @ v
        x = x + nn.functional.dropout(self.proj(o.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + nn.functional.dropout(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))), self.p,
                                         self.training)


class GPT(nn.Module):
    def __init__(self, h, a, n=2, fused=False):
        super().__init__()
        self.layers = nn.ModuleList(GPTLayer(h, a, fused=fused) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().square().mean()


S, B, H, A = 32, 2, 64, 4


def _layer_bytes(fused=False):
    """Predicted saved bytes of layers.1 (per the op-by-op model) and measured by autograd in
    an eager bf16 run (the difference of two runs: with the layer and without it)."""
    torch.manual_seed(0)
    model = GPT(H, A, fused=fused).to(torch.bfloat16)
    x = torch.randn(B, S, H, dtype=torch.bfloat16)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 1}), dims={"x": ("batch", "seq", "hidden")},
                               layout={}, train=True)
    params = {i.name for i in plan.captured.inputs if i.kind == "parameter" and i.trainable}
    segs = program_events(plan.program, plan.mesh, resolve_cost_model("h100"), params)
    predicted = sum(n for m, n in activations_by_module(segs).items() if m.startswith("layers.1"))

    def measured(layers):
        t = SavedBytes(exclude=model.parameters())
        with t.hooks():
            h = x
            for layer in layers:
                h = layer(h)
        return t.live, h
    with torch.random.fork_rng():
        one, _ = measured(model.layers[:1])
        two, _ = measured(model.layers[:2])
    return predicted, two - one


# LayerNorm's per-row mean and rstd, which the paper leaves out: float32 as a GPU keeps them
# (predicted), the input's dtype as the CPU kernel does (measured); two LayerNorms a layer
STATS_FP32, STATS_CPU = 2 * 2 * 4 * S * B, 2 * 2 * 2 * S * B
# the CPU's dropout keeps its scaled mask at the activation's width (2 bytes), not as a byte
# mask as the paper's (and a GPU's fused) dropout does: attention's and the two hidden ones
CPU_MASKS = A * S * S * B + 2 * S * B * H


def test_activation_model_is_korthikanti_per_layer():
    """Per layer, 16-bit, dropout on: 34 s b h + 5 a s^2 b bytes (Korthikanti et al., eq. 1)
    predicted by the op-by-op model exactly (plus LayerNorm statistics), and kept by autograd
    on the CPU exactly but for the CPU's wider dropout masks."""
    predicted, measured = _layer_bytes()
    formula = 34 * S * B * H + 5 * A * S * S * B
    assert predicted == formula + STATS_FP32
    assert measured == formula + CPU_MASKS + STATS_CPU


def test_fused_attention_keeps_no_s_squared_term():
    """With scaled_dot_product_attention (flash attention on CPU) no s x s matrix is kept: the
    5 a s^2 b term is gone without recompute (attention dropout 0: no mask either), as
    selective recompute removes it in the paper; attention keeps its log-sum-exp instead."""
    predicted, measured = _layer_bytes(fused=True)
    # q, k, v and the output are the paper's 34 s b h terms already (the output is the
    # projection's input); the log-sum-exp is float32, one per query row and head
    formula = 34 * S * B * H + 4 * A * S * B
    assert predicted == formula + STATS_FP32
    assert measured == formula + 2 * S * B * H + STATS_CPU  # the two hidden masks, 2 bytes wide


@pytest.mark.parametrize("policy", [False, "block", "selective"])
def test_predicted_activations_match_measured(policy):
    """Tiny Llama on dp=2 (batch 8 x seq 32): the plan's predicted activations per rank are
    within 15% of the peak bytes autograd holds on each rank (runtime.recompute.SavedBytes),
    without recompute and with either policy."""
    model, args, dims = llama_tiny(with_labels=True, batch=8, seq=32)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"}, train=True,
                               checkpoint=policy)
    predicted = plan.cost["memory"]["activations"]
    for _, acts, _ in measure(plan, args):
        assert abs(acts - predicted) <= 0.15 * acts, (acts, predicted)
