"""Cost of expert parallelism: rows per expert, the all-to-all of dispatch and combine, load
imbalance and grouped-GEMM efficiency.

Example::

    >>> tokens_per_expert(256, 2, 64)     # 256 tokens * top-2 / 64 experts
    8.0
"""
from __future__ import annotations


def tokens_per_expert(tokens: int, top_k: int, experts: int) -> float:
    """Average (token, expert) assignments per expert before capacity limits: ``B * k / E``
    (64 experts, top-2, 256 tokens -> 256 * 2 / 64 = 8 rows). Actual counts depend on the
    router; the busiest expert (or rank) sets the expert phase's time.

    >>> tokens_per_expert(4096, 8, 128)
    256.0
    """
    if tokens < 0 or top_k <= 0 or experts <= 0:
        raise ValueError(f"tokens_per_expert needs tokens >= 0, top_k > 0 and experts > 0, "
                         f"got {tokens}, {top_k}, {experts}")
    return tokens * top_k / experts
