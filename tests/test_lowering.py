"""The lowering interface (passes/lowering.py): a visitor registered for a node writes it
through ``Lowering`` alone, and the rewrite carries on from the placement it binds."""
import warnings

import pytest
import torch
from torch import nn

from autoshard import Mesh
from autoshard.ownership import R, Shard
from autoshard.passes.capture import capture
from autoshard.passes.dims import infer_dims
from autoshard.passes.spmd import resolve_layout, rewrite

aten = torch.ops.aten


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6, bias=False)

    def forward(self, x):
        return torch.relu(self.proj(x))


def _rewrite(visit):
    cap = capture(Head(), (torch.randn(4, 8),))
    g = cap.graph
    info = infer_dims(g, {i.name: i.target for i in cap.inputs})
    mesh = Mesh({"dp": 2})
    linear = next(n for n in g.nodes if n.target is aten.linear.default)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rewrite(g, info, resolve_layout(info, {}, mesh), mesh, set(), regions={linear: visit}), linear


def _rows_linear(lw, node):
    """The example of docs/extending.md: the linear on this rank's rows, recorded as an
    (imaginary) gather its runtime function would run."""
    x, w = node.args[:2]
    rows = (Shard(0),)
    local_x = lw.convert(x, rows, varying=(), consumer=node, reason="this lowering works on row blocks")
    tag = lw.new_tags(1)
    new = lw.call(aten.linear.default, (local_x, lw.local(w)), like=node, place=rows)
    lw.record("all_gather", "dp", nbytes=lw.nbytes(new), phase="forward", node=node, tag=tag, op="rows_linear",
              why="example: the rows' results gathered")
    lw.bind(node, new, rows)


def test_a_lowering_writes_the_node_and_the_rewrite_carries_on():
    program, linear = _rewrite(_rows_linear)
    assert program.placements[linear.name] == [(Shard(0),)]
    nodes = list(program.graph_module.graph.nodes)
    lin = next(n for n in nodes if n.target is aten.linear.default)
    assert tuple(lin.meta["val"].shape) == (2, 6)  # this rank's rows
    assert lin.args[0].target.__name__ == "shard_slice"  # the convert the lowering asked for
    mine = [c for c in program.collectives if c.op == "rows_linear"]
    assert len(mine) == 1 and mine[0].axes == ("dp",) and mine[0].where == "proj" and mine[0].node == linear.name
    assert mine[0].bytes == 2 * 6 * 4
    # relu needs the linear's result whole: the rewrite gathers it, with a tag of its own
    gathers = [c for c in program.collectives if c.op == "all_gather"]
    assert len(gathers) == 1 and gathers[0].tag != mine[0].tag
    tags = [n.kwargs["tag"] for n in nodes if "tag" in n.kwargs]
    assert len(tags) == len(set(tags)) and mine[0].tag not in tags


def test_record_refuses_a_kind_the_runtime_does_not_have():
    def visit(lw, node):
        lw.record("broadcast", "dp", nbytes=0, phase="forward", node=node, tag=lw.new_tags(1), op="x", why="")

    with pytest.raises(ValueError, match="'broadcast' is not one of runtime.collectives.COMM_KINDS"):
        _rewrite(visit)


def test_a_lowering_may_decline_to_the_rule():
    ruled, linear = _rewrite(lambda lw, node: lw.visit_rule(node))
    assert [n.target for n in ruled.graph_module.graph.nodes if n.op == "call_function"] == [
        aten.linear.default, aten.relu.default]
    assert ruled.placements[linear.name] == [(R,)] and not ruled.collectives
