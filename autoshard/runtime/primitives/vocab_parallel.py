"""Cross-entropy over logits whose class (vocab) dim is split on a mesh axis.

Each rank holds ``x [N, C/n]``, the columns ``[r*C/n, (r+1)*C/n)`` of the logits, and the whole
class-index targets ``[N]``. Instead of gathering the logits (``N*C`` values to every rank), the
softmax statistics travel, ``3N`` values per rank:

- the row maxima, all-gathered (``N`` per rank), of which every rank takes the largest: the
  global maximum, exactly;
- this rank's sum of ``exp(x - max)`` and its target logit (zero where the target is another
  rank's column), all-reduced together (``2N``): the global sum, and the target logit exactly
  (one term is not zero).

The loss per row is ``-((x_t - max) - log(sum))`` as torch's ``log_softmax`` + ``nll_loss``
compute it; only the summation order of ``sum`` differs (per rank, then across ranks), so the
result matches the single-device loss to rounding (fp32: rtol 1e-5). Backward needs no
communication: the loss is replicated on the axis, so each rank's gradient is the same and it
yields the gradient of its own columns, ``(exp(x - max) / sum - onehot) * g``.

Example::

    >>> import torch
    >>> from autoshard import Mesh
    >>> from autoshard.runtime import run_simulated
    >>> x, t = torch.randn(4, 6), torch.tensor([0, 5, 2, 3])
    >>> out = run_simulated(Mesh({"tp": 2}), lambda r: vocab_parallel_cross_entropy(x.chunk(2, 1)[r], t, "tp"))
    >>> torch.allclose(out[0], torch.nn.functional.cross_entropy(x, t, reduction="none"))
    True
"""
from __future__ import annotations

from typing import Optional

import torch

from autoshard.runtime.primitives import collectives as C
from autoshard.runtime.transport.rank_context import current


class _LocalStats(torch.autograd.Function):
    """``[sum_j exp(x_j - m), x_target or 0]`` per row of this rank's columns; the backward is
    written out so it costs one pass over ``x`` (autograd of the composition costs several)."""

    @staticmethod
    def forward(fctx, x, m, index, mine):
        e = torch.exp(x - m[:, None])
        picked = torch.where(mine, x.gather(1, index[:, None]).squeeze(1), torch.zeros((), dtype=x.dtype))
        fctx.save_for_backward(e, index, mine)
        return torch.stack([e.sum(1), picked])

    @staticmethod
    def backward(fctx, grad):
        e, index, mine = fctx.saved_tensors
        gx = e * grad[0][:, None]
        gx.scatter_add_(1, index[:, None], torch.where(mine, grad[1], torch.zeros((), dtype=grad.dtype))[:, None])
        return gx, None, None, None


def vocab_parallel_cross_entropy(x: torch.Tensor, target: torch.Tensor, axis: str, ignore_index: int = -100,
                                 tag: Optional[int] = None) -> torch.Tensor:
    """Per-row cross-entropy (``reduction='none'``) of logits split by columns on ``axis``.

    ``x [N, C/n]``: this rank's block of columns (rank ``r`` of ``n`` on the axis holds columns
    ``r*C/n ...``); ``target [N]``: class indices in ``[0, C)`` or ``ignore_index`` (loss 0),
    the same on every rank of the axis. Returns ``[N]``, the same on every rank of the axis.
    ``tag``: the plan's tag of the max gather; ``tag + 1`` tags the sum. See the module
    docstring for the method and an example.
    """
    rctx = current("autoshard vocab_parallel_cross_entropy")
    width = x.shape[1]
    start = rctx.coord(axis) * width
    with torch.no_grad():
        # the max only steadies exp: no gradient flows through it (the loss does not depend on it)
        m = C.all_gather(x.detach().amax(1)[None], axis, 0, tag=tag).amax(0)
    index = target - start
    mine = (index >= 0) & (index < width)
    index = torch.where(mine, index, torch.zeros((), dtype=index.dtype))
    stats = C.all_reduce(_LocalStats.apply(x, m, index, mine), axis, tag=None if tag is None else tag + 1)
    loss = -((stats[1] - m) - torch.log(stats[0]))
    return torch.where(target == ignore_index, torch.zeros((), dtype=loss.dtype), loss)


__all__ = ["vocab_parallel_cross_entropy"]
