"""Gradient accumulation: K microbatches per optimizer step, trained as one batch K times as large.

Each microbatch runs forward and backward; the data-axis gradient sums wait for the last one
(:meth:`~autoshard.runtime.execution.local.LocalModule.no_sync`: the bucketed all-reduces of ZeRO 0/1 and
the reduce-scatters of ZeRO 2/3 are summed locally and sent once, with the last microbatch's
backward; sums over other axes, and those of activations, run in every microbatch as usual). A
ZeRO-3 forward gathers its parameters again in every microbatch.

The microbatches' losses are weighed so that their gradients add up to the gradient of the big
batch's loss (the weight seeds each microbatch's backward), by how the loss reduces its batch
(``plan.json``'s ``accumulation``, see :mod:`autoshard.passes.loss_count`):

========= ================================ =============================================
reduction the loss                         weight of microbatch j
========= ================================ =============================================
sum       a sum over the batch             1
mean      a mean over every element        1 / K (the microbatches are equal in size)
count     ``sum / count`` (a masked mean)  count_j / (count_1 + ... + count_K)
========= ================================ =============================================

``count_j`` is microbatch j's count over every data rank (the exported ``normalizer.py``), so a
masked mean is normalized by the valid tokens of all K microbatches on all ranks, not K
separately normalized means. The step's loss is the weighted sum of the microbatch losses.

Example::

    with rank_context(mesh, rank, backend):
        pieces = accumulate(local, split_rows(flat_inputs, 4), loss_index=0, reduction="count",
                            normalizer=normalizer.forward, normalizer_inputs=["labels"])
        loss = sum(w * l.item() for l, w in pieces)      # the step's loss (a replicated scalar)
        opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib

import torch

REDUCTIONS = ("sum", "mean", "count")


def split_rows(flat: list, k: int, names=None) -> list:
    """``k`` microbatches of the flat inputs ``flat``: every tensor with a dim 0 is cut into
    ``k`` equal consecutive row blocks (``torch.chunk`` on dim 0), anything else (a 0-d tensor,
    None, a Python value) goes to every microbatch. ValueError, naming the input (``names``),
    where dim 0 does not divide by ``k``. Example::

        split_rows([ids_8x16, None, labels_8x16], 2)   # [[ids[:4], None, labels[:4]], [ids[4:], None, labels[4:]]]
    """
    names = list(names) if names is not None else [f"input {i}" for i in range(len(flat))]
    columns = []
    for name, x in zip(names, flat):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % k:
                raise ValueError(f"{name} has {x.shape[0]} rows, which do not split into {k} microbatches")
            columns.append(list(x.split(x.shape[0] // k)))
        else:
            columns.append([x] * k)
    return [[c[j] for c in columns] for j in range(k)]


def microbatch_weights(reduction: str, k: int, counts=None) -> list:
    """The weight of each of ``k`` microbatch losses (the table of the module docstring);
    ``counts``: for ``"count"``, each microbatch's global count (tensors or numbers). A step whose
    counts are all zero weighs NaN, as torch's mean of no element is. Example::

        microbatch_weights("count", 2, [3, 1])     # [0.75, 0.25]
    """
    if reduction == "sum":
        return [1.0] * k
    if reduction == "mean":
        return [1.0 / k] * k
    if reduction != "count":
        raise ValueError(f"unknown loss reduction {reduction!r}; known: {REDUCTIONS}")
    values = [float(c) for c in counts]
    total = sum(values)
    return [v / total if total else float("nan") for v in values]


def microbatch_counts(local, microbatches: list, normalizer, normalizer_inputs) -> list:
    """Each microbatch's global loss count: ``normalizer`` (the exported count program, whose
    arguments are the program placeholders ``normalizer_inputs``) on its inputs; a collective
    over the data axes, so call on every rank inside its rank context."""
    names = [s.name for s in local.spec.slots]
    counts = []
    with torch.no_grad():
        for mb in microbatches:
            args = dict(zip(names, local.local_inputs(mb)))
            counts.append(normalizer(*[args[n] for n in normalizer_inputs])[0])
    return counts


def accumulate(local, microbatches: list, *, loss_index: int, reduction: str, normalizer=None,
               normalizer_inputs=()) -> list:
    """Forward and backward of every microbatch (flat global inputs each) into ``local``'s
    gradients, data-axis sums sent once with the last; returns ``[(local loss, weight)]`` per
    microbatch. Call on every rank inside its rank context, then step the optimizer (see the
    module docstring). Example::

        pieces = accumulate(local, [mb0, mb1], loss_index=0, reduction="mean")
    """
    k = len(microbatches)
    counts = microbatch_counts(local, microbatches, normalizer, normalizer_inputs) if reduction == "count" else None
    weights = microbatch_weights(reduction, k, counts)
    out = []
    for j, (mb, w) in enumerate(zip(microbatches, weights)):
        with local.no_sync() if j < k - 1 else contextlib.nullcontext():
            loss = local.run_flat(mb)[loss_index]
            # the weight seeds backward: d(w * loss) = w * d(loss), for every owner of the loss
            loss.backward(torch.full_like(loss, w))
        out.append((loss.detach(), w))
    return out
