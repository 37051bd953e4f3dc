"""The same collective table on 4 gloo processes must equal the simulated mesh.

Spawned processes re-import this module by name, so workers are module-level functions.
gloo chooses its own summation order, so reductions are compared with a tolerance (fp32,
rtol 1e-5 / atol 1e-6); gathers, slices and all-to-all must be bit-exact.
"""
from __future__ import annotations

import time

import pytest
import torch

from autoshard import Mesh
from autoshard.runtime import DistributedBackend, rank_context, run_simulated
from autoshard.runtime.transport.launch import SpawnError, spawn

from test_runtime import MESHES, TABLE, build_case, check_mlp_dp_tp, mlp_dp_tp_rank, run_case_on_rank

pytestmark = pytest.mark.slow

EXACT_OPS = {"all_gather", "shard_slice", "all_to_all", "to_partial"}  # no summation anywhere


def _table_worker(rank, world_size):
    import torch.distributed as dist

    assert dist.get_backend() == "gloo" and world_size == 4
    out = {}
    # a list, not a set: string hashes differ between processes, and every rank must build
    # the device meshes (collective calls) in the same order
    for mesh_axes in dict.fromkeys(tuple(m.items()) for m, _ in MESHES):
        mesh = Mesh(dict(mesh_axes))
        backend = DistributedBackend(mesh)  # one init_device_mesh per mesh shape
        for m, axis, op, dims in TABLE:
            if tuple(m.items()) != mesh_axes:
                continue
            case = build_case(m, axis, op, dims)
            with rank_context(mesh, rank, backend):
                out[(mesh_axes, axis, op, dims)] = run_case_on_rank(rank, case, axis, op, dims)
        if mesh.names == ("a", "b"):
            dp_tp = Mesh({"dp": 2, "tp": 2})
            with rank_context(dp_tp, rank, DistributedBackend(dp_tp)):
                out["mlp"] = mlp_dp_tp_rank(rank)
    return out


def _failing_worker(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ZeroDivisionError("rank one gives up")
    t = torch.ones(2)
    dist.all_reduce(t)  # the others block here until the launcher kills them
    return t


def _sleepy_worker(rank, world_size):
    time.sleep(60)


def test_gloo_table_equals_simulated():
    per_rank = spawn(_table_worker, 4, timeout=240)
    for m, axis, op, dims in TABLE:
        key = (tuple(m.items()), axis, op, dims)
        case = build_case(m, axis, op, dims)
        sim = run_simulated(Mesh(m), lambda r: run_case_on_rank(r, case, axis, op, dims))
        for rank in range(4):
            (gy, gdx, gtrace), (sy, sdx, strace) = per_rank[rank][key], sim[rank]
            if op in EXACT_OPS:
                assert torch.equal(gy, sy) and torch.equal(gdx, sdx), (key, rank)
            else:
                torch.testing.assert_close(gy, sy, rtol=1e-5, atol=1e-6, msg=str((key, rank)))
                torch.testing.assert_close(gdx, sdx, rtol=1e-5, atol=1e-6, msg=str((key, rank)))
            assert gtrace == strace, (key, rank)
    mlp = [per_rank[r]["mlp"] for r in range(4)]
    check_mlp_dp_tp(mlp)
    assert all(r[-1] == mlp[0][-1] for r in mlp)


def test_spawn_propagates_a_rank_failure_without_hanging():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"(?s)rank 1 failed.*ZeroDivisionError: rank one gives up"):
        spawn(_failing_worker, 3, timeout=120)
    assert time.monotonic() - start < 60


def test_spawn_times_out_and_kills():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"timeout after 8s; ranks \[0, 1\] did not finish"):
        spawn(_sleepy_worker, 2, timeout=8)
    assert time.monotonic() - start < 30


def _p2p_worker(rank, world_size):
    """Rank 0 sends messages 1..3 (3 first); rank 1 posts 2 and 3 ahead, reads 1 unposted,
    then 3 before 2. Then rank 0 modifies a tensor it is sending."""
    from autoshard.runtime.transport.backend import CollectiveError

    mesh = Mesh({"pp": 2})
    backend = DistributedBackend(mesh)
    got = {}
    with rank_context(mesh, rank, backend):
        if rank == 0:
            for m in (3, 1, 2):
                backend.send(torch.full((2, 3), float(m)), "pp", 1, m)
            backend.wait_sends()
            x = torch.ones(4)
            backend.send(x, "pp", 1, 4)
            x.add_(1)  # against the contract: x is not copied
            try:
                backend.wait_sends()
            except CollectiveError as e:
                got["error"] = str(e)
        else:
            for m in (2, 3):
                backend.post_recv(torch.empty(2, 3), "pp", 0, m)
            template = torch.empty(2, 3)
            for m in (1, 3, 2):
                got[m] = backend.recv(template, "pp", 0, m)
            backend.recv(torch.empty(4), "pp", 0, 4)
    return got


def test_gloo_point_to_point_posted_receives_and_unmodified_sends():
    sender, receiver = spawn(_p2p_worker, 2, timeout=120)
    for m in (1, 2, 3):
        assert torch.equal(receiver[m], torch.full((2, 3), float(m))), m
    assert "modified in place while it was being sent" in sender["error"]


def _sum_order_inputs():
    # Magnitudes from 1e-3 to 1e4: a sum of four of them rounds differently in another order.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, 64, 3, generator=g)
    return x * torch.pow(10.0, torch.randint(-3, 5, x.shape, generator=g).float())


def _reduce_scatter_calls(rank):
    from autoshard.runtime import current

    backend, x = current().backend, _sum_order_inputs()[rank]
    # A leading dim of one makes the rank blocks of dim 1 a view of the input, not a copy: the
    # backend must not take that memory for its spare buffers (the next reduce-scatter of that
    # size would write into the caller's tensor).
    row = x[:1].clone()
    row_copy = row.clone()
    row_sum = backend.reduce_scatter(row, "x", 1)
    backend.reduce_scatter_async(row.reshape(-1) * 2, "x", 0).wait()
    return (backend.reduce_scatter(x, "x", 1), backend.reduce_scatter_async(x.reshape(-1), "x", 0).wait(),
            backend.reduce_scatter_async(x, "x", 1).wait(), backend.reduce_scatter_async(x[:4], "x", 0).wait(),
            row_sum, row, row_copy, backend.all_gather(row, "x", 1), backend.all_gather(x, "x", 2),
            backend.all_gather_async(x, "x", 1).wait(), backend.all_gather_async(row, "x", 1).wait())


def _reduce_scatter_worker(rank, world_size):
    mesh = Mesh({"x": 4})
    with rank_context(mesh, rank, DistributedBackend(mesh)):
        return _reduce_scatter_calls(rank)


def test_gloo_reduce_scatter_sums_in_rank_order_like_the_simulation():
    """Reduce-scatters on gloo (an all-to-all and a sum in rank order) equal the simulated
    backend's bit for bit on 4 processes, blocking or started early, on dim 0 or another dim,
    and so do gathers on other dims; results are contiguous, inputs untouched."""
    got = spawn(_reduce_scatter_worker, 4, timeout=120)
    sim = run_simulated(Mesh({"x": 4}), _reduce_scatter_calls)
    for rank in range(4):
        for g, s in zip(got[rank], sim[rank]):
            assert g.shape == s.shape and g.is_contiguous() and torch.equal(g, s), rank
        row, row_copy = got[rank][5:7]
        assert torch.equal(row, row_copy), rank  # the input of a reduce-scatter is left as it was
