"""Column-parallel linears with their input-gradient all-reduce overlapped with their weight
gradients: ``runtime/primitives/overlap_linear.py`` (the fused autograd node) and ``passes/overlap_linear.py``
(the pass that puts it into tensor-parallel programs). The fused program must be the unfused
one bit for bit, and the all-reduce must be in flight while the weight gradients are computed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard.passes.overlap_linear import OVERLAP, overlap_linear_sums  # noqa: E402
from autoshard.runtime.primitives import collectives as C  # noqa: E402
from autoshard.runtime import mark_varying, run_simulated  # noqa: E402
from autoshard.runtime.transport.backend import Pending  # noqa: E402
from autoshard.runtime.transport.rank_context import current  # noqa: E402
from autoshard.runtime.primitives.overlap_linear import varying_linears  # noqa: E402
from autoshard.runtime.transport import simulated  # noqa: E402
from autoshard.runtime.transport.simulated import SimulatedBackend  # noqa: E402
from examples.models import llama_tiny  # noqa: E402

aten = torch.ops.aten


def _data(outs, bias, shape=(4, 8, 64)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    ws = [torch.randn(o, shape[-1], generator=g) for o in outs]
    bs = [torch.randn(o, generator=g) if bias else None for o in outs]
    return x, ws, bs


def _step(rank, x0, ws0, bs0, fused, setup=lambda ctx: None, microbatches=1, gather_dim=None):
    """One rank: layer norm, the linears (fused or as mark_varying + aten.linear; with
    ``gather_dim``, reading token rows gathered by all_gather_varying), a loss that weighs the
    outputs differently; returns the gradients of x, weights, biases and the outputs."""
    setup(current())
    x = (x0 * (rank + 1)).requires_grad_()
    ws = [(w + rank).requires_grad_() for w in ws0]
    bs = [(b - rank).requires_grad_() if b is not None else None for b in bs0]
    for mb in range(microbatches):
        if mb == microbatches - 1:
            current().defer_axes = frozenset()  # the last microbatch sends the accumulated sums
        h = torch.nn.functional.layer_norm(x * (mb + 1), x.shape[-1:])
        if fused:
            ys = varying_linears(h, "tp", ws, bs, tag=1, gather_dim=gather_dim)
        else:
            m = mark_varying(h, "tp", tag=1) if gather_dim is None else C.all_gather_varying(h, "tp", gather_dim, tag=1)
            ys = [aten.linear.default(m, w) if b is None else aten.linear.default(m, w, b) for w, b in zip(ws, bs)]
        loss = sum((y * y).sum() * (i + 1) + y.sin().sum() for i, y in enumerate(ys))
        loss.backward()
    return [x.grad, *(w.grad for w in ws), *(b.grad for b in bs if b is not None), *(y.detach() for y in ys)]


def _both(mesh, *data, **kw):
    return [run_simulated(autoshard.Mesh(mesh), lambda r: _step(r, *data, fused=f, **kw)) for f in (False, True)]


def _assert_equal(unfused, fused):
    for rank, (a, b) in enumerate(zip(unfused, fused)):
        for k, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p, q), f"rank {rank}, value {k}: fused differs from unfused"


@pytest.mark.parametrize("outs,bias", [((24, 16, 8), False), ((32,), True), ((24, 16, 8), True)])
def test_fused_linears_equal_unfused_bitwise(outs, bias):
    _assert_equal(*_both({"tp": 2}, *_data(outs, bias)))


@pytest.mark.parametrize("gather_dim", [1, 0])
def test_fused_gather_linears_equal_unfused_bitwise(gather_dim):
    """Sequence parallelism: each rank's token rows gathered for the linears; backward
    reduce-scatters the input gradient. Also widened, accumulated, and on one rank."""
    data = _data((24, 16, 8), True)
    _assert_equal(*_both({"tp": 2}, *data, gather_dim=gather_dim))
    _assert_equal(*_both({"tp": 1}, *data, gather_dim=gather_dim))

    def wide(ctx):
        ctx.reduce_dtype = torch.float64
    _assert_equal(*_both({"tp": 2}, *data, setup=wide, gather_dim=gather_dim))

    def no_sync(ctx):
        ctx.defer_axes = frozenset({"tp"})
    _assert_equal(*_both({"tp": 2}, *data, setup=no_sync, microbatches=3, gather_dim=gather_dim))


def test_group_sums_input_gradients_in_autograd_order():
    """Three linears: autograd adds their input gradients last-created first, ((dv + dk) + dq).
    On these values the other order gives other bits, so the equalities check the order."""
    x, ws, _ = _data((24, 24, 24), False)
    h = torch.nn.functional.layer_norm(x, x.shape[-1:]).requires_grad_()
    g = [torch.randn(4, 8, 24, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    dq, dk, dv = (gi.reshape(32, 24).mm(w).reshape(4, 8, 64) for gi, w in zip(g, ws))
    assert not torch.equal((dv + dk) + dq, (dq + dk) + dv)
    unfused = torch.autograd.grad([torch.nn.functional.linear(h, w) for w in ws], [h], g)[0]
    fused = run_simulated(autoshard.Mesh({"tp": 1}), lambda r: torch.autograd.grad(
        varying_linears(h, "tp", ws, (None,) * 3, tag=1), [h], g)[0])[0]
    assert torch.equal(unfused, (dv + dk) + dq) and torch.equal(fused, unfused)


def test_fused_linears_exact_under_mixed_precision_accumulation_and_one_rank():
    data = _data((24, 16), True)
    _assert_equal(*_both({"tp": 1}, *data))

    def wide(ctx):
        ctx.reduce_dtype = torch.float64  # sums in float64, cast back
    _assert_equal(*_both({"tp": 2}, *data, setup=wide))

    def no_sync(ctx):
        ctx.defer_axes = frozenset({"tp"})  # gradient accumulation: sums stashed, sent once
    unfused, fused = _both({"tp": 2}, *data, setup=no_sync, microbatches=3)
    _assert_equal(unfused, fused)


class _MatmulLog(TorchDispatchMode):
    """Logs the shape of every matmul (aten.mm) run on this thread."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.mm.default:
            self.log.append(("mm", tuple(out.shape)))
        return out


@pytest.mark.parametrize("gather_dim", [None, 1])
def test_sum_is_in_flight_while_weight_gradients_are_computed(monkeypatch, gather_dim):
    """The input gradient's all-reduce (or, for gathered token rows, its reduce-scatter on the
    gathered dim) starts after the three input-gradient matmuls and is waited for after the
    weight gradients."""
    x0, ws0, _ = _data((24, 16, 8), False)  # x: 32 rows of 64 (each rank's, 64 once gathered)
    logs: dict = {0: [], 1: []}
    method = "all_reduce_async" if gather_dim is None else "reduce_scatter_async"

    def spied(self, x, axis, *dims, consume=False):
        log = logs[current().rank]
        log.append(("start", dims))
        done = getattr(SimulatedBackend, method)(self, x, axis, *dims, consume=consume)

        class Logged(Pending):
            def wait(self):
                log.append(("wait", None))
                return done.wait()
        return Logged(None)

    monkeypatch.setattr(simulated, "SimulatedBackend", type("Spy", (SimulatedBackend,), {method: spied}))

    def rank(r):
        x = x0.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in ws0]
        ys = varying_linears(torch.nn.functional.layer_norm(x, (64,)), "tp", ws, (None,) * 3, tag=1,
                             gather_dim=gather_dim)
        with _MatmulLog(logs[r]):
            sum(y.sum() for y in ys).backward()

    run_simulated(autoshard.Mesh({"tp": 2}), rank)
    rows = 32 if gather_dim is None else 64
    for log in logs.values():
        kinds = [e[0] for e in log]
        assert kinds.count("start") == kinds.count("wait") == 1, log
        start, wait = kinds.index("start"), kinds.index("wait")
        assert log[start][1] == (() if gather_dim is None else (gather_dim,)), log
        dx = [i for i, e in enumerate(log) if e == ("mm", (rows, 64))]
        dw = [i for i, e in enumerate(log) if e in (("mm", (24, 64)), ("mm", (16, 64)), ("mm", (8, 64)))]
        assert len(dx) == len(dw) == 3, log
        assert max(dx) < start < min(dw) and max(dw) < wait, log


# ---- the pass, on tensor-parallel programs --------------------------------------------------

class _Block(torch.nn.Module):
    """Pre-norm attention and GELU MLP as in PyTorch's test Transformer (benchmarks/vs_pytorch.py)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.wq(h), self.wk(h), self.wv(h)))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(torch.nn.functional.gelu(self.w1(self.ffn_norm(x))))


class _Transformer(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2, seq=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.layers = torch.nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, tokens, labels):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = torch.nn.functional.linear(self.norm(x), self.tok.weight)  # tied output head
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


TP_DIMS = {"tokens": "batch seq", "labels": "batch seq", "tok.weight": "vocab hidden",
           "*.wq.weight": "heads hidden", "*.wk.weight": "heads hidden", "*.wv.weight": "heads hidden",
           "*.wo.weight": "hidden heads", "*.w1.weight": "ffn hidden", "*.w1.bias": "ffn", "*.w2.weight": "hidden ffn"}


SP = {"heads": "tp", "ffn": "tp", "vocab": "tp", "seq": "tp?"}


def _transformer_plan(fuse=True, layout=None, **options):
    torch.manual_seed(0)
    model = _Transformer()
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=TP_DIMS,
                               layout=layout or {"heads": "tp", "ffn": "tp", "vocab": "tp"}, train=True,
                               search=False, **{"disable_passes": () if fuse else ("overlap_linear",), **options})
    return plan, args


def _fused_nodes(plan):
    return [n for n in plan.graph_module.graph.nodes if n.target is varying_linears]


def test_pass_fuses_every_column_parallel_input_of_a_tp_transformer(monkeypatch):
    plan, _ = _transformer_plan()
    unfused, _ = _transformer_plan(fuse=False)
    # per block the q/k/v input (three linears) and the MLP input (one, with bias); the head's input
    assert [len(n.args[2]) for n in _fused_nodes(plan)] == [3, 1, 3, 1, 1]
    assert not [n for n in plan.graph_module.graph.nodes if n.target is C.mark_varying]
    marks = [n for n in unfused.graph_module.graph.nodes if n.target is C.mark_varying]
    assert sorted(n.kwargs["tag"] for n in _fused_nodes(plan)) == sorted(n.kwargs["tag"] for n in marks)
    # the plan lists the same collectives; the fused sums say so
    key = [(c.kind, c.axes, c.bytes, c.phase, c.tag, c.op) for c in plan.collectives]
    assert key == [(c.kind, c.axes, c.bytes, c.phase, c.tag, c.op) for c in unfused.collectives]
    fused_tags = {n.kwargs["tag"] for n in marks}
    assert all(c.why.endswith(OVERLAP) == (c.tag in fused_tags and c.phase == "backward") for c in plan.collectives)
    assert str(plan.cost) == str(unfused.cost)  # priced as the unfused program


def test_pass_fuses_the_gathers_of_a_sequence_parallel_transformer(monkeypatch):
    plan, _ = _transformer_plan(layout=SP)
    unfused, _ = _transformer_plan(fuse=False, layout=SP)
    gathers = [n for n in unfused.graph_module.graph.nodes if n.target is C.all_gather_varying]
    # per block the q/k/v rows (three linears) and the MLP rows (one, with bias); the head's rows
    assert [(len(n.args[2]), n.kwargs.get("gather_dim")) for n in _fused_nodes(plan)] == [(3, 1), (1, 1)] * 2 + [(1, 1)]
    assert sorted(n.kwargs["tag"] for n in _fused_nodes(plan)) == sorted(n.kwargs["tag"] for n in gathers)
    assert not [n for n in plan.graph_module.graph.nodes if n.target is C.all_gather_varying]
    key = [(c.kind, c.axes, c.bytes, c.phase, c.tag, c.op) for c in plan.collectives]
    assert key == [(c.kind, c.axes, c.bytes, c.phase, c.tag, c.op) for c in unfused.collectives]
    assert str(plan.cost) == str(unfused.cost)


@pytest.mark.parametrize("options", [{}, {"checkpoint": True}, {"layout": SP}])
def test_fused_plan_equals_unfused_bitwise(monkeypatch, options):
    plan, args = _transformer_plan(**options)
    unfused, _ = _transformer_plan(fuse=False, **options)
    assert _fused_nodes(plan)
    out, grads = plan.simulate_grads(*args)
    ref_out, ref_grads = unfused.simulate_grads(*args)
    assert torch.equal(out, ref_out) and grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    trace = [[(r.kind, r.tag, r.phase, r.bytes) for r in t] for t in plan.last_trace]
    assert trace == [[(r.kind, r.tag, r.phase, r.bytes) for r in t] for t in unfused.last_trace]


def test_llama_query_key_value_fused_though_not_adjacent():
    model, args, dims = llama_tiny(with_labels=True)
    opts = dict(mesh=autoshard.Mesh({"tp": 2}), dims=dims, layout={"heads": "tp", "ffn": "tp"}, train=True)
    plan = autoshard.autoshard(model, args, **opts)
    unfused = autoshard.autoshard(model, args, **opts, disable_passes=("overlap_linear",))
    assert [len(n.args[2]) for n in _fused_nodes(plan)][:2] == [3, 2]  # q, k, v; gate, up
    out, grads = plan.simulate_grads(*args)
    ref_out, ref_grads = unfused.simulate_grads(*args)
    assert torch.equal(out, ref_out) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def _graph(extra_use):
    """x -> mark_varying -> linear(w1), linear(w2); ``extra_use``: 'add' reads the mark_varying
    too, 'weight' reads w2 between the two linears."""
    g = fx.Graph()
    x, w1, w2 = (g.placeholder(n) for n in ("x", "w1", "w2"))
    x.meta["val"], w1.meta["val"], w2.meta["val"] = torch.empty(4, 8), torch.empty(6, 8), torch.empty(6, 8)
    h = g.call_function(aten.relu.default, (x,))
    h.meta["val"] = torch.empty(4, 8)
    mv = g.call_function(C.mark_varying, (h, "tp"), {"tag": 0})
    mv.meta.update(val=torch.empty(4, 8), autoshard={"where": "", "why": "test", "tag": 0, "grad": True})
    a = g.call_function(aten.linear.default, (mv, w1))
    if extra_use == "weight":
        g.call_function(aten.mul.Tensor, (w2, 2.0))
    b = g.call_function(aten.linear.default, (mv, w2))
    outs = [a, b]
    if extra_use == "add":
        outs.append(g.call_function(aten.add.Tensor, (mv, 1.0)))
    g.output(tuple(outs))
    return g


@pytest.mark.parametrize("extra_use,fused", [(None, True), ("add", False), ("weight", False)])
def test_pass_fuses_only_when_it_is_the_same_computation(extra_use, fused):
    g = _graph(extra_use)
    before = g.python_code("self").src
    assert overlap_linear_sums(g) == ([0] if fused else [])
    if not fused:
        assert g.python_code("self").src == before
    else:
        g.lint()
        assert [n.target for n in g.nodes].count(C.mark_varying) == 0
