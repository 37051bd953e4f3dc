"""Per-rank execution of a plan's program: this rank's parameters as stored, the optimizer on
its slices, and the rank spec that describes both without the planner.

ZeRO stages are not special code paths in the program; they are where a parameter is *stored*
between uses (docs/design.md, "The ownership algebra"):

====== ==================== ================================ =================================
stage  parameters           gradients                        optimizer state / step
====== ==================== ================================ =================================
0      replicated           all-reduced (mark_varying bwd)   replicated, local step
1      replicated           all-reduced, replicated          sharded: update own slice, then
                                                             all-gather the updated slices
2      replicated (a full   reduce-scattered (use_persistent sharded: update own shard, then
       copy) + own shard    backward)                        all-gather into the full copy
3      sharded              reduce-scattered                 sharded: update own shard; the
                            (all_gather_varying backward)    next forward gathers it again
====== ==================== ================================ =================================

A :class:`RankSpec` is made by ``Plan.rank_spec()`` and, in an exported directory, from
``plan.json``; run.py needs this module and nothing above the runtime.

Example::

    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=layout, train=True, zero_stage=3)
    with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        loss = local(*batch); loss.backward(); opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from autoshard.ownership import ParamStorage, Replicate, held_fraction, local_piece, local_shape
from autoshard.runtime.primitives.buckets import GradBuckets
from autoshard.runtime.primitives.collectives import all_gather, reshard_after_forward
from autoshard.runtime.transport.rank_context import current, trace_phase
from autoshard.runtime.execution.inputs import check_input

UNCHECKED = object()  # Slot.value when the planned Python value is not known (not checked)

# Optimizers whose update of an element reads only that element's parameter, gradient and state:
# their step on a shard equals the matching slice of the step on the whole tensor.
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop")
    if hasattr(torch.optim, n))


@dataclass
class Slot:
    """One argument of the per-rank program and how this rank holds it."""

    name: str  # placeholder name
    kind: str  # user | parameter | buffer | constant | full (ZeRO-2's persistent full copy)
    target: str  # FQN or argument path; for "full", the placeholder name of its parameter
    placement: tuple  # as stored (for a user input: how each rank slices it)
    use_placement: tuple | None = None  # where the parameter is used, if stored otherwise
    storage: ParamStorage | None = None
    trainable: bool = False
    zero1: tuple | None = None  # (axis, dim) of ZeRO-1's optimizer slice
    shape: tuple | None = None  # global shape; None for a non-tensor value
    dtype: torch.dtype = torch.float32
    value: object = UNCHECKED  # a non-tensor user input: the planned Python value (checked per call)


@dataclass
class RankSpec:
    """What one rank needs to run and train a plan's program, without the planner: made by
    ``Plan.rank_spec()`` and, in an exported directory, from ``plan.json``."""

    mesh: object
    forward: Callable  # the per-rank program: forward(*slot values) -> flat outputs
    slots: list
    data_axes: list = field(default_factory=list)
    reshard_tags: frozenset = frozenset()
    buckets: list = field(default_factory=list)  # (tag, [parameter placeholder names]) in launch order
    flatten: Callable | None = None  # (args, kwargs) -> flat user inputs
    unflatten: Callable | None = None  # flat outputs -> the model's output structure
    reduce_dtype: torch.dtype | None = None  # mixed precision: gradient sums run in this dtype
    mutated: list = field(default_factory=list)  # buffer FQNs the program updates in place (running statistics)


def check_slot(slot: Slot, value) -> None:
    """Raise ``InputMismatchError`` unless a user input matches the planned one: the program is
    only right for the planned shapes and Python values (mixed precision casts floats)."""
    if slot.shape is not None or slot.value is not UNCHECKED:
        check_input(slot.target, value, slot.shape, slot.dtype, slot.value, cast_floats=slot.dtype in LOW_PRECISION)


class SliceSource:
    """A global tensor that is read by region (a tensor of a safetensors file): ``lookup`` may
    give one instead of a tensor, and each rank then reads only the block it holds, never the
    whole tensor. Subclasses set ``shape`` and ``dtype`` and read ``local_piece``.

    Example::

        class Zeros(SliceSource):
            shape, dtype = (8, 4), torch.float32
            def local_piece(self, place, mesh, rank):
                return local_piece(torch.zeros(self.shape), place, mesh, rank)
    """

    shape: tuple = ()
    dtype: torch.dtype = torch.float32
    convert = None  # the dtype a read block is cast to (the plan's, where the source's differs)
    is_meta = False

    def local_piece(self, place, mesh, rank: int) -> torch.Tensor:
        """The block ``rank`` holds under ``place`` (:func:`autoshard.ownership.local_piece`'s)."""
        raise NotImplementedError

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def as_dtype(self, dtype) -> "SliceSource":
        """The same source, its blocks cast to ``dtype`` as they are read."""
        other = copy.copy(self)
        other.dtype = other.convert = dtype
        return other


class LocalModule(nn.Module):
    """One rank's program with its parameters, called like the model (inside a rank context).

    ``parameters()`` are this rank's leaves as stored (shards or whole tensors); outputs come
    back as local pieces (whole where replicated, this rank's block where sharded). ``lookup``
    gives the global tensor (or value) of a slot's target; each rank keeps only its block."""

    def __init__(self, spec: RankSpec, rank: int, lookup: Callable, device=None):
        super().__init__()
        self.spec, self.rank, self.device = spec, rank, device
        mesh = spec.mesh
        self.fqn_of: dict = {}  # parameter attribute -> FQN
        self._values: dict = {}  # placeholder name -> tensor or value, for non-user slots
        for slot in spec.slots:
            if slot.kind in ("user", "full"):
                continue
            src = lookup(slot)
            if isinstance(src, SliceSource):
                block = src.local_piece  # reads only this rank's region of the file
            elif isinstance(src, torch.Tensor):
                if src.is_meta:  # torch's "Cannot copy out of meta tensor" names neither tensor nor fix
                    raise ValueError(f"{slot.kind} {slot.target} is on the meta device (a shape, no data): its "
                                     f"values must come from a checkpoint of the model with real weights")
                block = lambda place, mesh, rank, src=src.detach(): local_piece(src, place, mesh, rank)  # noqa: E731
            else:
                self._values[slot.name] = src
                continue
            st = slot.storage
            if st is not None and st.mode == "persistent":
                # The full copy is the parameter's memory; the trainable shard is a view of it.
                full = block(slot.use_placement, mesh, rank).to(device=device, copy=True)
                self.register_buffer(slot.name + "_full", full, persistent=False)
                self._values[slot.name + "_full"] = full
                n = full.shape[st.dim] // mesh.axes[st.axis]
                piece = full.narrow(st.dim, mesh.coords(rank)[st.axis] * n, n)
            else:
                piece = block(slot.placement, mesh, rank).to(device=device, copy=True)
            if slot.kind == "parameter":
                p = nn.Parameter(piece, requires_grad=slot.trainable)
                self.register_parameter(slot.name, p)
                self.fqn_of[slot.name] = slot.target
                self._values[slot.name] = p
            else:
                self.register_buffer(slot.name, piece, persistent=False)
                self._values[slot.name] = piece
        if spec.buckets and mesh.axes[spec.data_axes[0]] > 1:
            # Data-parallel gradient sync of replicated parameters is not in the program: it
            # runs as bucketed all-reduces started from gradient hooks, overlapping backward
            # (on a data axis of size one there is nothing to sum: no buckets, no copies).
            names = [ns for _, ns in spec.buckets]
            GradBuckets({n: self._values[n] for ns in names for n in ns}, names, spec.data_axes[0],
                        tags=[tag for tag, _ in spec.buckets]).attach()

    def local_inputs(self, flat_user: list) -> list:
        users = iter(flat_user)
        out = []
        for slot in self.spec.slots:
            if slot.kind == "user":
                v = next(users)
                check_slot(slot, v)
                if isinstance(v, torch.Tensor):
                    # floating inputs take the program's dtype (mixed precision: the parameters')
                    dtype = slot.dtype if v.is_floating_point() and slot.shape is not None else v.dtype
                    v = local_piece(v.detach(), slot.placement, self.spec.mesh, self.rank).to(
                        device=self.device, dtype=dtype, copy=True)
                out.append(v)
            elif slot.kind == "full":
                out.append(self._values[slot.target + "_full"])
            else:
                out.append(self._values[slot.name])
        return out

    def forward(self, *args, **kwargs):
        """The model's outputs for the global inputs ``args``; each rank slices its block."""
        return self.spec.unflatten(self.run_flat(self.spec.flatten(args, kwargs)))

    def run_flat(self, flat_user: list) -> list:
        """The program's flat local outputs for the flat global user inputs."""
        inputs = self.local_inputs(flat_user)
        ctx = current("LocalModule")
        if self.spec.reduce_dtype is not None:
            ctx.reduce_dtype = self.spec.reduce_dtype
        if not torch.is_grad_enabled():
            return list(self.spec.forward(*inputs))
        with contextlib.ExitStack() as stack:
            if self.spec.reshard_tags:
                ctx.reshard_tags = self.spec.reshard_tags
                stack.enter_context(reshard_after_forward())
            if ctx.saved_tracker is not None:
                # innermost, so it sees what the resharding hooks keep and what they release
                stack.enter_context(ctx.saved_tracker.hooks())
            return list(self.spec.forward(*inputs))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating on the data axes: the sums are sent,
        once, by the first backward outside this context (linear, so exact)."""
        ctx = current("no_sync")
        old = ctx.defer_axes
        ctx.defer_axes = frozenset(old | set(self.spec.data_axes))
        try:
            yield
        finally:
            ctx.defer_axes = old

    def held_bytes(self) -> dict:
        """Bytes of parameters (distinct storages: a ZeRO-2 shard is a view of its full copy)
        and gradients this rank holds now."""
        seen, params = set(), 0
        for t in list(self.parameters()) + [b for n, b in self.named_buffers() if n.endswith("_full")]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                params += t.untyped_storage().nbytes()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.parameters() if p.grad is not None)
        return {"params": params, "grads": grads}

    def updated_buffers(self) -> dict:
        """{FQN: this rank's piece} of the buffers the program updates in place (BatchNorm's
        running statistics, a counter): the program writes each rank's piece, so after a
        forward these are the new values, as the unsharded model's buffers would be.

        Example::

            local(*batch); local.updated_buffers()   # {'bn.running_mean': tensor([...]), ...}
        """
        fqns = set(self.spec.mutated)
        return {s.target: self._values[s.name] for s in self.spec.slots if s.kind == "buffer" and s.target in fqns}

    def full_parameters(self) -> dict:
        """{FQN: this rank's stored piece} (for assembling the trained model)."""
        return {self.fqn_of[n]: p.detach().clone() for n, p in self.named_parameters()}


LOW_PRECISION = (torch.bfloat16, torch.float16)
# the inner optimizers an exported run.py can name (``--optimizer``)
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class ShardedOptimizer:
    """A torch optimizer stepping this rank's slice of every parameter, plus the optimizer-phase
    all-gathers of ZeRO-1 and ZeRO-2. 16-bit parameters are stepped through fp32 master copies
    of this rank's slices (mixed precision): the gradient is cast up, the inner optimizer steps
    the master, and the parameter receives the master cast down.

    Example::

        opt = ShardedOptimizer(local, lambda params: torch.optim.AdamW(params, lr=1e-3))
        local(*batch).backward(); opt.step(); opt.zero_grad()
    """

    @classmethod
    def by_name(cls, local: LocalModule, kind: str, lr: float) -> "ShardedOptimizer":
        """The optimizer named ``kind`` (a key of :data:`OPTIMIZERS`) with learning rate ``lr``.

        Example::

            opt = ShardedOptimizer.by_name(local, "adamw", 1e-3)
        """
        inner = OPTIMIZERS[kind]
        return cls(local, lambda params: inner(params, lr=lr))

    def __init__(self, local: LocalModule, factory):
        self.local = local
        mesh, slots = local.spec.mesh, {s.name: s for s in local.spec.slots}
        self.slices = []  # ZeRO-1: (slice parameter, whole parameter, axis, dim, start)
        self.refresh = []  # ZeRO-2: (shard parameter, full copy, axis, dim)
        self.masters = []  # mixed precision: (fp32 master, the 16-bit tensor it updates)
        params = []
        for name, p in local.named_parameters():
            if not p.requires_grad:
                continue
            slot = slots[name]
            if slot.zero1 is not None:
                axis, d = slot.zero1
                n = p.shape[d] // mesh.axes[axis]
                start = mesh.coords(local.rank)[axis] * n
                s = nn.Parameter(p.detach().narrow(d, start, n))  # a view: stepping it updates p
                self.slices.append((s, p, axis, d, start))
                params.append(self._master(s))
                continue
            if slot.storage is not None and slot.storage.mode == "persistent":
                self.refresh.append((p, getattr(local, name + "_full"), slot.storage.axis, slot.storage.dim))
            params.append(self._master(p))
        self.inner = factory(params)
        sharded = any(s.kind == "parameter" and any(not isinstance(o, Replicate) for o in s.placement)
                      for s in slots.values())
        if (sharded or self.slices) and not isinstance(self.inner, ELEMENTWISE_OPTIMIZERS):
            raise ValueError(f"{type(self.inner).__name__} does not update each element independently, so it cannot "
                             f"step on parameter shards; use one of "
                             f"{sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)} or a plan without sharded state")

    def _master(self, p):
        if p.dtype not in LOW_PRECISION:
            return p
        m = nn.Parameter(p.detach().float())
        self.masters.append((m, p))
        return m

    @torch.no_grad()
    def step(self):
        for s, p, _, d, start in self.slices:
            s.grad = None if p.grad is None else p.grad.narrow(d, start, s.shape[d])
        for m, p in self.masters:
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for m, p in self.masters:
            p.copy_(m)
        with trace_phase("optimizer"):
            for s, p, axis, d, _ in self.slices:
                p.copy_(all_gather(s, axis, d))
            for shard, full, axis, d in self.refresh:
                full.copy_(all_gather(shard, axis, d))

    def zero_grad(self, set_to_none: bool = True):
        if self.slices or self.masters or not set_to_none:
            # the inner optimizer steps tensors of its own (ZeRO-1 slices, fp32 masters)
            self.inner.zero_grad(set_to_none=set_to_none)
        self.local.zero_grad(set_to_none=set_to_none)  # otherwise its parameters are the inner's

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (per-element buffers and fp32 master copies;
        step counters excluded)."""
        total = sum(m.numel() * m.element_size() for m, _ in self.masters)
        for state in self.inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total


def predicted_state_bytes(spec: RankSpec, optimizer_states: int = 2) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank holds under ``spec``, from
    placements alone: ``optimizer_states`` per-element buffers (2 for Adam/AdamW, 1 for SGD
    with momentum); 16-bit parameters add an fp32 master copy and keep fp32 state (ZeRO's
    accounting, Rajbhandari et al., 2020: 2 + 2 + 12 bytes per parameter for bf16 with Adam)."""
    mesh = spec.mesh
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for slot in spec.slots:
        if slot.kind != "parameter":
            continue
        size = torch.empty((), dtype=slot.dtype).element_size()
        # An expert owned by one index of an axis: every rank holds its share of such experts.
        held = held_fraction(slot.placement, mesh)
        use = int(torch.Size(local_shape(slot.shape, slot.use_placement or slot.placement, mesh)).numel() * held)
        stored = int(torch.Size(local_shape(slot.shape, slot.placement, mesh)).numel() * held)
        persistent = slot.storage is not None and slot.storage.mode == "persistent"
        out["params"] += size * (use if persistent else stored)
        if slot.trainable:
            out["grads"] += size * stored
            opt = stored // mesh.axes[slot.zero1[0]] if slot.zero1 else stored
            low = slot.dtype in LOW_PRECISION
            out["optimizer"] += (4 * opt * (optimizer_states + 1)) if low else size * opt * optimizer_states
    return out
