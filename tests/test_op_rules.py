"""Property test of op rules: each op with random shapes, planned with every letter its rule
lets shard (loop letters, and contracted letters that leave a pending sum), on a 2-rank mesh,
must equal the unsharded op (outputs and parameter gradients) and must really split that op.

The letters come from the rule itself (``info.indexing`` of the op's node), named by the dims
of the operand carrying them; a rule that claimed a letter it cannot shard, or a rewrite that
shards it wrongly, fails here. Ops rewritten at capture (``rules.DECOMPOSITIONS``) are checked
the same way on every dim of their input.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from autoshard.ownership import Partial, Shard
from autoshard.passes.capture import capture
from autoshard.passes.dims import infer_dims
from autoshard.passes.rules import get_path

aten = torch.ops.aten
SEEDS = [0, 1]


class OpModule(torch.nn.Module):
    """``fn(self, *inputs)`` with parameters ``params`` (name -> tensor)."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            self.register_parameter(k, torch.nn.Parameter(v))

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def sizes(r: random.Random, n: int, choices=(2, 4, 6)) -> list:
    return [r.choice(choices) for _ in range(n)]


# ----------------------------------------------------------------------------- cases
# Each case: seed -> (op whose node is checked, module, args). The module returns
# (scalar loss, the op's result...) so both are compared.

def conv(nd, groups="one"):
    def make(seed):
        r = random.Random(seed)
        n, cin = sizes(r, 2)
        cout = r.choice([2, 4, 6]) if groups == "one" else cin
        space = sizes(r, nd, (4, 5, 6))
        g = {"one": 1, "depthwise": cin, "two": 2}[groups]
        w = torch.randn(cout, cin // g, *[3] * nd)
        fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]

        def f(m, x):
            y = fn(x, m.w, m.b, padding=1, groups=g)
            return (y * y).sum(), y
        op = {1: aten.conv1d.default, 2: aten.conv2d.default, 3: aten.conv3d.default}[nd]
        return op, OpModule(f, w=w, b=torch.randn(cout)), (torch.randn(n, cin, *space),)
    return make


def along(kind):
    def make(seed):
        r = random.Random(seed)
        shape = sizes(r, 3)
        d = r.randrange(3)

        def f(m, x):
            y = x * m.w
            if kind == "topk":
                v, i = torch.topk(y, 2, dim=d)
            else:
                v, i = torch.sort(y, dim=d, descending=seed % 2 == 1)
            return (v * v).sum(), v, i
        op = aten.topk.default if kind == "topk" else aten.sort.default
        return op, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)
    return make


def gather(seed):
    r = random.Random(seed)
    shape = sizes(r, 3)
    d = r.randrange(3)
    ishape = list(shape)
    ishape[d] = r.choice([2, 4])
    index = torch.randint(0, shape[d], ishape)

    def f(m, x, idx):
        y = torch.gather(x * m.w, d, idx)
        return (y * y).sum(), y
    return aten.gather.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape), index)


def histc(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        h = torch.histc(x, bins=4, min=-1.0, max=1.0)
        return (h * m.w).sum(), h
    return aten.histc.default, OpModule(f, w=torch.randn(4)), (torch.randn(shape).clamp(-0.99, 0.99),)


def chunk(seed):
    r = random.Random(seed)
    shape = sizes(r, 3, (4, 6))
    d = r.randrange(3)

    def f(m, x):
        a, b = torch.chunk(x * m.w, 2, dim=d)
        y = a * b
        return (y * y).sum(), y
    return aten.chunk.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def index_put(seed):
    r = random.Random(seed)
    rows, n, h = r.choice([4, 6]), r.choice([2, 4]), r.choice([2, 4, 6])
    idx = torch.randint(0, rows, (n,))

    def f(m, x, i):
        v = x * m.w
        base = torch.zeros(rows, h).index_put_((i,), v, accumulate=True)
        return (base * base).sum(), base
    # written in place; made functional at capture (passes/functionalize.py)
    return aten.index_put.default, OpModule(f, w=torch.randn(n, h)), (torch.randn(n, h), idx)


def in_place(kind):
    def make(seed):
        r = random.Random(seed)
        shape = sizes(r, 3)

        def f(m, x):
            y = x * m.w
            if kind == "div_":
                y /= y.sum(-1, keepdim=True).abs() + 1.0  # a router's normalization
            else:
                y += x
            return (y * y).sum(), y
        op = aten.div.Tensor if kind == "div_" else aten.add.Tensor  # made functional at capture
        return op, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)
    return make


def scatter(kind):
    """x.scatter_(d, index, src) / scatter_(d, index, value) / scatter_add_ / index_add_ on a
    value computed from a parameter; the index has fewer positions along d than x."""
    def make(seed):
        r = random.Random(seed)
        shape = sizes(r, 3, (4, 6))
        d = r.randrange(3)
        ishape = list(shape)
        ishape[d] = 2
        g = torch.Generator().manual_seed(seed)
        index = torch.randint(0, shape[d], ishape, generator=g)
        if kind == "scatter":  # overwriting: distinct positions per slice (no last-write race)
            index = torch.rand(shape, generator=g).argsort(dim=d).narrow(d, 0, 2)
        rows = torch.randint(0, shape[d], (4,), generator=g)

        def f(m, x, idx, rows):
            y = x * m.w
            src = torch.tanh(y).narrow(d, 0, 2 if kind != "index_add" else 4) * 2
            if kind == "scatter":
                y = y.clone().scatter_(d, idx, src)
            elif kind == "scatter_value":
                y = y.clone().scatter_(d, idx, -1.5)
            elif kind == "scatter_add":
                y = y.clone().scatter_add_(d, idx, src)
            else:
                y = y.clone().index_add_(d, rows, src, alpha=0.5)
            return (y * y).sum(), y
        op = {"scatter": aten.scatter.src, "scatter_value": aten.scatter.value, "scatter_add": aten.scatter_add.default,
              "index_add": aten.index_add.default}[kind]
        return op, OpModule(f, w=torch.randn(shape)), (torch.randn(shape), index, rows)
    return make


def binary(kind):
    def make(seed):
        r = random.Random(seed)
        shape = sizes(r, 2)

        def f(m, x):
            y = x * m.w
            z = torch.where(x > 0, y, 0.5) if kind == "where" else torch.min(y, x)
            return (z * z).sum(), z
        op = aten.where.ScalarOther if kind == "where" else aten.min.other
        return op, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)
    return make


def pad(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        y = F.pad(x * m.w, (0, 1), value=-1.0)
        return (y * y).sum(), y
    return aten.pad.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def diff(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        y = x * m.w
        z = torch.diff(y, dim=-1, prepend=y[:, :1] - 1)
        return (z * z).sum(), z
    return aten.diff.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def batch_norm(seed):
    r = random.Random(seed)
    shape = sizes(r, 3)

    def f(m, x):  # eval mode: the running statistics of each channel (dim 1)
        y = F.batch_norm(x * m.w, m.mean, m.var, weight=m.g, bias=m.b, training=False)
        return (y * y).sum(), y
    c = shape[1]
    model = OpModule(f, w=torch.randn(shape), g=torch.randn(c), b=torch.randn(c))
    model.register_buffer("mean", torch.randn(c))
    model.register_buffer("var", torch.rand(c) + 0.5)
    return aten.batch_norm.default, model, (torch.randn(shape),)


def clamp_tensor(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        y = x * m.w
        z = torch.clamp(y, min=x * 0.5 - 0.1, max=m.hi)  # tensor bounds, the upper one broadcast
        return (z * z).sum(), z
    return aten.clamp.Tensor, OpModule(f, w=torch.randn(shape), hi=torch.rand(shape[-1])), (torch.randn(shape),)


def concat(seed):
    r = random.Random(seed)
    shape = sizes(r, 3)
    d = r.randrange(3)

    def f(m, x):
        y = torch.concat((x * m.w, x - m.w), dim=d)  # torch.concat: an alias of cat
        return (y * y).sum(), y
    return aten.concat.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def stack(seed):
    """Interleaved (rotate-every-two) RoPE: halves stacked on a new trailing dim, then merged."""
    r = random.Random(seed)
    shape = sizes(r, 2) + [r.choice([2, 4])]
    d = r.randrange(4)

    def f(m, x):
        y = x * m.w
        a, b = y[..., ::2], y[..., 1::2]
        z = torch.stack([-b, a], dim=d)
        return (z * z).sum(), z
    return aten.stack.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def complex_rope(op):
    """Complex RoPE as PyTorch-native Llama definitions write it: pairs of the head dim viewed as
    complex numbers, multiplied by a rotation (torch.polar) and viewed back as pairs."""
    def make(seed):
        r = random.Random(seed)
        b, s, h = sizes(r, 3)
        d = r.choice([2, 4])

        def f(m, x, angles):
            q = x * m.w
            qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
            rot = torch.polar(torch.ones_like(angles), angles).unsqueeze(0).unsqueeze(2)  # [1, s, 1, d/2]
            out = torch.view_as_real(qc * rot).flatten(3).type_as(x)
            return (out * out.cos()).sum(), out
        return op, OpModule(f, w=torch.randn(b, s, h, d)), (torch.randn(b, s, h, d), torch.randn(s, d // 2))
    return make


def repeat(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)
    reps = [r.choice([1, 2]), 1, 1] if seed % 2 else [1, r.choice([1, 3])]

    def f(m, x):
        y = (x * m.w).repeat(*reps)
        return (y * y).sum(), y
    return aten.repeat.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def softplus(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        y = F.softplus(x * m.w, beta=1.0 + seed)
        return (y * y).sum(), y
    return aten.softplus.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def transposed(kind):
    """``x @ W.T`` linears (``.T`` is aten.numpy_T; ``.mT`` swaps the last two dims)."""
    def make(seed):
        r = random.Random(seed)
        n, i, o = sizes(r, 3)

        def f(m, x):
            y = x @ (m.w.T if kind == "T" else m.w.mT)
            return (y * y).sum(), y
        op = aten.numpy_T.default if kind == "T" else aten.mT.default
        return op, OpModule(f, w=torch.randn(o, i)), (torch.randn(n, i),)
    return make


def outer(seed):
    r = random.Random(seed)
    n, k = sizes(r, 2)

    def f(m, x, t):
        y = torch.outer(t, x * m.w)
        return (y * y).sum(), y
    return aten.outer.default, OpModule(f, w=torch.randn(k)), (torch.randn(k), torch.randn(n))


def einsum(seed):
    """torch.einsum as state-space and attention code writes it: a batched contraction."""
    r = random.Random(seed)
    b, l, d, n = sizes(r, 4)
    eq = ["bld,dn->bln", "b l d, b n d -> b l n", "...d,dn->...n"][seed % 3]

    other = (b, n, d) if "b n d" in eq else (d, n)

    def f(m, x, y):
        z = torch.einsum(eq, x * m.w, y * m.v)
        return (z * z).sum(), z
    return (aten.einsum.default, OpModule(f, w=torch.randn(b, l, d), v=torch.randn(other)),
            (torch.randn(b, l, d), torch.randn(other)))


def tile(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        y = (x * m.w).tile((2,) if seed % 2 else (2, 1, 1))
        return (y * y).sum(), y
    return aten.tile.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def logsumexp(seed):
    r = random.Random(seed)
    shape = sizes(r, 3)

    def f(m, x):
        y = torch.logsumexp(x * m.w, dim=seed % 3)
        return (y * y).sum(), y
    return aten.logsumexp.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def pooled(kind):
    def make(seed):
        r = random.Random(seed)
        n, c = sizes(r, 2)
        space = [4, 6][: 1 if kind == "pool1d" else 2]

        def f(m, x):
            y = x * m.w
            if kind == "group_norm":
                z = F.group_norm(y, 2, m.g, m.b)
            else:
                z = (F.adaptive_avg_pool1d if kind == "pool1d" else F.adaptive_avg_pool2d)(y, 2)
            return (z * z).sum(), z
        op = {"pool1d": aten.adaptive_avg_pool1d.default, "pool2d": aten.adaptive_avg_pool2d.default,
              "group_norm": aten.group_norm.default}[kind]
        norm = dict(g=torch.randn(c), b=torch.randn(c)) if kind == "group_norm" else {}
        return op, OpModule(f, w=torch.randn(n, c, *space), **norm), (torch.randn(n, c, *space),)
    return make


def hardtanh(seed):
    r = random.Random(seed)
    shape = sizes(r, 2)

    def f(m, x):
        y = F.hardtanh(x * m.w * 4, -1.0, 2.0) + F.hardswish(x * m.w)
        return (y * y).sum(), y
    return aten.hardtanh.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


def expand_as(seed):
    """Decomposed at capture into expand: the expanded dim follows the other tensor's split."""
    r = random.Random(seed)
    b, n = sizes(r, 2)

    def f(m, x):
        y = (x * m.w).sum(-1, keepdim=True).expand_as(x) * m.w
        return (y * y).sum(), y
    return aten.expand.default, OpModule(f, w=torch.randn(b, n)), (torch.randn(b, n),)


def vector_norm(seed):
    r = random.Random(seed)
    shape = sizes(r, 3)

    def f(m, x):
        y = torch.linalg.vector_norm(x * m.w, dim=-1, keepdim=bool(seed % 2))
        return (y * y).sum(), y
    return aten.linalg_vector_norm.default, OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)


CASES = {
    "conv1d": conv(1), "conv2d": conv(2), "conv3d": conv(3), "conv2d_depthwise": conv(2, "depthwise"),
    "conv2d_groups": conv(2, "two"), "topk": along("topk"), "sort": along("sort"), "gather": gather,
    "histc": histc, "chunk": chunk, "index_put_": index_put, "div_": in_place("div_"), "add_": in_place("add_"),
    "scatter": scatter("scatter"), "scatter.value": scatter("scatter_value"), "scatter_add": scatter("scatter_add"),
    "index_add": scatter("index_add"), "where.ScalarOther": binary("where"), "min.other": binary("min"), "pad": pad, "diff": diff,
    "batch_norm": batch_norm, "clamp.Tensor": clamp_tensor, "concat": concat,
    'stack': stack,
    'view_as_complex': complex_rope(aten.view_as_complex.default),
    'view_as_real': complex_rope(aten.view_as_real.default),
    'polar': complex_rope(aten.polar.default),
    'repeat': repeat,
    'softplus': softplus,
    'numpy_T': transposed("T"),
    'mT': transposed("mT"),
    'outer': outer,
    'einsum': einsum,
    'tile': tile,
    'logsumexp': logsumexp,
    'adaptive_avg_pool1d': pooled("pool1d"),
    'adaptive_avg_pool2d': pooled("pool2d"),
    'group_norm': pooled("group_norm"),
    'hardtanh': hardtanh,
    'expand_as': expand_as,
    'linalg_vector_norm': vector_norm,
}
STRICT = {"stack", "view_as_complex", "view_as_real", "polar", "repeat", "softplus", "numpy_T", "mT", "outer", "einsum",
          "tile", "logsumexp", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "group_norm", "hardtanh",
          "expand_as", "linalg_vector_norm"}


def shardable(cap, op):
    """{dim name: (letter, summed?)} for every letter the op's rule lets shard."""
    info = infer_dims(cap.graph, {i.name: i.target for i in cap.inputs})
    node = next(n for n in cap.graph.nodes if n.target == op)
    ix = info.indexing[node]
    out = {}
    for letter in (ix.loop - ix.local) | ix.summed:
        for path, letters in ix.inputs:
            if letter in letters:
                atoms = info.of(get_path(node, path))[letters.index(letter)]
                out[info.dim_name(atoms)] = (letter, letter in ix.summed)
                break
    return node, out


def check_exact(plan, model, args, split_sum=False):
    """Outputs and parameter gradients equal the unsharded op's, to fp32 rounding at the
    values' scale: a sum over a split dim (a contraction, a parameter's gradient over a split
    batch) adds two halves then their sum, and CPU convolution kernels block a smaller batch or
    channel count differently, so the order of additions differs (atol 1e-6 x the largest
    magnitude; 1e-5 x for split contractions)."""
    model.zero_grad()
    ref = model(*args)
    ref[0].backward()
    got = plan.simulate(*args)
    for a, b in zip(got, ref):
        b = b.detach()
        scale = max(1.0, float(b.abs().max())) if b.dtype.is_floating_point else 0.0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=(1e-5 if split_sum else 1e-6) * scale)
    _, grads = plan.simulate_grads(*args)
    for n, p in model.named_parameters():
        # a gradient is a sum over the split batch or space: its rounding scales with its size
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6 * max(1.0, float(p.grad.abs().max())),
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_shardable_letter_matches_the_unsharded_op(case, seed):
    op, model, args = CASES[case](seed)
    cap = capture(model, args)
    node, names = shardable(cap, op)
    expect = {"conv2d_groups": 1, "histc": 2}.get(case)  # grouped conv: only the batch; histc: both dims summed
    assert names, f"{case}: the rule shards nothing"
    if expect is not None:
        assert len(names) == expect, names
    for name, (letter, summed) in names.items():
        # the rules real model code needs: strict, so nothing the layout splits is gathered whole
        plan = autoshard.autoshard(model, args, mesh=Mesh({"x": 2}), layout={name: "x"}, captured=cap,
                                   strict=case in STRICT)
        check_exact(plan, model, args, split_sum=summed)
        place = plan.program.placements[node.name][0][0]
        assert isinstance(place, Partial if summed else Shard), (case, name, letter, place)


@pytest.mark.parametrize("dim", [0, 1, None])
def test_repeat_interleave_keeps_the_split_of_its_dim(dim):
    """Decomposed at capture (unsqueeze, expand, reshape): a split of the repeated dim carries
    over (each rank repeats its own rows), and the result equals torch's."""
    r = random.Random(dim or 7)
    shape = sizes(r, 2)

    def f(m, x):
        y = (x * m.w).repeat_interleave(3, dim=dim)
        return (y * y).sum(), y
    model, args = OpModule(f, w=torch.randn(shape)), (torch.randn(shape),)
    cap = capture(model, args)
    assert not any(n.target == aten.repeat_interleave.self_int for n in cap.graph.nodes)
    for d in range(2):
        plan = autoshard.autoshard(model, args, mesh=Mesh({"x": 2}), layout={f"w:{d}": "x"}, captured=cap)
        check_exact(plan, model, args)
        out = plan.program.output_placements[1][0]
        split = dim == d or (dim is None and d == 0)
        assert isinstance(out, Shard) == (split or (dim is not None and d != dim)), (dim, d, out)
