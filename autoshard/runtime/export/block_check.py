"""``--check`` of an export over the check budget: its checked model, one block of each kind.

An export whose model is too big for an unsharded reference (or was planned on the meta device)
carries ``checks/``: the same model with each repeated block list cut to one block of each
distinct structure, at the real widths, planned as the whole model was and exported with its
references (``autoshard/block_check.py`` writes it, and checks there that each kept block has
its whole-plan block's collectives). ``run.py --check`` runs that export's check first, on the
same processes, then the whole program as asked (unchecked: there is nothing to compare it
with). Besides the usual verdict it prints one line per kept block, and one for the rest of the
model (embedding, head, loss), with the largest gradient difference among their parameters on
any rank.

Example (what rank 0 prints)::

    check block model.layers.0 (standing for model.layers.0-7, 9 parameters on each rank that holds it): max abs grad diff 2.1e-09: ok
    check the non-repeated parts (3 parameters on each rank that holds them, and the outputs): max abs grad diff 3.0e-09: ok

A pipelined export's checked model is pipelined alike (one block of each kind per stage, the
same cuts, schedule and microbatches): its lines name each block's stage.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

from autoshard.ownership import local_piece

from .checks import check_tolerance, compare

__all__ = ["block_args", "group_report"]


def block_args(args, steps_available: int) -> argparse.Namespace:
    """The options of the checked model's run: the check, at most as many steps as its
    references have, on its own saved inputs and weights (no data, checkpoints or metrics)."""
    sub = argparse.Namespace(**vars(args))
    sub.steps = min(args.steps, steps_available)
    for name in ("weights", "weights_prefix", "inputs", "data", "ckpt", "resume", "metrics", "timeline"):
        if hasattr(sub, name):
            setattr(sub, name, None)
    for name in ("allow_partial", "synthetic"):
        if hasattr(sub, name):
            setattr(sub, name, False)
    if hasattr(sub, "save_every"):
        sub.save_every = 0
    return sub


def _stands_for(names) -> str:
    if len(names) <= 2:
        return ", ".join(names)
    head, _, first = names[0].rpartition(".")
    last = names[-1].rpartition(".")[2]
    return f"{head}.{first}-{last}" if first.isdigit() and last.isdigit() else f"{names[0]} ... {names[-1]}"


def group_report(entry: dict, doc: dict, mesh, rank: int, res: dict, ref: dict, args, device) -> tuple:
    """(all groups passed, lines for rank 0): this rank's first-step gradients (``res["grads"]``)
    against its blocks of the references, the largest difference per kept block and for the
    other parameters, maxima over every rank (a group no rank compared fails). Call on every rank."""
    if not args.steps:
        return True, ["check of the blocks through the outputs only (with --steps K each block's gradients "
                      "are compared too)"]
    blocks = [b["name"] for b in entry["blocks"]]
    places = {m["target"]: m["_place"] for m in doc["inputs"]
              if m["kind"] == "parameter" and "_place" in m and m.get("role", "input") == "input"}
    tol = check_tolerance(doc, args.rtol, args.atol)
    n = len(blocks) + 1
    worst, bad, count = [0.0] * n, [0.0] * n, [0] * n
    for fqn, g in (res.get("grads") or {}).items():
        want = (ref.get("grads") or {}).get(fqn)
        if want is None or fqn not in places:
            continue
        k = next((i for i, b in enumerate(blocks) if fqn.startswith(b + ".")), n - 1)
        good, d, _ = compare(g.detach().cpu(), local_piece(want, places[fqn], mesh, rank), tol)
        worst[k], count[k] = max(worst[k], d), count[k] + 1
        bad[k] = max(bad[k], 0.0 if good else 1.0)
    t = torch.tensor(worst + bad + count, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a pipelined block's parameters are on its stage's ranks only
    worst, bad, count = t[:n].tolist(), t[n:2 * n].tolist(), [int(c) for c in t[2 * n:].tolist()]
    bad = [b or not c for b, c in zip(bad, count)]  # nothing compared is no verdict
    fmt = lambda d: "non-finite" if not math.isfinite(d) else f"{d:.2e}"
    lines = []
    for i, b in enumerate(entry["blocks"]):
        stage = f"stage {b['stage']}, " if b.get("stage") is not None else ""
        lines.append(f"check block {b['block']} ({stage}standing for {_stands_for(b['stands_for'])}, {count[i]} "
                     f"parameters on each rank that holds it): max abs grad diff {fmt(worst[i])}: "
                     f"{'FAILED' if bad[i] else 'ok'}")
    lines.append(f"check the non-repeated parts ({count[-1]} parameters on each rank that holds them, and the "
                 f"outputs): max abs grad diff {fmt(worst[-1])}: {'FAILED' if bad[-1] else 'ok'}")
    return not any(bad), lines
