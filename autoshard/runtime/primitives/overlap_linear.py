"""Column-parallel linears whose input-gradient sum runs under their weight gradients.

A replicated activation read by tensor-parallel (column-parallel) linears goes through
``mark_varying`` (identity forward; backward all-reduces the gradient)::

    h = mark_varying(x, "tp", tag=1)
    q = aten.linear(h, wq)
    k = aten.linear(h, wk)

Under plain autograd each linear's backward computes its input and weight gradients together,
and the all-reduce runs after all of them with nothing left to hide it behind.
:func:`varying_linears` is the same computation as one autograd node whose backward computes
the input gradient first, starts its all-reduce, computes the weight (and bias) gradients while
the sum is in flight, and then waits for it.

Sequence parallelism reads token rows gathered by ``all_gather_varying`` (backward:
reduce-scatter of the gradient) in the same linears; ``gather_dim`` fuses that gather the same
way, its reduce-scatter started as soon as the input gradient exists.

Values are those of the unfused program bit for bit: forward runs the same ``aten.linear``
calls, recording their autograd graph on detached copies of the inputs, and backward runs
autograd itself on that graph, once for the input gradient (summed over the linears in
autograd's own order) and once for the weights; the sum is ``mark_varying``'s own (same tag,
recorded as its op in the trace, deferred under gradient accumulation, widened under mixed
precision). Backward reads the tensors saved for it twice (once per pass): saved-tensor hooks
that expect one read per saved tensor (ZeRO-3 resharding of a gathered weight) would run twice.
``passes/overlap_linear.py`` puts these calls into the program, for weights read as they are.
"""
from __future__ import annotations

import torch

from autoshard.runtime.primitives.collectives import (all_gather_varying, mark_varying, run_forward, start_gradient_sum)
from autoshard.runtime.transport.rank_context import current

aten = torch.ops.aten


def _linear(x, w, b):
    # the call the program made (no bias argument when it had none)
    return aten.linear.default(x, w) if b is None else aten.linear.default(x, w, b)


class _VaryingLinears(torch.autograd.Function):
    """Forward: ``linear(x, w_i, b_i)`` for each i, with their autograd graph kept on detached
    leaves. Backward: autograd for the input gradient, its all-reduce started, autograd for
    the weight gradients, then the wait."""

    @staticmethod
    def forward(fctx, x, axis, tag, copy, gather_dim, n, *params):
        fctx.rctx, fctx.axis, fctx.tag = current("varying_linears"), axis, tag
        fctx.op, fctx.dims = ("mark_varying", ()) if gather_dim is None else ("all_gather_varying", (gather_dim,))
        fctx.set_materialize_grads(False)  # an output nobody reads gets no backward, as a plain linear
        weights, biases = params[:n], params[n:]
        needs = fctx.needs_input_grad
        param_needs = needs[len(needs) - len(params):]  # the parameters are the trailing arguments
        if gather_dim is not None:
            # all_gather_varying's forward (a new tensor: nothing else can write into it)
            h = run_forward(fctx.op, x, axis, fctx.dims, tag)
        else:
            # mark_varying's forward copies x (a later in-place op on x must not reach what
            # backward reads); ``copy=False`` where the program provably has no such op
            h = x.detach().clone() if copy else x

        def leaf(t, need):
            return None if t is None else t.detach().requires_grad_(need)

        with torch.enable_grad():
            xd = leaf(h, needs[0])
            wd = [leaf(w, need) for w, need in zip(weights, param_needs[:n])]
            bd = [leaf(b, need) for b, need in zip(biases, param_needs[n:])]
            ys = [_linear(xd, w, b) for w, b in zip(wd, bd)]
        fctx.x_leaf = xd
        fctx.param_leaves = [t for t in wd + bd if t is not None and t.requires_grad]
        fctx.slots = [t is not None and t.requires_grad for t in wd + bd]
        # the graph's roots without the outputs themselves: their memory is not held for backward
        fctx.edges = [torch.autograd.graph.get_gradient_edge(y) for y in ys]
        return tuple(y.detach() for y in ys)

    @staticmethod
    def backward(fctx, *grads):
        pairs = [(e, g) for e, g in zip(fctx.edges, grads) if g is not None]
        none = (None,) * (len(fctx.needs_input_grad) - len(fctx.slots))  # x and the options
        if not pairs:
            return none + (None,) * len(fctx.slots)
        edges, gs = [e for e, _ in pairs], [g for _, g in pairs]
        params = fctx.param_leaves
        wait = None
        if fctx.x_leaf.requires_grad:
            (dx,) = torch.autograd.grad(edges, [fctx.x_leaf], gs, retain_graph=bool(params))
            wait = start_gradient_sum(fctx, dx)
        got = iter(torch.autograd.grad(edges, params, gs, allow_unused=True) if params else ())
        dparams = tuple(next(got) if needed else None for needed in fctx.slots)
        fctx.edges = fctx.x_leaf = fctx.param_leaves = None
        return (wait() if wait is not None else None, *none[1:], *dparams)


def varying_linears(x: torch.Tensor, axis: str, weights, biases, tag: int | None = None,
                    copy: bool = True, gather_dim: int | None = None) -> tuple:
    """``tuple(aten.linear(h, w, b) for w, b in zip(weights, biases))`` with
    ``h = mark_varying(x, axis, tag)``, as one autograd node whose backward all-reduces the
    input gradient while it computes the weight gradients (module docstring). A bias may be
    None. ``copy=False`` reads ``x`` itself instead of mark_varying's copy of it (for programs
    that never write into a tensor in place). With ``gather_dim``, ``h`` is
    ``all_gather_varying(x, axis, gather_dim, tag)`` instead (sequence parallelism: token rows
    gathered for the linears), and backward reduce-scatters the input gradient while it
    computes the weight gradients.

    Example::

        q, k, v = varying_linears(x, "tp", (wq, wk, wv), (None, None, None), tag=1)
        q, k, v = varying_linears(x_rows, "tp", (wq, wk, wv), (None, None, None), tag=1, gather_dim=1)
    """
    weights, biases = tuple(weights), tuple(biases)
    tensors = [x, *weights, *(b for b in biases if b is not None)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        # no backward to overlap: the unfused calls (a recomputed block's first, no-grad run)
        h = mark_varying(x, axis, tag) if gather_dim is None else all_gather_varying(x, axis, gather_dim, tag)
        return tuple(_linear(h, w, b) for w, b in zip(weights, biases))
    current("varying_linears").mesh.check_axis(axis)
    return _VaryingLinears.apply(x, axis, tag, copy, gather_dim, len(weights), *weights, *biases)
