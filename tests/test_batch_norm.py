"""BatchNorm, in eval and in training mode, on data and channel splits.

- eval mode: each element is normalized with its channel's running statistics, so a block of
  the batch, of the positions or of the channels computes alone: no gather (``strict=True``);
- training mode: statistics over the global batch, as the unsharded model computes them (a
  synchronized BatchNorm): the mean and the biased variance are sums divided by the global
  count, each one all-reduce of ``[C]`` on the data axis; the running statistics (unbiased
  variance) and ``num_batches_tracked`` are updated on every rank and come back: ``simulate``
  writes them into the model as calling it does, ``simulate_train`` returns them with the
  parameters.

Exactness: outputs, every gradient and every updated buffer against the single-device model
(``test_property.close``: fp32 bounds, and where they fail the fp64 reference decides, at most
10x the single-device fp32 error).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from tests.helpers.exactness import close


class CNN(nn.Module):
    """conv -> BatchNorm2d -> relu -> conv -> BatchNorm2d -> pool -> linear -> BatchNorm1d -> CE."""

    def __init__(self, channels=8, classes=5):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.fc, self.bn3 = nn.Linear(channels, classes), nn.BatchNorm1d(classes)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h))).mean((2, 3))
        return F.cross_entropy(self.bn3(self.fc(h)), y)


DIMS = {"x": "batch rgb height width", "y": "batch", "conv1.weight": "channels rgb - -",
        "bn1.[wbr]*": "channels", "conv2.weight": "out_channels channels - -", "bn2.[wbr]*": "out_channels"}
DP = {"batch": "dp"}
DP_TP = {"batch": "dp", "channels": "tp"}  # conv1's output channels and bn1 split on tp


def make(seed=0, batch=8, train=True):
    torch.manual_seed(seed)
    model = CNN().train(train)
    if not train:
        for bn in (model.bn1, model.bn2, model.bn3):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, 3, 6, 6, generator=g), torch.randint(0, 5, (batch,), generator=g))


def eager(model, args, dtype=torch.float32):
    """One forward and backward of a copy of ``model`` in ``dtype``: loss, gradients, buffers after."""
    m = copy.deepcopy(model).to(dtype)
    a = tuple(t.to(dtype) if t.is_floating_point() else t for t in args)
    loss = m(*a)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, {n: b.clone() for n, b in m.named_buffers()}


def f64_of(model, args):
    cache = []

    def get(kind, name=None):
        def value():
            if not cache:
                cache.append(eager(model, args, torch.float64))
            loss, grads, buffers = cache[0]
            return loss if kind == "loss" else (grads if kind == "grad" else buffers)[name]
        return value
    return get


def forward_collectives(plan, axis, kind=None):
    return [c for c in plan.collectives
            if c.phase == "forward" and c.axes == (axis,) and (kind is None or c.kind == kind)]


@pytest.mark.parametrize("mesh,layout", [({"dp": 2}, DP), ({"dp": 2, "tp": 2}, DP_TP), ({"tp": 2}, {"channels": "tp"})],
                         ids=["dp2", "dp2xtp2", "tp2"])
def test_eval_mode_is_per_channel_and_pointwise_in_batch(mesh, layout):
    model, args = make(train=False)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=DIMS, layout=layout, strict=True)
    if "dp" in mesh:  # nothing on dp in forward but the loss's sum and count
        assert len(forward_collectives(plan, "dp")) == 2, [c.why for c in forward_collectives(plan, "dp")]
    loss32, grads32, buffers32 = eager(model, args)
    exact = f64_of(model, args)
    before = {n: b.clone() for n, b in model.named_buffers()}
    out, grads = plan.simulate_grads(*args)
    close(out, loss32, "loss", exact("loss"))
    for n, g in grads32.items():
        close(grads[n], g, f"gradient of {n}", exact("grad", n))
    for n, b in model.named_buffers():  # eval mode updates nothing
        assert torch.equal(b, before[n]), n


@pytest.mark.parametrize("mesh,layout", [({"dp": 2}, DP), ({"dp": 4}, DP), ({"dp": 2, "tp": 2}, DP_TP)],
                         ids=["dp2", "dp4", "dp2xtp2"])
def test_train_mode_is_a_synchronized_batch_norm(mesh, layout):
    model, args = make()
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=DIMS, layout=layout, train=True, strict=True)
    # per BatchNorm one all-reduce of the mean and one of the variance ([C] each), plus the loss's two
    stats = [c for c in forward_collectives(plan, "dp", "all_reduce") if c.where.startswith("bn")]
    assert sorted(c.where for c in stats) == ["bn1", "bn1", "bn2", "bn2", "bn3", "bn3"], [(c.where, c.why) for c in stats]
    assert not forward_collectives(plan, "dp", "all_gather")
    loss32, grads32, buffers32 = eager(model, args)
    exact = f64_of(model, args)
    out, grads = plan.simulate_grads(*args)
    close(out, loss32, "loss", exact("loss"))
    for n, g in grads32.items():
        close(grads[n], g, f"gradient of {n}", exact("grad", n))
    # the running statistics the one forward updated are in the model, as after model(*args)
    for n, b in model.named_buffers():
        if b.is_floating_point():
            close(b, buffers32[n], f"buffer {n}", exact("buffer", n))
        else:
            assert torch.equal(b, buffers32[n]), (n, b, buffers32[n])
    assert model.bn1.num_batches_tracked.item() == 1


@pytest.mark.parametrize("mesh,layout,zero_stage", [({"dp": 2}, DP, 0), ({"dp": 4}, DP, 0), ({"dp": 2}, DP, 3),
                                                    ({"dp": 2, "tp": 2}, DP_TP, 0)],
                         ids=["dp2", "dp4", "dp2-zero3", "dp2xtp2"])
def test_training_steps_update_running_statistics_like_single_device(mesh, layout, zero_stage):
    model, args = make()
    batches = [make(seed=s)[1] for s in range(3)]
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=DIMS, layout=layout, train=True,
                               zero_stage=zero_stage)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731

    def train(dtype):
        m = copy.deepcopy(model).to(dtype)
        opt = sgd(list(m.parameters()))
        losses = []
        for x, y in batches:
            loss = m(x.to(dtype), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {**{n: p.detach() for n, p in m.named_parameters()}, **dict(m.named_buffers())}

    before = {n: b.clone() for n, b in model.named_buffers()}
    ref_losses, ref_state = train(torch.float32)
    losses, state = plan.simulate_train(batches, optimizer=sgd)
    f64 = []

    def exact(name):
        def get():
            if not f64:
                f64.append(train(torch.float64)[1])
            return f64[0][name]
        return get

    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert set(ref_state) == set(state)
    for n, v in ref_state.items():
        if v.is_floating_point():
            close(state[n], v, f"after 3 steps: {n}", exact(n))
        else:
            assert torch.equal(state[n], v), (n, state[n], v)
    assert state["bn2.num_batches_tracked"].item() == 3
    for n, b in model.named_buffers():  # the model's own buffers are left as they were
        assert torch.equal(b, before[n]), n


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return (self.proj(x) * self.calls).sum()


def test_a_replicated_buffer_update_comes_back_on_every_call():
    model, x = Counter(), torch.randn(4, 4)
    ref = copy.deepcopy(model)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    for call in (1, 2):  # each call sees the count the previous one left, as the model does
        expected = ref(x)
        close(plan.simulate(x), expected.detach(), f"call {call}")
        assert model.calls.item() == ref.calls.item() == call


class RandomBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("noise", torch.zeros(4))

    def forward(self, x):
        self.noise.copy_(torch.randn(4))
        return (self.proj(x) + self.noise).sum()


class ParameterWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        self.scale.mul_(2)
        return (self.proj(x) * self.scale).sum()


@pytest.mark.parametrize("model,pattern", [
    (RandomBuffer(), r"forward writes a random value into the buffer noise \(copy_.default in module <root> at "
                     r"test_batch_norm.py:\d+\); every rank would draw its own"),
    (ParameterWrite(), r"forward updates the parameter scale in place \(mul_.Tensor in module <root> at "
                       r"test_batch_norm.py:\d+\)"),
])
def test_state_updates_that_cannot_come_back_are_refused_in_one_line(model, pattern):
    before = {n: b.clone() for n, b in model.state_dict().items()}
    with pytest.raises(autoshard.UnsupportedModelError, match=pattern) as e:
        autoshard.autoshard(model, (torch.randn(4, 4),), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                            layout={"batch": "dp"})
    assert "\n" not in str(e.value)
    for n, b in model.state_dict().items():  # planning never touched the model's state
        assert torch.equal(b, before[n]), n


def test_batch_statistics_under_a_pipeline_or_recompute_are_refused():
    model, args = make()
    with pytest.raises(autoshard.UnsupportedModelError, match=r"batch's statistics in bn1 .*per microbatch"):
        autoshard.autoshard(model, args, mesh=Mesh({"pp": 2}), dims=DIMS, layout={}, train=True,
                            pipeline={"axis": "pp", "microbatches": 2})
    with pytest.raises(autoshard.UnsupportedModelError, match=r"buffer bn1\.\w+ in place .*checkpoint=True"):
        autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=DIMS, layout=DP, train=True, checkpoint=True)


def test_an_exported_training_run_checks_against_the_unsharded_model(tmp_path):
    """run.py's path (weights, program and inputs loaded as it does, ranks as threads): the
    first step's outputs and gradients and 3 AdamW steps' losses equal the unsharded model's."""
    from autoshard.passes.export import simulate_export
    model, args = make()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=DIMS, layout=DP, train=True)
    path = plan.export(tmp_path / "cnn", args, reference_steps=3)
    ranks = simulate_export(path, steps=3, check=True)
    assert all(r["ok"] for r in ranks), [r["problems"] for r in ranks]
