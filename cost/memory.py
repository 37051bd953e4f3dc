"""Memory: persistent model state under ZeRO / FSDP, KV cache, and saved activations.

Model state follows the ZeRO accounting (mixed-precision Adam): BF16 weights (2 bytes/param),
BF16 gradients (2) and 12 bytes of optimizer state (FP32 master weight + two FP32 Adam
moments), 16 bytes per parameter in all. Stage 1 shards the optimizer state over the data
axis, stage 2 also the gradients, stage 3 also the parameters. Tensor and pipeline degrees
divide every term first (even partitions assumed). Activations, temporary gathers,
communication buffers and allocator overhead are *not* included.

Example::

    >>> s = model_state_bytes(7.5e9, dp=64, zero_stage=1)
    >>> round(s.total / 1e9, 1)
    31.4
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelState", "model_state_bytes", "kv_cache_bytes", "activation_bytes"]


@dataclass(frozen=True)
class ModelState:
    """Persistent model-state bytes held by one rank."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def __str__(self) -> str:
        gb = lambda b: f"{b / 1e9:.1f} GB"
        return (f"params {gb(self.params)} + grads {gb(self.grads)} + optimizer "
                f"{gb(self.optimizer)} = {gb(self.total)} per rank")


def _positive_int(name: str, v) -> int:
    if int(v) != v or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def model_state_bytes(n_params: float, *, dp: int, zero_stage: int, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12, tp: int = 1,
                      pp: int = 1) -> ModelState:
    """Per-rank model-state bytes for ``n_params`` parameters (ZeRO stage 0-3 over ``dp`` ranks).

    Each rank holds ``n_params / (tp * pp)`` parameters; of their state, stage >= 1 divides the
    optimizer term by ``dp``, stage >= 2 the gradients, stage 3 the parameters.

    >>> s = model_state_bytes(70e9, dp=4, zero_stage=1, tp=8, pp=2)
    >>> s.params + s.grads, s.optimizer, s.total      # 17.5 GB + 13.125 GB
    (17500000000.0, 13125000000.0, 30625000000.0)
    """
    dp, tp, pp = (_positive_int(n, v) for n, v in (("dp", dp), ("tp", tp), ("pp", pp)))
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params!r}")
    local = n_params / (tp * pp)
    return ModelState(
        params=local * param_bytes / (dp if zero_stage >= 3 else 1),
        grads=local * grad_bytes / (dp if zero_stage >= 2 else 1),
        optimizer=local * optimizer_bytes / (dp if zero_stage >= 1 else 1),
    )


def kv_cache_bytes(tokens: float, *, layers: int, kv_heads: int, head_dim: int,
                   dtype_bytes: float = 2, batch: float = 1) -> float:
    """Bytes of keys + values: ``2 * batch * tokens * layers * kv_heads * head_dim * dtype_bytes``.

    With GQA pass the *KV* head count. Divide ``tokens`` by the context-parallel degree for a
    rank's share, or pass ``layers=1`` for one layer's block.

    >>> kv_cache_bytes(131072, layers=32, kv_heads=8, head_dim=128) / 2**30   # GiB
    16.0
    """
    return float(2 * batch * tokens * layers * kv_heads * head_dim * dtype_bytes)


def activation_bytes(*, batch: float, seq: float, hidden: float, heads: float, layers: float,
                     n_hidden: float, n_score: float = 0, dtype_bytes: float = 2) -> float:
    """Saved-activation estimate ``L*b*(n_hidden*B*T*d + n_score*B*H*T^2)`` (a per-layer count of saved
    [B,T,d] and [B,H,T,T] tensors, as in Korthikanti et al., 2022).

    ``n_hidden`` / ``n_score`` are how many hidden-sized ([B,T,d]) and attention-matrix-sized
    ([B,H,T,T]) tensors each layer saves; they depend on the implementation (a fused
    attention kernel saves no score matrix: ``n_score=0``).

    >>> activation_bytes(batch=1, seq=2048, hidden=4096, heads=32, layers=10, n_hidden=16, n_score=1) / 2**30
    5.0
    """
    return float(layers * dtype_bytes * (n_hidden * batch * seq * hidden + n_score * batch * heads * seq**2))
