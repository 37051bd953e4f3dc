"""Compute cost: FLOPs and memory traffic per op, and a roofline time.

Counts are forward-only; a multiply-add is 2 FLOPs. For training, a matmul's backward is about
2x its forward (one matmul for the input gradient, one for the weight gradient).

Example::

    >>> from autoshard.cost import load_hardware
    >>> f = attention_flops(16384, 16384, heads=32, head_dim=128)
    >>> round(roofline_time(f, 0, load_hardware("h100").device) * 1e3, 2)   # ms
    4.45
"""
from __future__ import annotations

from typing import Any

from .hardware import DeviceSpec

__all__ = [
    "matmul_flops",
    "matmul_bytes",
    "attention_flops",
    "elementwise_flops",
    "elementwise_bytes",
    "roofline_time",
]


def matmul_flops(m: float, n: float, k: float, *, batch: float = 1) -> float:
    """FLOPs of ``[batch, m, k] @ [batch, k, n]``: ``2*batch*m*n*k``.

    >>> matmul_flops(2, 3, 4)
    48.0
    """
    return 2.0 * batch * m * n * k


def matmul_bytes(m: float, n: float, k: float, *, batch: float = 1, dtype_bytes: float = 2) -> float:
    """Minimum memory traffic of that matmul: read both operands, write the output once.

    >>> matmul_bytes(2, 3, 4, dtype_bytes=4)   # (2*4 + 4*3 + 2*3) * 4
    104.0
    """
    return float(batch * (m * k + k * n + m * n) * dtype_bytes)


def attention_flops(s_q: float, s_k: float, *, heads: float, head_dim: float, batch: float = 1,
                    visible_fraction: float = 1.0) -> float:
    """Forward FLOPs of dense attention: ``4*s_q*s_k*heads*head_dim`` per sequence.

    Two matmuls (``Q K^T`` and ``P V``) of ``2*s_q*s_k*head_dim`` each per head; softmax is
    ignored. ``visible_fraction`` scales for masking a kernel skips (about 0.5 for a causal
    diagonal block, 0 for a fully masked one). With GQA ``heads`` is the *query* head count.

    >>> attention_flops(16384, 16384, heads=32, head_dim=128) / 1e12
    4.398046511104
    """
    return 4.0 * batch * s_q * s_k * heads * head_dim * visible_fraction


def elementwise_flops(numel: float, *, flops_per_element: float = 1) -> float:
    """FLOPs of a pointwise op over ``numel`` outputs (e.g. ~4-8 for GELU/SiLU, 1 for add).

    >>> elementwise_flops(1000, flops_per_element=2)
    2000.0
    """
    return float(numel * flops_per_element)


def elementwise_bytes(numel: float, *, inputs: int = 1, outputs: int = 1, dtype_bytes: float = 2) -> float:
    """Memory traffic of a pointwise op: each input read and each output written once.

    >>> elementwise_bytes(1000, inputs=2)   # a + b in bf16
    6000.0
    """
    return float(numel * (inputs + outputs) * dtype_bytes)


def roofline_time(flops: float, bytes_moved: float, device: DeviceSpec, *, dtype: Any = "bf16",
                  flops_efficiency: float | None = None, mem_efficiency: float | None = None) -> float:
    """Seconds for an op: ``max(flops / achieved FLOP/s, bytes / achieved bandwidth)``.

    Achieved = peak x efficiency; efficiencies default to the device's (1.0 in the presets,
    i.e. the spec-sheet peak, until calibration sets them).

    >>> d = DeviceSpec("toy", {"bf16": 1e12}, mem_bandwidth=1e11, mem_capacity=1e9)
    >>> roofline_time(1e12, 1e9, d), roofline_time(1e9, 1e11, d), roofline_time(1e12, 0, d, flops_efficiency=0.5)
    (1.0, 1.0, 2.0)
    """
    fe = device.flops_efficiency if flops_efficiency is None else flops_efficiency
    me = device.mem_efficiency if mem_efficiency is None else mem_efficiency
    if not (0 < fe <= 1 and 0 < me <= 1):
        raise ValueError(f"efficiencies must be in (0, 1], got flops {fe!r}, memory {me!r}")
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops!r}, {bytes_moved!r}")
    return max(flops / (device.flops(dtype) * fe), bytes_moved / (device.mem_bandwidth * me))
