"""Context parallelism: seed numbers, the ring-attention kernel against PyTorch's SDPA.

Seed 000 ("Sequence and context parallelism") and seed 003 §13.5.4 give the numbers; every
expected value below is the seed's or comes from eager ``F.scaled_dot_product_attention``.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from autoshard import Mesh
from autoshard.cost import DeviceSpec, LinkSpec, causal_pairs_per_rank, context_parallel_estimate, online_softmax_merge
from autoshard.runtime import run_simulated
from autoshard.runtime.primitives.ring_attention import (allgather_attention, order_index, ring_attention, zigzag_permute)

GiB = 2 ** 30


# --- seed 000: the online-softmax worked example ------------------------------------------

def test_online_softmax_worked_example_either_order():
    # Block A: one key scoring ln 3 with value 6; block B: one key scoring 0 with value 6.
    A = (math.log(3), 1.0, 6.0)
    B = (0.0, 1.0, 6.0)
    for states in ([A, B], [B, A]):
        s = online_softmax_merge(states)
        assert float(s.m) == pytest.approx(math.log(3))           # "the shared maximum is ln(3)"
        assert float(s.l) == pytest.approx(4 / 3)                 # "accumulated denominator is 4/3"
        assert float(s.u) == pytest.approx(8.0)                   # "the numerator is 8"
        assert float(s.output()) == pytest.approx(6.0)            # "the output remains 6"
    # "Block B contributes weight e^(0 - ln 3) = 1/3": B's share of the merged denominator
    s = online_softmax_merge([A, B])
    assert float(s.l) - 1.0 == pytest.approx(1 / 3)
    # the same as a softmax over both keys at once
    w = torch.softmax(torch.tensor([math.log(3), 0.0], dtype=torch.float64), 0)
    assert float(s.output()) == pytest.approx(float(w @ torch.tensor([6.0, 6.0], dtype=torch.float64)))


def test_online_softmax_guarded_empty_blocks():
    # Fully masked blocks are (-inf, 0, 0): merging them never evaluates exp(-inf - -inf).
    empty = (float("-inf"), 0.0, 0.0)
    s = online_softmax_merge([empty, empty])
    assert float(s.l) == 0 and float(s.output()) == 0.0 and not torch.isnan(s.output()).any()
    assert float(s.lse()) == float("-inf")
    s = online_softmax_merge([empty, (math.log(3), 1.0, 6.0), empty])
    assert float(s.output()) == pytest.approx(6.0) and float(s.l) == pytest.approx(1.0)


# --- seed 000: zigzag balance ---------------------------------------------------------------

def _pairs_brute_force(S, R, chunks_of):
    # query position q (1-based) sees keys 1..q: q valid pairs
    c = S // (len(chunks_of(0)) * R)
    return [sum(p for ch in chunks_of(r) for p in range(ch * c + 1, (ch + 1) * c + 1)) for r in range(R)]


def test_zigzag_pairs_16_positions_8_ranks():
    zig = causal_pairs_per_rank(16, 8, order="zigzag")
    con = causal_pairs_per_rank(16, 8, order="contiguous")
    assert zig == [17] * 8                                     # "Zigzag ownership gives every rank 17"
    assert min(con) == 3 and max(con) == 31                    # "ranges from 3 to 31 valid pairs per rank"
    assert sum(zig) == sum(con) == 136                         # "the same 136 valid pairs"
    assert zig == _pairs_brute_force(16, 8, lambda r: (r, 15 - r))   # rank i holds chunks i and 2R-1-i
    assert con == _pairs_brute_force(16, 8, lambda r: (r,))


# --- seed 003 §13.5.4: 128k tokens on eight GPUs ------------------------------------------------

def test_128k_example_through_the_cost_model():
    e = context_parallel_estimate(131072, 8, layers=32, heads=32, kv_heads=8, head_dim=128, dtype_bytes=2,
                                  link=LinkSpec(400e9))
    assert e.kv_bytes == 16 * GiB                              # "requires 16 GiB"
    assert e.kv_bytes_per_rank == 2 * GiB                      # "gives 2 GiB per GPU"
    assert e.block_bytes == 2 * 16384 * 8 * 128 * 2            # "2 x 16,384 x 8 x 128 x 2"
    assert round(e.block_bytes / 1e6) == 67                    # "~67 MB"
    assert round(e.block_send_s * 1e3, 2) == 0.17              # "about 0.17 ms at the assumed 400 GB/s"
    assert e.block_pair_flops == 4 * 16384 ** 2 * 32 * 128     # "4 x 16,384^2 x 32 x 128"
    assert round(e.block_pair_flops / 1e12, 1) == 4.4          # "~4.4 x 10^12 FLOPs"
    assert round(e.block_compute_s * 1e3, 1) == 4.4            # "about 4.4 ms at 989 TFLOP/s" (h100 preset)
    # "leaves room to hide the next transfer behind computation": the ring wins here
    assert e.block_compute_s > 10 * e.block_send_s and e.variant == "ring"
    # zigzag halves the busiest rank's causal work; contiguous leaves the last rank ~(2R-1)/(2R)
    c = context_parallel_estimate(131072, 8, layers=32, heads=32, kv_heads=8, head_dim=128, order="contiguous")
    assert e.busiest_fraction == pytest.approx(0.5, abs=1e-4)
    assert c.busiest_fraction == pytest.approx(15 / 16, abs=1e-4)
    # a short sequence: blocks too small to hide a hop, and with a 5 us launch per block, R
    # launches lose to one all-gather; at 128k the same device still prefers the ring
    dev = DeviceSpec("h100-launch", {"bf16": 989e12}, mem_bandwidth=3.35e12, mem_capacity=80e9, op_overhead=5e-6)
    short = context_parallel_estimate(1024, 8, layers=1, heads=32, kv_heads=8, head_dim=128, device=dev)
    assert short.block_compute_s < short.block_send_s and short.variant == "allgather"
    assert context_parallel_estimate(131072, 8, layers=32, heads=32, kv_heads=8, head_dim=128,
                                     device=dev).variant == "ring"


# --- the kernel: ring and all-gather attention on simulated ranks vs SDPA -----------------------

def _check(R, order, causal, mask_kind, gqa, fn, S=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(R * 100 + len(order) + causal * 7 + gqa)
    B, H, D = 2, 4, 8
    G = 2 if gqa else H
    q = torch.randn(B, H, S, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, G, S, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, G, S, D, generator=g, dtype=dtype, requires_grad=True)
    mask = None
    if mask_kind == "pad":
        keep = torch.ones(B, S, dtype=torch.bool)
        keep[0, :5] = False   # left padding: rows 0..4 of sequence 0 see no valid key at all
        mask = torch.tril(torch.ones(S, S, dtype=torch.bool))[None, None] & keep[:, None, None, :]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                         attn_mask=mask, is_causal=causal and mask is None)
    dout = torch.randn(ref.shape, generator=g, dtype=dtype)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    idx = order_index(S, R, order).view(R, -1)

    def rank(r):
        mine = [x.detach()[:, :, idx[r]].clone().requires_grad_() for x in (q, k, v)]
        out = fn(*mine, None if mask is None else mask[:, :, idx[r]], "cp", causal and mask is None, order)
        return out.detach(), torch.autograd.grad(out, mine, dout[:, :, idx[r]])

    out, grads = torch.zeros_like(ref), [torch.zeros_like(x) for x in (q, k, v)]
    for r, (o, gr) in enumerate(run_simulated(Mesh({"cp": R}), rank)):
        out[:, :, idx[r]] = o
        for full, part in zip(grads, gr):
            full[:, :, idx[r]] = part
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return out, ref


@pytest.mark.parametrize("R,order,causal,mask_kind,gqa", [
    (2, "zigzag", True, None, False), (2, "contiguous", True, None, True), (4, "zigzag", True, None, True),
    (4, "contiguous", False, None, False), (2, "zigzag", False, "pad", True), (4, "contiguous", False, "pad", False),
])
@pytest.mark.parametrize("fn", [ring_attention, allgather_attention])
def test_kernel_matches_sdpa(R, order, causal, mask_kind, gqa, fn):
    _check(R, order, causal, mask_kind, gqa, fn)


def test_kernel_fp32_and_row_without_keys_is_zero():
    out, ref = _check(4, "zigzag", False, "pad", True, ring_attention, dtype=torch.float32)
    # the padded rows of sequence 0 see no key: documented output zeros (PyTorch's SDPA agrees)
    assert torch.equal(out[0, :, :5], torch.zeros_like(out[0, :, :5]))


def test_ring_skips_fully_masked_blocks():
    # causal contiguous on 4 ranks: rank 0 sees only its own block; the 3 arriving blocks are
    # all in its future and skipped (the trace still shows the 3 hops of the ring)
    S, R = 16, 4
    q, k, v = (torch.randn(1, 2, S, 4) for _ in range(3))
    from autoshard.runtime.primitives import ring_attention as ra
    calls = []
    orig = ra._Blocks.scores

    def counting(self, *a):
        calls.append(1)
        return orig(self, *a)

    def rank(r):
        sl = slice(r * 4, r * 4 + 4)
        return ring_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, "cp", True, "contiguous")

    ra._Blocks.scores = counting
    try:
        run_simulated(Mesh({"cp": R}), rank)
    finally:
        ra._Blocks.scores = orig
    assert len(calls) == 1 + 2 + 3 + 4    # rank r computes its r+1 visible blocks; 6 of 16 skipped


def test_zigzag_permute_chunks():
    # rank i holds chunks i and 2R-1-i: contiguous blocks of the permuted sequence
    x = torch.arange(16)
    blocks = zigzag_permute(x, 0, 4).view(4, -1)
    for i in range(4):
        assert blocks[i].tolist() == list(range(2 * i, 2 * i + 2)) + list(range(2 * (7 - i), 2 * (7 - i) + 2))


# --- plans: layout={"seq": "cp"} on the Llama-style example ------------------------------------

import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.nn as nn  # noqa: E402

import autoshard  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from exactness import assert_exact, assert_trains_like_single_device  # noqa: E402
from examples.models import llama_tiny  # noqa: E402

LLAMA_TP = {"heads": "tp", "kv_heads": "tp", "ffn": "tp"}


def _plan(model, args, dims, mesh, layout, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        return autoshard.autoshard(model, args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout, train=True, **kw)


@pytest.mark.parametrize("mesh,layout,mask,order", [
    ({"cp": 2}, {}, False, "zigzag"),
    ({"cp": 2}, {}, True, "contiguous"),
    ({"cp": 4}, {}, True, "zigzag"),
    ({"cp": 4}, {}, False, "contiguous"),
    ({"cp": 2, "tp": 2}, LLAMA_TP, True, "zigzag"),
    ({"cp": 2, "tp": 2}, LLAMA_TP, False, "contiguous"),
    ({"dp": 2, "cp": 2}, {"batch": "dp"}, False, "zigzag"),
    ({"dp": 2, "cp": 2}, {"batch": "dp"}, True, "contiguous"),
])
def test_llama_context_parallel_exact(mesh, layout, mask, order):
    model, args, dims = llama_tiny(with_mask=mask, with_labels=True, seq=16)
    plan = _plan(model, args, dims, mesh, {"seq": "cp", **layout}, context={"order": order, "variant": "ring"})
    atts = plan.program.context.attention
    assert len(atts) == 2 and all(a.axis == "cp" and a.order == order and a.variant == "ring" for a in atts)
    targets = [n.target for n in plan.graph_module.graph.nodes if n.op == "call_function"]
    assert ring_attention in targets and torch.ops.aten.scaled_dot_product_attention.default not in targets
    # GQA: the 2 kv heads travel (1 per tp rank), never the 8 repeated heads
    for n in plan.graph_module.graph.nodes:
        if n.target is ring_attention:
            q_heads, kv_heads = n.args[0].meta["val"].shape[1], n.args[1].meta["val"].shape[1]
            assert kv_heads * 4 == q_heads, (q_heads, kv_heads)
    assert_exact(plan, model, args)
    # ring hops are on the trace: R-1 per attention in forward
    R = mesh["cp"]
    fwd = [r for r in plan.last_trace[0] if r.op == "ring_attention" and r.phase == "forward"]
    bwd = [r for r in plan.last_trace[0] if r.op == "ring_attention" and r.phase == "backward"]
    assert len(fwd) == 2 * (R - 1) and len(bwd) == 2 * ((R - 1) + R)


def test_allgather_variant_exact_and_zero_training():
    model, args, dims = llama_tiny(with_mask=True, with_labels=True, seq=16)
    plan = _plan(model, args, dims, {"dp": 2, "cp": 2}, {"seq": "cp", "batch": "dp"}, zero_stage=3,
                 context={"variant": "allgather"})
    assert {a.variant for a in plan.program.context.attention} == {"allgather"}
    assert_trains_like_single_device(plan, model, [args] * 2)  # SGD with momentum


@pytest.mark.parametrize("variant", ["allgather", "ring"])
def test_gradient_accumulation_sends_kv_gradients_in_each_microbatch(variant):
    """Two microbatches a step: the all-gather variant's K/V gradient reduce-scatter carries an
    activation's gradient, which the rest of that microbatch's backward reads. Gradient
    accumulation once held it for the last microbatch like a parameter's sum (the first
    microbatch's K/V got no gradient, the last one both): losses off from the second step."""
    model, args, dims = llama_tiny(with_labels=True, seq=16)
    halves = [tuple(None if a is None else a[i::2].contiguous() for a in args) for i in range(2)]
    plan = _plan(model, halves[0], dims, {"cp": 2}, {"seq": "cp"}, context={"variant": variant})
    assert {a.variant for a in plan.program.context.attention} == {variant}
    steps = [halves, halves[::-1], halves]
    assert_trains_like_single_device(plan, model, steps, microbatches=2)


class StyledTokens(nn.Module):
    """Token embeddings plus a per-sequence style embedding: the style vector has no sequence
    dim, so it is whole on cp, computed from the batch, and read by the sequence-split work."""

    def __init__(self):
        super().__init__()
        self.emb, self.style, self.out = nn.Embedding(16, 8), nn.Embedding(4, 8), nn.Linear(8, 16)

    def forward(self, ids, style, labels):
        h = torch.tanh(self.emb(ids) + self.style(style)[:, None, :])
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())


def test_gradient_accumulation_sums_a_batch_value_in_each_microbatch():
    """The style vector's gradient is summed over cp where it is read (a mark_varying on a data
    axis of a value computed from the batch). Gradient accumulation once held that sum for the
    last microbatch, whose style ids then received the first one's gradient too."""
    torch.manual_seed(0)
    model = StyledTokens()
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        batch = (torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 4, (4,), generator=g),
                 torch.randint(0, 16, (4, 8), generator=g))
        steps.append([tuple(t[i::2].contiguous() for t in batch) for i in range(2)])
    dims = {"ids": "batch seq", "style": "batch", "labels": "batch seq"}
    plan = _plan(model, steps[0][0], dims, {"dp": 2, "cp": 2}, {"batch": "dp", "seq": "cp"})
    assert_trains_like_single_device(plan, model, steps, microbatches=2)
    # the style vector's sum on cp is sent in each microbatch; the parameters' sums still wait
    undeferred = [n.args[0].name for n in plan.graph_module.graph.nodes if n.kwargs.get("defer") is False]
    assert undeferred == ["unsqueeze_default"], undeferred


def test_ring_zero1_training_matches():
    model, args, dims = llama_tiny(with_labels=True, seq=16)
    plan = _plan(model, args, dims, {"dp": 2, "cp": 2}, {"seq": "cp", "batch": "dp"}, zero_stage=1,
                 context={"variant": "ring"})
    assert_trains_like_single_device(plan, model, [args] * 2)  # SGD with momentum


class PaddedAttention(nn.Module):
    """One attention layer with an HF-style padding mask that is *not* unmasked for padded
    queries: a left-padded row sees no valid key (PyTorch's SDPA returns zeros there)."""

    def __init__(self, hidden=16, heads=2, raw=False):
        super().__init__()
        self.heads, self.raw = heads, raw
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, attention_mask):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        idx = torch.arange(s, device=x.device)
        causal = idx[None, :] <= idx[:, None]
        mask = causal[None, None] & attention_mask.to(torch.bool)[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.raw:
            return y
        return self.out(y.transpose(1, 2).reshape(b, s, h)).pow(2).sum()


@pytest.mark.parametrize("R,order", [(2, "zigzag"), (4, "contiguous")])
def test_fully_masked_block_and_row_without_keys(R, order):
    torch.manual_seed(0)
    model = PaddedAttention()
    x = torch.randn(2, 16, 16)
    am = torch.ones(2, 16, dtype=torch.long)
    am[0, :4] = 0   # 4 padded positions: a whole KV chunk (zigzag chunk 0 of 4; contiguous block 0 of 4)
    args = (x, am)
    dims = {"x": "batch seq hidden", "attention_mask": "batch seq"}
    plan = _plan(model, args, dims, {"cp": R}, {"seq": "cp"}, context={"order": order, "variant": "ring"})
    assert_exact(plan, model, args)   # loss and every gradient
    # the attention output itself: padded rows (no valid key) are zeros, as documented
    model.raw = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        fwd = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"cp": R}), dims=dims, layout={"seq": "cp"},
                                  context={"order": order, "variant": "ring"})
    y, ref = fwd.simulate(*args), model(*args)
    assert not torch.isnan(y).any()
    assert torch.equal(y[0, :, :4], torch.zeros_like(y[0, :, :4]))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
