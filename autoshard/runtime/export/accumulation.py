"""``run.py --grad-accum K``: where a step's K microbatches come from and how their losses add up.

:mod:`autoshard.runtime.execution.grad_accum` runs the step (data-axis sums once, with the last
microbatch; a masked mean normalized by the valid tokens of all K); this module reads what
it needs from the export (plan.json's ``accumulation``, the count program ``normalizer.py``) and
the command line, and refuses what it cannot run exactly, before any process group exists.

Example::

    accum = grad_accum_setup(root, doc, args)       # None for K = 1
    user = load_step_inputs(root, doc, args)        # K lists of flat inputs with --grad-accum K
"""
from __future__ import annotations

from pathlib import Path

import torch

from autoshard.runtime.execution import grad_accum

from .errors import RunError
from .inputs import check_input, load_inputs, read_inputs_file
from .plan_file import load_program


def grad_accum_setup(root: Path, doc: dict, args):
    """``--grad-accum K``: None for K = 1; else how the step adds up its K microbatches (plan.json's
    ``accumulation``: the loss's reduction, and the count program of a masked mean), where its
    microbatches come from; RunError where it cannot apply (a loss whose K-batch value does not
    follow from the microbatches'). A pipelined export runs its schedule K times per step
    (``PipelineProgram.train_accumulated``)."""
    k = args.grad_accum
    if k < 1:
        raise RunError("--grad-accum must be >= 1")
    if k == 1:
        return None
    source = ("--data: the next K planned batches of tokens" if args.data else
              f"--inputs: {k} blocks of rows of each input" if args.inputs else
              f"--synthetic: {k} random batches, seeds {args.seed} to {args.seed + k - 1}" if args.synthetic else
              f"the saved inputs, {k} times")
    pipe = doc.get("pipeline")
    if pipe:  # K passes of the schedule; the stage programs and the normalizer are already loaded
        reduction = "count" if pipe.get("normalizer") else pipe.get("loss_reduction", "mean")
        return {"k": k, "reduction": reduction, "module": None, "normalizer": None, "inputs": [], "source": source}
    acc = doc.get("accumulation")
    if not isinstance(acc, dict):
        raise RunError("--grad-accum: plan.json does not say how the loss adds up over microbatches (hint: export "
                       "the plan again with this autoshard)")
    reduction = acc.get("reduction")
    if reduction is None:
        raise RunError(f"--grad-accum: the loss (output {doc['loss_output']}) does not end in a sum, a mean or a "
                       f"masked mean (sum / a count from the inputs) over the batch, so the loss of {k} batches "
                       f"together does not follow from theirs exactly (hint: end the loss in x.sum(), x.mean() or "
                       f"F.cross_entropy(...))")
    if reduction not in grad_accum.REDUCTIONS:
        raise RunError(f"plan.json is corrupted: accumulation reduction {reduction!r} (hint: export the plan again)")
    module, inputs = None, []
    if reduction == "count":
        norm = acc.get("normalizer") or {}
        names = {m["name"] for m in doc["inputs"]}
        inputs = norm.get("inputs")
        if not isinstance(norm.get("file"), str) or not isinstance(inputs, list) or not set(inputs) <= names:
            raise RunError("plan.json is corrupted: the accumulation's normalizer does not name a file and the "
                           "program's inputs (hint: export the plan again)")
        module = load_program(root, norm["file"])
    return {"k": k, "reduction": reduction, "module": module, "normalizer": module.forward if module else None,
            "inputs": list(inputs), "source": source}


def grad_accum_mismatch(path: Path, manifest: dict, args) -> list:
    """A warning where the resumed run accumulates another number of batches per step than the
    checkpoint's run (the global batch changes from here on)."""
    saved = (manifest.get("extra") or {}).get("grad_accum", 1)
    if saved == args.grad_accum:
        return []
    return [f"--resume: {path}'s run took {saved} planned batch{'es' if saved != 1 else ''} per optimizer step; this "
            f"one takes {args.grad_accum} (--grad-accum): the global batch changes from here on"]


def load_step_inputs(root: Path, doc: dict, args) -> list:
    """One step's user inputs without ``--data``: the flat global inputs (:func:`load_inputs`),
    or with ``--grad-accum K`` K of them: ``--inputs FILE`` holds K x the planned rows of every
    input with a batch dim (the K batches joined on dim 0), cut into K consecutive blocks;
    ``--synthetic`` draws K batches (seeds ``--seed``, ``--seed + 1``, ...); the saved inputs
    are taken K times (the same gradient, accumulated)."""
    k = args.grad_accum
    if k == 1:
        return load_inputs(root, doc, synthetic=args.synthetic, path=args.inputs, seed=args.seed)
    if args.synthetic:
        return [load_inputs(root, doc, synthetic=True, seed=args.seed + j) for j in range(k)]
    if not args.inputs:
        return [load_inputs(root, doc, synthetic=False)] * k
    users = [m for m in doc["inputs"] if m["kind"] == "user"]
    flat = read_inputs_file(Path(args.inputs), "inputs file", users)
    for m, x in zip(users, flat):
        if m.get("shape") and isinstance(x, torch.Tensor) and x.dim() == len(m["shape"]) \
                and x.shape[0] != k * m["shape"][0]:
            raise RunError(f"input {m['target']} has {x.shape[0]} rows; --grad-accum {k} needs {k} x the planned "
                           f"{m['shape'][0]} = {k * m['shape'][0]} (the {k} batches joined on dim 0)")
    try:
        microbatches = grad_accum.split_rows(flat, k, [f"input {m['target']}" for m in users])
    except ValueError as e:
        raise RunError(f"--grad-accum {k}: {e} (the {k} batches joined on dim 0)") from None
    for mb in microbatches:
        for m, x in zip(users, mb):
            check_input(m, x)
    return microbatches
