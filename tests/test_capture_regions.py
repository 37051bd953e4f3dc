"""Regions of forward that torch.export keeps as higher-order ops, and losses training cannot
seed (issue 29, items 2 and 3).

- ``torch.no_grad()`` / ``torch.set_grad_enabled(False)`` blocks (a router's top-k choice, as
  MoE code writes it) are inlined at capture; what they compute carries no gradient, exactly as
  in eager: plans with data and tensor parallelism equal the unsharded model on forward, every
  gradient and training steps;
- ``torch.cond``, ``while_loop``, ``map`` and an enabled autocast block are refused at capture in
  one line naming the op, the module and the source line;
- a loss that is not a scalar is refused for training, as ``loss.backward()`` refuses it.

Tolerances: ``test_property.close`` (rtol 1e-5, atol 1e-6 of the tensor's scale; where that
fails, the plan may be at most 10x as far from the float64 reference as the single-device float32
result is: the reference's own rounding spread decides, not this CPU's summation order).
"""
from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard import CaptureError, Mesh
from autoshard.runtime import export as R
from exactness import reference_train, sgd_momentum
from test_property import close

HIDDEN, FFN, EXPERTS, TOP_K = 16, 32, 4, 2
# the dense-dispatch experts below are not token rows [T, h]: the generic op rules plan them
pytestmark = pytest.mark.filterwarnings("ignore::autoshard.passes.experts.MoEWarning")


class NoGradRouterMoE(nn.Module):
    """A dense-dispatch MoE layer whose router chooses its top-k experts under ``no_grad`` (the
    choice is a mask; the kept logits' softmax carries the gradient), a z-loss computed with
    ``enable_grad`` inside that block, a ``set_grad_enabled(False)`` centering, and a router
    temperature used only under ``no_grad`` (no gradient at all in eager)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.temperature = nn.Parameter(torch.ones(EXPERTS))
        self.up = nn.ModuleList(nn.Linear(HIDDEN, FFN, bias=False) for _ in range(EXPERTS))
        self.down = nn.ModuleList(nn.Linear(FFN, HIDDEN, bias=False) for _ in range(EXPERTS))
        self.head = nn.Linear(HIDDEN, HIDDEN)
        self.cut = True  # False: the same computation with every region grad-enabled

    def forward(self, x):
        no_grad = torch.no_grad if self.cut else contextlib.nullcontext
        logits = self.gate(x)
        with no_grad():
            probs = (logits * self.temperature).softmax(-1)
            top = probs.topk(TOP_K, dim=-1).values
            keep = probs >= top[..., -1:]
            confidence = top[..., :1] * 2  # a float computed without gradient
            with torch.enable_grad():  # nested: this one carries gradients out
                z_loss = (logits ** 2).mean()
        weights = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        with torch.set_grad_enabled(not self.cut):
            center = x.mean(-1, keepdim=True)
        h = x - center
        y = 0
        for e in range(EXPERTS):
            y = y + weights[..., e:e + 1] * self.down[e](torch.relu(self.up[e](h)))
        return (self.head(y * confidence) ** 2).mean() + 0.1 * z_loss


DIMS = {"x": "batch seq hidden", "up.*.weight": "ffn hidden", "down.*.weight": "hidden ffn"}
LAYOUTS = [({"dp": 2}, {"batch": "dp"}), ({"tp": 2}, {"ffn": "tp"}), ({"dp": 2, "tp": 2}, {"batch": "dp", "ffn": "tp"})]


def eager(model, x):
    """Loss and every parameter's gradient (zeros where autograd gives none)."""
    m = copy.deepcopy(model)
    loss = m(x)
    loss.backward()
    return loss.detach(), {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in m.named_parameters()}


def moe_case(seed=0):
    torch.manual_seed(seed)
    return NoGradRouterMoE(), torch.randn(4, 3, HIDDEN)


def test_the_no_grad_blocks_change_the_gradients_in_eager():
    """The model tests the semantics: without its no_grad blocks (every value with gradient) the
    gate's gradient differs and the temperature gets one, so a plan that ignored them would fail."""
    model, x = moe_case()
    _, cut = eager(model, x)
    free = copy.deepcopy(model)
    free.cut = False
    _, uncut = eager(free, x)
    assert torch.count_nonzero(cut["temperature"]) == 0 and torch.count_nonzero(uncut["temperature"]) > 0
    assert not torch.allclose(cut["gate.weight"], uncut["gate.weight"], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("mesh,layout", LAYOUTS, ids=["dp", "tp", "dp2xtp2"])
def test_no_grad_router_plans_are_exact(mesh, layout):
    model, x = moe_case()
    ref_loss, ref_grads = eager(model, x)
    f64 = []

    def exact(grad=None):
        def get():
            if not f64:
                f64.append(eager(copy.deepcopy(model).double(), x.double()))
            return f64[0][0] if grad is None else f64[0][1][grad]
        return get

    plan = autoshard.autoshard(model, (x,), mesh=Mesh(mesh), dims=DIMS, layout=layout, train=True, strict=True)
    close(plan.simulate(x), ref_loss, f"{mesh}: simulate", exact())
    loss, grads = plan.simulate_grads(x)
    close(loss, ref_loss, f"{mesh}: simulate_grads loss", exact())
    for name, g in ref_grads.items():
        close(grads[name], g, f"{mesh}: grad of {name}", exact(name))
    assert torch.count_nonzero(grads["temperature"]) == 0  # no gradient, as in eager


@pytest.mark.parametrize("mesh,layout", LAYOUTS[::2], ids=["dp", "dp2xtp2"])
def test_no_grad_router_trains_like_single_device(mesh, layout):
    model, x = moe_case(1)
    steps = [(x,), (x * 0.5,), (x.flip(0),)]
    plan = autoshard.autoshard(model, (x,), mesh=Mesh(mesh), dims=DIMS, layout=layout, train=True)
    losses, params = plan.simulate_train(steps, optimizer=sgd_momentum)
    ref_losses, ref_params = reference_train(model, steps, sgd_momentum)
    f64 = []

    def exact(name=None):
        def get():
            if not f64:
                f64.append(reference_train(copy.deepcopy(model).double(), [(a.double(),) for (a,) in steps],
                                           sgd_momentum))
            return torch.tensor(f64[0][0], dtype=torch.float64) if name is None else f64[0][1][name]
        return get

    close(torch.tensor(losses), torch.tensor(ref_losses), f"{mesh}: losses", exact())
    for name, p in ref_params.items():
        close(params[name], p, f"{mesh}: {name} after training", exact(name))


def test_an_exported_no_grad_router_passes_its_check(tmp_path):
    """The exported program (run.py's loading, on a simulated mesh) gives the unsharded model's
    outputs, gradients and training step (run.py --steps 1 --check)."""
    from autoshard.passes.export import simulate_export
    model, x = moe_case(2)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims=DIMS, layout={"batch": "dp"}, train=True)
    plan.export(tmp_path / "exp", (x,))
    for r in simulate_export(tmp_path / "exp", steps=1, check=True):
        assert r["ok"], r["problems"]


def test_inlined_regions_leave_plain_aten_nodes_and_no_gradient_marks():
    """The captured graph holds no higher-order op or submodule; the values computed under
    no_grad that grad-enabled code reads go through one detach each."""
    from autoshard.passes.capture import capture
    from autoshard.passes.spmd import requires_grad_nodes
    model, x = moe_case()
    cap = capture(model, (x,))
    kinds = {n.op for n in cap.graph.nodes}
    assert kinds == {"placeholder", "call_function", "output"}
    assert not any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in cap.graph.nodes)
    detached = [n for n in cap.graph.nodes if n.target == torch.ops.aten.detach.default]
    # confidence and center are read with grad enabled; keep is a bool (no gradient to cut)
    assert len(detached) == 2, [d.args[0].name for d in detached]
    rg = requires_grad_nodes(cap.graph, {i.name for i in cap.inputs if i.trainable})
    assert not any(d in rg for d in detached)


class EmaUnderNoGrad(nn.Module):
    """An exponential moving average kept in a buffer and updated under no_grad (as VQ codebooks
    and EMA teachers do)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        y = self.proj(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0) * 0.1)
        return y.sum()


def test_a_buffer_update_inside_no_grad_is_written_back_as_eager_updates_it():
    """Inlining a no_grad block keeps its in-place buffer update: the moving average of the
    batch mean (split on dp, so summed over both ranks) lands in the model's buffer as eager's."""
    import copy

    torch.manual_seed(0)
    model, x = EmaUnderNoGrad(), torch.randn(4, 4)
    eager = copy.deepcopy(model)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"},
                               train=True)
    eager(x)
    plan.simulate_grads(x)
    assert eager.ema.abs().sum() > 0
    torch.testing.assert_close(model.ema, eager.ema, rtol=1e-6, atol=1e-7)  # a mean of 4 rows, summed in 2 parts


class WriteUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x) * 2
        with torch.no_grad():
            y[:, 0] = 0.0  # autograd does not see it: the gradient passes through column 0
        return (y * x).sum()


def test_a_write_under_no_grad_into_a_value_with_gradient_is_refused():
    """Eager passes the gradient through elements overwritten under no_grad (the write is not
    recorded); no functional program computes that, so the capture refuses in one line."""
    m = WriteUnderNoGrad()
    x = torch.randn(4, 4)
    m(x).backward()
    assert torch.count_nonzero(m.proj.weight.grad[0]) > 0  # column 0 of y still passes gradient
    with pytest.raises(CaptureError) as e:
        autoshard.autoshard(WriteUnderNoGrad(), (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                            layout={"batch": "dp"}, train=True)
    msg = str(e.value)
    line = _line_of(WriteUnderNoGrad, "y[:, 0] = 0.0")
    assert "\n" not in msg and re.match(rf"aten\.fill_\.\w+ under torch\.no_grad\(\) writes into \w+, which needs "
                                        rf"gradients, at node \w+ in module '<root>' at test_capture_regions\.py:{line}",
                                        msg), msg


# ------------------------------------------------------------------ other higher-order ops: refused
class Cond(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, (self.proj(x),)).sum()


class WhileLoop(nn.Module):
    def forward(self, x):
        return torch._higher_order_ops.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2),
                                                  (torch.tensor(0), x))[1].sum()


class Map(nn.Module):
    def forward(self, x):
        return torch._higher_order_ops.map(lambda a: a * 2, x).sum()


class Autocast(nn.Module):
    def __init__(self, enabled=True):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.enabled = enabled

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            y = self.proj(x)
        return y.float().sum()


def _line_of(cls, text):
    import inspect
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


@pytest.mark.parametrize("cls,op,text", [
    (Cond, r"higher-order op torch\.ops\.higher_order\.cond", "torch.cond"),
    (WhileLoop, r"higher-order op torch\.ops\.higher_order\.while_loop", "while_loop"),
    (Map, r"higher-order op torch\.ops\.higher_order\.map_impl", "map("),
    (Autocast, r"an enabled autocast region \(cpu, bfloat16\)", "self.proj(x)"),
], ids=["cond", "while_loop", "map", "autocast"])
def test_other_higher_order_ops_are_refused_in_one_line(cls, op, text):
    with pytest.raises(CaptureError) as e:
        autoshard.autoshard(cls(), (torch.randn(4, 4),), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                            layout={"batch": "dp"}, train=True)
    msg = str(e.value)
    assert "\n" not in msg
    line = _line_of(cls, text)
    assert re.match(rf"capture does not support {op} at node \w+ in module '<root>' at "
                    rf"test_capture_regions\.py:{line} \(hint: ", msg), msg


def test_a_disabled_autocast_region_is_inlined_and_exact():
    torch.manual_seed(3)
    model, x = Autocast(enabled=False), torch.randn(4, 4)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"},
                               train=True)
    ref_loss, ref_grads = eager(model, x)
    loss, grads = plan.simulate_grads(x)
    close(loss, ref_loss, "loss")
    for name, g in ref_grads.items():
        close(grads[name], g, name)


def test_an_unexpected_node_kind_is_one_line_naming_node_and_module():
    """A program with a get_attr node left in it (capture inlines or refuses every submodule it
    knows) stops the rewriter with one line, not a bare NotImplementedError."""
    from autoshard.passes.capture import capture
    from autoshard.passes.dims import infer_dims
    from autoshard.passes.spmd import resolve_layout, rewrite
    model, x = Autocast(enabled=False), torch.randn(4, 4)
    cap = capture(model, (x,))
    g = cap.graph
    first = next(n for n in g.nodes if n.op == "call_function")
    with g.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fx: no such attribute on the module (it is never run)
        stray = g.get_attr("stray_constant")
    stray.meta = {k: first.meta[k] for k in ("nn_module_stack", "stack_trace")}
    info = infer_dims(g, {i.name: i.target for i in cap.inputs})
    with pytest.raises(CaptureError) as e:
        rewrite(g, info, resolve_layout(info, {}, Mesh({"dp": 2})), Mesh({"dp": 2}), set())
    msg = str(e.value)
    assert "\n" not in msg and re.search(r"cannot run a get_attr node: node stray_constant .* in module 'proj' "
                                         r"at \w+\.py:\d+", msg), msg


# ------------------------------------------------------------------ item 2: non-scalar losses
class PerRowLoss(nn.Module):
    def __init__(self, first=False):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.first = first

    def forward(self, x):
        per_row = (self.proj(x) ** 2).mean(-1)  # [batch]: not reduced
        return (per_row, x.sum()) if self.first else per_row


@pytest.mark.parametrize("first,name", [(False, "the model's output"), (True, r"output\[0\]")])
def test_a_non_scalar_loss_is_refused_for_training(first, name):
    x = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        PerRowLoss(first)(x)[0 if first else ...].backward()  # torch's own refusal
    with pytest.raises(ValueError) as e:
        autoshard.autoshard(PerRowLoss(first), (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"},
                            layout={"batch": "dp"}, train=True)
    msg = str(e.value)
    assert "\n" not in msg and re.match(
        rf"train=True: the loss, {name}, has shape \[4\]: grad can be implicitly created only for scalar outputs",
        msg), msg


def test_a_forward_plan_with_a_non_scalar_output_probes_backward_with_ones_but_does_not_train(tmp_path, monkeypatch):
    """Forward-only plans keep simulate_grads' documented seeding (the gradients of the output's
    sum, as out.backward(torch.ones_like(out))); simulate_train and an export's run.py --steps
    refuse to train on it, as loss.backward() does."""
    torch.manual_seed(4)
    model, x = PerRowLoss(), torch.randn(4, 4)
    plan = autoshard.autoshard(model, (x,), mesh=Mesh({"dp": 2}), dims={"x": "batch h"}, layout={"batch": "dp"})
    m = copy.deepcopy(model)
    out = m(x)
    out.backward(torch.ones_like(out))
    got, grads = plan.simulate_grads(x)
    close(got, out.detach(), "output")
    for n, p in m.named_parameters():
        close(grads[n], p.grad, n)
    with pytest.raises(ValueError, match=r"^simulate_train: the loss, the model's output, has shape \[4\]: grad can"):
        plan.simulate_train([(x,)])
    plan.export(tmp_path / "exp", (x,))
    monkeypatch.setenv("WORLD_SIZE", "2")
    R.prepare(tmp_path / "exp", R._parser().parse_args([]))  # forward only: fine
    with pytest.raises(R.RunError) as e:
        R.prepare(tmp_path / "exp", R._parser().parse_args(["--steps", "1"]))
    assert re.match(r"--steps trains on output 0 \(the loss\), of shape \[4\]: grad can be implicitly created only "
                    r"for scalar outputs", str(e.value)), str(e.value)


# ------------------------------------------------------------------ a Hugging Face MoE routed under no_grad
def test_phimoe_router_under_no_grad_plans_and_is_exact():
    """PhiMoE's sparsemixer computes its routing masks under ``torch.no_grad()`` in every mode;
    it used to stop the capture. The data-parallel plan is strict (no value it splits is gathered)
    and its forward and backward equal the unsharded model."""
    from hf_zoo import BATCH, DECODER, SEQ, TOKENS
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("phimoe", **dict(DECODER, num_local_experts=4, num_experts_per_tok=2,
                                                experts_implementation="batched_mm"))
    model = AutoModelForCausalLM.from_config(cfg).eval()  # train mode applies a custom autograd Function
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
    kwargs = {"input_ids": ids, "labels": torch.roll(ids, 1, dims=1)}
    plan = autoshard.autoshard(model, (), kwargs, mesh=Mesh({"dp": 2}), dims=TOKENS, layout={"batch": "dp"},
                               train=True, strict=True)  # the split batch is never gathered
    m = copy.deepcopy(model)
    ref = m(**kwargs)
    ref.loss.backward()
    f64 = []

    def exact(name=None):
        def get():
            if not f64:
                m64 = copy.deepcopy(model).double()
                out = m64(**kwargs)
                out.loss.backward()
                f64.append((out.loss.detach(), {n: p.grad for n, p in m64.named_parameters()}))
            return f64[0][0] if name is None else f64[0][1][name]
        return get

    out, grads = plan.simulate_grads(**kwargs)
    close(out.loss, ref.loss.detach(), "loss", exact())
    for n, p in m.named_parameters():
        close(grads[n], p.grad, f"grad of {n}", exact(n))
