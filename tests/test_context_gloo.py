"""Ring attention for real: cp=2 x dp=2 on 4 gloo processes equals the simulated mesh, bit for bit.

Every rank plans the tiny Llama itself (seeded, identical everywhere) and runs its program under
a :class:`DistributedBackend`: K/V blocks hop the ring with ``isend``/``recv``. Each rank's
outputs, gradients and trace must be *identical* to that rank in ``run_simulated``: the ring
only copies tensors, every summing collective here has 2 ranks (a + b == b + a in floating
point), and both sides run one intra-op thread.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.runtime import DistributedBackend, current, rank_context, run_simulated  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from examples.models import llama_tiny  # noqa: E402

pytestmark = pytest.mark.slow


def _plan(order):
    model, args, dims = llama_tiny(with_mask=True, with_labels=True, seq=16)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "cp": 2}), dims=dims,
                               layout={"batch": "dp", "seq": "cp"}, train=True,
                               context={"order": order, "variant": "ring"})
    return plan, args


def _plain(trace):
    return [(r.kind, r.axis, r.phase, r.tag, r.op, tuple(r.shape), str(r.dtype), r.bytes) for r in trace]


def _worker(rank, world_size, order):
    plan, args = _plan(order)
    with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)) as ctx:
        outs, grads = plan.run_rank(rank, *args, grads=True)
    return dict(outs=outs, grads=grads, trace=_plain(ctx.trace))


@pytest.mark.parametrize("order", ["zigzag"])  # contiguous: same code path, simulated in test_context_parallel
def test_ring_attention_gloo_equals_simulation_bitwise(order):
    real = spawn(_worker, 4, order, timeout=120)
    plan, args = _plan(order)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = run_simulated(plan.mesh, lambda r: (*plan.run_rank(r, *args, grads=True), _plain(current().trace)))
    finally:
        torch.set_num_threads(threads)
    for rank, (outs, grads, trace) in enumerate(sim):
        got = real[rank]
        assert got["trace"] == trace, f"rank {rank}: collectives differ"
        assert any(t[4] == "ring_attention" for t in trace)
        for a, b in zip(got["outs"], outs):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b), f"rank {rank}: output differs"
        assert set(got["grads"]) == set(grads)
        for name, g in grads.items():
            assert torch.equal(got["grads"][name], g), f"rank {rank}: gradient of {name} differs"
