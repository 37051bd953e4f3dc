"""Cost of context parallelism (attention over a sequence split on a mesh axis).

- :func:`causal_pairs_per_rank`: valid (query, key) pairs each rank computes under a causal
  mask, for contiguous and zigzag ownership (seed 000, "Why pair early and late queries?").
- :func:`online_softmax_merge`: the runtime's merge of per-block softmax states (seed 000's
  worked example), re-exported here.
- :func:`context_parallel_estimate`: seed 003 §13.5.4's estimate (KV memory, one block's bytes,
  transfer and compute time of a block pair) and the per-layer time of ring attention against
  the all-gather-KV variant; :func:`choose_variant` picks the faster for a plan.
- :func:`attention_seconds`: forward / backward seconds of one rewritten ring or all-gather
  attention node, for the graph cost model.

Example::

    >>> causal_pairs_per_rank(16, 8, "zigzag")
    [17, 17, 17, 17, 17, 17, 17, 17]
    >>> e = context_parallel_estimate(131072, 8, layers=32, heads=32, kv_heads=8, head_dim=128)
    >>> e.kv_bytes / 2**30, e.kv_bytes_per_rank / 2**30, round(e.block_bytes / 1e6)
    (16.0, 2.0, 67)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autoshard.runtime.ring_attention import chunk_ranges, online_softmax_merge

from .comm import collective_time
from .compute import attention_flops, roofline_time
from .hardware import DeviceSpec, LinkSpec, load_hardware

__all__ = ["causal_pairs_per_rank", "online_softmax_merge", "ContextEstimate", "context_parallel_estimate",
           "choose_variant", "attention_seconds"]


def causal_pairs_per_rank(seq_len: int, ranks: int, order: str = "zigzag") -> list:
    """Valid causal (query, key) pairs per rank: query position ``p`` (1-based) sees ``p`` keys,
    itself included; rank ``r`` holds the positions :func:`~autoshard.runtime.ring_attention.chunk_ranges`
    gives it (``zigzag``: chunks ``r`` and ``2R-1-r`` of ``2R``; ``contiguous``: chunk ``r``).

    >>> causal_pairs_per_rank(16, 8, "contiguous")
    [3, 7, 11, 15, 19, 23, 27, 31]
    """
    if seq_len <= 0 or ranks <= 0:
        raise ValueError(f"causal_pairs_per_rank needs seq_len > 0 and ranks > 0, got {seq_len}, {ranks}")
    return [sum(p + 1 for a, b in chunk_ranges(seq_len, ranks, r, order) for p in range(a, b)) for r in range(ranks)]


@dataclass(frozen=True)
class ContextEstimate:
    """Seed 003 §13.5.4's quantities for one sequence split over ``ranks``, and the per-layer
    forward time of both attention variants (seconds)."""

    kv_bytes: float           # K and V of the full sequence, every layer
    kv_bytes_per_rank: float  # the resident shard of that
    block_bytes: float        # one layer's K+V block (what one ring hop sends)
    block_pair_flops: float   # one query block against one full KV block
    block_send_s: float
    block_compute_s: float
    ring_layer_s: float       # busiest rank: per hop max(visible compute, next block's transfer)
    allgather_layer_s: float  # all-gather of K/V (not overlapped), then the busiest rank's compute
    busiest_fraction: float   # the busiest rank's visible share of its R block pairs

    @property
    def variant(self) -> str:
        """The faster variant: ``"ring"`` or ``"allgather"``."""
        return "ring" if self.ring_layer_s <= self.allgather_layer_s else "allgather"


def context_parallel_estimate(seq_len: int, ranks: int, *, layers: int, heads: int, kv_heads: int, head_dim: int,
                              dtype_bytes: int = 2, batch: int = 1, causal: bool = True, order: str = "zigzag",
                              link: Optional[LinkSpec] = None, device: Optional[DeviceSpec] = None,
                              dtype: str = "bf16") -> ContextEstimate:
    """Seed 003's 128k example through the cost formulas (defaults: the ``h100`` preset's
    device and the fastest link, 400 GB/s NVLink-class in the seed's words).

    The ring overlaps each hop with the attention on the block already present, so a hop costs
    ``max(compute, transfer)``; causal masking leaves the busiest rank ``busiest_fraction`` of
    its ``R`` block pairs to compute (zigzag: about one half; contiguous: the last rank, about
    ``(2R-1)/(2R)``), and each hop launches its own block computation (``device.op_overhead``).
    The all-gather variant moves ``(R-1)/R`` of the K/V before computing, in one launch.

    >>> e = context_parallel_estimate(131072, 8, layers=32, heads=32, kv_heads=8, head_dim=128)
    >>> round(e.block_pair_flops / 1e12, 1), e.variant
    (4.4, 'ring')
    """
    hw = load_hardware("h100")
    link = link or hw.links[0]
    device = device or hw.device
    per_rank = seq_len // ranks
    kv_bytes = 2.0 * batch * seq_len * kv_heads * head_dim * dtype_bytes * layers
    block_bytes = 2.0 * batch * per_rank * kv_heads * head_dim * dtype_bytes
    flops = attention_flops(per_rank, per_rank, heads=heads, head_dim=head_dim, batch=batch)
    send_s = collective_time("send", block_bytes, ranks, link)
    compute_s = roofline_time(flops, 0, device, dtype=dtype)
    if causal:
        pairs = causal_pairs_per_rank(seq_len, ranks, order) if seq_len <= 1 << 20 else \
            _pairs_closed_form(seq_len, ranks, order)
        busiest = max(pairs) / (per_rank * per_rank * ranks)
    else:
        busiest = 1.0
    # hops: R-1 transfers each hidden under (or exposing) one block pair's compute
    # ... and launches one block computation per hop (the all-gather variant: one).
    ring = (compute_s * busiest * ranks + max(0.0, send_s - compute_s * busiest) * (ranks - 1)
            + device.op_overhead * ranks)
    gather = (collective_time("all_gather", block_bytes * ranks, ranks, link) + compute_s * busiest * ranks
              + device.op_overhead)
    return ContextEstimate(kv_bytes, kv_bytes / ranks, block_bytes, flops, send_s, compute_s, ring, gather, busiest)


def _pairs_closed_form(seq_len, ranks, order):
    out = []
    for r in range(ranks):
        tot = 0
        for a, b in chunk_ranges(seq_len, ranks, r, order):
            tot += (b * (b + 1) - a * (a + 1)) // 2
        out.append(tot)
    return out


def attention_seconds(cm, mesh, axis: str, variant: str, q_shape, kv_shape, dtype_bytes: int, causal: bool,
                      order: str) -> tuple:
    """(forward, backward) seconds of one context-parallel attention node of a rewritten
    program: local ``q_shape [*B, H, s, d]``, local ``kv_shape [*B, G, s, d]`` on ``axis``.
    The ring's hops overlap the block compute; the all-gather variant's gather and its backward
    reduce-scatter do not."""
    # deferred: cost.model imports this module (it costs the nodes this module knows)
    from .model import collective_seconds
    n = mesh.axes[axis]
    *lead, H, s, d = q_shape
    G = kv_shape[-3]
    B = 1
    for x in lead:
        B *= int(x)
    seq = s * n
    frac = 1.0
    if causal:
        frac = max(_pairs_closed_form(seq, n, order)) / (s * s * n)
    flops = attention_flops(s, s, heads=H, head_dim=d, batch=B) * frac
    dev = cm.hardware.device
    dt = {2: "bf16", 4: "fp32"}.get(dtype_bytes, "fp32")
    if dt not in dev.peak_flops:
        dt = max(dev.peak_flops, key=dev.peak_flops.get)
    block_s = roofline_time(flops, 0, dev, dtype=dt)
    block_bytes = 2 * B * G * s * d * dtype_bytes
    if variant == "allgather":
        fwd = collective_seconds(cm, mesh, "all_gather", (axis,), block_bytes) + block_s * n
        bwd = collective_seconds(cm, mesh, "reduce_scatter", (axis,), block_bytes * n) + 2 * block_s * n
        return fwd, bwd
    hop = collective_seconds(cm, mesh, "send", (axis,), block_bytes)
    fwd = block_s * n + max(0.0, hop - block_s) * (n - 1)
    # backward: 2x compute; K/V travel again and dK/dV with them (n hops)
    bwd = 2 * block_s * n + max(0.0, 2 * hop - 2 * block_s) * n
    return fwd + dev.op_overhead * n, bwd


def choose_variant(cm, mesh):
    """A chooser for :func:`autoshard.passes.context.plan_context`: ``(axis, q_shape,
    kv_shape, dtype_bytes, causal, order) -> "ring" | "allgather"``, whichever
    :func:`attention_seconds` predicts faster (forward + backward) on ``cm``'s hardware."""
    def choose(axis, q_shape, kv_shape, dtype_bytes, causal, order):
        t = {v: sum(attention_seconds(cm, mesh, axis, v, q_shape, kv_shape, dtype_bytes, causal, order))
             for v in ("ring", "allgather")}
        return min(t, key=lambda v: (t[v], v != "ring"))
    return choose
