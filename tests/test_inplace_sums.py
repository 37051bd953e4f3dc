"""Forward sums written into their input where nothing else reads it (``passes/inplace_sums.py``
marks them ``consume=True``; the runtime sums in place and tells autograd). The simulated
backend sums into a consumed input as gloo does, so these run the in-place path."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import fx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.passes.inplace_sums import IN_PLACE, consume_sum_inputs  # noqa: E402
from autoshard.runtime import all_reduce, run_simulated  # noqa: E402
from autoshard.runtime.primitives import collectives as C  # noqa: E402
from test_overlap_linear import _transformer_plan  # noqa: E402

aten = torch.ops.aten


def _sums(plan):
    return [n for n in plan.graph_module.graph.nodes if n.target is C.all_reduce]


def test_row_parallel_sums_are_marked_and_equal_the_copying_program():
    plan, args = _transformer_plan()
    copying, _ = _transformer_plan(disable_passes=("inplace_sums",))
    # per block the partial sums of the attention output and of the MLP's second linear
    marked = [n for n in _sums(plan) if n.kwargs.get("consume")]
    assert [n.args[0].target for n in marked] == [aten.linear.default] * 4 == [n.args[0].target for n in _sums(plan)]
    assert not [n for n in _sums(copying) if n.kwargs.get("consume")]
    tags = {n.kwargs["tag"] for n in marked}
    assert all(c.why.endswith(IN_PLACE) == (c.tag in tags and c.phase == "forward") for c in plan.collectives)
    out, grads = plan.simulate_grads(*args)
    ref_out, ref_grads = copying.simulate_grads(*args)
    assert torch.equal(out, ref_out) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    trace = [[(r.kind, r.tag, r.phase, r.bytes) for r in t] for t in plan.last_trace]
    assert trace == [[(r.kind, r.tag, r.phase, r.bytes) for r in t] for t in copying.last_trace]


def _graph(producer, extra_reader=False):
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    y = g.call_function(producer, (x, w) if producer is aten.linear.default else (x,))
    d = g.call_function(aten.dropout.default, (y, 0.0, True))
    s = g.call_function(C.all_reduce, (d, "tp"), {"tag": 1})
    outs = (s, g.call_function(aten.sin.default, (y,))) if extra_reader else (s,)
    g.output(outs)
    return g, s


@pytest.mark.parametrize("producer,extra_reader,marked", [
    (aten.linear.default, False, True),
    (aten.linear.default, True, False),   # the linear's result is read again
    (aten.exp.default, False, False),     # exp's backward reads its result
])
def test_only_new_tensors_nothing_else_reads_are_consumed(producer, extra_reader, marked):
    g, s = _graph(producer, extra_reader)
    assert consume_sum_inputs(g) == ([1] if marked else [])
    assert s.kwargs.get("consume", False) is marked


def test_sum_is_written_into_the_input_and_gradients_stay_exact():
    w0 = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))

    def rank(r, consume):
        x = torch.full((3, 4), float(r + 1), requires_grad=True)
        w = w0.clone().requires_grad_()
        y = torch.nn.functional.linear(x, w)
        s = all_reduce(y, "tp", tag=1, consume=consume)
        same = s.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        (s * s).sum().backward()
        return same, s.detach(), x.grad, w.grad

    got = run_simulated(autoshard.Mesh({"tp": 2}), lambda r: rank(r, True))
    ref = run_simulated(autoshard.Mesh({"tp": 2}), lambda r: rank(r, False))
    for (same, *values), (ref_same, *ref_values) in zip(got, ref):
        assert same and not ref_same
        assert all(torch.equal(a, b) for a, b in zip(values, ref_values))


def test_a_consumed_tensor_that_backward_needs_fails_loudly():
    """Were a pass to mark a sum whose input autograd saved (exp's result), the in-place sum
    must not silently corrupt the gradient: autograd sees the write and refuses."""
    def rank(r):
        x = torch.full((3, 4), 0.1 * (r + 1), requires_grad=True)
        s = all_reduce(x.exp(), "tp", tag=1, consume=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            s.sum().backward()
        return True

    assert run_simulated(autoshard.Mesh({"tp": 2}), rank) == [True, True]
