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
    """SGD with momentum: sharded optimizer state, and updates linear in the gradients."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ---- bounds from the reference's own floating-point spread ---------------------------------------
#
# A plan computes the same float32 arithmetic as the single-device model in another order (sums
# split over ranks, another BLAS kernel on another CPU). Its distance from the exact result is
# therefore of the same kind as the single-device float32 result's own distance from it, which we
# measure: the same computation in float64 is "exact" at float32's scale, and
#     spread = max over the tensor of |float32 reference - float64 reference|
# is the float32 rounding this very computation carries (for AdamW it includes the elements whose
# gradient is a few eps, where dividing by sqrt(v) + eps amplifies rounding to a fraction of lr).
# The plan may be SPREAD_FACTOR times as far from float64 as that, plus ULPS units in the last
# place of each element (the rounding of storing each step's value, which the spread of a tensor
# whose elements all round alike may not show). Two independent float32 orders are each about
# one spread from float64; 4 leaves room for the plan's worst element to be another one than the
# reference's. A wrong layout is off by orders of magnitude more (a lost sum, a stale shard).
SPREAD_FACTOR = 4.0
ULPS = 8
EPS32 = torch.finfo(torch.float32).eps


def to_float64(value):
    """``value`` with every floating-point tensor in it (nested in tuples, lists and dicts) as
    float64: ``to_float64((x, None, [y]))``."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: to_float64(v) for k, v in value.items()}
    return value


def within_spread(actual, ref32, ref64, what: str) -> float:
    """The worst |actual - ref64| / bound over the elements (<= 1 passes), the bound per element
    being ``SPREAD_FACTOR * spread + ULPS * eps32 * |ref64|`` with ``spread`` the tensor's largest
    |ref32 - ref64| (see above); AssertionError naming ``what`` and the worst element when it
    exceeds 1. Usage: ``within_spread(plan_params[n], ref32[n], ref64[n], n)``."""
    actual, ref32, ref64 = (torch.as_tensor(t).detach().double() for t in (actual, ref32, ref64))
    if actual.shape != ref64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference {tuple(ref64.shape)}")
    if not actual.numel():
        return 0.0
    spread = (ref32 - ref64).abs().max()
    err = (actual - ref64).abs()
    bound = SPREAD_FACTOR * spread + ULPS * EPS32 * ref64.abs()
    ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.inf, 0.0))
    worst = ratio.argmax()
    r = ratio.flatten()[worst].item()
    if not r <= 1:  # NaN fails too
        idx = tuple(int(i) for i in torch.unravel_index(worst, ratio.shape)) if ratio.ndim else ()
        raise AssertionError(
            f"{what}: {int((~(ratio <= 1)).sum())} of {ratio.numel()} elements beyond the float32 spread bound; "
            f"worst at {list(idx)}: {actual.flatten()[worst].item():.9g} vs float64 reference "
            f"{ref64.flatten()[worst].item():.9g} (float32 reference {ref32.flatten()[worst].item():.9g}): "
            f"|diff| {err.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g} "
            f"= {SPREAD_FACTOR:g} x spread {spread.item():.3g} + {ULPS} ulp")
    return r


def reference_train64(model, steps, make_opt, microbatches=1, as_float64=None):
    """``reference_train`` of a float64 copy of ``model`` on float64 inputs (the same optimizer);
    ``as_float64(model)`` makes the copy where ``.double()`` alone does not run (a kernel without
    float64 support, swapped for one computing the same sums)."""
    m = as_float64(model) if as_float64 else copy.deepcopy(model).double()
    return reference_train(m, to_float64(steps), make_opt, microbatches=microbatches)


def assert_training_within_spread(losses, params, model, steps, make_opt, microbatches=1, reference32=None,
                                  as_float64=None) -> dict:
    """Per-step losses and final parameters of a plan's training (``simulate_train`` or a rank
    loop) against single-device training of ``model``: each within the float32 spread bound of
    ``within_spread`` (losses as one tensor over the steps, parameters per tensor). Pass
    ``reference32`` when the caller already ran ``reference_train``, ``as_float64`` as for
    ``reference_train64``. Returns the worst ratio to the bound, by name. Usage::

        losses, params = plan.simulate_train(steps, optimizer=adamw)
        assert_training_within_spread(losses, params, model, steps, adamw)
    """
    ref_losses, ref_params = reference32 or reference_train(model, steps, make_opt, microbatches=microbatches)
    losses64, params64 = reference_train64(model, steps, make_opt, microbatches=microbatches, as_float64=as_float64)
    ratios = {"losses": within_spread(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses),
                                      torch.tensor(losses64), "losses")}
    assert set(ref_params) <= set(params), sorted(set(ref_params) - set(params))  # tied: listed under both names
    for name, p in ref_params.items():
        ratios[name] = within_spread(params[name], p, params64[name], name)
    return ratios


def assert_grads_within_spread(out, grads, model, args) -> dict:
    """A plan's output and parameter gradients (``plan.simulate_grads(*args)``) against the
    unsharded model's, each within the float32 spread bound of ``within_spread`` (the model's
    float32 against its float64 forward and backward); returns the worst ratios by name."""
    ref_out, ref_grads = reference(model, args)
    out64, grads64 = reference(copy.deepcopy(model).double(), to_float64(tuple(args)))
    model.zero_grad()
    ratios = {"output": within_spread(out, ref_out, out64, "output")}
    assert set(ref_grads) <= set(grads), sorted(set(ref_grads) - set(grads))
    for name, g in ref_grads.items():
        ratios[name] = within_spread(grads[name], g, grads64[name], f"gradient of {name}")
    return ratios


def assert_trains_like_single_device(plan, model, steps, make_opt=sgd_momentum, microbatches=1) -> dict:
    """``plan.simulate_train`` over ``steps`` equals single-device training (``reference_train``):
    every step's loss and every final parameter, within the float32 spread bound
    (``assert_training_within_spread``); returns the worst ratios to the bound."""
    losses, params = plan.simulate_train(steps, optimizer=make_opt, microbatches=microbatches)
    return assert_training_within_spread(losses, params, model, steps, make_opt, microbatches=microbatches)


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


def close(actual, expected, what, exact=None):
    """assert_close(rtol=1e-5, atol=1e-6), the atol relative to the tensor's scale (a gradient
    element that cancels to ~0 in a tensor of magnitude 10 carries float32 rounding of ~1e-6
    on one device already). Where that fails, the float64 reference (``exact()``) decides: the
    sharded result may be at most 10x as far from it as the single-device float32 result is
    (ill-conditioned programs, e.g. softmax of large scores, amplify summation order); every
    real bug seen so far is off by orders of magnitude more."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        if exact is None:
            raise
        e64 = exact()
        err = (actual.double() - e64).abs().max().item()
        noise = (expected.double() - e64).abs().max().item()
        if actual.shape != expected.shape or not err <= 10 * noise + 1e-7 * scale:
            raise
