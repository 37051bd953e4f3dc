"""In-place and scatter-style writes along sharded and whole dims: exact or refused.

torch.export keeps ``y[0] = 0`` as a ``select`` view and a ``fill_`` into it; before writes were
made functional at capture (``passes/functionalize.py``) a layout that split the written dim
gathered the view's base into a copy and the write landed there: the loss of
``test_clone_then_write_row_on_dp`` came out as if the write never happened. Each family below
writes into ``y`` (``[batch, seq, hid]``, computed from parameters) along dim ``d`` and reads
``y`` afterwards; every plan must reproduce the single-device outputs and every gradient, with
the written dim split on {x: 2} and {x: 4}, split on one axis of {a: 2, b: 2} with another dim on
the other, and whole on {x: 2} with another dim split.

Tolerance: ``test_property.close`` (fp32 bounds; where they fail, at most 10x the single-device
fp32 result's own distance from the fp64 reference).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import LayoutError, Mesh
from tests.helpers.exactness import close

B, S, H = 4, 8, 8
NAMES = ["batch", "seq", "hid"]  # dims of y, by position
DIMS = {"x": "batch seq hidden", "inp.weight": "hid hidden", "src.weight": "hid hidden", "out.weight": "hidden hid"}


def _at(d, i):
    return (slice(None),) * d + (i,)


def _pos_mask(y, d):
    n = y.shape[d]
    return (torch.arange(n) % 3 == 1).view([n if k == d else 1 for k in range(y.dim())])


# family -> write(y, z, x, d): in place into y; z (like y) needs gradients, x is the input
WRITES = {
    "index_scalar": lambda y, z, x, d: y.__setitem__(_at(d, 1), 0.0),
    "index_tensor": lambda y, z, x, d: y.__setitem__(_at(d, -1), z.select(d, 0) * 2),
    "slice": lambda y, z, x, d: y.__setitem__(_at(d, slice(1, 3)), z.narrow(d, 2, 2)),
    "slice_step": lambda y, z, x, d: y.__setitem__(_at(d, slice(1, None, 2)), z.narrow(d, 0, y.shape[d] // 2)),
    "shift_copy": lambda y, z, x, d: y.narrow(d, 1, y.shape[d] - 1).copy_(z.narrow(d, 0, y.shape[d] - 1)),
    "select_fill": lambda y, z, x, d: y.select(d, 2).fill_(3.0),
    "narrow_zero": lambda y, z, x, d: y.narrow(d, 1, 2).zero_(),
    "masked_fill": lambda y, z, x, d: y.masked_fill_((z.detach() > 0.3) & _pos_mask(y, d), 0.5),
    "bool_index": lambda y, z, x, d: y.__setitem__(z.detach() > 0.5, -1.0),
    "index_put": lambda y, z, x, d: y.__setitem__(_at(d, torch.tensor([3, 0])), z.narrow(d, 1, 2)),
    "index_put_acc": lambda y, z, x, d: y.transpose(0, d).index_put_(
        (torch.tensor([1, 1, 2]),), z.transpose(0, d).narrow(0, 0, 3), accumulate=True),
    "scatter": lambda y, z, x, d: y.scatter_(d, z.detach().argsort(dim=d), z * 2),
    "scatter_value": lambda y, z, x, d: y.scatter_(d, z.argmax(dim=d, keepdim=True), 7.0),
    "scatter_add": lambda y, z, x, d: y.scatter_add_(d, (z.detach() * 10).long().remainder(y.shape[d]), z),
    "index_add": lambda y, z, x, d: y.index_add_(d, torch.tensor([2, 0, 2]), z.narrow(d, 1, 3), alpha=0.5),
    "add_alias_read": lambda y, z, x, d: y.add_(z),
}


class Writes(nn.Module):
    """y = inp(x); a write into y (``WRITES[family]``) along dim d; y read after it (and a view
    of y taken before the write, which must see it)."""

    def __init__(self, family: str, d: int):
        super().__init__()
        self.family, self.d = family, d
        self.inp, self.src, self.out = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        y = self.inp(x)
        z = self.src(x)
        before = y.select(self.d, 1)  # a view taken before the write: it sees the write
        WRITES[self.family](y, z, x, self.d)
        h = self.out(torch.tanh(y))
        return h.sum() + (y * y).mean() + (before * 2).sum(), y


def layouts(d: int) -> list:
    """(mesh, layout): the written dim split, on one axis or two; and whole, another dim split."""
    name, other = NAMES[d], NAMES[(d + 1) % 3]
    return [({"x": 2}, {name: "x"}), ({"x": 4}, {name: "x"}), ({"a": 2, "b": 2}, {name: "a", other: "b"}),
            ({"x": 2}, {other: "x"})]


def reference(model, x):
    m = copy.deepcopy(model)
    out = m(x)
    out[0].backward()
    return tuple(o.detach() for o in out), {n: p.grad if p.grad is not None else torch.zeros_like(p)
                                            for n, p in m.named_parameters()}


def plan_for(model, x, mesh, layout, captured=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.UnsupportedOpWarning)
        return autoshard.autoshard(model, (x,), mesh=Mesh(dict(mesh)), dims=DIMS, layout=layout, captured=captured)


def assert_exact(plan, model, x, what: str):
    """Outputs of simulate and simulate_grads, and every gradient, against one device."""
    ref_out, ref_grads = reference(model, x)
    f64 = []

    def exact(k, grad=None):
        def get():
            if not f64:
                f64.append(reference(copy.deepcopy(model).double(), x.double()))
            return f64[0][0][k] if grad is None else f64[0][1][grad]
        return get

    for k, (o, r) in enumerate(zip(plan.simulate(x), ref_out)):
        close(o, r, f"{what}: output {k}", exact(k))
    out, grads = plan.simulate_grads(x)
    for k, (o, r) in enumerate(zip(out, ref_out)):
        close(o, r, f"{what}: simulate_grads output {k}", exact(k))
    for n, g in ref_grads.items():
        close(grads[n], g, f"{what}: grad of {n}", exact(0, n))


@pytest.mark.parametrize("d", [0, 1, 2], ids=NAMES)
@pytest.mark.parametrize("family", list(WRITES))
def test_write_is_exact(family, d):
    torch.manual_seed(d)
    model, x = Writes(family, d), torch.randn(B, S, H)
    captured = None
    for mesh, layout in layouts(d):
        plan = plan_for(model, x, mesh, layout, captured)
        captured = plan.captured
        assert_exact(plan, model, x, f"{family} along {NAMES[d]}, {mesh} {layout}")


class CloneWrite(nn.Module):
    """The smallest reproducer: ``y = x.clone(); y[0] = 0`` under plain data parallelism."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).clone()
        y[0] = 0
        return (y * y).sum()


def test_clone_then_write_row_on_dp():
    torch.manual_seed(0)
    model, x = CloneWrite(), torch.randn(4, 8)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    ref = model(x)
    torch.testing.assert_close(plan.simulate(x), ref.detach())
    # the write matters: without it the loss differs
    assert not torch.allclose(ref, (model.lin(x) ** 2).sum())
    out, grads = plan.simulate_grads(x)
    model.zero_grad()
    ref.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=lambda m: f"{n}: {m}")
    # the row write is elementwise on each rank's block of rows: nothing is gathered for it
    assert not [c for c in plan.collectives if c.kind == "all_gather"], [c.why for c in plan.collectives]


class ShiftRight(nn.Module):
    """Decoder inputs from labels, as encoder-decoder models shift them: slice and index writes
    into a fresh tensor, then the shifted tokens feed the embedding, the loss targets and a mask."""

    def __init__(self, vocab=16, hidden=8, start=3, loss_only=False):
        super().__init__()
        self.start, self.loss_only = start, loss_only
        self.emb, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = self.start
        shifted.masked_fill_(shifted == 5, 0)
        logits = self.head(self.emb(shifted))
        keep = (labels != 0).float()  # per position: the shifted tokens share the labels' sequence dim
        loss = F.cross_entropy(logits.transpose(1, 2), shifted) + (logits.sum(-1) * keep).sum() * 1e-2
        return loss if self.loss_only else (loss, shifted)


@pytest.mark.parametrize("mesh,layout", [({"tp": 2}, {"seq": "tp"}), ({"tp": 4}, {"seq": "tp"}),
                                         ({"dp": 2, "tp": 2}, {"batch": "dp", "seq": "tp"})],
                         ids=["seq2", "seq4", "dp2xseq2"])
def test_label_shift_with_seq_split(mesh, layout):
    torch.manual_seed(0)
    model = ShiftRight()
    labels = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = autoshard.autoshard(model, (labels,), mesh=Mesh(mesh), dims={"labels": "batch seq"}, layout=layout)
    ref = model(labels)
    out = plan.simulate(labels)
    assert torch.equal(out[1], ref[1])
    torch.testing.assert_close(out[0], ref[0].detach())
    out, grads = plan.simulate_grads(labels)
    model.zero_grad()
    ref[0].backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=lambda m: f"{n}: {m}")


class DetachedWrite(nn.Module):
    """A write through ``detach()`` (a view with no functional form): it stays in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        y.detach()[1].fill_(0.0)
        return (y * y).sum()


def test_write_that_stays_in_place_is_exact_or_refused():
    torch.manual_seed(0)
    model, x = DetachedWrite(), torch.randn(4, 8)
    with pytest.raises(LayoutError) as e:
        autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    msg = str(e.value)
    assert "\n" not in msg
    assert "fill_" in msg and "module '<root>'" in msg and "test_inplace_writes.py:" in msg, msg
    assert "would land in a copy" in msg, msg
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"tp": 2}), dims={"x": "batch h", "lin.weight": "o h"},
                               layout={"o": "tp"})
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(plan.simulate(x), ref)


@pytest.mark.slow
def test_exported_label_shift_passes_check_under_torchrun(tmp_path):
    """The label shift with the batch on dp and the sequence on tp, trained: run.py --check on 4
    gloo processes compares outputs, gradients and two optimizer steps with the unsharded model."""
    from tests.helpers.torchrun import torchrun
    torch.manual_seed(0)
    model = ShiftRight(loss_only=True)
    labels = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    plan = autoshard.autoshard(model, (labels,), mesh=Mesh({"dp": 2, "tp": 2}), dims={"labels": "batch seq"},
                               layout={"batch": "dp", "seq": "tp"}, train=True)
    path = plan.export(tmp_path / "out", (labels,))
    proc, _ = torchrun(path, 4, "--check", "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check passed" in proc.stdout and "outputs and gradients equal" in proc.stdout, proc.stdout
