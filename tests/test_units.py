"""ZeRO-3 units: parameters gathered and reduce-scattered in one flat buffer per unit, prefetched.
Grouping moves the same values, so every policy trains bit for bit like one collective per
parameter; the plan lists one all-gather and one reduce-scatter per unit with its parameters."""
import collections
import sys
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.passes.zero_units import unit_of
from autoshard.runtime import all_gather_varying, run_simulated
from autoshard.runtime.primitives.collectives import gather_unit, start_gather_unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.models import llama_tiny  # noqa: E402

MESH, LAYOUT = {"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"}


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def zero3(units, reshard=True, **config):
    model, args, dims = llama_tiny(with_labels=True, **config)
    plan = autoshard.autoshard(model, args, mesh=Mesh(MESH), dims=dims, layout=LAYOUT, train=True, zero_stage=3,
                               reshard_after_forward=reshard, units=units)
    return plan, args


def test_gather_unit_equals_per_parameter_gathers_and_gradients():
    """Two shards on different dims (0 and 1) in one flat buffer: the same whole tensors, and
    (through the asynchronous landing in .grad) the same gradient blocks."""
    torch.manual_seed(0)
    w, b, x = torch.randn(4, 6), torch.randn(4, 4), torch.randn(2, 3, 6)

    def body(rank, grouped):
        ws = torch.nn.Parameter(w.chunk(2, 0)[rank].clone())
        bs = torch.nn.Parameter(b.chunk(2, 1)[rank].clone())
        wf, bf = (gather_unit((ws, bs), "dp", (0, 1), tag=0) if grouped
                  else (all_gather_varying(ws, "dp", 0), all_gather_varying(bs, "dp", 1)))
        assert torch.equal(wf, w) and torch.equal(bf, b)
        ((x[rank] @ wf.T) @ bf).pow(2).sum().backward()
        return ws.grad, bs.grad

    grouped = run_simulated(Mesh({"dp": 2}), lambda r: body(r, True))
    single = run_simulated(Mesh({"dp": 2}), lambda r: body(r, False))
    for g, s in zip(grouped, single):
        assert all(torch.equal(a, c) for a, c in zip(g, s))


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_units_train_bit_for_bit_like_one_collective_per_parameter(reshard):
    """3 AdamW steps (dp=2 x tp=2): per block, one unit for everything, and a user's prefixes
    all give the per-parameter result exactly; one forward gather per unit and step."""
    results = {}
    for units in ("param", "block", "model", ["layers.*"]):
        plan, args = zero3(units, reshard)
        results[str(units)] = plan.simulate_train([args] * 3, optimizer=adamw)
        n_units = len(plan.program.units) if units != "param" else None
        ran = collections.Counter((r.phase, r.kind) for r in plan.last_trace[0] if r.op == "gather_unit")
        if n_units:
            assert ran[("forward", "all_gather")] == ran[("backward", "reduce_scatter")] == 3 * n_units
    ref_losses, ref_params = results["param"]
    for key, (losses, params) in results.items():
        assert losses == ref_losses, key
        for fqn, p in ref_params.items():
            assert torch.equal(params[fqn], p), (key, fqn)


def test_plan_lists_one_gather_and_reduce_scatter_per_unit_with_its_parameters():
    plan, _ = zero3("block", num_layers=3)
    units = plan.program.units
    assert [u[0] for u in units] == ["<before blocks>", "layers.0", "layers.1", "layers.2", "<after blocks>"]
    for name, tag, members in units:
        recs = [c for c in plan.collectives if c.tag == tag]
        assert sorted((c.phase, c.kind) for c in recs) == [("backward", "all_gather"), ("backward", "reduce_scatter"),
                                                           ("forward", "all_gather")]
        fwd = next(c for c in recs if c.phase == "forward")
        assert len(fwd.params) == len(members) and all(p.startswith(name) for p in fwd.params if "<" not in name)
        # the bytes are this rank's shards of every member
        shards = [n.meta["val"] for n in plan.graph_module.graph.nodes if n.op == "placeholder" and n.name in members]
        assert fwd.bytes == sum(v.numel() * v.element_size() for v in shards)
        assert "one flat buffer" in fwd.why
    assert not any(c.op == "all_gather_varying" and "ZeRO" in c.why for c in plan.collectives)
    assert "layers.1" in str(plan) and "gather_unit" in plan.graph_module.code


def test_unit_policies_and_errors():
    assert unit_of("model.layers.3.attention.wq.weight", "block") == "model.layers.3"
    assert unit_of("model.norm.weight", "block") == ""
    assert unit_of("model.layers.3.attention.wq.weight", ["model.layers.*.attention", "model.layers.*"]) \
        == "model.layers.3.attention"
    assert unit_of("model.layers.3.mlp.w1.weight", ["model.layers.*.attention"]) == ""
    with pytest.raises(ValueError, match="units="):
        zero3("blocks")


def test_gradient_accumulation_with_units_is_exact():
    """no_sync over units: the flat gradient buffers are summed locally and reduce-scattered
    once, in the last microbatch; equals one collective per parameter bit for bit."""
    out = {}
    for units in ("param", "block"):
        plan, args = zero3(units)
        out[units] = plan.simulate_train([[args, args]] * 2, optimizer=adamw, microbatches=2)
        if units == "block":
            rs = [r for r in plan.last_trace[0] if r.kind == "reduce_scatter" and r.axis == "dp"]
            assert len(rs) == 2 * len(plan.program.units)  # 2 steps, the second microbatch of each
    assert out["param"][0] == out["block"][0]
    assert all(torch.equal(out["param"][1][k], v) for k, v in out["block"][1].items())


def test_backward_prefetch_looks_past_a_small_unit():
    """Resharded units gathered again in backward: when the next unit backward needs is small
    (a final norm), the big one after it is started as well, before backward reaches it."""
    from autoshard.runtime import current, reshard_after_forward

    torch.manual_seed(0)
    wa, wb, wc, x = torch.randn(8, 8), torch.randn(8), torch.randn(8, 8), torch.randn(4, 8)

    def body(rank):
        ctx = current()
        ctx.reshard_tags = frozenset({1, 2, 3})
        sa, sb, sc = (torch.nn.Parameter(w.chunk(2, 0)[rank].clone()) for w in (wa, wb, wc))
        xr = x.clone().requires_grad_()  # so that every product saves its parameter
        started = []
        with reshard_after_forward():
            (a,) = gather_unit((sa,), "dp", (0,), tag=1)
            h1 = xr @ a
            (b,) = gather_unit((sb,), "dp", (0,), tag=2)
            h2 = h1 * b
            (c,) = gather_unit((sc,), "dp", (0,), tag=3)
            # fires once c's product has been differentiated, before b's is reached
            h2.register_hook(lambda g: started.extend(
                r.tag for r in ctx.trace if r.phase == "backward" and r.kind == "all_gather"))
            (h2 @ c).pow(2).sum().backward()
        return started

    for started in run_simulated(Mesh({"dp": 2}), body):
        assert started == [3, 2, 1]


class _Embedded(torch.nn.Module):
    """Token and position embeddings, then two blocks and a head, plus a penalty on the position
    table: its gradient comes in whole there, so the table stays out of the units (gathered for
    replicated use by a plain all_gather between them, its rows' gradient summed where they meet
    the tokens', passes/grad_regions.py)."""

    def __init__(self, vocab=16, seq=8, dim=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, labels):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        loss = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return loss + 1e-2 * self.pos.weight.pow(2).mean()


def test_unit_collectives_do_not_hold_up_the_plain_ones_between_units():
    """A group runs its collectives one after another. Forward: the position table's
    all_gather must not queue behind the first block's prefetched gather, so that gather
    starts after it. Backward: the first block's reduce-scatter is held until the sum of the
    position rows' gradient has run. The order is the same on every rank, and training stays
    bit for bit per-parameter's."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g)
    out = {}
    for units in ("param", "block"):
        torch.manual_seed(0)
        plan = autoshard.autoshard(_Embedded(), (tokens, labels), mesh=Mesh({"dp": 2}),
                                   dims={"tokens": "batch seq", "labels": "batch seq"}, layout={"batch": "dp"},
                                   train=True, search=False, zero_stage=3, units=units)
        out[units] = plan.simulate_train([(tokens, labels)] * 2, optimizer=adamw)
    pos_tag = next(c.tag for c in plan.collectives if c.op == "all_gather" and c.where == "pos")
    first_block = next(tag for name, tag, _ in plan.program.units if name == "layers.0")
    pos_sum = next(c.tag for c in plan.collectives if c.op == "mark_varying" and c.phase == "backward")
    orders = []
    for trace in plan.last_trace:
        fwd = [r.tag for r in trace if r.phase == "forward" and r.kind == "all_gather"]
        assert fwd.index(pos_tag) < fwd.index(first_block)
        bwd = [r.tag for r in trace if r.phase == "backward" and r.kind in ("all_reduce", "reduce_scatter")]
        assert bwd.index(pos_sum) < bwd.index(first_block)
        orders.append([(r.phase, r.kind, r.tag) for r in trace])
    assert orders[0] == orders[1]
    # the separate start is costed with its unit, not as a second gather
    graph = plan.program.graph_module.graph
    starts = [n for n in graph.nodes if n.target is start_gather_unit]
    compute = plan.cost["compute"]
    assert starts
    for n in starts:
        graph.erase_node(n)
    plan._autoshard_cost = None  # (cached on the plan)
    assert plan.cost["compute"] == compute
    assert out["param"][0] == out["block"][0]
    assert all(torch.equal(out["param"][1][k], v) for k, v in out["block"][1].items())
