"""Gradient sums of parameters that backward never reads, added into ``.grad`` when it ends.

A replicated parameter read by per-rank work on an axis goes through ``mark_varying``, whose
backward all-reduces its gradient over the axis (under sequence parallelism: the norms'
weights and biases, the position embedding, on tp). When that parameter has no other use in
the program, nothing in backward reads the sum: only whoever reads ``.grad`` after backward
(the optimizer). ``mark_varying(param, axis, later=True)`` (placed by ``passes/param_sums.py``)
starts the all-reduce without waiting and returns no gradient for the parameter; autograd's
final callback waits for the sum and adds it into ``.grad`` (:class:`SumsLater`).

Values are those of the synchronous sum bit for bit: the same all-reduce of the same gradient,
and the same additions into ``.grad`` in the same order as autograd's: several sums of one
parameter in one backward are added up first, in the order autograd would have received them,
and the total is then added into ``.grad`` (or becomes it). The sums of one backward land when
that backward ends (an inner backward, as a recomputed block runs, lands its own before it
returns). Where something else observes the gradient as autograd delivers it, the sum is left
synchronous (:func:`lands_in_grad`).

Example::

    w = mark_varying(norm_weight, "tp", tag=3, later=True)
    loss = (w * rows).sum(); loss.backward()   # norm_weight.grad holds the sum over tp
"""
from __future__ import annotations

import torch


def lands_in_grad(leaf: torch.Tensor, node) -> bool:
    """Whether autograd, in the backward running now, would add the gradient it gets for
    ``leaf`` through ``node`` (the leaf's ``AccumulateGrad``) into ``leaf.grad`` with nothing
    watching: no hooks on the leaf (a gradient bucket's readiness hook, a user's hook would
    see the gradient missing), and not ``torch.autograd.grad`` (which returns gradients
    instead of accumulating them) nor a ``backward(inputs=...)`` that leaves this leaf out."""
    if leaf._backward_hooks or leaf._post_accumulate_grad_hooks:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch.autograd.grad: the leaf's gradient is returned, not accumulated
        return False


class SumsLater:
    """Sums in flight for parameter leaves, by autograd graph task; each task's are added
    into ``.grad`` by its final callback (the module docstring says in which order)."""

    def __init__(self):
        # graph task id -> [(leaf, pending, dtype)]; ids are unique in the process, and each
        # task's backward runs on one thread (simulated ranks are threads of one process)
        self.tasks: dict = {}

    def add(self, leaf: torch.Tensor, pending, dtype: torch.dtype) -> None:
        """Land ``pending.wait().to(dtype)`` in ``leaf.grad`` when the current backward ends."""
        task = torch._C._current_graph_task_id()
        entries = self.tasks.get(task)
        if entries is None:
            entries = self.tasks[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._land(task))
        entries.append((leaf, pending, dtype))

    def _land(self, task) -> None:
        totals: dict = {}  # id(leaf) -> (leaf, sum of its gradients so far)
        for leaf, pending, dtype in self.tasks.pop(task):
            g = pending.wait().to(dtype)
            key = id(leaf)
            # autograd's input buffer adds a leaf's gradients as they arrive, then accumulates once
            totals[key] = (leaf, g) if key not in totals else (leaf, totals[key][1] + g)
        for leaf, g in totals.values():
            if leaf.grad is None:
                leaf.grad = g
            else:
                leaf.grad += g


LANDING = SumsLater()  # shared by every rank context of the process: entries are per graph task
