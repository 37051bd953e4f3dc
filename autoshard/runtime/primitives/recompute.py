"""Activation checkpointing at run time: a block's forward runs without keeping its
intermediate values, and backward recomputes them; plus a tracker of the bytes autograd holds
for backward (saved tensors), which is what checkpointing trades for time.

:class:`Recomputed` wraps one block of the per-rank program (an FX GraphModule cut out by
``autoshard.passes.recompute``). Its forward saves only the block's inputs and runs the block
under ``no_grad``; when backward reaches it, the block is run again with the same random state
(dropout masks match) and differentiated, and the gradients of its inputs flow on. Values are
those of the program without checkpointing, bit for bit: the recompute runs the same kernels on
the same inputs. Collectives inside the block run again during backward, in the same order on
every rank (they are labelled ``backward`` in the trace).

:class:`SavedBytes` counts, per rank, the bytes of distinct tensor storages autograd holds for
backward at each moment (parameters and buffers excluded: they are state, counted apart) and
keeps the peak. It composes with the saved-tensor hooks already active (ZeRO-3 resharding:
a released parameter is not held, so it is not counted), and it also sees what a recompute
saves while it runs.

Example::

    tracker = SavedBytes(exclude=local.parameters())
    with rank_context(mesh, rank, backend) as ctx:
        ctx.saved_tracker = tracker           # LocalModule.run_flat installs its hooks
        local(*batch).backward()
    tracker.peak                              # bytes, at the worst moment of forward + backward
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from autoshard.runtime.transport.rank_context import current_or_none


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward (distinct storages).

    Example::

        t = SavedBytes(exclude=model.parameters())
        with t.hooks():
            loss = model(x); loss.backward()
        t.peak, t.live          # live is 0 once backward has freed everything
    """

    def __init__(self, exclude=()):
        self.excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self.refs: dict = {}  # storage ptr -> number of saved references
        self.sizes: dict = {}
        self.live = 0
        self.peak = 0

    def exclude(self, tensors) -> None:
        self.excluded |= {t.untyped_storage().data_ptr() for t in tensors}

    def _add(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.excluded or st.nbytes() == 0:
            return None
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return key

    def _drop(self, key) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    @contextlib.contextmanager
    def hooks(self):
        """Count what autograd saves inside the block; the hooks active before (if any) still
        decide how a tensor is kept."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        inner_pack, inner_unpack = top if top is not None else (None, None)
        tracker = self

        class _Held:
            __slots__ = ("value", "key", "__weakref__")

            def __init__(self, value, key):
                self.value, self.key = value, key

            def __del__(self):  # autograd dropped the saved value (its backward ran, or the graph died)
                if self.key is not None:
                    tracker._drop(self.key)

        def pack(t):
            value = inner_pack(t) if inner_pack is not None else t
            # a tensor the inner hooks replaced by a token (a released ZeRO-3 gather) is not held
            key = tracker._add(t) if value is t or isinstance(value, torch.Tensor) else None
            return _Held(value, key)

        def unpack(h):
            return inner_unpack(h.value) if inner_unpack is not None else h.value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self


class _Recompute(torch.autograd.Function):
    """Forward: the block under no_grad, saving only its tensor inputs. Backward: the block
    again, with the forward's random state, then autograd through it."""

    @staticmethod
    def forward(ctx, fn, n_out_hint, *args):
        ctx.fn = fn
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = (torch.cuda.get_rng_state_all()
                        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) else None)
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.needs = [args[i].requires_grad for i in ctx.tensor_at]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])
        rctx = current_or_none()
        ctx.tracker = getattr(rctx, "saved_tracker", None) if rctx is not None else None
        outs = tuple(fn(*args))
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor)
                                      and not (o.is_floating_point() or o.is_complex())])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        inputs = []
        for i, t, need in zip(ctx.tensor_at, ctx.saved_tensors, ctx.needs):
            x = t.detach().requires_grad_(need)
            args[i] = x
            inputs.append(x)
        with torch.random.fork_rng(devices=[] if ctx.cuda_rng is None else range(len(ctx.cuda_rng))):
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state_all(ctx.cuda_rng)
            track = ctx.tracker.hooks() if ctx.tracker is not None else contextlib.nullcontext()
            with torch.enable_grad(), track:
                outs = tuple(ctx.fn(*args))
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        got = iter(x.grad if need else None for x, need in zip(inputs, ctx.needs))
        out = [None] * len(ctx.others)
        for i in ctx.tensor_at:
            out[i] = next(got)
        return (None, None, *out)


def recompute(fn, *args) -> tuple:
    """``fn(*args)`` (a tuple of outputs) without keeping ``fn``'s intermediate values for
    backward: they are recomputed when backward reaches this call.

    Example::

        h, = recompute(block, x, w)          # block(x, w) -> (h,)
        h.sum().backward()                   # runs block again, then differentiates it
    """
    if not torch.is_grad_enabled():
        return tuple(fn(*args))
    return _Recompute.apply(fn, None, *args)


class Recomputed(nn.Module):
    """A block of the program run through :func:`recompute` (what the checkpointing pass
    calls in place of the block's code)."""

    def __init__(self, block: nn.Module, name: str = ""):
        super().__init__()
        self.block = block
        self.name = name

    def forward(self, *args):
        return recompute(self.block, *args)
