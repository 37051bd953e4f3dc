"""Acceptance tests for autoshard.cost: every worked number of the seeds, through the public calculators.

Expected values are typed from the seed text (seed 003 = "13 Distributed Training and Serving",
seed 000 = "Distributed Training and Parallelism", seed 002 = "Distributed Training: One Model,
Many Accelerators"). GB = 1e9 bytes, GiB = 2**30, as the seeds use them. Where the seed
prints a rounded figure, the test checks the seed's own rounding (one decimal, or "about").
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
    # Seed tables print GB to one decimal, halves rounded up (1.875 -> 1.9).
    return math.floor(x * 10 + 0.5) / 10


# --- Seed 003, Table 13.1: ZeRO model state for 7.5B parameters on N_d = 64 -----------------

@pytest.mark.parametrize(
    "stage, seed_gb, seed_bytes_per_param",
    [
        (0, 120, 16),                 # plain DP: 16 bytes/param
        (1, 31.4, 4 + 12 / 64),       # "4 + 12/64 ~ 4.19"
        (2, 16.6, 2 + 14 / 64),       # "2 + 14/64 ~ 2.22"
        (3, 1.9, 16 / 64),            # "16/64 = 0.25"
    ],
)
def test_zero_table_7_5b_on_64(stage, seed_gb, seed_bytes_per_param):
    s = model_state_bytes(7.5e9, dp=64, zero_stage=stage)
    assert one_decimal(s.total / GB) == seed_gb
    assert s.total == pytest.approx(7.5e9 * seed_bytes_per_param)


def test_zero_table_printed_bytes_per_param():
    per_param = [model_state_bytes(7.5e9, dp=64, zero_stage=z).total / 7.5e9 for z in (1, 2, 3)]
    assert [round(x, 2) for x in per_param] == [4.19, 2.22, 0.25]


def test_zero_optimizer_is_12_of_16_bytes():
    # "Most of the saving comes from the optimizer state, which is 12 of the 16 bytes."
    s = model_state_bytes(1, dp=1, zero_stage=0)
    assert (s.params, s.grads, s.optimizer, s.total) == (2, 2, 12, 16)


# --- Seed 003, 13.6: a 70B model on 64 GPUs (TP 8 x PP 2 x DP 4, ZeRO-1) ----------------------

MESH_70B = {"dp": 4, "pp": 2, "tp": 8}   # 8 x 2 x 4 = 64, tp innermost (inside a server)


def test_70b_total_model_state_is_1120_gb():
    # "16 x 70 x 10^9 = 1,120 GB"
    assert model_state_bytes(70e9, dp=1, zero_stage=0).total == pytest.approx(1120 * GB)


def test_70b_memory_per_gpu():
    s = model_state_bytes(70e9, dp=4, zero_stage=1, tp=8, pp=2)
    # "each GPU holds 70e9/(8x2) ~ 4.4 billion parameters" (4.375e9 in the next line)
    assert s.params / 2 == pytest.approx(4.375e9)
    # "Weights and gradients take 4 x 4.375e9 = 17.5 GB"
    assert (s.params + s.grads) / GB == pytest.approx(17.5)
    # "the sharded optimizer state takes 12 x 4.375e9 / 4 ~ 13.1 GB"
    assert one_decimal(s.optimizer / GB) == 13.1
    assert s.optimizer == pytest.approx(12 * 4.375e9 / 4)
    # "30.6 GB in total"
    assert one_decimal(s.total / GB) == 30.6
    # "Using 80 GB as the planning capacity leaves about 49 GB"
    headroom = load_hardware("h100").device.mem_capacity - s.total
    assert round(headroom / GB) == 49


def test_70b_gradient_all_reduce_traffic():
    s = model_state_bytes(70e9, dp=4, zero_stage=1, tp=8, pp=2)
    # "Each GPU's tensor/pipeline partition has 4.375e9 x 2 = 8.75 GB of gradients"
    assert s.grads / GB == pytest.approx(8.75)
    # "one ring gradient all-reduce over the 4 data-parallel replicas ... sends about
    #  2 x (3/4) x 8.75 ~ 13.1 GB per GPU across servers"
    traffic = collective_bytes("all_reduce", s.grads, MESH_70B["dp"])
    assert one_decimal(traffic / GB) == 13.1
    assert traffic == pytest.approx(2 * (3 / 4) * 8.75 * GB)
    # ... "across servers": the dp axis leaves the node; "keeps tensor-parallel collectives on NVLink"
    hw = load_hardware("h100")
    assert hw.link_for_axis(MESH_70B, "dp").name == "infiniband"
    assert hw.link_for_axis(MESH_70B, "pp").name == "infiniband"
    assert hw.link_for_axis(MESH_70B, "tp").name == "nvlink"


def test_70b_pipeline_bubble():
    # "(2-1)/(16+2-1) ~ 5.9 percent"
    b = bubble_fraction(MESH_70B["pp"], 16)
    assert b == pytest.approx(1 / 17)
    assert one_decimal(100 * b) == 5.9


def test_70b_fully_sharded_alternative():
    # "tensor degree 8 with FSDP across 8 data-parallel replicas, reduces persistent model
    #  state to 17.5 GB per GPU under the same byte accounting"
    s = model_state_bytes(70e9, dp=8, zero_stage=3, tp=8)
    assert s.total / GB == pytest.approx(17.5)


# --- Seed 003, eq. 13.1 worked calculation; seed 002 fill-drain diagram ------------------------

def test_gpipe_bubbles():
    # "K = 4 pipeline stages and M = 8 micro-batches ... 3/11", "With M = 32 ... 3/35"
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 32) == pytest.approx(3 / 35)
    # "about 27.3 percent", "about 8.6 percent"
    assert round(100 * bubble_fraction(4, 8), 1) == 27.3
    assert round(100 * bubble_fraction(4, 32), 1) == 8.6


def test_seed_002_fill_drain_diagram():
    # Two stages, three microbatches (m0..m2), time slots 1..8; each stage is busy in 6 of the
    # 8 slots (3 F + 3 B of equal length), so 2 of 8 slots are idle.
    assert bubble_fraction(2, 3) == pytest.approx(2 / 8)


def test_interleaving_divides_the_bubble_by_v():
    # Seed 000: "with v virtual chunks per physical stage, ideal balanced interleaving can
    # reduce the non-interleaved bubble by roughly 1/v" (exactly 1/v for overhead relative to
    # useful work; the elapsed fraction is o / (1 + o)).
    for p, m, v in [(4, 8, 2), (8, 32, 4), (2, 16, 3)]:
        assert bubble_overhead(p, m, v) == pytest.approx(bubble_overhead(p, m) / v)
        o = bubble_overhead(p, m, v)
        assert bubble_fraction(p, m, v) == pytest.approx(o / (1 + o))
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)


# --- Full-shard traffic (seed 000 "Count the whole step"; seed 003 13.1 "about 1.5 times") ---

@pytest.mark.parametrize("ranks", [2, 4, 8, 64, 1000])
def test_full_shard_traffic_is_1_5x_dp(ranks):
    V = 8.75e9
    full_shard = (collective_bytes("all_gather", V, ranks)        # forward parameter gather
                  + collective_bytes("all_gather", V, ranks)      # backward re-gather
                  + collective_bytes("reduce_scatter", V, ranks)) # gradient reduce-scatter
    dp = collective_bytes("all_reduce", V, ranks)
    assert full_shard / dp == pytest.approx(1.5)
    # Seed 000: "An all-gather plus reduce-scatter has roughly one all-reduce's ring byte volume"
    assert (collective_bytes("all_gather", V, ranks) + collective_bytes("reduce_scatter", V, ranks)
            == pytest.approx(dp))


def test_full_shard_ratio_symbolically():
    ratio = (2 * collective_formula("all_gather") + collective_formula("reduce_scatter")) / collective_formula("all_reduce")
    assert sp.simplify(ratio - sp.Rational(3, 2)) == 0


# --- Seed 003, 13.5.4: a 128k-token sequence on eight GPUs ------------------------------------

LLAMA8B = dict(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)   # BF16, 8 KV heads, d_h 128


def test_context_parallel_kv_memory():
    # "keys and values for the full sequence across all 32 layers requires 16 GiB"
    assert kv_cache_bytes(131072, **LLAMA8B) == 16 * GiB
    # "Partitioning that payload evenly gives 2 GiB per GPU" (8 GPUs, 16,384 tokens each)
    assert kv_cache_bytes(131072 // 8, **LLAMA8B) == 2 * GiB


def test_context_parallel_block_transfer_and_compute():
    # "one KV block is 2 x 16,384 x 8 x 128 x 2 ~ 67 MB" (one layer)
    block = kv_cache_bytes(16384, **{**LLAMA8B, "layers": 1})
    assert block == 2 * 16384 * 8 * 128 * 2
    assert round(block / 1e6) == 67
    # "about 0.17 ms at the assumed 400 GB/s" - ring attention sends each block to the next rank
    t_send = collective_time("send", block, 8, LinkSpec(400e9))
    assert round(t_send * 1e3, 2) == 0.17
    # "4 x 16,384^2 x 32 x 128 ~ 4.4 x 10^12 FLOPs"
    flops = attention_flops(16384, 16384, heads=32, head_dim=128)
    assert flops == 4 * 16384**2 * 32 * 128
    assert round(flops / 1e12, 1) == 4.4
    # "about 4.4 ms at the assumed 989 TFLOP/s"
    seed_device = DeviceSpec("seed", {"bf16": 989e12}, mem_bandwidth=3.35e12, mem_capacity=80e9)
    t_compute = roofline_time(flops, 0, seed_device)
    assert round(t_compute * 1e3, 1) == 4.4
    assert round(roofline_time(flops, 0, load_hardware("h100").device) * 1e3, 1) == 4.4
    # "this estimate leaves room to hide the next transfer behind computation"
    assert t_compute > 10 * t_send


# --- Seed 003, 13.5.2 activation estimate; 13.7.2 MoE weights ---------------------------------

def test_activation_estimate_5_gib():
    # "10 x 2 (16 x 2048 x 4096 + 32 x 2048^2) = 5,368,709,120 bytes = 5 GiB"
    a = activation_bytes(batch=1, seq=2048, hidden=4096, heads=32, layers=10, n_hidden=16, n_score=1, dtype_bytes=2)
    assert a == 5_368_709_120 == 5 * GiB


def test_deepseek_v2_weights():
    # "236 billion parameters ... in BF16, their payload is 472 GB, a capacity-only lower bound
    #  of six 80 GB GPUs"
    w = model_state_bytes(236e9, dp=1, zero_stage=0).params
    assert w / GB == pytest.approx(472)
    assert math.ceil(w / load_hardware("h100").device.mem_capacity) == 6


# --- Ring volume formulas (seed 000: "(R-1)V/R for all-gather or reduce-scatter; all-reduce
#     roughly twice that") ------------------------------------------------------------------

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
