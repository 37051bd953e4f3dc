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
import threading
import weakref

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoshard.runtime.primitives import collectives, overlap_linear, ring_attention
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

    def hold(self, t: torch.Tensor):
        """Count ``t`` as held for backward besides autograd's saved tensors (a pipeline
        stage's sent value, kept for its gradient); returns the key :meth:`release` takes."""
        return self._add(t)

    def release(self, key) -> None:
        """Stop counting what :meth:`hold` counted (``key`` None: nothing was)."""
        if key is not None:
            self._drop(key)

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
            # Kept detached: a saved output holding itself (its grad_fn is the node saving it)
            # would make a cycle that outlives the graph whenever a backward retains it (a
            # zero-bubble B) and a later one does not reach that node. Unpacking re-attaches
            # the saved variable's own autograd edge, so backward sees the same tensor.
            value = inner_pack(t) if inner_pack is not None else t.detach()
            # a tensor the inner hooks replaced by a token (a released ZeRO-3 gather) is not held
            key = tracker._add(t) if value is t or isinstance(value, torch.Tensor) else None
            return _Held(value, key)

        def unpack(h):
            return inner_unpack(h.value) if inner_unpack is not None else h.value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self


# ---------------------------------------------------------------------------- selective recompute
#
# A selectively recomputed region calls the ops it keeps through keep(op, ...). In the region's
# forward (no_grad) keep runs the op with autograd on detached inputs and keeps its output and
# its autograd node; the node's saved tensors that are its inputs (a matmul's activation and
# weight) are kept as references to "input i", not as tensors. When backward reruns the region,
# keep does not run the op again: it returns the kept output through _Stitch, whose backward
# differentiates the kept node with its input references resolved to the rerun's (recomputed,
# bit-identical) input values. So only the ops keep is not called on are recomputed, and the
# kept ops' inputs are not held between forward and backward unless they are the region's.

_LOCAL = threading.local()  # the selective region running on this thread (simulated ranks are threads)
_REF = object()


def _kept_ops() -> dict:
    """{name: function}: the runtime's own ops a selective region may keep by name (FX code
    cannot print a function object as an argument); aten ops are passed themselves."""
    fns = [f for f in vars(collectives).values() if callable(f) and getattr(f, "__module__", "") == collectives.__name__
           and f.__name__ in collectives.ADJOINTS]
    fns += [overlap_linear.varying_linears, ring_attention.ring_attention, ring_attention.allgather_attention]
    return {f.__name__: f for f in fns}


KEPT_BY_NAME: dict = {}


def keepable_name(fn):
    """The name under which :func:`keep` finds the runtime op ``fn``, or None if it cannot keep it."""
    if not KEPT_BY_NAME:
        KEPT_BY_NAME.update(_kept_ops())
    name = getattr(fn, "__name__", None)
    return name if KEPT_BY_NAME.get(name) is fn else None


def _is_grad_tensor(a) -> bool:
    return isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())


class _Kept:
    """One kept op of a selective region's forward: its outputs, autograd graph and inputs."""

    __slots__ = ("leaves", "outs", "held", "spec", "rng", "now", "__weakref__")

    def __init__(self):
        self.now = None


class _Selective:
    """The state of one selective region: the ops kept in its forward, then replayed in order."""

    def __init__(self, hooks):
        self.kept, self.i, self.replaying = [], 0, False
        self.inner_pack, self.inner_unpack = hooks if hooks is not None else (None, None)

    def hold(self, t):
        return self.inner_pack(t) if self.inner_pack is not None else t

    def get(self, h):
        return self.inner_unpack(h) if self.inner_unpack is not None else h

    def record(self, op, args, kwargs):
        if kwargs.get("consume"):  # a sum written into its input: autograd refuses it on a leaf
            kwargs = {**kwargs, "consume": False}
        flat, spec = pytree.tree_flatten((args, kwargs))
        rec = _Kept()
        rec.leaves = []
        dflat = []
        for a in flat:
            if _is_grad_tensor(a):
                d = a.detach().requires_grad_()
                rec.leaves.append(d)
                dflat.append(d)
            else:
                dflat.append(a)
        by_storage = {}
        for i, d in enumerate(rec.leaves):
            by_storage.setdefault(d.untyped_storage().data_ptr(), i)

        # the hooks live in the kept graph, which the record holds: they reach it weakly (no cycle)
        wrec, offsets = weakref.ref(rec), [d.storage_offset() for d in rec.leaves]
        inner_pack, inner_unpack = self.inner_pack, self.inner_unpack

        def pack(t):
            i = by_storage.get(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else None
            if i is not None:  # an input: recomputed (or the region's own) in backward, not held
                return (_REF, i, t.size(), t.stride(), t.storage_offset() - offsets[i])
            return (None, inner_pack(t) if inner_pack is not None else t)

        def unpack(h):
            if h[0] is not _REF:
                return inner_unpack(h[1]) if inner_unpack is not None else h[1]
            a = wrec().now[h[1]]
            if a.size() == h[2] and a.stride() == h[3] and h[4] == 0:
                return a
            return a.as_strided(h[2], h[3], a.storage_offset() + h[4])

        a2, k2 = pytree.tree_unflatten(dflat, spec)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = op(*a2, **k2)
        outs, rec.spec = pytree.tree_flatten(out)
        rec.outs = outs
        rec.held = [self.hold(o.detach()) if isinstance(o, torch.Tensor) else o for o in outs]
        rec.rng = torch.get_rng_state()  # ops kept may draw (attention dropout): the rerun skips them
        self.kept.append(rec)
        return pytree.tree_unflatten([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], rec.spec)

    def replay(self, args, kwargs):
        rec = self.kept[self.i]
        self.i += 1
        flat, _ = pytree.tree_flatten((args, kwargs))
        tensors = [a for a in flat if _is_grad_tensor(a)]
        outs = _Stitch.apply(rec, self, *tensors)
        torch.set_rng_state(rec.rng)
        return pytree.tree_unflatten(list(outs), rec.spec)


class _Stitch(torch.autograd.Function):
    """Forward: a kept op's output, unchanged (nothing computed). Backward: the kept autograd
    node of that op, differentiated with its inputs read from this rerun's values."""

    @staticmethod
    def forward(ctx, rec, sel, *tensors):
        ctx.rec = rec
        ctx.save_for_backward(*tensors)
        outs = tuple(sel.get(h) if isinstance(o, torch.Tensor) else o for o, h in zip(rec.outs, rec.held))
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor) and not _is_grad_tensor(o)])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        rec = ctx.rec
        rec.now = ctx.saved_tensors
        pairs = [(o, g) for o, g in zip(rec.outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        got = [None] * len(rec.leaves)
        if pairs:
            got = torch.autograd.grad([o for o, _ in pairs], rec.leaves, [g for _, g in pairs], allow_unused=True)
        rec.now = rec.outs = rec.leaves = rec.held = None  # differentiated once: free it now
        return (None, None, *got)


def keep(op, *args, **kwargs):
    """``op(*args, **kwargs)``, kept (not recomputed) when it runs in a selectively recomputed
    region (:func:`recompute` with ``selective=True``); ``op`` is an aten op or the name of a
    runtime op (``"all_reduce"``). Outside such a region it just runs the op.

    Example::

        def mlp(x, w1, w2):                       # pointwise ops recomputed, matmuls kept
            return (keep(torch.ops.aten.linear.default, torch.relu(keep(torch.ops.aten.linear.default, x, w1)), w2),)
        y, = recompute(mlp, x, w1, w2, selective=True)
    """
    if isinstance(op, str):
        keepable_name(None)  # fills KEPT_BY_NAME once
        fn = KEPT_BY_NAME[op]
    else:
        fn = op
    sel = getattr(_LOCAL, "region", None)
    if sel is None:
        return fn(*args, **kwargs)
    if sel.replaying:
        return sel.replay(args, kwargs)
    return sel.record(fn, args, kwargs)


@contextlib.contextmanager
def _region(sel):
    prev = getattr(_LOCAL, "region", None)
    _LOCAL.region = sel
    try:
        yield
    finally:
        _LOCAL.region = prev


class _Recompute(torch.autograd.Function):
    """Forward: the block under no_grad, saving only its tensor inputs. Backward: the block
    again, with the forward's random state, then autograd through it. ``selective``: the ops
    the block calls through :func:`keep` are kept in forward, not run again."""

    @staticmethod
    def forward(ctx, fn, selective, *args):
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
        ctx.sel = _Selective(torch._C._autograd._top_saved_tensors_default_hooks(False)) if selective else None
        with _region(ctx.sel) if selective else contextlib.nullcontext():
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
            if ctx.sel is not None:
                ctx.sel.replaying, ctx.sel.i = True, 0
            with torch.enable_grad(), track, _region(ctx.sel) if ctx.sel is not None else contextlib.nullcontext():
                outs = tuple(ctx.fn(*args))
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        got = iter(x.grad if need else None for x, need in zip(inputs, ctx.needs))
        out = [None] * len(ctx.others)
        for i in ctx.tensor_at:
            out[i] = next(got)
        for rec in ctx.sel.kept if ctx.sel is not None else ():
            rec.outs = rec.leaves = rec.held = None  # the kept ops' outputs and graphs go now
        ctx.sel = None
        return (None, None, *out)


def recompute(fn, *args, selective: bool = False) -> tuple:
    """``fn(*args)`` (a tuple of outputs) without keeping ``fn``'s intermediate values for
    backward: they are recomputed when backward reaches this call. ``selective=True``: what
    ``fn`` computes through :func:`keep` is kept instead (its outputs and what its autograd
    needs besides its inputs), the rest recomputed.

    Example::

        h, = recompute(block, x, w)          # block(x, w) -> (h,)
        h.sum().backward()                   # runs block again, then differentiates it
    """
    if not torch.is_grad_enabled():
        return tuple(fn(*args))
    return _Recompute.apply(fn, selective, *args)


def recompute_selective(fn, *args) -> tuple:
    """:func:`recompute` with ``selective=True`` (what an exported program calls).

    Example::

        h, = recompute_selective(block, x, w)  # block's keep(...) ops are not run again
    """
    return recompute(fn, *args, selective=True)


class Recomputed(nn.Module):
    """A block of the program run through :func:`recompute` (what the checkpointing pass
    calls in place of the block's code); ``selective``: its :func:`keep` ops are kept."""

    def __init__(self, block: nn.Module, name: str = "", selective: bool = False):
        super().__init__()
        self.block = block
        self.name = name
        self.selective = selective

    def forward(self, *args):
        return recompute(self.block, *args, selective=self.selective)
