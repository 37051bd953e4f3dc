"""Bucketed data-parallel gradient all-reduce, overlapped with the rest of backward.

Parameters are assigned to buckets up front, in the order their gradients become ready
(reverse order of first use in forward), the same on every rank. When autograd has finished a
parameter's gradient (post-accumulate-grad hook) it is marked ready; a bucket is flattened and
its all-reduce started (asynchronously where the backend can) as soon as it and every earlier
bucket are ready, so communication runs under the remaining backward compute. At the end of
backward every bucket is waited for and the sums are copied back into ``.grad``; the bucket's
buffer goes back to the backend for the next step (see ``Backend.buffer``: new memory of a
bucket's size costs a page fault per 4 KiB on CPU, every step).

Inside ``LocalModule.no_sync()`` (gradient accumulation) nothing is sent: gradients accumulate
locally and the first backward outside it all-reduces the accumulated sums (the sum is linear,
so this is exact).

Example::

    names = assign_buckets([("w2", w2.numel() * 4), ("w1", w1.numel() * 4)], bucket_bytes=25 * 2**20)
    GradBuckets({"w1": w1, "w2": w2}, names, axis="dp").attach()
    loss.backward()          # grads of w1, w2 are summed over dp when backward returns
"""
from __future__ import annotations

import functools

import torch

from autoshard.runtime.transport.rank_context import CollectiveRecord, current


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


def flatten(tensors: list, out: torch.Tensor) -> torch.Tensor:
    """``out`` (1-d) filled with ``tensors`` one after the other (``torch.cat`` of their
    flattened values, converted to ``out``'s dtype), by two C++ calls: its views shaped as
    ``tensors``, then one foreach copy (a bucket holds up to hundreds of gradients, and a Python
    ``reshape`` per gradient would cost more than the copy).

    Example::

        flatten([torch.ones(2, 2), torch.zeros(3)], out=torch.empty(7))   # tensor([1., 1., 1., 1., 0., 0., 0.])
    """
    torch._foreach_copy_(unflatten(out, tensors), tensors)
    return out


def unflatten(flat: torch.Tensor, like: list) -> list:
    """Views of ``flat`` shaped as each tensor of ``like``, in order (the inverse of
    :func:`flatten`), made in one C++ call (not ``split`` and a Python ``view`` per gradient,
    whose overhead grows with the number of gradients). Views keep ``flat``'s dtype.

    Example::

        a, b = unflatten(torch.arange(7.0), [torch.empty(2, 2), torch.empty(3)])   # a: 2x2, b: 3
    """
    return torch._utils._unflatten_dense_tensors(flat, like)


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
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        ctx = self.ctx
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))  # as torch.cat
        if ctx.reduce_dtype is not None and dtype.is_floating_point:
            dtype = ctx.reduce_dtype  # mixed precision: sum in the reduce dtype
        flat = flatten(grads, out=ctx.backend.buffer((sum(g.numel() for g in grads),), dtype))
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
            pieces = unflatten(summed, ps)
            # the sums replace the local gradients in place (mixed precision: cast back from
            # the reduce dtype), so the buffer is free again once they are copied
            held = [(p.grad, piece) for p, piece in zip(ps, pieces) if p.grad is not None]
            if held:
                torch._foreach_copy_([g for g, _ in held], [piece for _, piece in held])
            for p, piece in zip(ps, pieces):
                if p.grad is None:  # no gradient this step: zeros were sent, the sum is new
                    p.grad = piece.to(p.dtype, copy=True)
            self.ctx.backend.recycle(summed)
        self._reset()
