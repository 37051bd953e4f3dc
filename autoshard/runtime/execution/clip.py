"""Gradient clipping by the global norm over every shard and mesh axis.

Each rank holds gradients of its stored pieces: a tensor-parallel block, a ZeRO shard, or a
whole replicated parameter. The global 2-norm sums every element's square once: a piece counts
on the ranks at coordinate 0 of each axis it is replicated on (on sharded and expert axes every
rank holds a different block), the sums (in float64) are added over all mesh axes, and every
rank scales its gradients by the same factor, computed as ``torch.nn.utils.clip_grad_norm_``
computes it (fp32: ``max_norm / (norm + 1e-6)``, clamped to 1), so the clipped gradients are
the single-device ones, sliced.

Example (inside each rank's context, after backward, before the optimizer step)::

    norm = clip_grad_norm_(local, 1.0)      # the same float on every rank
"""
from __future__ import annotations

import math

import torch

from autoshard.ownership import Owned, Shard
from autoshard.runtime.execution.checkpoint import stored_placement
from autoshard.runtime.transport.rank_context import current


def counted_here(place, mesh, rank: int, apart=()) -> bool:
    """Whether this rank's piece is the one that counts in a global sum: on every axis the
    piece is replicated on, only coordinate 0 counts. On the axes in ``apart`` every rank holds
    other tensors (a pipeline axis: other stages' parameters), so each one counts there."""
    coords = mesh.coords(rank)
    return all(a in apart or isinstance(o, (Shard, Owned)) or coords[a] == 0 for o, a in zip(place, mesh.names))


def global_grad_norm(local, counted=None) -> float:
    """The 2-norm of all gradients of ``local``'s trainable parameters, as on one device.
    ``counted(name)``, when given, says whether this rank's piece of parameter ``name`` counts
    (a pipeline stage's rank, see ``PipelineRank.counts_in_norm``) instead of :func:`counted_here`."""
    ctx = current("clip_grad_norm_")
    mesh = local.spec.mesh
    slots = {s.name: s for s in local.spec.slots}
    total = torch.zeros(1, dtype=torch.float64)
    for name, p in local.named_parameters():
        if not p.requires_grad or p.grad is None:
            continue
        if (counted(name) if counted is not None
                else counted_here(stored_placement(slots[name], mesh), mesh, local.rank)):
            # squared in place: the fp64 copy (a copy even of an fp64 gradient) is the one
            # temporary, 8 bytes per element; the same values and sum as .double().pow(2)
            total += p.grad.detach().to(torch.float64, copy=True).pow_(2).sum().cpu()
    for axis in mesh.names:
        total = ctx.backend.all_reduce(total, axis)
    return math.sqrt(total.item())


def clip_grad_norm_(local, max_norm: float, norm_type: float = 2.0, counted=None) -> float:
    """Scale every gradient of ``local`` so that their global 2-norm is at most ``max_norm``
    (exactly as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model); returns the norm
    before clipping. Call on every rank, inside its rank context. ``counted``: as for
    :func:`global_grad_norm`.

    Example::

        loss.backward(); clip_grad_norm_(local, 1.0); opt.step()
    """
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} is not supported across shards (only 2.0)")
    norm = global_grad_norm(local, counted)
    # as torch does it, in fp32: the coefficient from the norm rounded to fp32
    coef = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)
    with torch.no_grad():
        for p in local.parameters():
            if p.requires_grad and p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return norm
