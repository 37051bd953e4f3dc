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

MESHES = [({"x": 4}, "x"), ({"a": 2, "b": 2}, "a"), ({"a": 2, "b": 2}, "b")]
SHAPE = (4, 8, 12)  # every dim divisible by 4

# op -> dims variants to test (positional args after the axis)
DIMS = {
    "all_reduce": [()],
    "mark_varying": [()],
    "to_partial": [()],
    "reduce_scatter": [(0,), (1,), (-1,)],
    "all_gather": [(0,), (2,)],
    "all_gather_varying": [(0,), (1,)],
    "shard_slice": [(1,), (2,)],
    "all_to_all": [(0, 1), (1, 0), (2, 0)],
}
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


def ownership(op, dims):
    """(input ownership, output ownership as its gradient sees it).

    R: replicated, grad is the full G everywhere.  V: replicated value used by varying work,
    so each rank's upstream grad is a partial contribution G_i.  P: pending sum (its grad is
    the full G).  ("S", d): chunk along d.
    """
    d = dims[0] if dims else None
    return {
        "all_reduce": ("P", "R"),
        "mark_varying": ("R", "V"),
        "reduce_scatter": ("P", ("S", d)),
        "all_gather": (("S", d), "R"),
        "all_gather_varying": (("S", d), "V"),
        "shard_slice": ("R", ("S", d)),
        "all_to_all": (("S", dims[-1] if dims else None), ("S", d)),
        "to_partial": ("R", "P"),
    }[op]


def ordered_sum(parts):
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def chunk(t, d, i, n):
    s = t.shape[d] // n
    return t.narrow(d, i * s, s).contiguous()


def build_case(mesh_axes, axis, op, dims, seed=0):
    """Per-rank (input, upstream grad) and expected (output, input grad), by rank."""
    mesh = Mesh(mesh_axes)
    n = mesh.axis_size(axis)
    d = [x % len(SHAPE) for x in dims]
    in_own, out_own = ownership(op, d)
    case = {k: {} for k in ("x", "g", "y", "dx")}
    for group in mesh.groups(axis):
        gen = torch.Generator().manual_seed(seed * 1000 + group[0])
        X, G = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
        x_parts = [torch.randn(SHAPE, generator=gen) for _ in range(n)]
        g_parts = [torch.randn(SHAPE, generator=gen) for _ in range(n)]
        if in_own == "P":
            X = ordered_sum(x_parts)
        if out_own == "V":
            G = ordered_sum(g_parts)
        for i, r in enumerate(group):
            def local(t, own, parts):
                if own == "P":
                    return parts[i]
                if isinstance(own, tuple):
                    return chunk(t, own[1], i, n)
                return t
            case["x"][r] = local(X, in_own, x_parts)
            case["g"][r] = g_parts[i] if out_own == "V" else local(G, out_own, None) if out_own != "P" else G
            if out_own == "P":  # to_partial: axis index 0 holds X, the rest zeros
                case["y"][r] = X if i == 0 else torch.zeros_like(X)
            else:
                case["y"][r] = chunk(X, out_own[1], i, n) if isinstance(out_own, tuple) else X
            case["dx"][r] = chunk(G, in_own[1], i, n) if isinstance(in_own, tuple) else G
    return case


def run_case_on_rank(rank, case, axis, op, dims, tag=7):
    x = case["x"][rank].clone().requires_grad_()
    y = COLLECTIVES[op](x, axis, *dims, tag=tag)
    y.backward(case["g"][rank])
    trace = [(t.kind, t.axis, t.phase, t.bytes, t.tag, t.op) for t in current().trace]
    return y.detach(), x.grad, trace


def expected_trace(case, rank, axis, op, tag=7):
    fwd, bwd = KINDS[op]
    out = []
    if fwd:
        out.append((fwd, axis, "forward", case["x"][rank].numel() * 4, tag, op))
    if bwd:
        out.append((bwd, axis, "backward", case["g"][rank].numel() * 4, tag, op))
    return out


TABLE = [(m, a, op, dims) for m, a in MESHES for op in DIMS for dims in DIMS[op]]


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

def _mlp_reference(x, w1, b1, w2, b2, g):
    x, w1, b1, w2, b2 = (t.clone().requires_grad_() for t in (x, w1, b1, w2, b2))
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(g)
    return y.detach(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad


def _mlp_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=gen)
    w1, b1 = torch.randn(32, 16, generator=gen) / 4, torch.randn(32, generator=gen)
    w2, b2 = torch.randn(16, 32, generator=gen) / 4, torch.randn(16, generator=gen)
    g = torch.randn(8, 16, generator=gen)
    return x, w1, b1, w2, b2, g


def test_megatron_column_row_mlp_matches_unsharded():
    x, w1, b1, w2, b2, g = _mlp_tensors()
    ref = _mlp_reference(x, w1, b1, w2, b2, g)
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


def mlp_dp_tp_rank(rank):
    """Data x tensor parallel MLP on mesh {"dp": 2, "tp": 2}: DDP falls out of mark_varying.

    Runs as the current rank context (simulated or distributed); returns local results.
    """
    ctx = current()
    dp, tp = ctx.mesh.axis_size("dp"), ctx.mesh.axis_size("tp")
    x, w1, b1, w2, b2, g = _mlp_tensors(1)
    xl = x.clone().requires_grad_()                                  # Replicate on both axes
    p = [chunk(w1, 0, ctx.coord("tp"), tp), chunk(b1, 0, ctx.coord("tp"), tp),
         chunk(w2, 1, ctx.coord("tp"), tp), b2]
    p = [t.clone().requires_grad_() for t in p]                      # Replicate on dp
    # parameters are used by batch-sharded (dp-varying) work: their backward all-reduce is DDP
    w1v, b1v, w2v, b2v = (mark_varying(t, "dp") for t in p)
    xb = shard_slice(xl, "dp", 0)                                    # this rank's batch
    h = mark_varying(xb, "tp")
    y = all_reduce(F.linear(F.gelu(F.linear(h, w1v, b1v)), w2v), "tp") + b2v
    # loss = sum(y * g) over the global batch: local sum is dp-partial
    loss = all_reduce((y * shard_slice(g, "dp", 0)).sum(), "dp")
    loss.backward()
    return loss.detach(), xl.grad, *(t.grad for t in p), [(t.kind, t.axis, t.phase) for t in ctx.trace]


def check_mlp_dp_tp(results, rtol=1e-5, atol=1e-6):
    x, w1, b1, w2, b2, g = _mlp_tensors(1)
    y, *grads = _mlp_reference(x, w1, b1, w2, b2, g)
    mesh = Mesh({"dp": 2, "tp": 2})
    for rank, (loss, dx, dw1, db1, dw2, db2, _) in enumerate(results):
        t = mesh.coords(rank)["tp"]
        tol = dict(rtol=rtol, atol=atol)
        torch.testing.assert_close(loss, (y * g).sum(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(dx, grads[0], **tol)
        torch.testing.assert_close(dw1, chunk(grads[1], 0, t, 2), **tol)
        torch.testing.assert_close(db1, chunk(grads[2], 0, t, 2), **tol)
        torch.testing.assert_close(dw2, chunk(grads[3], 1, t, 2), **tol)
        torch.testing.assert_close(db2, grads[4], **tol)


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
    x, w1, b1, w2, b2, g = _mlp_tensors()
    ref_dx = _mlp_reference(x, w1, b1, w2, b2, g)[1]

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
