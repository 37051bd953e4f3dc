"""Bucketed data-parallel gradient all-reduce, overlapped with the rest of backward.

Parameters are assigned to buckets up front, in the order their gradients become ready
(reverse order of first use in forward), the same on every rank. When autograd has finished a
parameter's gradient (post-accumulate-grad hook) it is marked ready; a bucket is flattened and
its all-reduce started (asynchronously where the backend can) as soon as it and every earlier
bucket are ready, so communication runs under the remaining backward compute. At the end of
backward every bucket is waited for and the sums are copied back into ``.grad``.

Inside ``LocalModule.no_sync()`` (gradient accumulation) nothing is sent: gradients accumulate
locally and the first backward outside it all-reduces the accumulated sums (the sum is linear,
so this is exact).

Example::

    names = assign_buckets([("w2", w2.numel() * 4), ("w1", w1.numel() * 4)], bucket_bytes=25 * 2**20)
    GradBuckets({"w1": w1, "w2": w2}, names, axis="dp").attach()
    loss.backward()          # grads of w1, w2 are summed over dp when backward returns
"""
from __future__ import annotations

import torch

from .context import CollectiveRecord, current


def assign_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Greedy buckets over (name, bytes) in order: a bucket closes once it reaches
    ``bucket_bytes`` (a parameter larger than that gets a bucket of its own)."""
    buckets, cur, filled = [], [], 0
    for name, n in sizes:
        cur.append(name)
        filled += n
        if filled >= bucket_bytes:
            buckets.append(cur)
            cur, filled = [], 0
    if cur:
        buckets.append(cur)
    return buckets


class GradBuckets:
    """Sums the gradients of ``params`` ({name: leaf}) over ``axis`` by ``buckets`` (lists of
    names, in the order they become ready), tagging each bucket's all-reduce with ``tags``."""

    def __init__(self, params: dict, buckets: list, axis: str, tags: list | None = None):
        self.params = dict(params)
        self.axis = axis
        self.buckets = buckets
        self.tags = tags or [None] * len(self.buckets)
        self.bucket_of = {n: k for k, names in enumerate(self.buckets) for n in names}
        self._reset()

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.pending: list = []
        self.next = 0
        self.finishing = False

    def attach(self):
        for name, p in self.params.items():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._on_ready(name))
        return self

    def _on_ready(self, name: str):
        ctx = current("gradient bucket")
        if self.axis in ctx.defer_axes:
            return  # accumulating: keep the local sum in .grad
        if not self.finishing:
            self.finishing = True
            self.ctx = ctx
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        k = self.bucket_of[name]
        self.ready[k] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            self._launch(self.next)
            self.next += 1

    def _launch(self, k: int):
        ps = [self.params[n] for n in self.buckets[k]]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        ctx = self.ctx
        if ctx.reduce_dtype is not None and flat.is_floating_point():
            flat = flat.to(ctx.reduce_dtype)  # mixed precision: sum in the reduce dtype
        self.pending.append((k, ctx.backend.all_reduce_async(flat, self.axis, consume=True)))
        ctx.trace.append(CollectiveRecord(kind="all_reduce", axis=self.axis, bytes=flat.numel() * flat.element_size(),
                                          phase="backward", tag=self.tags[k], op="grad_bucket",
                                          shape=tuple(flat.shape), dtype=flat.dtype))

    def _finish(self):
        # Parameters that got no gradient this step never fired their hook: their buckets go
        # out now, in order, so every rank sends the same buckets.
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for k, handle in self.pending:
            ps = [self.params[n] for n in self.buckets[k]]
            summed = handle.wait()
            # a view of the bucket's private result replaces the local gradient: no copy
            # (the flat buffer is new each step, so no two steps share it); mixed precision
            # casts back from the reduce dtype
            for p, piece in zip(ps, summed.split([p.numel() for p in ps])):
                piece = piece.view(p.shape)
                p.grad = piece if piece.dtype == p.dtype else piece.to(p.dtype)
        self._reset()
