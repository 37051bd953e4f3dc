"""Per-step overhead of the runtime: what a plan's program does beyond the model's own ops.

On a mesh axis of size one a collective is its input: the program must not call the backend
(no rendezvous, no bucket copies) and must still train exactly like the single-device model.
Unit gradient packing writes each gradient once into the flat reduce-scatter buffer; a gradient
bucket flattens its gradients into a buffer of its own and hands the sum back as views."""
import sys
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.runtime import Backend, rank_context
from autoshard.runtime.primitives.buckets import flatten, unflatten
from autoshard.runtime.primitives.zero_units import pack_grads, pack_shards, unpack_full, unpack_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.models import llama_tiny  # noqa: E402
from exactness import assert_training_within_spread, train_steps  # noqa: E402


class NoCalls(Backend):
    """A backend that fails on any communication."""

    def __getattribute__(self, name):
        if name in ("check",):
            return object.__getattribute__(self, name)
        raise AssertionError(f"the program called the backend's {name} on a mesh of size one")


@pytest.mark.parametrize("stage", [0, 3])
def test_mesh_of_one_calls_no_backend_and_trains_exactly(stage):
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 1}), dims=dims, layout={"batch": "dp"}, train=True,
                               zero_stage=stage)
    assert any(c.kind == "all_reduce" for c in plan.collectives)  # the plan lists them; they cost nothing
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    with rank_context(plan.mesh, 0, NoCalls()) as ctx:
        local = plan.build(0)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        losses = train_steps(local, opt, [args] * 3)
        assert ctx.trace  # still recorded, as on any mesh
    params = {local.fqn_of[n]: p.detach() for n, p in local.named_parameters()}
    # Adam amplifies rounding in tiny gradients: within single-device training's own float32
    # spread (float32 against float64, per parameter tensor; tests/exactness.py)
    assert_training_within_spread(losses, params, model, [args] * 3, make_opt)


def test_pack_grads_layout_matches_blocks():
    """Row r of the packed buffer is block r of every gradient along its storage dim, also
    when cast to a wider dtype on the way (derived here with chunk, not with the packer)."""
    n = 2
    g1 = torch.arange(24.0).reshape(4, 6)
    g2 = torch.arange(10.0).reshape(2, 5) + 100
    flat = pack_grads([g1, g2], (1, 0), n).view(n, -1)
    for r in range(n):
        want = torch.cat([g1.chunk(n, 1)[r].reshape(-1), g2.chunk(n, 0)[r].reshape(-1)])
        assert torch.equal(flat[r], want)
    wide = pack_grads([g1.bfloat16(), g2.bfloat16()], (1, 0), n, dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, flat.reshape(-1))
    # and the gather side inverts the shard packing
    shards = [g1.chunk(n, 1)[0].contiguous(), g2.chunk(n, 0)[0].contiguous()]
    rows = torch.cat([pack_shards([g1.chunk(n, 1)[r], g2.chunk(n, 0)[r]]) for r in range(n)])
    full = unpack_full(rows, [tuple(s.shape) for s in shards], (1, 0), n)
    assert torch.equal(full[0], g1) and torch.equal(full[1], g2)
    assert [tuple(t.shape) for t in unpack_shards(flat[0], [(4, 3), (1, 5)])] == [(4, 3), (1, 5)]


@pytest.mark.parametrize("shapes", [[(3, 4), (0, 4), (5,), (2, 3)], [(6,)]], ids=["several", "one"])
def test_bucket_flatten_is_its_own_buffer_and_unflatten_views_it(shapes):
    """The bucket buffer holds the gradients one after the other (a transposed one by value),
    is not a view of them also for a single gradient (the all-reduce writes its sum into it),
    and the views given back as gradients have each gradient's shape and alias the buffer."""
    ts = [torch.arange(float(torch.Size(s).numel())).reshape(s) + 10 * i for i, s in enumerate(shapes)]
    ts[0] = ts[0].t().contiguous().t() if ts[0].dim() == 2 else ts[0]  # non-contiguous where 2-d
    before = [t.clone() for t in ts]
    flat = flatten(ts, out=torch.empty(sum(t.numel() for t in ts)))
    assert flat.tolist() == [x for t in before for x in t.flatten().tolist()]
    into = torch.full((flat.numel(),), -1.0, dtype=torch.float64)  # a given buffer, another dtype
    assert flatten(ts, out=into) is into and into.tolist() == flat.tolist()
    flat += 1000
    for t, b in zip(ts, before):
        assert torch.equal(t, b)  # the inputs are untouched: the buffer is not a view of them
    views = unflatten(flat, ts)
    assert [tuple(v.shape) for v in views] == [tuple(t.shape) for t in ts]
    for v, b in zip(views, before):
        assert torch.equal(v, b + 1000)
    flat.zero_()
    assert all(not v.any() for v in views)  # views of the buffer, not copies
