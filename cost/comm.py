"""Communication cost: ring volumes per rank and alpha-beta times, as sympy formulas.

Symbols: ``V`` payload bytes, ``R`` ranks in the group, ``alpha`` seconds per algorithm step
(link latency), ``beta`` seconds per byte (1 / per-direction bandwidth).

What ``V`` means per kind (bandwidth-dominated ring / pairwise algorithms):

==============  =========================================  =====================  ============
kind            V is                                       bytes sent per rank    steps
==============  =========================================  =====================  ============
all_gather      the gathered (full, logical) tensor        (R-1)/R * V            R-1
reduce_scatter  the full input each rank contributes       (R-1)/R * V            R-1
all_reduce      the tensor being summed                    2*(R-1)/R * V          2*(R-1)
all_to_all      each rank's send buffer (per rank, not     (R-1)/R * V            R-1
                the logical total)
send / recv     the message                                V                      1
==============  =========================================  =====================  ============

All-to-all convention: each rank splits its V-byte buffer into R chunks, keeps one and sends
R-1 directly to their owners, as on a switched fabric (NVSwitch, a fat tree). Seed 000 warns
that conventions differ: the Scaling Book's "about a quarter of the all-gather time" is for a
bidirectional ring/torus where chunks travel several hops and V is the logical array; that is
a topology statement, not this per-rank volume.

Example::

    >>> collective_formula("all_reduce")
    2*V*(R - 1)/R
    >>> collective_bytes("all_reduce", 8.75e9, 4) / 1e9
    13.125
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import sympy as sp

from autoshard.runtime.primitives.collectives import COMM_KINDS

from .hardware import LinkSpec

__all__ = [
    "V", "R", "alpha", "beta",
    "COLLECTIVE_KINDS",
    "collective_formula",
    "collective_steps_formula",
    "collective_time_formula",
    "collective_bytes",
    "collective_time",
]

V, R, alpha, beta = sp.symbols("V R alpha beta", positive=True)

# the runtime's communicating primitives (one table: autoshard/runtime/primitives/collectives.py)
COLLECTIVE_KINDS = COMM_KINDS

# Build 2*(R-1) unevaluated so it prints as the textbook 2*V*(R - 1)/R, not V*(2*R - 2)/R.
_two_r_minus_1 = sp.Mul(2, R - 1, evaluate=False)

_BYTES = {
    "all_gather": (R - 1) * V / R,
    "reduce_scatter": (R - 1) * V / R,
    "all_reduce": _two_r_minus_1 * V / R,
    "all_to_all": (R - 1) * V / R,
    "send": V,
    "recv": V,
}

_STEPS = {
    "all_gather": R - 1,
    "reduce_scatter": R - 1,
    "all_reduce": _two_r_minus_1,
    "all_to_all": R - 1,
    "send": sp.Integer(1),
    "recv": sp.Integer(1),
}


def _kind(kind: str) -> str:
    k = str(kind).lower().replace("-", "_")
    k = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
         "alltoall": "all_to_all", "all2all": "all_to_all", "p2p": "send"}.get(k, k)
    if k not in _BYTES:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    return k


def collective_formula(kind: str) -> sp.Expr:
    """Per-rank bytes sent by one ``kind`` collective, as a sympy expression in ``V`` and ``R``.

    >>> collective_formula("all_gather"), collective_formula("send")
    (V*(R - 1)/R, V)
    """
    return _BYTES[_kind(kind)]


def collective_steps_formula(kind: str) -> sp.Expr:
    """Number of latency-bound steps (ring: R-1, all-reduce 2*(R-1), send 1) in ``R``.

    >>> collective_steps_formula("all_reduce")
    2*(R - 1)
    """
    return _STEPS[_kind(kind)]


def collective_time_formula(kind: str) -> sp.Expr:
    """Alpha-beta time: ``steps*alpha + bytes*beta``.

    >>> collective_time_formula("all_gather")
    alpha*(R - 1) + V*beta*(R - 1)/R
    """
    k = _kind(kind)
    return _STEPS[k] * alpha + _BYTES[k] * beta


@lru_cache(maxsize=None)
def _bytes_fn(kind: str) -> Callable[[float, float], float]:
    return sp.lambdify((V, R), _BYTES[kind], "math")


@lru_cache(maxsize=None)
def _time_fn(kind: str) -> Callable[[float, float, float, float], float]:
    return sp.lambdify((V, R, alpha, beta), collective_time_formula(kind), "math")


def _check(payload_bytes: float, ranks: int) -> None:
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes!r}")
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks!r}")


def collective_bytes(kind: str, payload_bytes: float, ranks: int) -> float:
    """Bytes each rank sends for one ``kind`` collective of ``payload_bytes`` over ``ranks``.

    ``payload_bytes`` is ``V`` as defined in the module table. A collective over one rank
    moves nothing; a send moves ``V`` whatever ``ranks`` is.

    >>> collective_bytes("all_gather", 8e9, 4)
    6000000000.0
    """
    k = _kind(kind)
    _check(payload_bytes, ranks)
    if ranks == 1 and k not in ("send", "recv"):
        return 0.0
    return float(_bytes_fn(k)(float(payload_bytes), float(ranks)))


def collective_time(kind: str, payload_bytes: float, ranks: int, link: LinkSpec) -> float:
    """Seconds for one ``kind`` collective on ``link``: latency steps + bytes / bandwidth.

    Uses ``link.latency`` as alpha and ``1 / link.effective_bandwidth`` as beta; no overlap,
    contention or hierarchical algorithm is modelled.

    >>> kv_block = 2 * 16384 * 8 * 128 * 2        # one layer's K+V block, bf16
    >>> round(collective_time("send", kv_block, 2, LinkSpec(400e9)) * 1e3, 3)   # ms
    0.168
    """
    k = _kind(kind)
    _check(payload_bytes, ranks)
    if ranks == 1 and k not in ("send", "recv"):
        return 0.0
    return float(_time_fn(k)(float(payload_bytes), float(ranks), float(link.latency),
                             1.0 / link.effective_bandwidth))
