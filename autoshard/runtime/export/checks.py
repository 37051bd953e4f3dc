"""``--check``: a run's outputs, gradients and losses against the unsharded model's references.

The tolerance comes from the dtype's rounding, scaled by the number of ranks whose partial
sums a value passes through (``check_tolerance``), so a correct layout always passes and a
wrong one (a lost partial sum: a share of the tensor) always fails. A NaN or infinity on
either side fails, naming the side.

Example::

    tol = check_tolerance(doc, rtol=1e-4, atol=1e-5)
    good, diff, why = compare(local_output, reference_piece, tol)
"""
from __future__ import annotations

import math

import torch

from autoshard.mesh import Mesh
from autoshard.ownership import Shard, local_piece
from autoshard.runtime import current

from .weights import _dt


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b|; inf where either side holds a NaN or an infinity (Python's max()
    of the per-tensor values would drop a NaN)."""
    if not a.numel():
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return d if math.isfinite(d) else math.inf


# A 16-bit program rounds each rank's partial sum (half a unit, eps, of its magnitude) and each
# addition of the collective once more: about one unit of the tensor's largest magnitude per rank
# per sum, against the unsharded model's single rounding. A parameter's gradient passes through
# the sums of the layers above it, which compound this a few times (measured on a 4-rank bf16
# dp x tp llama: up to 3.8 units of the tensor's scale). Allowed: UNITS_PER_RANK x ranks eps of
# the dtype, relative to each value and to its tensor's largest magnitude. A wrong layout is off
# by a share of the tensor (a lost partial sum: a quarter to a half of it).
UNITS_PER_RANK = 4


def check_dtype(doc) -> torch.dtype:
    """The least precise floating dtype among the program's parameters and inputs: the rounding
    every value of the run carries (an fp32 loss of a bf16 model is as coarse as bf16)."""
    dtypes = [m["_dtype"] for m in doc["inputs"] if m.get("_dtype") is not None and m["_dtype"].is_floating_point]
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def check_tolerance(doc, rtol: float, atol: float) -> dict:
    """--check's tolerance for this export: ``rtol``/``atol`` (run.py's --rtol/--atol) for a
    float32 program; for a 16-bit one ``units`` eps of its dtype (UNITS_PER_RANK per rank),
    relative to each value and to its tensor's largest magnitude, and losses within one eps
    relative (a loss is a mean: its rounding is far below one unit). Example::

        tol = check_tolerance(doc, 1e-4, 1e-5)   # {'dtype': torch.bfloat16, 'units': 16, ...}
    """
    dtype = check_dtype(doc)
    if dtype not in (torch.bfloat16, torch.float16):
        return {"dtype": dtype, "units": 0, "eps": 0.0, "rtol": rtol, "atol": atol,
                "text": f"{_dt(dtype)} tolerance: rtol {rtol:g}, atol {atol:g}"}
    eps, units = torch.finfo(dtype).eps, UNITS_PER_RANK * doc["world_size"]
    return {"dtype": dtype, "units": units, "eps": eps, "rtol": max(rtol, units * eps), "atol": atol,
            "text": f"{_dt(dtype)} tolerance: {units} eps ({units * eps:.2g}) of each value and of its tensor's "
                    f"largest magnitude, losses {eps:.2g} relative"}


def compare(a: torch.Tensor, b: torch.Tensor, tol: dict):
    """(ok, max abs diff, why) for a run's tensor ``a`` against the reference's ``b`` under
    ``check_tolerance``'s ``tol``: NaN or infinity on either side fails and says which side."""
    if a.shape != b.shape:
        return False, math.inf, f"shape {list(a.shape)} != the reference's {list(b.shape)}"
    for t, side in ((b, "the unsharded reference"), (a, "this run")):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n = int((~torch.isfinite(t)).sum())
            return False, math.inf, f"non-finite in {side} ({n} of {t.numel()} values NaN or infinite)"
    d = _max_diff(a, b)
    atol = tol["atol"]
    if tol["units"] and b.numel():
        atol = max(atol, tol["units"] * tol["eps"] * b.double().abs().max().item())
    ok = torch.allclose(a.double(), b.double(), rtol=tol["rtol"], atol=atol)
    return ok, d, f"max abs diff {d:.3g}"


def compare_outputs(doc, mesh, rank, outs, ref, rtol, atol):
    """(ok, max abs diff, problems) for this rank's outputs against its blocks of the references."""
    ok, worst, problems = True, 0.0, []
    tol = check_tolerance(doc, rtol, atol)
    for k, (o, meta, want) in enumerate(zip(outs, doc["outputs"], ref["outputs"])):
        if not isinstance(o, torch.Tensor):
            if o != want:
                ok = False
                problems.append(f"output {k}: {o!r} != {want!r}")
            continue
        piece = local_piece(want, meta["_place"], mesh, rank)
        good, d, why = compare(o.detach().cpu(), piece, tol)
        worst = max(worst, d)
        if not good:
            ok = False
            problems.append(f"output {k}: {why}")
    return ok, worst, problems


def compare_grads(doc, mesh, rank, params, ref, rtol, atol):
    """(ok, max abs diff, problems) for this rank's gradients of the first step against its
    blocks of the reference's."""
    ok, worst, problems = True, 0.0, []
    tol = check_tolerance(doc, rtol, atol)
    places = {m["target"]: m["_place"] for m in doc["inputs"]
              if m["kind"] == "parameter" and "_place" in m and m.get("role", "input") == "input"}
    for fqn, p in params.items():
        want = ref["grads"].get(fqn)
        if want is None:
            continue
        g = p.grad.detach().cpu() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
        piece = local_piece(want, places[fqn], mesh, rank)
        good, d, why = compare(g, piece, tol)
        worst = max(worst, d)
        if not good:
            ok = False
            problems.append(f"gradient of {fqn}: {why}")
    return ok, worst, problems


def global_sum(x: torch.Tensor, place, mesh: Mesh) -> float:
    """Sum of a value's global tensor from this rank's block (summed over its sharding axes);
    call inside the rank context."""
    backend = current("global_sum").backend
    s = x.detach().double().sum().reshape(1)
    for o, axis in zip(place or (), mesh.names):
        if isinstance(o, Shard):
            s = backend.all_reduce(s, axis)
    return s.item()


def summarize_check(doc, ref, args, ok: bool, worst, losses, n_ranks):
    """(passed, one line) for --check: outputs (and gradients) on every rank, and losses, at
    ``check_tolerance``'s tolerance (which the line names). A NaN or infinity on either side
    fails, naming the side and the step (the first step's outputs and gradients, or a loss)."""
    train = args.steps > 0
    tol = check_tolerance(doc, args.rtol, args.atol)
    what = "outputs" + (" and gradients" if train else "")
    diff = "max abs diff " + " / ".join("non-finite" if not math.isfinite(w) else f"{w:.2e}"
                                        for w in worst[:2 if train else 1])
    loss_msg, nonfinite = "", []
    if not all(math.isfinite(w) for w in worst[:2]):
        nonfinite.append(f"{'step 1' if train else 'forward'}: {what} non-finite (or of another shape) on some rank "
                         f"(its run.py: rank line names the tensor and the side)")
    r = doc.get("reference") or {}
    ref_losses = ref.get("losses") or []
    if train and ref_losses and args.optimizer == r.get("optimizer") and args.lr == r.get("lr"):
        n = min(len(ref_losses), len(losses))
        pairs = list(zip(losses[:n], ref_losses[:n]))
        bad = next(((step, a, b) for step, (a, b) in enumerate(pairs, 1)
                    if not (math.isfinite(a) and math.isfinite(b))), None)
        if bad:
            step, a, b = bad
            nonfinite.append(f"the unsharded reference's loss of step {step} is {b}" if not math.isfinite(b)
                             else f"this run's loss of step {step} is {a}")
        ld = max((abs(a - b) for a, b in pairs), default=0.0)
        rtol = tol["eps"] if tol["units"] else args.rtol
        loss_ok = not nonfinite and all(abs(a - b) <= args.atol + rtol * abs(b) for a, b in pairs)
        ok = ok and loss_ok
        loss_msg = (f"; losses of {n} {args.optimizer} step{'s' if n != 1 else ''} "
                    f"{'match' if loss_ok else 'DIFFER FROM'} single-device training (max abs diff {ld:.2e})")
    elif train:
        loss_msg = (f"; losses not checked (the references were made with {r.get('optimizer')} lr "
                    f"{r.get('lr')})")
    if ok and not nonfinite:
        return True, (f"check passed: {what} equal the unsharded model's on all {n_ranks} ranks ({diff}){loss_msg}"
                      f" ({tol['text']})")
    if nonfinite:
        return False, f"CHECK FAILED: {'; '.join(nonfinite)} ({tol['text']})"
    return False, f"CHECK FAILED: {what} differ from the unsharded model's ({diff}){loss_msg} ({tol['text']})"
