"""Context parallelism: attention over a sequence split on a mesh axis (ring attention).

Each rank of the context-parallel axis keeps its block of query positions; key/value blocks
travel around the ring (rank i sends to i+1 and receives from i-1, with wraparound), and every
rank folds each arriving block into an *online-softmax state* per query row (seed 000,
"Sequence and context parallelism"; FlashAttention appendix B.3, Ring Attention section 3):

- ``m`` the running maximum score, ``l`` the denominator (sum of ``exp(s - m)``), ``u`` the
  numerator (sum of ``exp(s - m) * v``). A block with a larger maximum rescales the old ``l``
  and ``u`` by ``exp(m_old - m_new)``; the represented output ``u / l`` does not change.
- An empty row starts at ``m = -inf, l = 0, u = 0``; the update is *guarded*: while the new
  maximum is still ``-inf`` nothing is exponentiated against it (no ``exp(-inf - -inf)``).
- Fully masked blocks (a future causal block, a block of padding) are skipped, not computed.
- **A query row with no valid key at all outputs zeros** (``l = 0``), with zero gradients, and
  its log-sum-exp is ``-inf``; never NaN. (PyTorch's own SDPA also returns zeros there.)

Positions are global: rank ``r`` owns *chunks* of the sequence, ``contiguous`` (chunk ``r`` of
``R``) or ``zigzag`` (chunks ``r`` and ``2R-1-r`` of ``2R``, which balances causal work:
:func:`autoshard.cost.causal_pairs_per_rank`). The causal mask compares global positions, an
explicit mask is indexed by them, so query positions never move.

Backward is exact: it recomputes each block's probabilities from the saved log-sum-exp and runs
the ring again, sending ``(k, v)`` forward as before and the accumulated ``(dk, dv)`` of the
block along with it, so after ``R`` hops every block's gradient is back on its owner.

``allgather_attention`` is the variant for short sequences: all-gather K/V once (backward:
reduce-scatter of dK/dV) and attend locally. Both take K/V with their own (kv) head count:
with GQA the kv heads travel, not repeated copies.

Example (two simulated ranks, each holding half of a causal sequence in zigzag order)::

    >>> import torch
    >>> from autoshard import Mesh
    >>> from autoshard.runtime import run_simulated
    >>> from autoshard.runtime.primitives.ring_attention import ring_attention, zigzag_permute
    >>> q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> def rank(r):
    ...     pick = lambda x: zigzag_permute(x, 2, 2).chunk(2, 2)[r]
    ...     return ring_attention(pick(q), pick(k), pick(v), None, "cp", True, "zigzag")
    >>> out = zigzag_permute(torch.cat(run_simulated(Mesh({"cp": 2}), rank), 2), 2, 2, inverse=True)
    >>> torch.allclose(out, ref, atol=1e-6)
    True
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional

import torch

from autoshard.runtime.primitives import collectives as C
from autoshard.runtime.transport.rank_context import CollectiveRecord, current

ORDERS = ("zigzag", "contiguous")
_NEG_INF = float("-inf")


# ---- the online-softmax state -------------------------------------------------------------

class SoftmaxState(NamedTuple):
    """Online-softmax state of query rows: running max ``m``, denominator ``l``, numerator ``u``
    (``u`` has one more trailing dim, the value width). Floats work too (one row, scalar values)."""

    m: torch.Tensor
    l: torch.Tensor
    u: torch.Tensor

    def output(self) -> torch.Tensor:
        """``u / l``; zeros for a row that saw no valid key (``l == 0``): no division by zero."""
        m, l, u = (torch.as_tensor(t, dtype=torch.float64) if not isinstance(t, torch.Tensor) else t for t in self)
        empty = l == 0
        denom = torch.where(empty, torch.ones_like(l), l)
        if u.dim() > l.dim():
            empty, denom = empty[..., None], denom[..., None]
        return torch.where(empty, torch.zeros_like(u), u / denom)

    def lse(self) -> torch.Tensor:
        """Log-sum-exp of the row's scores, ``m + log l``; ``-inf`` for an empty row."""
        m, l, _ = (torch.as_tensor(t, dtype=torch.float64) if not isinstance(t, torch.Tensor) else t for t in self)
        return torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))), torch.full_like(m, _NEG_INF))


def empty_state(rows_shape, width: int, dtype=torch.float32, device=None) -> SoftmaxState:
    """The state of rows that saw nothing yet: ``m = -inf, l = 0, u = 0``."""
    return SoftmaxState(torch.full(tuple(rows_shape), _NEG_INF, dtype=dtype, device=device),
                        torch.zeros(tuple(rows_shape), dtype=dtype, device=device),
                        torch.zeros(tuple(rows_shape) + (width,), dtype=dtype, device=device))


def block_state(scores: torch.Tensor, v: torch.Tensor) -> SoftmaxState:
    """State of one block: ``scores [..., s, t]`` (masked entries ``-inf``), ``v [..., t, e]``.
    A row whose block is fully masked gets the empty state (guarded: no ``exp(-inf - -inf)``)."""
    m = scores.amax(-1)
    p = torch.exp(scores - _guard(m)[..., None])
    return SoftmaxState(m, p.sum(-1), p @ v)


def _guard(m: torch.Tensor) -> torch.Tensor:
    # A row still at -inf has nothing to scale against: use 0 (every exp below is exp(-inf) = 0).
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def merge(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Fold state ``b`` into ``a``: rescale both by ``exp(m_old - m_new)`` to the new maximum.

    >>> import math, torch
    >>> A = SoftmaxState(torch.tensor(math.log(3)), torch.tensor(1.0), torch.tensor([6.0]))
    >>> B = SoftmaxState(torch.tensor(0.0), torch.tensor(1.0), torch.tensor([6.0]))
    >>> round(float(merge(A, B).output()), 5), round(float(merge(B, A).l), 5)
    (6.0, 1.33333)
    """
    m = torch.maximum(a.m, b.m)
    g = _guard(m)
    alpha, beta = torch.exp(a.m - g), torch.exp(b.m - g)
    return SoftmaxState(m, a.l * alpha + b.l * beta, a.u * alpha[..., None] + b.u * beta[..., None])


def online_softmax_merge(states: Iterable) -> SoftmaxState:
    """Merge per-block states ``(m, l, u)`` in the order given (seed 000's worked example).

    ``states``: ``SoftmaxState`` or ``(m, l, u)`` tuples of tensors or numbers; scalars mean one
    row with a one-wide value. Returns the merged :class:`SoftmaxState`; ``.output()`` is the
    attention output, ``.lse()`` the log-sum-exp. With no state at all, the empty row.

    >>> import math
    >>> s = online_softmax_merge([(math.log(3), 1.0, 6.0), (0.0, 1.0, 6.0)])
    >>> round(float(s.m), 4), round(float(s.l), 4), float(s.u), float(s.output())
    (1.0986, 1.3333, 8.0, 6.0)
    """
    out = None
    for st in states:
        m, l, u = (torch.as_tensor(t, dtype=torch.float64) if not isinstance(t, torch.Tensor) else t for t in st)
        if u.dim() == l.dim():
            u = u[..., None]
        st = SoftmaxState(m, l, u)
        out = st if out is None else merge(out, st)
    if out is None:
        return empty_state((), 1, torch.float64)
    return SoftmaxState(out.m, out.l, out.u.squeeze(-1) if out.u.shape[-1:] == (1,) and out.u.dim() == 1 else out.u)


# ---- who holds which positions -----------------------------------------------------------

def chunk_ranges(seq_len: int, ranks: int, rank: int, order: str) -> list:
    """Global ``[start, stop)`` position ranges that ``rank`` holds, in local order.

    >>> chunk_ranges(16, 4, 1, "zigzag"), chunk_ranges(16, 4, 1, "contiguous")
    ([(2, 4), (12, 14)], [(4, 8)])
    """
    if order not in ORDERS:
        raise ValueError(f"sequence order must be one of {ORDERS}, got {order!r}")
    if order == "contiguous":
        if seq_len % ranks:
            raise ValueError(f"a sequence of {seq_len} positions does not split into {ranks} equal blocks")
        n = seq_len // ranks
        return [(rank * n, (rank + 1) * n)]
    if seq_len % (2 * ranks):
        raise ValueError(f"zigzag order splits the sequence into 2 x {ranks} chunks, but {seq_len} positions do "
                         f"not divide by {2 * ranks}; use order='contiguous' or a multiple of {2 * ranks}")
    c = seq_len // (2 * ranks)
    return [(rank * c, (rank + 1) * c), ((2 * ranks - 1 - rank) * c, (2 * ranks - rank) * c)]


def positions(seq_len: int, ranks: int, rank: int, order: str, device=None) -> torch.Tensor:
    """Global positions held by ``rank``, in local order (a LongTensor)."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in chunk_ranges(seq_len, ranks, rank, order)])


def order_index(seq_len: int, ranks: int, order: str, device=None) -> torch.Tensor:
    """The permutation that lays a natural-order sequence out as the ranks hold it: position
    ``k`` of the result is global position ``index[k]`` (identity for contiguous)."""
    return torch.cat([positions(seq_len, ranks, r, order, device) for r in range(ranks)])


def zigzag_permute(x: torch.Tensor, dim: int, ranks: int, inverse: bool = False) -> torch.Tensor:
    """Reorder dim ``dim`` of ``x`` from natural order into zigzag rank order (chunks
    ``0, 2R-1, 1, 2R-2, ...``), so contiguous blocks are the zigzag chunks; ``inverse`` undoes
    it (after an all-gather). A permutation: its gradient is the inverse permutation, exactly.

    >>> zigzag_permute(torch.arange(8), 0, 2)
    tensor([0, 1, 6, 7, 2, 3, 4, 5])
    >>> zigzag_permute(zigzag_permute(torch.arange(8), 0, 2), 0, 2, inverse=True)
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    index = order_index(x.shape[dim], ranks, "zigzag", x.device)
    if inverse:
        index = torch.argsort(index)
    return x.index_select(dim, index)


# ---- the local kernel ----------------------------------------------------------------------

class _Blocks:
    """Shapes and masks of one rank's attention: q ``[*B, H, s, d]``, k/v ``[*B, G, t, d|e]``
    viewed as ``[*B, G, rep, s, d]`` against ``[*B, G, 1, t, d]`` so GQA needs no repeated K/V."""

    def __init__(self, q, k, mask, causal, scale, q_ranges, seq_len):
        self.lead = tuple(q.shape[:-3])
        self.H, self.s, self.d = q.shape[-3:]
        self.G = k.shape[-3]
        if self.H % self.G:
            raise ValueError(f"ring attention: {self.H} query heads do not group over {self.G} key/value heads")
        self.rep = self.H // self.G
        self.causal, self.seq_len = causal, seq_len
        self.scale = (1.0 / math.sqrt(self.d)) if scale is None else scale
        self.q_ranges = q_ranges
        self.q_local = _local_slices(q_ranges)
        self.mask = None if mask is None else self._mask5(mask, q.dim())

    def _mask5(self, mask, nd):
        while mask.dim() < nd:
            mask = mask.unsqueeze(0)
        h = mask.shape[-3]
        if h == 1:
            return mask.unsqueeze(-3)
        if h != self.H:
            raise ValueError(f"ring attention: mask with {h} heads for {self.H} query heads")
        return mask.reshape(*mask.shape[:-3], self.G, self.rep, *mask.shape[-2:])

    def q5(self, q):
        return q.reshape(*self.lead, self.G, self.rep, self.s, q.shape[-1])

    def pairs(self, k_ranges):
        """(q rows slice, k cols slice, allowed bool or None, additive mask or None) for every
        chunk pair with at least one valid entry; fully masked pairs are skipped."""
        out = []
        for (qa, qb), qsl in zip(self.q_ranges, self.q_local):
            for (ka, kb), ksl in zip(k_ranges, _local_slices(k_ranges)):
                allowed, add = None, None
                if self.causal:
                    if ka > qb - 1:
                        continue  # a future block: nothing visible
                    if kb - 1 > qa:  # the diagonal: part visible
                        allowed = (torch.arange(qa, qb)[:, None] >= torch.arange(ka, kb)[None, :])
                if self.mask is not None:
                    m = self.mask
                    if m.shape[-2] != 1:
                        m = m[..., qsl, :]
                    if m.shape[-1] != 1:
                        m = m[..., ka:kb]
                    if m.dtype == torch.bool:
                        allowed = m if allowed is None else (m & allowed)
                    else:
                        add = m
                        if allowed is None and torch.isneginf(m).all():
                            continue
                if allowed is not None and not bool(allowed.any()):
                    continue  # fully masked chunk pair: skipped
                out.append((qsl, ksl, allowed, add))
        return out

    def scores(self, q5, k, qsl, ksl, allowed, add):
        s = (q5[..., qsl, :] @ k[..., ksl, :].unsqueeze(-3).transpose(-1, -2)) * self.scale
        if add is not None:
            s = s + add
        if allowed is not None:
            s = s.masked_fill(~allowed, _NEG_INF)
        return s


def _local_slices(ranges):
    out, at = [], 0
    for a, b in ranges:
        out.append(slice(at, at + b - a))
        at += b - a
    return out


def _fold(bl, q5, k, v, k_ranges, m, l, u):
    """Fold one K/V block into the state (in place on m, l, u), chunk pair by chunk pair."""
    for qsl, ksl, allowed, add in bl.pairs(k_ranges):
        s = bl.scores(q5, k, qsl, ksl, allowed, add)
        m_old = m[..., qsl]
        m_new = torch.maximum(m_old, s.amax(-1))
        g = _guard(m_new)
        alpha = torch.exp(m_old - g)
        p = torch.exp(s - g[..., None])
        l[..., qsl] = l[..., qsl] * alpha + p.sum(-1)
        u[..., qsl, :] = u[..., qsl, :] * alpha[..., None] + p @ v[..., ksl, :].unsqueeze(-3)
        m[..., qsl] = m_new


def _grad_block(bl, q5, k, v, k_ranges, lse, do5, D, dq5, dk, dv):
    """Add one K/V block's share of dq (this rank's queries) and of that block's dk, dv."""
    g = _guard(lse)
    for qsl, ksl, allowed, add in bl.pairs(k_ranges):
        s = bl.scores(q5, k, qsl, ksl, allowed, add)
        p = torch.exp(s - g[..., qsl, None])       # the forward's probabilities (0 where masked)
        do = do5[..., qsl, :]
        vb = v[..., ksl, :].unsqueeze(-3)
        dv[..., ksl, :] += (p.transpose(-1, -2) @ do).sum(-3)
        ds = p * (do @ vb.transpose(-1, -2) - D[..., qsl, None])
        dq5[..., qsl, :] += (ds @ k[..., ksl, :].unsqueeze(-3)) * bl.scale
        dk[..., ksl, :] += (ds.transpose(-1, -2) @ q5[..., qsl, :]).sum(-3) * bl.scale


# ---- ring communication --------------------------------------------------------------------

_MESSAGE_BASE = 1 << 30


def _message(tag, backward: bool, step: int) -> int:
    # Distinct from pipeline messages (small numbers); FIFO per (sender, receiver, message).
    return _MESSAGE_BASE + ((tag or 0) % (1 << 16)) * 4096 + (2048 if backward else 0) + step


def _shift(ctx, x: torch.Tensor, axis: str, message: int, tag, phase: str):
    """Send ``x`` to the next rank on ``axis`` (returns a receive function for the previous
    rank's tensor): started before the block's compute so a real backend overlaps the two."""
    n, r = ctx.mesh.axis_size(axis), ctx.coord(axis)
    x = x.contiguous()
    ctx.backend.send(x, axis, (r + 1) % n, message)
    ctx.trace.append(CollectiveRecord(kind="send", axis=axis, bytes=x.numel() * x.element_size(), phase=phase,
                                      tag=tag, op="ring_attention", shape=tuple(x.shape), dtype=x.dtype))
    return lambda: ctx.backend.recv(x, axis, (r - 1) % n, message)


def _ring_forward(ctx, axis, q, k, v, mask, causal, order, scale, tag, phase):
    n, r = ctx.mesh.axis_size(axis), ctx.coord(axis)
    seq_len = q.shape[-2] * n
    bl = _Blocks(q, k, mask, causal, scale, chunk_ranges(seq_len, n, r, order), seq_len)
    q5 = bl.q5(q)
    m = torch.full((*bl.lead, bl.G, bl.rep, bl.s), _NEG_INF, dtype=q.dtype)
    l = torch.zeros_like(m)
    u = torch.zeros((*bl.lead, bl.G, bl.rep, bl.s, v.shape[-1]), dtype=q.dtype)
    kv = torch.stack([k, v]) if k.shape == v.shape else None
    cur_k, cur_v = k, v
    for step in range(n):
        src = (r - step) % n
        receive = None
        if step < n - 1:
            receive = (_shift(ctx, kv, axis, _message(tag, False, step), tag, phase) if kv is not None else
                       _pair_shift(ctx, cur_k, cur_v, axis, tag, False, step, phase))
        _fold(bl, q5, cur_k, cur_v, chunk_ranges(seq_len, n, src, order), m, l, u)
        if receive is not None:
            got = receive()
            if kv is not None:
                kv = got
                cur_k, cur_v = kv[0], kv[1]
            else:
                cur_k, cur_v = got
    empty = l == 0
    out5 = torch.where(empty[..., None], torch.zeros_like(u), u / torch.where(empty, torch.ones_like(l), l)[..., None])
    lse = torch.where(empty, torch.full_like(m, _NEG_INF), m + torch.log(torch.where(empty, torch.ones_like(l), l)))
    return out5.reshape(*bl.lead, bl.H, bl.s, v.shape[-1]), lse


def _pair_shift(ctx, a, b, axis, tag, backward, step, phase):
    ra = _shift(ctx, a, axis, _message(tag, backward, 2 * step), tag, phase)
    rb = _shift(ctx, b, axis, _message(tag, backward, 2 * step + 1), tag, phase)
    return lambda: (ra(), rb())


def _ring_backward(ctx, axis, q, k, v, mask, causal, order, scale, tag, out, lse, dout):
    n, r = ctx.mesh.axis_size(axis), ctx.coord(axis)
    seq_len = q.shape[-2] * n
    bl = _Blocks(q, k, mask, causal, scale, chunk_ranges(seq_len, n, r, order), seq_len)
    q5 = bl.q5(q)
    do5 = bl.q5(dout)
    D = (do5 * bl.q5(out)).sum(-1)
    dq5 = torch.zeros_like(q5)
    cur_k, cur_v = k, v
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    same = k.shape == v.shape
    for step in range(n):
        src = (r - step) % n
        receive_kv = None
        if step < n - 1:
            receive_kv = (_shift(ctx, torch.stack([cur_k, cur_v]), axis, _message(tag, True, 2 * step), tag, "backward")
                          if same else _pair_shift(ctx, cur_k, cur_v, axis, tag, True, 2 * step, "backward"))
        _grad_block(bl, q5, cur_k, cur_v, chunk_ranges(seq_len, n, src, order), lse, do5, D, dq5, dk, dv)
        # The block's gradient travels with it; after n hops it is home.
        receive_grad = (_shift(ctx, torch.stack([dk, dv]), axis, _message(tag, True, 2 * step + 1), tag, "backward")
                        if same else _pair_shift(ctx, dk, dv, axis, tag, True, 1024 + 2 * step, "backward"))
        if receive_kv is not None:
            got = receive_kv()
            cur_k, cur_v = (got[0], got[1]) if same else got
        got = receive_grad()
        dk, dv = (got[0].clone(), got[1].clone()) if same else (got[0].clone(), got[1].clone())
    return dq5.reshape(q.shape), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, mask, axis, causal, order, scale, tag):
        rctx = current("autoshard ring_attention")
        phase = C._phase(rctx)
        with torch.no_grad():
            out, lse = _ring_forward(rctx, axis, q.detach(), k.detach(), v.detach(),
                                     None if mask is None else mask.detach(), causal, order, scale, tag, phase)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.mask, fctx.rctx, fctx.args = mask, rctx, (axis, causal, order, scale, tag)
        return out

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        axis, causal, order, scale, tag = fctx.args
        with torch.no_grad():
            dq, dk, dv = _ring_backward(fctx.rctx, axis, q, k, v, None if fctx.mask is None else fctx.mask.detach(),
                                        causal, order, scale, tag, out, lse, dout.contiguous())
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], axis: str,
                   causal: bool = False, order: str = "zigzag", scale: Optional[float] = None,
                   tag: Optional[int] = None) -> torch.Tensor:
    """Attention of this rank's query block against the whole sequence, split on ``axis``.

    ``q [*B, H, s, d]``, ``k [*B, G, s, d]``, ``v [*B, G, s, e]``: this rank's positions (in
    ``order``: :func:`chunk_ranges`), ``G`` dividing ``H`` (GQA: kv heads travel). ``mask``:
    ``None``, or bool (True = attend) / additive float, broadcastable to ``[*B, H, s, S]``: rows
    this rank's queries, columns *all* ``S`` key positions in natural order. ``causal``: key
    position <= query position, on global positions. Returns ``[*B, H, s, e]``; a row with no
    valid key is zeros. See the module docstring for an example.
    """
    return _RingAttention.apply(q, k, v, mask, axis, bool(causal), order, scale, tag)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                        axis: str, causal: bool = False, order: str = "zigzag", scale: Optional[float] = None,
                        tag: Optional[int] = None) -> torch.Tensor:
    """The all-gather-KV variant of :func:`ring_attention` (same arguments and result): K/V are
    all-gathered once (``all_gather_varying``: backward reduce-scatters dK/dV), then this rank's
    queries attend to the whole sequence with the same guarded softmax (rows with no valid key
    are zeros). One collective instead of ``R - 1`` hops; ``R`` times the K/V memory.

    Example::

        out = allgather_attention(q_block, k_block, v_block, None, "cp", causal=True)
    """
    rctx = current("autoshard allgather_attention")
    n, r = rctx.mesh.axis_size(axis), rctx.coord(axis)
    seq_len = q.shape[-2] * n
    kv = C.all_gather_varying(torch.stack([k, v]) if k.shape == v.shape else k, axis,
                              k.dim() - 1 if k.shape == v.shape else k.dim() - 2, tag=tag, defer=False)
    if k.shape == v.shape:
        kk, vv = kv[0], kv[1]
    else:
        kk, vv = kv, C.all_gather_varying(v, axis, v.dim() - 2, tag=tag, defer=False)
    key_pos = order_index(seq_len, n, order, q.device)
    bl = _Blocks(q, k, mask, causal, scale, chunk_ranges(seq_len, n, r, order), seq_len)
    q5 = bl.q5(q)
    s = (q5 @ kk.unsqueeze(-3).transpose(-1, -2)) * bl.scale
    allowed = None
    if causal:
        allowed = positions(seq_len, n, r, order, q.device)[:, None] >= key_pos[None, :]
    if bl.mask is not None:
        mk = bl.mask if bl.mask.shape[-1] == 1 else bl.mask.index_select(-1, key_pos)
        if mk.dtype == torch.bool:
            allowed = mk if allowed is None else (mk & allowed)
        else:
            s = s + mk
    if allowed is not None:
        s = s.masked_fill(~allowed, _NEG_INF)
    m = _guard(s.amax(-1)).detach()
    p = torch.exp(s - m[..., None])
    l = p.sum(-1)
    empty = l == 0
    out5 = (p @ vv.unsqueeze(-3)) / torch.where(empty, torch.ones_like(l), l)[..., None]
    return out5.reshape(*bl.lead, bl.H, bl.s, v.shape[-1])


__all__ = ["SoftmaxState", "empty_state", "block_state", "merge", "online_softmax_merge", "chunk_ranges",
           "positions", "order_index", "zigzag_permute", "ring_attention", "allgather_attention", "ORDERS"]
