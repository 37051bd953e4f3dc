"""Cost of context parallelism (attention over a sequence split on a mesh axis).

- :func:`causal_pairs_per_rank`: valid (query, key) pairs each rank computes under a causal
  mask, for contiguous and zigzag ownership (zigzag pairs an early chunk with a late one so every rank gets
  the same causal work).
- :func:`online_softmax_merge`: the runtime's merge of per-block softmax states (online softmax,
  Milakov & Gimelshein, 2018), re-exported here.
- :func:`context_parallel_estimate`: ring attention's estimate (Liu et al., 2023: KV memory, one block's bytes,
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

import math
from dataclasses import dataclass
from typing import Optional

from autoshard.passes.context_parallel import SDPA
from autoshard.passes.rules import arg
from autoshard.runtime.primitives.ring_attention import (allgather_attention, chunk_ranges, online_softmax_merge, ring_attention)

from autoshard.cost.comm import collective_time
from autoshard.cost.compute import attention_flops, roofline_time
from autoshard.cost.hardware import DeviceSpec, LinkSpec, load_hardware

__all__ = ["causal_pairs_per_rank", "online_softmax_merge", "ContextEstimate", "context_parallel_estimate",
           "choose_variant", "attention_seconds", "ContextSearch", "context_explanation"]


def causal_pairs_per_rank(seq_len: int, ranks: int, order: str = "zigzag") -> list:
    """Valid causal (query, key) pairs per rank: query position ``p`` (1-based) sees ``p`` keys,
    itself included; rank ``r`` holds the positions :func:`~autoshard.runtime.primitives.ring_attention.chunk_ranges`
    gives it (``zigzag``: chunks ``r`` and ``2R-1-r`` of ``2R``; ``contiguous``: chunk ``r``).

    >>> causal_pairs_per_rank(16, 8, "contiguous")
    [3, 7, 11, 15, 19, 23, 27, 31]
    """
    if seq_len <= 0 or ranks <= 0:
        raise ValueError(f"causal_pairs_per_rank needs seq_len > 0 and ranks > 0, got {seq_len}, {ranks}")
    return [sum(p + 1 for a, b in chunk_ranges(seq_len, ranks, r, order) for p in range(a, b)) for r in range(ranks)]


@dataclass(frozen=True)
class ContextEstimate:
    """Ring attention's quantities (Liu et al., 2023) for one sequence split over ``ranks``, and the per-layer
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
    """A long sequence split over ``ranks`` through the cost formulas (defaults: the ``h100``
    preset's device and its fastest link, a 400 GB/s NVLink-class link). Worked example: a
    128k-token sequence of the Llama-3-8B shape (32 layers, 32 heads, 8 KV heads, head dim 128,
    bf16) on eight GPUs holds K+V = 2*131072*8*128*2*32 B = 16 GiB, 2 GiB per rank.

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
    from autoshard.cost.model import collective_seconds
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
    """A chooser for :func:`autoshard.passes.context_parallel.plan_context`: ``(axis, q_shape,
    kv_shape, dtype_bytes, causal, order) -> "ring" | "allgather"``, whichever
    :func:`attention_seconds` predicts faster (forward + backward) on ``cm``'s hardware."""
    def choose(axis, q_shape, kv_shape, dtype_bytes, causal, order):
        t = {v: sum(attention_seconds(cm, mesh, axis, v, q_shape, kv_shape, dtype_bytes, causal, order))
             for v in ("ring", "allgather")}
        return min(t, key=lambda v: (t[v], v != "ring"))
    return choose


class ContextSearch:
    """Context parallelism as an option of the layout search (``cost.search``), as data.

    ``names``: the dim names that are the query sequence of some
    ``scaled_dot_product_attention`` of the program that ring attention can run split (no
    attention dropout: the condition ``layout={"seq": "cp"}`` checks). The search may put such
    a name on an axis even where it meets itself in one tensor (a ``[b, 1, s, s]`` mask): under
    context parallelism rows follow the queries. ``options(mesh)`` is the ``context=`` the
    search builds its candidates with, the variant (ring or all-gather) chosen per node by
    :func:`choose_variant`, so a candidate is costed as the plan ``autoshard()`` would build.

    Example::

        >>> cs = ContextSearch(cap.graph, info, cost_model)                      # doctest: +SKIP
        >>> cs.names                                                            # doctest: +SKIP
        frozenset({'seq'})
        >>> build_program(..., context=cs.options(mesh))                        # doctest: +SKIP
    """

    def __init__(self, graph, info, cm):
        self.cm = cm
        names, refused = set(), set()
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not SDPA or node.args[0] not in info.dims:
                continue
            name = info.names.get(info.leaves(info.of(node.args[0])[-2]))
            if name is None:
                continue
            (refused if arg(node, 4, "dropout_p", 0.0) else names).add(name)
        self.names = frozenset(names - refused)

    def __bool__(self):
        return bool(self.names)

    def options(self, mesh) -> dict:
        """``context=`` for ``build_program`` on ``mesh``: the variant by cost."""
        return {"variant": choose_variant(self.cm, mesh)}

    @staticmethod
    def overlapped(collective) -> bool:
        """Whether a program collective is a context-parallel attention's own traffic (ring
        hops under block compute, or the all-gather variant's gather): the cost model costs it
        with the node (:func:`attention_seconds`), so a lower bound on blocking
        communication must leave it out."""
        return collective.op in ("ring_attention", "allgather_attention")


def context_explanation(program, mesh, cm, *, step_time: float = 0.0, memory_limit: Optional[float] = None,
                        whole=None, seq_names: Optional[dict] = None, train: bool = True) -> list:
    """Sentences for ``plan.explain()`` about a program's context-parallel attention (empty
    when it has none): per axis the variant and order chosen and why (ring vs all-gather
    seconds per attention from :func:`attention_seconds`), the bytes of one K/V block and how
    the blocks circulate, the full sequence's K/V against the resident shard (``2*T*kv_heads*head_dim*bytes*layers``
    over ``R``), and why the sequence is split at all: ``whole`` is ``(layout description, step
    seconds, peak bytes)`` of the same plan with the sequence kept whole, compared with the
    plan's ``step_time`` and ``memory_limit``. ``seq_names``: {axis: the split dim's name}.

    >>> context_explanation(program, mesh, cm, step_time=0.18, memory_limit=80e9,
    ...                     whole=("tp: ffn+heads", 0.25, 1.1e11))                   # doctest: +SKIP
    ['Context parallelism: seq is split on cp (8 ranks, zigzag order) ...', ...]
    """
    nodes = [n for n in program.graph_module.graph.nodes
             if n.op == "call_function" and n.target in (ring_attention, allgather_attention)]
    if not nodes:
        return []
    gb = lambda b: (f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB" if b >= 1e6  # noqa: E731
                    else f"{b / 1e3:.1f} kB")
    lines = []
    by_axis: dict = {}
    for n in nodes:
        by_axis.setdefault(n.args[4], []).append(n)
    for axis, ns in by_axis.items():
        R = mesh.axes[axis]
        n0 = ns[0]
        at = (n0.meta.get("autoshard") or {}).get("context")
        q, kv = n0.args[0].meta["val"], n0.args[1].meta["val"]
        *lead, H, s, d = q.shape
        G = kv.shape[-3]
        B = math.prod(int(x) for x in lead)
        esz = q.element_size()
        causal, order = bool(n0.args[5]), n0.args[6]
        block = 2 * B * G * s * d * esz
        t = {v: sum(attention_seconds(cm, mesh, axis, v, tuple(q.shape), tuple(kv.shape), esz, causal,
                                      order)[:2 if train else 1]) for v in ("ring", "allgather")}
        variants = sorted({("ring" if m.target is ring_attention else "allgather") for m in ns})
        name = at.node if at is not None else n0.name
        seq_name = (seq_names or {}).get(axis) or "the sequence"
        ms = lambda x: f"{x * 1e3:.3f} ms"  # noqa: E731
        head = (f"Context parallelism: {seq_name} is split on {axis} ({R} ranks, {order} order, {s} query positions "
                f"per rank of {s * R}); {len(ns)} attention(s) run as {' and '.join(variants)} attention.")
        if variants == ["ring"]:
            head += (f" Each rank keeps its queries; K/V blocks of {gb(block)} ({B} x {G} kv heads x {s} positions x "
                     f"{d} x {esz} bytes x 2 for K and V) circulate rank i -> i+1, {R - 1} hops per attention in "
                     f"forward, each hop overlapped with one block pair's compute"
                     + (" (backward: the ring again with dK/dV)." if train else "."))
        else:
            head += (f" K/V of {gb(block)} per rank are all-gathered once per attention ({gb(block * R)} gathered), "
                     f"then each rank attends its queries to every key.")
        why = ("ring" if t["ring"] <= t["allgather"] else "all-gather")
        head += (f" Variant by cost: ring {ms(t['ring'])} vs all-gather {ms(t['allgather'])} per attention "
                 f"({'forward + backward' if train else 'forward'}), so {why}"
                 + (" (the hops hide under block compute; the gather does not)." if why == "ring" else
                    " (too little compute per block to hide the ring's hops)."))
        head += (f" Full-sequence K/V: {gb(block * R * len(ns))} over {len(ns)} attention(s), "
                 f"{gb(block * len(ns))} resident per rank.")
        lines.append(head)
        if whole is not None:
            desc, step, peak = whole
            over = memory_limit is not None and peak > memory_limit
            msg = (f"Why split {seq_name}: the same plan with {seq_name} whole ({desc}) predicts {ms(step)} and "
                   f"peaks at {gb(peak)} per rank")
            if over:
                msg += (f", over memory_limit {gb(memory_limit)}: its activations hold all {s * R} positions on "
                        f"every rank; split {R} ways they fit.")
            elif step > step_time:
                msg += (f" (within memory_limit)" if memory_limit is not None else "")
                msg += f": {ms(step - step_time)} slower than with context parallelism."
            else:
                msg += "."
            lines.append(msg)
    return lines
