"""Acceptance tests for autoshard.cost: published formulas and their worked examples, through
the public calculators.

Expected values are typed by hand from the published formula or worked example named next to
each test (ZeRO, Rajbhandari et al., 2020; GPipe, Huang et al., 2019; Megatron-LM interleaving,
Narayanan et al., 2021; activation memory, Korthikanti et al., 2022; ring attention, Liu et al.,
2023; ring collectives, Patarasuk & Yuan, 2009), with the arithmetic written out in the
comment, never copied from the code under test. GB = 1e9 bytes, GiB = 2**30. Where a figure is
stated rounded, the test checks that rounding (one decimal, or "about").
"""
import math

import pytest
import sympy as sp

from autoshard.cost import (
    DeviceSpec,
    LinkSpec,
    activation_bytes,
    attention_flops,
    bubble_fraction,
    bubble_overhead,
    collective_bytes,
    collective_formula,
    collective_time,
    kv_cache_bytes,
    load_hardware,
    model_state_bytes,
    roofline_time,
)

GB = 1e9
GiB = 2**30


def one_decimal(x: float) -> float:
    # Figures in GB are stated to one decimal, halves rounded up (1.875 -> 1.9).
    return math.floor(x * 10 + 0.5) / 10


# --- ZeRO model state (Rajbhandari et al., 2020, Figure 1): 7.5B parameters on N_d = 64 -------

@pytest.mark.parametrize(
    "stage, expected_gb, bytes_per_param",
    [
        (0, 120, 16),                 # plain DP: 16 bytes/param
        (1, 31.4, 4 + 12 / 64),       # 4 + 12/64 ~ 4.19
        (2, 16.6, 2 + 14 / 64),       # 2 + 14/64 ~ 2.22
        (3, 1.9, 16 / 64),            # 16/64 = 0.25
    ],
)
def test_zero_table_7_5b_on_64(stage, expected_gb, bytes_per_param):
    s = model_state_bytes(7.5e9, dp=64, zero_stage=stage)
    assert one_decimal(s.total / GB) == expected_gb
    assert s.total == pytest.approx(7.5e9 * bytes_per_param)


def test_zero_table_printed_bytes_per_param():
    per_param = [model_state_bytes(7.5e9, dp=64, zero_stage=z).total / 7.5e9 for z in (1, 2, 3)]
    assert [round(x, 2) for x in per_param] == [4.19, 2.22, 0.25]


def test_zero_optimizer_is_12_of_16_bytes():
    # Mixed-precision Adam: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master, two moments)
    # bytes per parameter, so most of ZeRO's saving comes from the 12 optimizer bytes.
    s = model_state_bytes(1, dp=1, zero_stage=0)
    assert (s.params, s.grads, s.optimizer, s.total) == (2, 2, 12, 16)


# --- A 70B model on 64 GPUs (TP 8 x PP 2 x DP 4, ZeRO-1), ZeRO's 16 bytes per parameter -------

MESH_70B = {"dp": 4, "pp": 2, "tp": 8}   # 8 x 2 x 4 = 64, tp innermost (inside a server)


def test_70b_total_model_state_is_1120_gb():
    # 16 x 70 x 10^9 = 1,120 GB
    assert model_state_bytes(70e9, dp=1, zero_stage=0).total == pytest.approx(1120 * GB)


def test_70b_memory_per_gpu():
    s = model_state_bytes(70e9, dp=4, zero_stage=1, tp=8, pp=2)
    # each GPU holds 70e9/(8x2) = 4.375e9 parameters
    assert s.params / 2 == pytest.approx(4.375e9)
    # weights and gradients take (2 + 2) x 4.375e9 = 17.5 GB
    assert (s.params + s.grads) / GB == pytest.approx(17.5)
    # the optimizer state sharded over dp = 4 takes 12 x 4.375e9 / 4 ~ 13.1 GB
    assert one_decimal(s.optimizer / GB) == 13.1
    assert s.optimizer == pytest.approx(12 * 4.375e9 / 4)
    # 17.5 + 13.125 = 30.6 GB in total
    assert one_decimal(s.total / GB) == 30.6
    # an 80 GB GPU leaves about 80 - 30.6 ~ 49 GB
    headroom = load_hardware("h100").device.mem_capacity - s.total
    assert round(headroom / GB) == 49


def test_70b_gradient_all_reduce_traffic():
    s = model_state_bytes(70e9, dp=4, zero_stage=1, tp=8, pp=2)
    # each GPU's tensor/pipeline partition has 4.375e9 x 2 = 8.75 GB of bf16 gradients
    assert s.grads / GB == pytest.approx(8.75)
    # one ring all-reduce over the 4 data-parallel replicas sends 2 (R-1)/R V =
    # 2 x (3/4) x 8.75 ~ 13.1 GB per GPU across servers
    traffic = collective_bytes("all_reduce", s.grads, MESH_70B["dp"])
    assert one_decimal(traffic / GB) == 13.1
    assert traffic == pytest.approx(2 * (3 / 4) * 8.75 * GB)
    # tp = 8 fills one 8-GPU server, so dp and pp leave the node and tp stays on NVLink
    hw = load_hardware("h100")
    assert hw.link_for_axis(MESH_70B, "dp").name == "infiniband"
    assert hw.link_for_axis(MESH_70B, "pp").name == "infiniband"
    assert hw.link_for_axis(MESH_70B, "tp").name == "nvlink"


def test_70b_pipeline_bubble():
    # GPipe bubble (p-1)/(m+p-1) (Huang et al., 2019): (2-1)/(16+2-1) ~ 5.9 percent
    b = bubble_fraction(MESH_70B["pp"], 16)
    assert b == pytest.approx(1 / 17)
    assert one_decimal(100 * b) == 5.9


def test_70b_fully_sharded_alternative():
    # tensor degree 8 with full sharding (ZeRO-3) across 8 data-parallel replicas:
    # 16 x 70e9 / (8 x 8) = 17.5 GB of model state per GPU
    s = model_state_bytes(70e9, dp=8, zero_stage=3, tp=8)
    assert s.total / GB == pytest.approx(17.5)


# --- GPipe bubble (p-1)/(m+p-1) (Huang et al., 2019) and a fill-drain schedule -----------------

def test_gpipe_bubbles():
    # K = 4 stages, M = 8 micro-batches: (4-1)/(8+4-1) = 3/11; M = 32: 3/35
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 32) == pytest.approx(3 / 35)
    # about 27.3 percent and about 8.6 percent
    assert round(100 * bubble_fraction(4, 8), 1) == 27.3
    assert round(100 * bubble_fraction(4, 32), 1) == 8.6


def test_fill_drain_diagram():
    # Two stages, three microbatches (m0..m2), time slots 1..8; each stage is busy in 6 of the
    # 8 slots (3 F + 3 B of equal length), so 2 of 8 slots are idle.
    assert bubble_fraction(2, 3) == pytest.approx(2 / 8)


def test_interleaving_divides_the_bubble_by_v():
    # Megatron-LM's interleaved schedule (Narayanan et al., 2021): v virtual chunks per
    # physical stage divide the bubble by v: overhead (p-1)/(v*m) relative to useful work
    # (exactly 1/v of the non-interleaved one); the elapsed fraction is o / (1 + o).
    for p, m, v in [(4, 8, 2), (8, 32, 4), (2, 16, 3)]:
        assert bubble_overhead(p, m, v) == pytest.approx(bubble_overhead(p, m) / v)
        o = bubble_overhead(p, m, v)
        assert bubble_fraction(p, m, v) == pytest.approx(o / (1 + o))
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)


# --- Full-shard traffic: ZeRO-3 moves about 1.5x plain DP's bytes (Rajbhandari et al., 2020) --

@pytest.mark.parametrize("ranks", [2, 4, 8, 64, 1000])
def test_full_shard_traffic_is_1_5x_dp(ranks):
    V = 8.75e9
    full_shard = (collective_bytes("all_gather", V, ranks)        # forward parameter gather
                  + collective_bytes("all_gather", V, ranks)      # backward re-gather
                  + collective_bytes("reduce_scatter", V, ranks)) # gradient reduce-scatter
    dp = collective_bytes("all_reduce", V, ranks)
    assert full_shard / dp == pytest.approx(1.5)
    # A ring all-reduce is a reduce-scatter then an all-gather, so their volumes add up to it
    assert (collective_bytes("all_gather", V, ranks) + collective_bytes("reduce_scatter", V, ranks)
            == pytest.approx(dp))


def test_full_shard_ratio_symbolically():
    ratio = (2 * collective_formula("all_gather") + collective_formula("reduce_scatter")) / collective_formula("all_reduce")
    assert sp.simplify(ratio - sp.Rational(3, 2)) == 0


# --- Ring attention (Liu et al., 2023): a 128k-token sequence on eight GPUs ---------------------

LLAMA8B = dict(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)   # BF16, 8 KV heads, d_h 128


def test_context_parallel_kv_memory():
    # K and V of 131,072 tokens over 32 layers: 2 x 131072 x 8 x 128 x 2 B x 32 = 16 GiB
    assert kv_cache_bytes(131072, **LLAMA8B) == 16 * GiB
    # split evenly: 2 GiB per GPU (8 GPUs, 16,384 tokens each)
    assert kv_cache_bytes(131072 // 8, **LLAMA8B) == 2 * GiB


def test_context_parallel_block_transfer_and_compute():
    # one KV block is 2 x 16,384 x 8 x 128 x 2 B ~ 67 MB (one layer)
    block = kv_cache_bytes(16384, **{**LLAMA8B, "layers": 1})
    assert block == 2 * 16384 * 8 * 128 * 2
    assert round(block / 1e6) == 67
    # 67 MB / 400 GB/s ~ 0.17 ms: ring attention sends each block to the next rank
    t_send = collective_time("send", block, 8, LinkSpec(400e9))
    assert round(t_send * 1e3, 2) == 0.17
    # QK^T and PV, 2 FLOPs per multiply-add: 4 x 16,384^2 x 32 x 128 ~ 4.4 x 10^12 FLOPs
    flops = attention_flops(16384, 16384, heads=32, head_dim=128)
    assert flops == 4 * 16384**2 * 32 * 128
    assert round(flops / 1e12, 1) == 4.4
    # 4.4e12 / 989 TFLOP/s (H100 SXM dense bf16) ~ 4.4 ms
    h100_sxm = DeviceSpec("h100-sxm", {"bf16": 989e12}, mem_bandwidth=3.35e12, mem_capacity=80e9)
    t_compute = roofline_time(flops, 0, h100_sxm)
    assert round(t_compute * 1e3, 1) == 4.4
    assert round(roofline_time(flops, 0, load_hardware("h100").device) * 1e3, 1) == 4.4
    # compute is about 26x the transfer, so the next block's transfer hides behind it
    assert t_compute > 10 * t_send


# --- Activation memory (after Korthikanti et al., 2022); MoE weights (DeepSeek-V2, 2024) ---------

def test_activation_estimate_5_gib():
    # L x bytes x (n_hidden B T d + n_score B H T^2), 10 layers, 2 bytes:
    # 10 x 2 (16 x 2048 x 4096 + 32 x 2048^2) = 5,368,709,120 bytes = 5 GiB
    a = activation_bytes(batch=1, seq=2048, hidden=4096, heads=32, layers=10, n_hidden=16, n_score=1, dtype_bytes=2)
    assert a == 5_368_709_120 == 5 * GiB


def test_deepseek_v2_weights():
    # DeepSeek-V2 has 236 billion parameters: 2 bytes each in bf16 is 472 GB, so at least
    # ceil(472 / 80) = six 80 GB GPUs just to hold the weights
    w = model_state_bytes(236e9, dp=1, zero_stage=0).params
    assert w / GB == pytest.approx(472)
    assert math.ceil(w / load_hardware("h100").device.mem_capacity) == 6


# --- Ring volume formulas (Patarasuk & Yuan, 2009): (R-1)V/R for all-gather or reduce-scatter,
#     twice that for all-reduce --------------------------------------------------------------

def test_ring_formulas_print():
    assert str(collective_formula("all_gather")) == "V*(R - 1)/R"
    assert str(collective_formula("reduce_scatter")) == "V*(R - 1)/R"
    assert str(collective_formula("all_reduce")) == "2*V*(R - 1)/R"
    assert str(collective_formula("all_to_all")) == "V*(R - 1)/R"
    assert str(collective_formula("send")) == "V"
    assert str(collective_formula("recv")) == "V"


@pytest.mark.parametrize("V", [0, 1, 1000, 8.75e9])
@pytest.mark.parametrize("R", [2, 3, 8, 64])
def test_lambdified_equals_direct_arithmetic(V, R):
    assert collective_bytes("all_gather", V, R) == pytest.approx((R - 1) * V / R)
    assert collective_bytes("reduce_scatter", V, R) == pytest.approx((R - 1) * V / R)
    assert collective_bytes("all_reduce", V, R) == pytest.approx(2 * (R - 1) * V / R)
    assert collective_bytes("all_to_all", V, R) == pytest.approx((R - 1) * V / R)
    assert collective_bytes("send", V, R) == V
    link = LinkSpec(50e9, latency=5e-6)
    assert collective_time("all_reduce", V, R, link) == pytest.approx(2 * (R - 1) * 5e-6 + 2 * (R - 1) * V / R / 50e9)
    assert collective_time("all_gather", V, R, link) == pytest.approx((R - 1) * 5e-6 + (R - 1) * V / R / 50e9)
    assert collective_time("recv", V, R, link) == pytest.approx(5e-6 + V / 50e9)


# --- Hardware: an axis inside an 8-GPU node gets NVLink, an axis spanning nodes gets IB -------

def test_h100_axis_links():
    hw = load_hardware("h100")
    nvlink, ib = hw.link("nvlink"), hw.link("infiniband")
    assert nvlink.bandwidth == 450e9 and ib.bandwidth == 50e9        # per direction
    assert hw.axis_links({"dp": 16, "tp": 8}) == {"dp": ib, "tp": nvlink}
    assert hw.axis_links({"dp": 2, "tp": 4}) == {"dp": nvlink, "tp": nvlink}   # one node
    assert hw.axis_links({"dp": 8, "tp": 2}) == {"dp": ib, "tp": nvlink}       # dp spans 2 nodes
    assert hw.axis_links({"pp": 2, "dp": 4, "tp": 2}) == {"pp": ib, "dp": nvlink, "tp": nvlink}


def test_h100_preset_spec_numbers():
    d = load_hardware("h100").device
    assert d.flops("bf16") == pytest.approx(989e12, rel=1e-3)
    assert d.mem_bandwidth == 3.35e12 and d.mem_capacity == 80e9
