"""The collective table of the runtime tests: per (mesh, axis, collective, dims) case, every rank's
input and upstream gradient and the output and input gradient the conventions prescribe; and a
data x tensor parallel MLP built from the collectives by hand. The simulated mesh
(tests/test_runtime.py) and gloo processes (tests/test_runtime_dist.py) run the same cases."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard import Mesh
from autoshard.runtime import COLLECTIVES, all_reduce, current, mark_varying, shard_slice

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
    """The sum of ``parts`` in list order (the simulated backend's order)."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def chunk(t, d, i, n):
    """Piece ``i`` of ``n`` equal pieces of ``t`` along dim ``d``."""
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
    """(output, input gradient, trace) of ``op`` on this rank's piece of ``case``."""
    x = case["x"][rank].clone().requires_grad_()
    y = COLLECTIVES[op](x, axis, *dims, tag=tag)
    y.backward(case["g"][rank])
    trace = [(t.kind, t.axis, t.phase, t.bytes, t.tag, t.op) for t in current().trace]
    return y.detach(), x.grad, trace


TABLE = [(m, a, op, dims) for m, a in MESHES for op in DIMS for dims in DIMS[op]]


def mlp_reference(x, w1, b1, w2, b2, g):
    """The unsharded MLP's output and the gradients of its input and parameters for upstream ``g``."""
    x, w1, b1, w2, b2 = (t.clone().requires_grad_() for t in (x, w1, b1, w2, b2))
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(g)
    return y.detach(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad


def mlp_tensors(seed=0):
    """Seeded (x, w1, b1, w2, b2, upstream gradient) of the MLP."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=gen)
    w1, b1 = torch.randn(32, 16, generator=gen) / 4, torch.randn(32, generator=gen)
    w2, b2 = torch.randn(16, 32, generator=gen) / 4, torch.randn(16, generator=gen)
    g = torch.randn(8, 16, generator=gen)
    return x, w1, b1, w2, b2, g


def mlp_dp_tp_rank(rank):
    """Data x tensor parallel MLP on mesh {"dp": 2, "tp": 2}: DDP falls out of mark_varying.

    Runs as the current rank context (simulated or distributed); returns local results.
    """
    ctx = current()
    dp, tp = ctx.mesh.axis_size("dp"), ctx.mesh.axis_size("tp")
    x, w1, b1, w2, b2, g = mlp_tensors(1)
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
    """Every rank's results of :func:`mlp_dp_tp_rank` against the unsharded MLP's, rank by rank."""
    x, w1, b1, w2, b2, g = mlp_tensors(1)
    y, *grads = mlp_reference(x, w1, b1, w2, b2, g)
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
