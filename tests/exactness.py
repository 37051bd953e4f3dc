"""Shared checks: a plan against the unsharded model (imported by the test modules)."""
import copy
import re

import pytest
import torch


def reference(model, args):
    """The model's output and every parameter's gradient, on one device."""
    model.zero_grad()
    out = model(*args)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_exact(plan, model, args):
    """simulate and simulate_grads equal the unsharded forward and gradients (fp32 bounds)."""
    ref_out, ref_grads = reference(model, args)
    torch.testing.assert_close(plan.simulate(*args), ref_out, rtol=1e-5, atol=1e-6)
    out, grads = plan.simulate_grads(*args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert set(ref_grads) <= set(grads)  # tied parameters are also listed under their alias
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def block_of(where: str):
    """The transformer block index of a module FQN ('layers.3.mlp' -> 3), else None."""
    m = re.match(r"layers\.(\d+)(\.|$)", where)
    return int(m.group(1)) if m else None


def reference_train(model, steps, make_opt, microbatches=1):
    """Single-device training of a copy of ``model``: per-step losses and final parameters;
    with ``microbatches=k`` each step is k argument tuples, each loss scaled by 1/k."""
    m = copy.deepcopy(model)
    opt = make_opt(list(m.parameters()))
    losses = []
    for step in steps:
        mbs = step if microbatches > 1 else [step]
        total = 0.0
        for mb in mbs:
            loss = m(*mb)
            (loss / len(mbs)).backward()
            total += loss.item() / len(mbs)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach() for n, p in m.named_parameters()}


def sgd_momentum(params):
    """SGD with momentum: sharded optimizer state, and updates linear in the gradients (Adam
    divides by sqrt(v) and would magnify float noise of near-zero gradient elements)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_trains_like_single_device(plan, model, steps, make_opt=sgd_momentum, microbatches=1):
    """``plan.simulate_train`` over ``steps`` equals single-device training (``reference_train``):
    every step's loss and every final parameter, within the fp32 bounds."""
    ref_losses, ref_params = reference_train(model, steps, make_opt, microbatches=microbatches)
    losses, params = plan.simulate_train(steps, optimizer=make_opt, microbatches=microbatches)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def train_steps(local, opt, batches) -> list:
    """A rank's training steps (forward, backward, optimizer step, zero_grad) over ``batches``
    (argument tuples); the loss of each step, read after it."""
    losses = []
    for args in batches:
        loss = local(*args)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
