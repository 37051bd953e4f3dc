"""Brute-force semantics of the runtime collectives on a simulated mesh.

Every collective only changes how a logical value is represented on an axis, so each case
builds a global value X and an upstream gradient G per axis group, hands every rank its local
piece under the documented conventions, runs forward + backward, and compares with what the
conventions say the local pieces must be. The simulated backend sums in axis order, and so does
the reference, so comparisons are exact (torch.equal).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from autoshard import Mesh
from autoshard.runtime import (ADJOINTS, COLLECTIVES, CollectiveError, SimulatedBackend,
                               all_gather, all_reduce, backward_collective, current,
                               forward_collective, mark_varying, rank_context, reduce_scatter,
                               run_simulated, shard_slice, trace_phase)
from tests.helpers.collective_cases import (TABLE, build_case, check_mlp_dp_tp, chunk, mlp_dp_tp_rank, mlp_reference,
                                            mlp_tensors, run_case_on_rank)


# Written out independently of ADJOINTS: (forward comm kind, backward comm kind).
KINDS = {
    "all_reduce": ("all_reduce", None),
    "mark_varying": (None, "all_reduce"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "all_gather": ("all_gather", None),
    "all_gather_varying": ("all_gather", "reduce_scatter"),
    "shard_slice": (None, "all_gather"),
    "all_to_all": ("all_to_all", "all_to_all"),
    "to_partial": (None, None),
    "replicated_use": (None, None),  # semantics: tests/test_sequence_parallel.py
    "use_persistent": (None, "reduce_scatter"),
    "gather_unit": ("all_gather", "reduce_scatter"),  # semantics: tests/test_units.py
    "dispatch": ("all_to_all", "all_to_all"),  # variable splits, costed as all-to-all
    "combine": ("all_to_all", "all_to_all"),
    "send": ("send", "recv"),  # pipeline boundaries: tests/test_pipeline.py
    "recv": ("recv", "send"),
}


def expected_trace(case, rank, axis, op, tag=7):
    fwd, bwd = KINDS[op]
    out = []
    if fwd:
        out.append((fwd, axis, "forward", case["x"][rank].numel() * 4, tag, op))
    if bwd:
        out.append((bwd, axis, "backward", case["g"][rank].numel() * 4, tag, op))
    return out


@pytest.mark.parametrize("mesh_axes,axis,op,dims", TABLE,
                         ids=[f"{'x'.join(map(str, m.values()))}-{a}-{op}-{dims}" for m, a, op, dims in TABLE])
def test_collective_semantics(mesh_axes, axis, op, dims):
    case = build_case(mesh_axes, axis, op, dims)
    results = run_simulated(Mesh(mesh_axes), lambda r: run_case_on_rank(r, case, axis, op, dims))
    for rank, (y, dx, trace) in enumerate(results):
        assert torch.equal(y, case["y"][rank]), f"forward on rank {rank}"
        assert torch.equal(dx, case["dx"][rank]), f"backward on rank {rank}"
        assert trace == expected_trace(case, rank, axis, op)


def test_table_covers_every_function_and_names_its_comms():
    assert set(ADJOINTS) == set(COLLECTIVES) == set(KINDS)
    for op, (fwd, bwd) in KINDS.items():
        assert (forward_collective(op), backward_collective(op)) == (fwd, bwd)
    fwd, bwd = ADJOINTS["all_reduce"]  # plain 2-tuples for outside readers
    assert (fwd, bwd) == ("all_reduce", "identity")


# ---- Megatron f / g -------------------------------------------------------------------------


def test_megatron_column_row_mlp_matches_unsharded():
    x, w1, b1, w2, b2, g = mlp_tensors()
    ref = mlp_reference(x, w1, b1, w2, b2, g)
    tp = 2

    def rank_fn(rank):
        # column-parallel w1 (rows = output features), row-parallel w2 (columns = inputs)
        p = [chunk(w1, 0, rank, tp), chunk(b1, 0, rank, tp), chunk(w2, 1, rank, tp), b2]
        p = [t.clone().requires_grad_() for t in p]
        xl = x.clone().requires_grad_()
        h = mark_varying(xl, "tp")                                  # f
        y = all_reduce(F.linear(F.gelu(F.linear(h, p[0], p[1])), p[2]), "tp") + p[3]   # g
        y.backward(g)
        return y.detach(), xl.grad, *(t.grad for t in p), current().trace

    for rank, (y, dx, dw1, db1, dw2, db2, trace) in enumerate(run_simulated(Mesh({"tp": tp}), rank_fn)):
        tol = dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y, ref[0], **tol)
        torch.testing.assert_close(dx, ref[1], **tol)
        torch.testing.assert_close(dw1, chunk(ref[2], 0, rank, tp), **tol)
        torch.testing.assert_close(db1, chunk(ref[3], 0, rank, tp), **tol)
        torch.testing.assert_close(dw2, chunk(ref[4], 1, rank, tp), **tol)
        torch.testing.assert_close(db2, ref[5], **tol)
        assert [(t.kind, t.phase, t.op) for t in trace] == [
            ("all_reduce", "forward", "all_reduce"), ("all_reduce", "backward", "mark_varying")]
        assert trace[0].bytes == 8 * 16 * 4 and trace[1].bytes == 8 * 16 * 4


def test_dp_tp_mlp_matches_unsharded_and_ddp_sync_is_the_adjoint():
    results = run_simulated(Mesh({"dp": 2, "tp": 2}), mlp_dp_tp_rank)
    check_mlp_dp_tp(results)
    trace = results[0][-1]
    fwd = [t for t in trace if t[2] == "forward"]
    bwd = [t for t in trace if t[2] == "backward"]
    assert fwd == [("all_reduce", "tp", "forward"), ("all_reduce", "dp", "forward")]
    # 4 parameter grad syncs over dp, the input-grad all-reduce over tp, x's grad all-gather
    assert sorted(bwd) == sorted([("all_reduce", "dp", "backward")] * 4 + [
        ("all_reduce", "tp", "backward"), ("all_gather", "dp", "backward")])
    for r in results[1:]:  # identical traces everywhere
        assert r[-1] == trace


def test_without_mark_varying_the_input_grad_is_only_partial():
    """The reason f exists: dropping it leaves each rank with half of dx."""
    x, w1, b1, w2, b2, g = mlp_tensors()
    ref_dx = mlp_reference(x, w1, b1, w2, b2, g)[1]

    def rank_fn(rank):
        xl = x.clone().requires_grad_()
        y = all_reduce(F.linear(F.gelu(F.linear(xl, chunk(w1, 0, rank, 2), chunk(b1, 0, rank, 2))),
                                chunk(w2, 1, rank, 2)), "tp") + b2
        y.backward(g)
        return xl.grad

    dxs = run_simulated(Mesh({"tp": 2}), rank_fn)
    assert not torch.allclose(dxs[0], ref_dx, atol=1e-4)
    torch.testing.assert_close(dxs[0] + dxs[1], ref_dx, rtol=1e-5, atol=1e-5)


# ---- trace phases ---------------------------------------------------------------------------

def test_trace_phases_optimizer_and_checkpoint_recompute():
    from torch.utils.checkpoint import checkpoint

    def rank_fn(rank):
        w = torch.ones(4, requires_grad=True)
        # sin saves the all-reduce output, so the recompute must run the collective again
        y = checkpoint(lambda t: all_reduce(t * 2, "x", tag=1).sin(), w * (rank + 1), use_reentrant=False)
        y.sum().backward()
        with trace_phase("optimizer"), torch.no_grad():
            all_gather(w, "x", 0, tag=2)
        return [(t.kind, t.phase, t.tag) for t in current().trace]

    for trace in run_simulated(Mesh({"x": 2}), rank_fn):
        # forward, then the recompute inside backward, then the optimizer-step gather
        assert trace == [("all_reduce", "forward", 1), ("all_reduce", "backward", 1),
                         ("all_gather", "optimizer", 2)]


def test_outputs_allow_inplace_and_integer_payloads():
    def rank_fn(rank):
        x = torch.ones(2, 4, requires_grad=True)
        y = mark_varying(x, "x")
        y.mul_(2)  # in-place on a collective's output: needs the output not to be an input view
        y.sum().backward()
        ids = shard_slice(torch.arange(8), "x", 0)
        count = all_reduce(torch.tensor(rank + 1), "x")
        return x.grad, all_gather(ids, "x", 0), count

    for grad, ids, count in run_simulated(Mesh({"x": 2}), rank_fn):
        assert torch.equal(grad, torch.full((2, 4), 4.0))
        assert torch.equal(ids, torch.arange(8)) and count.item() == 3


def test_backward_collectives_in_four_threads_do_not_deadlock():
    def rank_fn(rank):
        torch.manual_seed(rank)
        w = torch.randn(8, 8, requires_grad=True)
        h = torch.randn(4, 8)
        for i in range(5):  # several collectives on both axes, all in forward and backward
            h = all_reduce(mark_varying(h, "a") @ w, "b", tag=i).tanh()
            h = all_gather(reduce_scatter(h, "a", 1), "a", 1)
        h.sum().backward()
        return len(current().trace)

    start = time.monotonic()
    # 3 forward + 2 backward per step, except the first mark_varying: its input needs no grad
    assert run_simulated(Mesh({"a": 2, "b": 2}), rank_fn, timeout=30) == [24] * 4
    assert time.monotonic() - start < 20


# ---- errors ---------------------------------------------------------------------------------

def test_outside_a_rank_context_is_a_clear_error():
    with pytest.raises(RuntimeError, match="rank context"):
        all_reduce(torch.ones(2), "tp")


def test_uneven_split_and_unknown_axis_are_value_errors():
    mesh = Mesh({"x": 4})
    with pytest.raises(ValueError, match=r"rank \d.*axis 'x'.*dim 1.*size 6"):
        run_simulated(mesh, lambda r: reduce_scatter(torch.ones(2, 6), "x", 1))
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        run_simulated(mesh, lambda r: all_reduce(torch.ones(2), "tp"))
    with pytest.raises(ValueError, match="dim=3"):
        run_simulated(mesh, lambda r: all_gather(torch.ones(2), "x", 3))


def test_exception_in_one_rank_releases_the_others():
    def rank_fn(rank):
        if rank == 2:
            time.sleep(0.05)
            raise KeyError("boom")  # not a ValueError: the runner must keep the type
        return all_reduce(torch.ones(2), "x")

    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 2: boom"):
        run_simulated(Mesh({"x": 4}), rank_fn, timeout=60)
    assert time.monotonic() - start < 5
    assert not [t for t in threading.enumerate() if t.name.startswith("autoshard-rank")]


def test_exception_inside_backward_releases_the_others():
    def rank_fn(rank):
        x = torch.ones(2, requires_grad=True)
        y = mark_varying(x * 2, "x")
        if rank == 1:  # fails in backward before reaching mark_varying's all-reduce
            def hook(grad):
                raise ArithmeticError("bad grad")
            y.register_hook(hook)
        y.sum().backward()

    start = time.monotonic()
    with pytest.raises(ArithmeticError, match="rank 1: bad grad"):
        run_simulated(Mesh({"x": 4}), rank_fn, timeout=60)
    assert time.monotonic() - start < 5


def test_mismatched_collectives_name_both_calls():
    def rank_fn(rank):
        if rank == 1:
            return all_gather(torch.ones(2), "x", 0, tag=5)
        return all_reduce(torch.ones(2), "x", tag=5)

    with pytest.raises(CollectiveError, match=r"mismatched.*all_(reduce|gather)\(.*all_(gather|reduce)\("):
        run_simulated(Mesh({"x": 2}), rank_fn, timeout=60)

    def shapes(rank):
        return all_reduce(torch.ones(2 + rank), "x")

    with pytest.raises(CollectiveError, match=r"shape=\(2,\).*shape=\(3,\)|shape=\(3,\).*shape=\(2,\)"):
        run_simulated(Mesh({"x": 2}), shapes, timeout=60)


def test_deadlocks_are_detected_not_waited_out():
    # a-groups {0,2} {1,3}; b-groups {0,1} {2,3}: a wait cycle 0 -a-> 2 -b-> 3 -a-> 1 -b-> 0
    order = {0: "ab", 1: "ba", 2: "ba", 3: "ab"}

    def rank_fn(rank):
        for axis in order[rank]:
            all_reduce(torch.ones(1), axis)

    start = time.monotonic()
    with pytest.raises(CollectiveError, match="deadlock"):
        run_simulated(Mesh({"a": 2, "b": 2}), rank_fn, timeout=60)

    def skipper(rank):  # rank 1 returns without the collective its peer waits in
        if rank == 0:
            all_reduce(torch.ones(1), "x")

    with pytest.raises(CollectiveError, match="rank 1 has finished"):
        run_simulated(Mesh({"x": 2}), skipper, timeout=60)
    assert time.monotonic() - start < 5


def test_timeout_names_the_rank_still_computing():
    def rank_fn(rank):
        if rank == 1:
            time.sleep(1.0)
        all_reduce(torch.ones(1), "x")

    with pytest.raises(CollectiveError, match="timeout.*rank 1 is still computing"):
        run_simulated(Mesh({"x": 2}), rank_fn, timeout=0.3)


def test_rank_context_by_hand():
    mesh = Mesh({"x": 1})
    with rank_context(mesh, 0, SimulatedBackend(mesh)) as ctx:
        y = all_reduce(torch.ones(3), "x", tag=9)
    assert torch.equal(y, torch.ones(3))
    assert [(t.kind, t.bytes, t.tag, t.phase) for t in ctx.trace] == [("all_reduce", 12, 9, "forward")]
