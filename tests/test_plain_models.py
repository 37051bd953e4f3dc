"""Plain-PyTorch models (``tests/helpers/plain_models.py``) planned as practitioners lay them out, with
``strict=True`` (nothing the layout shards is gathered whole in forward): data parallel, and
Megatron tensor parallel on top (heads and ffn on tp). Each plan equals the unsharded model
(loss and every gradient, ``tests/helpers/exactness.py``) and runs the textbook forward collectives: the
loss's sum and count on dp, one tp all-reduce per row-parallel linear (two per layer).
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.passes.rules import rule_for

from tests.helpers import plain_models
from tests.helpers.exactness import assert_exact, block_of

aten = torch.ops.aten


def plan_for(model, args, dims, layout, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.UnsupportedOpWarning)  # every op has a rule
        return autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=dims, layout=layout, strict=True)


def forward(plan, kind, axis):
    return [c for c in plan.collectives if c.phase == "forward" and c.kind == kind and c.axes == (axis,)]


@pytest.mark.parametrize("name", list(plain_models.PLAIN))
def test_plain_models_plan_strict_exact_with_megatron_collectives(name):
    build, tp_layout, per_layer = plain_models.PLAIN[name]
    model, args, dims = build()
    plan = plan_for(model, args, dims, {"batch": "dp", **tp_layout}, {"dp": 2, "tp": 2})
    assert_exact(plan, model, args)
    assert not [c for c in plan.collectives if c.phase == "forward" and c.kind == "all_gather"], \
        [(c.where, c.why) for c in plan.collectives if c.phase == "forward" and c.kind == "all_gather"]
    assert len(forward(plan, "all_reduce", "dp")) == 2  # the loss's sum and token count
    # the block of the partial sum (a residual add in the model's own forward has no block)
    blocks = [block_of(c.where) if block_of(c.where) is not None else int(re.search(r" in layers\.(\d+)", c.why)[1])
              for c in forward(plan, "all_reduce", "tp")]
    assert sorted(blocks) == sorted(list(range(plain_models.LAYERS)) * per_layer), \
        [(c.where, c.why) for c in forward(plan, "all_reduce", "tp")]


def test_x_at_w_transposed_linears_shard_their_weights():
    """``x @ W.T`` (aten.numpy_T) linears: the weights are split by ffn / heads on tp (not held
    whole), so each rank stores and computes its block."""
    model, args, dims = plain_models.gpt()
    plan = plan_for(model, args, dims, {"batch": "dp", "heads": "tp", "ffn": "tp"}, {"dp": 2, "tp": 2})
    for name, dim in (("layers.0.w_fc", 0), ("layers.0.w_out", 1), ("layers.0.w_o", 1)):
        assert plan.placement_of(name)[1] == autoshard.ownership.Shard(dim), (name, plan.placement_of(name))


@pytest.mark.skipif(rule_for(aten.batch_norm.default) is None, reason="aten.batch_norm has no sharding rule yet")
def test_cnn_with_batch_norm_is_data_parallel_and_exact():
    model, args, dims = plain_models.cnn()
    plan = plan_for(model, args, dims, {"batch": "dp"}, {"dp": 2})
    assert_exact(plan, model, args)
    assert not [c for c in plan.collectives if c.phase == "forward" and c.kind == "all_gather"]


class _MergeThenSplit(torch.nn.Module):
    """nn.MultiheadAttention's chain: [s, b, h*d] viewed as [s, b*h, d], transposed, viewed as
    [b, h, s, d]; and rows flattened for a linear, unflattened after it."""

    def __init__(self, s, b, h, d):
        super().__init__()
        self.shape = (s, b, h, d)
        self.w = torch.nn.Parameter(torch.randn(s, b, h * d))
        self.proj = torch.nn.Linear(h * d, h * d)

    def forward(self, x):
        s, b, h, d = self.shape
        y = (x * self.w).view(s, b * h, d).transpose(0, 1).view(b, h, s, d)
        z = self.proj(y.permute(2, 0, 1, 3).reshape(s * b, h * d)).view(s, b, h * d)
        return (z * z).sum(), y, z


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_merged_then_split_dims_stay_sharded(dim):
    """Composed at capture (passes/view_chains.py): each dim of x keeps its split through the
    chain (before, a dim merged after another was gathered whole), and values are unchanged."""
    from autoshard.ownership import Shard
    torch.manual_seed(dim)
    model, args = _MergeThenSplit(4, 2, 4, 2), (torch.randn(4, 2, 8),)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"x": 2}), layout={f"w:{dim}": "x"}, strict=True)
    ref = model(*args)
    for got, want in zip(plan.simulate(*args), ref):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    # y keeps the split; so does z, but for h*d, which proj contracts (its output is a new dim)
    outs = plan.program.output_placements[1:] if dim < 2 else plan.program.output_placements[1:2]
    assert all(isinstance(p[0], Shard) for p in outs), plan.program.output_placements
