"""Silent wrong results found by hostile inputs: each case is either exact
against the unsharded model (outputs and gradients, fp32 bounds) or refused with a documented
error or warning type."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from tests.helpers.exactness import assert_exact


# ----------------------------------------------------------------- 1. probability targets
class SoftCE(nn.Module):
    def __init__(self, classes=16, smoothing=0.0):
        super().__init__()
        self.proj = nn.Linear(8, classes)
        self.smoothing = smoothing

    def forward(self, x, target):
        logits = self.proj(x)
        if logits.dim() == 3:  # [N, L, C] -> [N, C, L]: a per-position loss
            logits = logits.transpose(1, 2)
        return F.cross_entropy(logits, target, label_smoothing=self.smoothing)


@pytest.mark.parametrize("mesh,layout", [({"dp": 1}, {}), ({"dp": 2}, {"batch": "dp"}),
                                         ({"dp": 2, "tp": 2}, {"batch": "dp", "cls": "tp"})])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_probability_targets_exact(mesh, layout, smoothing):
    torch.manual_seed(0)
    model = SoftCE(smoothing=smoothing)
    x = torch.randn(4, 8)
    target = torch.softmax(torch.randn(4, 16), -1)
    # torch's mean over probability targets divides by N, not N*C (independent reference)
    expected = -(torch.log_softmax(model.proj(x), -1) * ((1 - smoothing) * target + smoothing / 16)).sum() / 4
    torch.testing.assert_close(model(x, target), expected, rtol=1e-5, atol=1e-6)
    plan = autoshard.autoshard(model, (x, target), mesh=Mesh(mesh),
                               dims={"x": "batch hidden", "target": "batch cls", "proj.weight": "cls hidden",
                                     "proj.bias": "cls"}, layout=layout)
    assert_exact(plan, model, (x, target))


def test_cross_entropy_probability_targets_per_position():
    """[N, C, L] probability targets: torch divides by N*L."""
    torch.manual_seed(1)
    model = SoftCE(classes=6)
    x = torch.randn(4, 3, 8)
    target = torch.softmax(torch.randn(4, 6, 3), 1)
    plan = autoshard.autoshard(model, (x, target), mesh=Mesh({"dp": 2}),
                               dims={"x": "batch seq hidden", "target": "batch cls seq"}, layout={"batch": "dp"})
    assert_exact(plan, model, (x, target))


def test_cross_entropy_class_targets_still_exact():
    """Class-index targets keep dividing by the count of targets != ignore_index."""
    torch.manual_seed(2)
    model = SoftCE()
    x = torch.randn(8, 8)
    target = torch.tensor([1, -100, 3, 4, -100, 6, 7, 0])
    plan = autoshard.autoshard(model, (x, target), mesh=Mesh({"dp": 2}),
                               dims={"x": "batch hidden", "target": "batch"}, layout={"batch": "dp"})
    assert_exact(plan, model, (x, target))



class SumCE(nn.Module):
    def __init__(self, weighted, smoothing):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.register_buffer("weight", torch.linspace(0.5, 2.0, 16) if weighted else None)
        self.smoothing = smoothing

    def forward(self, x, target):
        return F.cross_entropy(self.proj(x), target, weight=self.weight, reduction="sum",
                               label_smoothing=self.smoothing)


@pytest.mark.parametrize("weighted,smoothing", [(False, 0.0), (True, 0.0), (True, 0.1)])
def test_a_summed_cross_entropy_sums_over_ranks_without_gathering_the_logits(weighted, smoothing):
    """reduction="sum" (class weights and smoothing included) is the sum of the per-position
    losses: a batch split across ranks sums it (one all-reduce of a scalar) instead of gathering
    the logits to compute it whole on every rank."""
    torch.manual_seed(3)
    model = SumCE(weighted, smoothing)
    x = torch.randn(8, 8)
    target = torch.tensor([1, -100, 3, 4, 15, 6, 7, 0])
    plan = autoshard.autoshard(model, (x, target), mesh=Mesh({"dp": 2}),
                               dims={"x": "batch hidden", "target": "batch"}, layout={"batch": "dp"})
    assert [(c.kind, c.bytes) for c in plan.collectives if c.phase == "forward"] == [("all_reduce", 4)]
    assert_exact(plan, model, (x, target))

# ----------------------------------------------------------------- 2. inputs other than the planned ones
class PerSample(nn.Module):
    """Divides by the batch size read from the input's shape, scales by a Python scalar, and
    branches on a Python bool: all three are fixed in the captured program."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, scale, flag=True):
        y = self.proj(x) * scale
        if flag:
            y = y + 1
        return y.sum() / x.shape[0]


def _per_sample_plan():
    torch.manual_seed(3)
    model = PerSample()
    x = torch.randn(4, 4)
    plan = autoshard.autoshard(model, (x, 2.0, True), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                               layout={"batch": "dp"})
    return model, x, plan


@pytest.mark.parametrize("call,pattern", [
    ((torch.randn(8, 4), 2.0, True), r"input x has shape \(8, 4\); the plan was made for shape \(4, 4\)"),
    ((torch.randn(4, 4, dtype=torch.float64), 2.0, True), r"input x has dtype float64; the plan was made for float32"),
    ((torch.randn(4, 4), 3.0, True), r"input scale is 3.0; the plan was made for 2.0"),
    ((torch.randn(4, 4), 2.0, False), r"input flag is False; the plan was made for True"),
    ((torch.randn(4, 4), 2, True), r"input scale is 2; the plan was made for 2.0"),
    ((torch.randn(4, 4), torch.tensor(2.0), True), r"input scale is a tensor of shape \(\); the plan was made for "
                                                   r"the value 2.0"),
])
def test_other_inputs_than_planned_are_refused(call, pattern):
    model, x, plan = _per_sample_plan()
    assert_exact(plan, model, (x, 2.0, True))  # the planned inputs are exact
    for run in (plan.simulate, plan.simulate_grads):
        with pytest.raises(autoshard.InputMismatchError, match=pattern) as e:
            run(*call)
        assert "\n" not in str(e.value)
    with pytest.raises(autoshard.InputMismatchError, match=pattern):
        plan.simulate_train([call])


class WithMask(nn.Module):
    def forward(self, x, mask=None):
        return (x * mask).sum() if mask is not None else x.sum()


@pytest.mark.parametrize("args,kwargs,pattern", [
    ((torch.ones(4, 2),), {}, r"^keyword input mask is missing: the plan was made for keyword inputs \['mask'\], got none"),
    ((torch.ones(4, 2),), {"mask": torch.ones(4, 2), "bias": 1.0},
     r"^keyword input bias not planned: the plan was made for keyword inputs \['mask'\], got \['mask', 'bias'\]"),
    ((torch.ones(4, 2), torch.ones(4, 2)), {}, r"^the call has 2 positional argument\(s\); the plan was made for 1"),
])
def test_a_call_of_another_structure_is_refused_in_one_line(args, kwargs, pattern):
    """A keyword input left out (or added, or passed by position) is named, not shown as two
    pytree specs."""
    x = torch.randn(4, 2)
    plan = autoshard.autoshard(WithMask(), (x,), {"mask": torch.ones(4, 2)}, mesh=Mesh({"dp": 2}),
                               dims={"x": "batch h", "mask": "batch h"}, layout={"batch": "dp"})
    for run in (plan.simulate, plan.simulate_grads):
        with pytest.raises(autoshard.InputMismatchError, match=pattern) as e:
            run(*args, **kwargs)
        assert "\n" not in str(e.value) and "TreeSpec" not in str(e.value)


def test_other_inputs_refused_in_run_rank():
    """run_rank (what a real process calls) checks too, inside the rank context."""
    from autoshard.runtime import run_simulated
    _, _, plan = _per_sample_plan()
    with pytest.raises(autoshard.InputMismatchError, match="input x has shape"):
        run_simulated(plan.mesh, lambda rank: plan.run_rank(rank, torch.randn(8, 4), 2.0, True))


# ----------------------------------------------------------------- 3. custom autograd Functions
class Times2(torch.autograd.Function):
    """Forward doubles; the custom backward scales by 7 (so a dropped backward is visible)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 7


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return Times2.apply(self.proj(x)).sum()


def test_custom_autograd_function_is_refused():
    model = WithFunction()
    with pytest.raises(autoshard.UnsupportedModelError,
                       match=r"custom autograd Function Times2 \(at test_exact_inputs.py:\d+\)") as e:
        autoshard.autoshard(model, (torch.randn(2, 4),), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                            layout={"batch": "dp"})
    assert "\n" not in str(e.value)
    # the Function is restored: eager still runs the custom backward
    x = torch.randn(2, 4, requires_grad=True)
    Times2.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 4), 7.0))


def test_custom_autograd_function_without_gradients_is_exact():
    """Applied to values that need no gradient (an input) its backward never runs."""
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(Times2.apply(x)).sum()

    torch.manual_seed(4)
    model, x = NoGrad(), torch.randn(4, 4)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    assert_exact(plan, model, (x,))


# ----------------------------------------------------------------- 4. in-place state updates
# Buffer updates (a counter, BatchNorm's running statistics) come back into the model, and a
# parameter written in place is refused: tests/test_batch_norm.py.
class BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.proj(x)).square().sum()


def test_batchnorm_in_eval_mode_is_exact():
    torch.manual_seed(5)
    model = BN().eval()
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 4)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    assert_exact(plan, model, (x,))


# ----------------------------------------------------------------- 5. dropout in training mode
class Drop(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.proj(x)).sum()


def test_train_mode_dropout_warns():
    with pytest.warns(autoshard.DropoutWarning, match=r"dropout in training mode \(module drop at "
                                                      r"test_exact_inputs.py:\d+\)"):
        autoshard.autoshard(Drop().train(), (torch.randn(4, 4),), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                            layout={"batch": "dp"})


@pytest.mark.parametrize("model", [Drop().eval(), Drop(p=0.0).train()])
def test_inactive_dropout_is_silent_and_exact(model):
    import warnings
    torch.manual_seed(6)
    x = torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.DropoutWarning)
        plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    assert_exact(plan, model, (x,))


def test_exported_program_checks_its_inputs(tmp_path):
    """The exported runner (run.py's RankProgram, here on a simulated mesh) checks inputs too."""
    from autoshard.passes.export import simulate_export
    model, x, plan = _per_sample_plan()
    path = plan.export(tmp_path / "out", (x, 2.0, True))
    ok = simulate_export(path, inputs=[x, 2.0, True])
    torch.testing.assert_close(ok[0]["outputs"][0], model(x, 2.0, True).detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(autoshard.InputMismatchError, match=r"input scale is 3.0; the plan was made for 2.0"):
        simulate_export(path, inputs=[x, 3.0, True])
    with pytest.raises(autoshard.InputMismatchError, match=r"input x has shape \(8, 4\)"):
        simulate_export(path, inputs=[torch.randn(8, 4), 2.0, True])
