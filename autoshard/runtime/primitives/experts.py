"""Mixture-of-Experts at run time: token-expert assignments, their routing to the ranks that own
the experts, and the weighted combination of the expert outputs.

One MoE layer on one rank (what ``passes/experts.py`` writes into a per-rank program)::

    pairs = assign_topk(top_k_index, num_experts)      # this rank's (token, expert) pairs by expert
    rows = pair_rows(hidden, pairs)                    # their token rows, grouped by expert
    route = exchange_counts(pairs, "ep")               # rows per (rank, expert): an all-to-all of counts
    mine = dispatch_rows(rows, route)                  # all-to-all: rows to the ranks of their experts
    out = <the experts' computation>(mine, local experts, expert_offsets(route))
    back = combine_rows(out, route)                    # all-to-all: outputs back, in ``rows`` order
    y = combine_topk(back, pairs, top_k_weights)       # sum over each token's choices, weighted

Experts are placed in contiguous blocks: with E experts on an axis of n ranks, index i holds
experts ``[i*E/n, (i+1)*E/n)``. Rows arrive grouped by local expert and, within an expert, by
source rank then by the source's own order, so every run (simulated or real) is deterministic.
Split sizes may be zero: a rank whose tokens all go elsewhere, an expert nobody chose.

**Capacity** (optional, ``capacity_factor``): an expert accepts at most
``C = ceil(capacity_factor * P / E)`` assignments, P the number of (token, expert) pairs of the
whole batch. Pairs are served in global token order (batch-major, as in the input; a token's own
choices in their order, Switch Transformer's cumulative rule extended to top-k); the pairs past C
are dropped: they add nothing to their token's output (the remaining weights are not
renormalized; the token still flows through the residual connection). The drops depend on the
batch only, not on the mesh, so a plan on one device drops exactly the same pairs.

Example::

    >>> import torch
    >>> pairs = assign_topk(torch.tensor([[1, 0], [1, 1]]), 2)
    >>> pairs.counts.tolist(), pairs.tokens.tolist()
    ([1, 3], [0, 0, 1, 1])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autoshard.runtime.primitives import collectives as C
from autoshard.runtime.transport.rank_context import current


# ---- a grouped matrix multiply (one expert per block of rows) ---------------------------------

@torch.library.custom_op("autoshard::grouped_mm", mutates_args=())
def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


@_grouped_mm.register_fake
def _(x, w, offs):
    torch._check(x.dim() == 2 and w.dim() == 3 and offs.dim() == 1 and offs.shape[0] == w.shape[0])
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("autoshard::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e].T, out=dx[start:end])
            torch.mm(x[start:end].T, grad[start:end], out=dw[e])
        start = end
    return dx, dw


@_grouped_mm_backward.register_fake
def _(x, w, offs, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _gmm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w)
    ctx.offs = offs


def _gmm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    dx, dw = torch.ops.autoshard.grouped_mm_backward(x, w, ctx.offs, grad.contiguous())
    return dx, dw, None


_grouped_mm.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``x[offs[e-1]:offs[e]] @ w[e]`` for every group e (``offs``: cumulative row counts,
    ``offs[-1] <= len(x)``; rows past it are zero). A custom op that ``torch.export`` keeps whole,
    in any dtype, like ``torch._grouped_mm`` (bf16 only on CPU) and Hugging Face's fallback.

    Example::

        >>> x, w = torch.ones(3, 2), torch.stack([torch.eye(2), 2 * torch.eye(2)])
        >>> grouped_mm(x, w, torch.tensor([1, 3]))[:, 0].tolist()
        [1.0, 2.0, 2.0]
    """
    return torch.ops.autoshard.grouped_mm(x, w, offs)


# ---- assignments: this rank's (token, expert) pairs, grouped by expert ------------------------

@dataclass
class Pairs:
    """This rank's kept (token, expert) pairs, sorted by expert (stable: token order within one).

    ``order``: position of each kept pair in the flat pair list (token-major); ``tokens``: its
    token; ``experts``: its expert; ``counts``: kept pairs per expert ``[E]``; ``num_pairs``:
    pairs before drops; ``num_tokens``: tokens of this rank."""

    order: torch.Tensor
    tokens: torch.Tensor
    experts: torch.Tensor
    counts: torch.Tensor
    num_pairs: int
    num_tokens: int

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]


def assign_topk(top_k_index: torch.Tensor, num_experts: int, capacity_factor: float | None = None,
                token_axes: tuple = (), tag: int | None = None) -> Pairs:
    """Pairs of a top-k router's choices ``top_k_index [T, k]`` (expert ids), grouped by expert;
    with ``capacity_factor``, the pairs past each expert's capacity are dropped (module
    docstring). ``token_axes``: mesh axes, in mesh order, whose ranks hold the other blocks of
    the batch (the capacity counts are gathered over them).

    Example::

        >>> assign_topk(torch.tensor([[2, 0]]), 3).experts.tolist()
        [0, 2]
    """
    T, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    tokens = torch.arange(T * k, device=ids.device) // k
    return _group(ids, tokens, num_experts, T, capacity_factor, token_axes, tag)


def assign_dense(weights, capacity_factor: float | None = None, token_axes: tuple = (),
                 tag: int | None = None) -> Pairs:
    """Pairs of dense per-expert weights (``weights[e]``: ``[T]`` or ``[T, 1]``, zero where a
    token does not use expert e), as a looped MoE writes ``sum_e expert_e(x) * w_e``.

    Example::

        >>> assign_dense([torch.tensor([0.5, 0.0]), torch.tensor([0.5, 1.0])]).tokens.tolist()
        [0, 0, 1]
    """
    w = torch.stack([x.reshape(-1) for x in weights], 1)  # [T, E]
    T, E = w.shape
    hit = (w != 0).reshape(-1).nonzero().reshape(-1)  # token-major
    return _group(hit % E, hit // E, E, T, capacity_factor, token_axes, tag)


def _group(ids, tokens, E, T, capacity_factor, token_axes, tag) -> Pairs:
    n = ids.shape[0]
    experts, order = torch.sort(ids, stable=True)
    counts = torch.bincount(experts, minlength=E)
    if counts.shape[0] > E:
        raise ValueError(f"router chose expert {int(ids.max())}, but the layer has {E} experts")
    if capacity_factor is not None:
        keep = _within_capacity(experts, counts, capacity_factor, token_axes, tag)
        order, experts = order[keep], experts[keep]
        counts = torch.bincount(experts, minlength=E)
    return Pairs(order, tokens[order], experts, counts, n, T)


def _within_capacity(experts, counts, capacity_factor, token_axes, tag) -> torch.Tensor:
    """Mask over the sorted pairs: True for those within their expert's capacity."""
    E = counts.shape[0]
    blocks = counts.reshape(1, E)
    for axis in reversed(token_axes):  # minor axis first: blocks end up in batch order
        blocks = C.all_gather(blocks, axis, 0, tag)
    mine = _block_index(token_axes)
    before = blocks[:mine].sum(0)  # pairs of earlier tokens, per expert
    capacity = math.ceil(capacity_factor * int(blocks.sum()) / E)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(experts.shape[0], device=experts.device) - starts[experts] + before[experts]
    return position < capacity


def _block_index(token_axes) -> int:
    if not token_axes:
        return 0
    ctx = current("expert capacity")
    index = 0
    for axis in token_axes:
        index = index * ctx.mesh.axis_size(axis) + ctx.coord(axis)
    return index


def pair_rows(x: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """The token rows of ``pairs`` (``x [T, ...]``), grouped by expert."""
    return x[pairs.tokens]


# ---- routing: rows to the ranks owning their experts, and back --------------------------------

@dataclass
class Route:
    """How one rank's rows travel on ``axis`` (None: experts are local, nothing moves)."""

    axis: str | None
    send_splits: list
    recv_splits: list
    expert_counts: list  # rows per local expert after dispatch
    to_expert_major: torch.Tensor | None  # received rows (by source) -> grouped by local expert
    to_source_major: torch.Tensor | None
    first_expert: int


def exchange_counts(pairs: Pairs, axis: str | None, tag: int | None = None) -> Route:
    """Exchange rows per (rank, expert) on ``axis`` (an all-to-all of ``E`` counts) and derive
    the splits of :func:`dispatch_rows` and :func:`combine_rows`.

    Example (inside a rank context on a mesh with an ``ep`` axis)::

        route = exchange_counts(pairs, "ep")     # route.expert_counts: rows per local expert
    """
    counts = pairs.counts
    if axis is None or current("exchange_counts").mesh.axis_size(axis) == 1:
        c = counts.tolist()
        return Route(None, [sum(c)], [sum(c)], c, None, None, 0)
    n = current("exchange_counts").mesh.axis_size(axis)
    E = counts.shape[0]
    if E % n:
        raise ValueError(f"{E} experts cannot be placed evenly on mesh axis {axis!r} of size {n}")
    per = E // n
    sent = counts.reshape(n, per)
    got = C.all_to_all(sent, axis, 0, 0, tag).tolist()  # got[j][e]: rows from index j for local expert e
    send_splits = sent.sum(1).tolist()
    recv_splits = [sum(r) for r in got]
    expert_counts = [sum(got[j][e] for j in range(n)) for e in range(per)]
    # Received rows are by source, then expert; the experts want them by expert, then source.
    starts, pos = {}, 0
    for j in range(n):
        for e in range(per):
            starts[j, e] = pos
            pos += got[j][e]
    pieces = [torch.arange(starts[j, e], starts[j, e] + got[j][e]) for e in range(per) for j in range(n)]
    to_expert = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty_like(to_expert)
    inverse[to_expert] = torch.arange(to_expert.shape[0])
    return Route(axis, send_splits, recv_splits, expert_counts, to_expert.to(counts.device),
                 inverse.to(counts.device), current().coord(axis) * per)


def dispatch_rows(rows: torch.Tensor, route: Route, tag: int | None = None) -> torch.Tensor:
    """Rows grouped by (global) expert -> the rows of this rank's experts, grouped by local
    expert. Backward returns the gradient rows to their sources (the reversed all-to-all)."""
    if route.axis is None:
        return rows
    got = C.dispatch(rows, route.axis, route.send_splits, route.recv_splits, tag)
    return got[route.to_expert_major]


def combine_rows(rows: torch.Tensor, route: Route, tag: int | None = None) -> torch.Tensor:
    """The inverse of :func:`dispatch_rows`: expert outputs back to the ranks (and the order) of
    the rows that were dispatched."""
    if route.axis is None:
        return rows
    return C.combine(rows[route.to_source_major], route.axis, route.recv_splits, route.send_splits, tag)


def expert_offsets(route: Route, dtype: torch.dtype = torch.int64, device=None) -> torch.Tensor:
    """Cumulative rows per local expert (the ``offs`` of a grouped matmul)."""
    return torch.tensor(route.expert_counts, dtype=dtype, device=device).cumsum(0).to(dtype)


def expert_ids(route: Route, dtype: torch.dtype = torch.int64, device=None) -> torch.Tensor:
    """The local expert of each row after dispatch (rows arrive grouped by local expert): a
    batched-matmul MoE selects each row's expert weights with them (``w[expert_ids]``).

    Example::

        >>> expert_ids(Route(None, [3], [3], [2, 0, 1], None, None, 0)).tolist()
        [0, 0, 2]
    """
    counts = torch.tensor(route.expert_counts, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts).to(dtype)


def expert_segments(rows: torch.Tensor, route: Route) -> tuple:
    """The rows of each local expert (a looped MoE runs each expert on its own rows)."""
    return torch.split(rows, route.expert_counts, 0)


def owned(params, axis: str | None, slot: int) -> torch.Tensor:
    """The ``slot``-th expert this rank owns among per-expert tensors ``params`` (one per
    expert, in expert order): index i of ``axis`` owns the i-th contiguous block.

    Example::

        w1 = owned((e0_w1, e1_w1, e2_w1, e3_w1), "ep", 0)   # expert 2 on ep index 1 of 2
    """
    if axis is None:
        return params[slot]
    ctx = current("owned")
    per = len(params) // ctx.mesh.axis_size(axis)
    return params[ctx.coord(axis) * per + slot]


# ---- combining the expert outputs ------------------------------------------------------------

def combine_topk(rows: torch.Tensor, pairs: Pairs, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * rows_of(t, j)`` over a token's choices in order (a dropped pair
    counts as zero), as Hugging Face's experts do: weighted rows in pair order, then a sum over k."""
    T, k = top_k_weights.shape
    full = rows.new_zeros((pairs.num_pairs,) + tuple(rows.shape[1:])).index_copy(0, pairs.order, rows)
    weighted = full * top_k_weights.reshape(-1, *([1] * (rows.dim() - 1))).to(rows.dtype)
    return weighted.reshape(T, k, *rows.shape[1:]).sum(1)


def combine_dense(rows: torch.Tensor, pairs: Pairs, weights, init: torch.Tensor) -> torch.Tensor:
    """``init + sum_e rows_e * w_e`` added expert by expert in order, each expert's rows to its
    tokens: the looped MoE's own sum without its terms of weight zero."""
    out = init
    start = 0
    # Every expert's weight enters the autograd graph, even with no rows here: backward then
    # runs the same steps (and collectives) on every rank.
    for e, n in enumerate(pairs.counts.tolist()):
        tok = pairs.tokens[start:start + n]
        w = weights[e].reshape(weights[e].shape[0], -1)[tok]
        out = out.index_add(0, tok, rows[start:start + n] * w.to(rows.dtype))
        start += n
    return out
