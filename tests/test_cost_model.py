"""Unit tests for autoshard.cost: validation, edge cases, JSON, mesh interop, docstring examples."""
import doctest
import importlib
import time

import pytest

import autoshard
from autoshard.cost import (
    COLLECTIVE_KINDS,
    DeviceSpec,
    Hardware,
    LinkSpec,
    bubble_fraction,
    collective_bytes,
    collective_time,
    collective_time_formula,
    elementwise_bytes,
    matmul_bytes,
    matmul_flops,
    model_state_bytes,
    load_hardware,
    roofline_time,
    save_hardware,
)


@pytest.mark.parametrize("mod", ["hardware", "comm", "compute", "memory", "pipeline"])
def test_docstring_examples(mod):
    m = importlib.import_module(f"autoshard.cost.{mod}")
    result = doctest.testmod(m)
    assert result.attempted > 0 and result.failed == 0


def test_collective_edge_cases():
    for k in COLLECTIVE_KINDS:
        if k in ("send", "recv"):
            assert collective_bytes(k, 100, 1) == 100
        else:
            assert collective_bytes(k, 100, 1) == 0.0
            assert collective_time(k, 100, 1, LinkSpec(1e9, latency=1.0)) == 0.0
    assert collective_bytes("all-reduce", 8, 2) == collective_bytes("allreduce", 8, 2) == 8
    with pytest.raises(ValueError, match="unknown collective kind"):
        collective_bytes("broadcast", 8, 2)
    with pytest.raises(ValueError, match="ranks"):
        collective_bytes("all_reduce", 8, 0)
    with pytest.raises(ValueError, match="payload"):
        collective_bytes("all_reduce", -1, 2)


def test_collective_time_uses_link_efficiency_and_latency():
    link = LinkSpec(100.0, latency=0.5, efficiency=0.5)
    # all-gather, R=4: 3 steps of 0.5 s + 0.75*V bytes at 50 B/s
    assert collective_time("all_gather", 400, 4, link) == pytest.approx(1.5 + 300 / 50)
    assert str(collective_time_formula("send")) == "V*beta + alpha"


def test_collective_bytes_is_fast():
    t = time.perf_counter()
    for r in range(2, 10002):
        collective_bytes("all_reduce", 1e9, r)
    assert time.perf_counter() - t < 1.0   # the search calls this in inner loops


def test_model_state_validation_and_stages():
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(1e9, dp=8, zero_stage=4)
    with pytest.raises(ValueError, match="dp"):
        model_state_bytes(1e9, dp=0, zero_stage=1)
    s = model_state_bytes(8e9, dp=8, zero_stage=2, tp=2, pp=2, optimizer_bytes=8)
    assert (s.params, s.grads, s.optimizer) == (4e9, 0.5e9, 2e9)
    assert "per rank" in str(s)


def test_bubble_validation():
    assert bubble_fraction(1, 7) == 0.0
    with pytest.raises(ValueError, match="microbatches"):
        bubble_fraction(4, 0)


def test_compute_counts_and_roofline():
    assert matmul_flops(4, 5, 6, batch=2) == 2 * 2 * 4 * 5 * 6
    assert matmul_bytes(4, 5, 6) == (4 * 6 + 6 * 5 + 4 * 5) * 2
    d = DeviceSpec("toy", {"fp32": 1e9, "bf16": 4e9}, mem_bandwidth=1e9, mem_capacity=1e9)
    # memory-bound elementwise op: 2e9 bytes at 1e9 B/s
    assert roofline_time(1e6, elementwise_bytes(0.5e9, inputs=1, outputs=1, dtype_bytes=2), d) == pytest.approx(2.0)
    assert roofline_time(4e9, 0, d, dtype="torch.float32") == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'fp8'"):
        d.flops("fp8")


def test_op_classes_come_from_the_rule_table():
    """The cost model's matrix products and views are classes of passes/rules.py's RULES: an op
    added to the table with a view rule (or as a two-factor contraction) is costed as one."""
    import torch
    from autoshard.cost import model
    from autoshard.passes import rules
    aten = torch.ops.aten
    assert model.MATMUL_OPS is rules.MATMUL_OPS and model.VIEW_OPS is rules.VIEW_OPS
    for op in set(model.MATMUL_OPS) | model.VIEW_OPS:
        assert op in rules.RULES, op
    for op, rule in rules.RULES.items():
        if rule in rules.VIEW_RULES:
            assert op in model.VIEW_OPS, op
    # the first factor of each product, where the op's arguments put it (a bias first for addmm)
    assert model.MATMUL_OPS[aten.addmm.default] == 1 and model.MATMUL_OPS[aten.mm.default] == 0
    # an einsum equation and an outer product are contractions, but not products of two matrices
    assert aten.einsum.default not in model.MATMUL_OPS and aten.outer.default not in model.MATMUL_OPS
    # costed as the class says: a product 2mnk FLOPs, a view nothing
    graph = torch.fx.Graph()
    a, b, bias = (graph.placeholder(n) for n in "abc")
    a.meta["val"], b.meta["val"], bias.meta["val"] = torch.empty(4, 6), torch.empty(6, 5), torch.empty(4, 5)
    out = [torch.empty(4, 5)]
    assert model.op_work(aten.addmm.default, (bias, a, b), {}, out)[0] == 2 * 4 * 5 * 6
    assert model.op_work(aten.view_as.default, (a, b), {}, out) == (0.0, 0.0)


def test_axis_links_accepts_autoshard_mesh_and_misaligned_groups():
    hw = load_hardware("h100")
    assert hw.link_for_axis(autoshard.Mesh({"dp": 2, "tp": 8}), "tp").name == "nvlink"
    # 4 x 3 = 12 ranks: tp groups {6,7,8} straddle the node boundary at rank 8.
    assert hw.link_for_axis({"dp": 4, "tp": 3}, "tp").name == "infiniband"
    # A collective over two axes is as slow as the group they span.
    assert hw.link_for_axes({"dp": 4, "tp": 2}, ("dp", "tp")).name == "nvlink"
    assert hw.link_for_axes({"dp": 8, "tp": 2}, ("dp", "tp")).name == "infiniband"
    with pytest.raises(ValueError, match="unknown mesh axis"):
        hw.link_for_axis({"dp": 2}, "tp")


def test_three_tier_hardware_and_pinning():
    hw = Hardware(
        "nvl-rack",
        load_hardware("h100").device,
        (LinkSpec(450e9, domain_size=4, name="nvl4"), LinkSpec(100e9, domain_size=16, name="rack"),
         LinkSpec(50e9, name="ib")),
        pinned={"tp": "rack"},
    )
    links = {a: l.name for a, l in hw.axis_links({"dp": 4, "cp": 4, "tp": 4}).items()}
    assert links == {"dp": "ib", "cp": "rack", "tp": "rack"}   # tp would be nvl4 unpinned
    with pytest.raises(ValueError, match="reach every rank"):
        Hardware("bad", hw.device, (LinkSpec(1e9, domain_size=8),))
    with pytest.raises(ValueError, match="increasing domain_size"):
        Hardware("bad", hw.device, (LinkSpec(1e9, domain_size=8, name="a"), LinkSpec(1e9, domain_size=4, name="b"),
                                    LinkSpec(1e9, name="c")))


def test_hardware_json_round_trip(tmp_path):
    for name in ("h100", "cpu-gloo"):
        hw = load_hardware(name)
        p = save_hardware(hw, tmp_path / f"{name}.json")
        assert load_hardware(p) == hw
        assert load_hardware(str(p)) == hw
    d = load_hardware("cpu-gloo").to_dict()
    d["links"][0]["bandwdith"] = 1
    with pytest.raises(ValueError, match="bad hardware description"):
        load_hardware(d)
    with pytest.raises(ValueError, match="neither a hardware preset"):
        load_hardware("no-such-preset")
