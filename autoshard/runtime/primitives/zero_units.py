"""Flat buffers of a ZeRO-3 / FSDP *unit*: the parameters gathered and reduce-scattered together.

A unit's parameters are each stored as this rank's block along their own dim ``d_i`` (their
``ParamStorage``). One collective moves all of them: the all-gather input is this rank's blocks
flattened and concatenated (``S`` elements); the output, ``n`` such rows in rank order, is cut
into the whole parameters. The gradient reduce-scatter input has the same layout: row ``r``
holds block ``r`` of every gradient, so rank ``r`` receives the sums of its own blocks. Sums
are elementwise, so grouping changes no value: a unit's reduce-scatter equals its members'
reduce-scatters bit for bit on every backend.

Example::

    flat = pack_shards([w_shard, b_shard])                     # this rank's S elements
    fulls = unpack_full(all_gather(flat), shapes, dims, n)     # [w, b], whole
    grads = unpack_shards(reduce_scatter(pack_grads([gw, gb], dims, n)), shapes)
"""
from __future__ import annotations

import math

import torch


def pack_shards(shards, empty=None) -> torch.Tensor:
    """This rank's blocks, flattened and concatenated: the all-gather input, in a tensor from
    ``empty(shape, dtype, device)`` if given (a backend's :meth:`buffer`)."""
    flat = [s.detach().reshape(-1) for s in shards]
    if empty is None:
        return torch.cat(flat)
    return torch.cat(flat, out=empty((sum(f.numel() for f in flat),), flat[0].dtype, flat[0].device))


def full_shape(shard_shape, dim: int, n: int) -> tuple:
    out = list(shard_shape)
    out[dim] *= n
    return tuple(out)


def unpack_full(flat: torch.Tensor, shard_shapes, dims, n: int) -> list:
    """Whole parameters from the gathered ``[n * S]`` buffer (rank-major rows)."""
    rows = flat.view(n, -1)
    out, off = [], 0
    for shape, d in zip(shard_shapes, dims):
        k = math.prod(shape)
        piece = rows[:, off:off + k].reshape(n, *shape)
        # rank blocks sit along dim d: move the rank index next to it and merge the two
        out.append(piece.movedim(0, d).reshape(full_shape(shape, d, n)))
        off += k
    return out


def pack_grads(grads, dims, n: int, dtype=None, empty=None) -> torch.Tensor:
    """The reduce-scatter input ``[n * S]``: row ``r`` is block ``r`` of every gradient, in
    ``dtype`` (default: the gradients'), in a tensor from ``empty`` as for :func:`pack_shards`.
    Each gradient is copied once, straight into its columns (a cast, if any, happens in the
    same copy)."""
    sizes = [g.numel() // n for g in grads]
    shape, dtype, device = (n, sum(sizes)), dtype or grads[0].dtype, grads[0].device
    flat = torch.empty(shape, dtype=dtype, device=device) if empty is None else empty(shape, dtype, device)
    off = 0
    for g, d, k in zip(grads, dims, sizes):
        block = g.unflatten(d, (n, g.shape[d] // n)).movedim(d, 0)  # [n, ...block] (a view)
        flat[:, off:off + k].view((n,) + tuple(block.shape[1:])).copy_(block)
        off += k
    return flat.reshape(-1)


def unpack_shards(flat: torch.Tensor, shard_shapes) -> list:
    """This rank's gradient blocks from its ``[S]`` reduce-scatter output (views)."""
    out, off = [], 0
    for shape in shard_shapes:
        k = math.prod(shape)
        out.append(flat[off:off + k].view(shape))
        off += k
    return out


class GradLanding:
    """Reduce-scatters in flight for leaf shards: waited for when backward ends (autograd's
    final callback, before any optimizer step can run), then added into ``.grad``.

    Example::

        landing.add(shards, shapes, pending)      # inside backward
        # ... when loss.backward() returns, every shard's .grad holds its reduced block
    """

    def __init__(self):
        self.pending: list = []

    def add(self, shards, shard_shapes, pending) -> None:
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.land)
        self.pending.append((shards, shard_shapes, pending))

    def settle(self) -> None:
        """Finish the reduce-scatters whose transfer is done (run their ``finish``): their
        receive buffers, as large as the unit's whole gradients, are freed now rather than when
        backward ends. Same values: the sum is the same, only earlier."""
        for _, _, p in self.pending:
            p = getattr(p, "pending", p)  # a held reduce-scatter: its transfer, once started
            if p is not None and p.ready():
                p.wait()

    def land(self) -> None:
        pending, self.pending = self.pending, []
        for _, _, p in pending:
            if hasattr(p, "start"):  # held until a collective that never came: start them all first
                p.start()
        for shards, shapes, p in pending:
            for s, g in zip(shards, unpack_shards(p.wait(), shapes)):
                g = g.to(s.dtype)
                if s.grad is None:
                    s.grad = g
                else:
                    s.grad += g
