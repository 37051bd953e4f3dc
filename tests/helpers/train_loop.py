"""The learning-rate schedule the training-loop tests ask for, written out independently of the
library's."""
from __future__ import annotations

import math


def expected_lr(s, lr=1e-2, warmup=2, total=6):
    """The schedule, written out: linear warmup, then cosine to 0 (s: 0-based step)."""
    if s < warmup:
        return lr * (s + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
