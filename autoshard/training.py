"""Training state on the data axis: where parameters, gradients and optimizer state live.

ZeRO stages are not special code paths in the program; they are where a parameter is *stored*
between uses (DESIGN.md, "The ownership algebra"):

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

Example::

    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=layout, train=True, zero_stage=3)
    with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        loss = local(*batch); loss.backward(); opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .ownership import Replicate, Shard, local_piece, local_shape
from .runtime.buckets import GradBuckets, assign_buckets
from .runtime.collectives import all_gather, reshard_after_forward
from .runtime.context import current, trace_phase
from autoshard.passes.spmd import LayoutError, ParamStorage

# Optimizers whose update of an element reads only that element's parameter, gradient and state:
# their step on a shard equals the matching slice of the step on the whole tensor.
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop")
    if hasattr(torch.optim, n))


def data_axes(user_placements) -> list[str]:
    """Mesh axes that split a user input (the batch): the data-parallel axes."""
    axes = []
    for place, names in user_placements:
        for o, a in zip(place, names):
            if isinstance(o, Shard) and a not in axes:
                axes.append(a)
    return axes


def choose_storage(param_nodes: dict, use_placements: dict, mesh, axis: str, stage: int,
                   reshard: bool) -> dict:
    """{placeholder name: ParamStorage} for stage 2 and 3: each parameter is split on ``axis``
    along its first dim that no other axis splits and that ``axis`` divides evenly. A parameter
    with no such dim stays whole (listed in the plan)."""
    out = {}
    if stage < 2:
        return out
    for name, val in param_nodes.items():
        use = use_placements[name]
        for d, size in enumerate(val.shape):
            taken = any(isinstance(o, Shard) and o.dim == d for o in use)
            if not taken and size % mesh.axes[axis] == 0:
                place = tuple(Shard(d) if a == axis else o for o, a in zip(use, mesh.names))
                out[name] = ParamStorage(place, axis, d, stage, "persistent" if stage == 2 else "gather",
                                         reshard=(stage == 3 and reshard))
                break
    return out


def state_collectives(program, stage: int, axes: list, mesh, shapes: dict, display: dict) -> list:
    """Collectives of state sharding that the forward program does not show: the second gather
    of a resharded parameter (backward) and the optimizer-phase gathers of ZeRO-1/2."""
    from autoshard.passes.spmd import Collective

    out = []
    for c in program.collectives:
        if c.tag in program.reshard_tags and c.phase == "forward":
            out.append(Collective("all_gather", c.axes, c.bytes, "backward", c.where,
                                  c.why.split(";")[0] + "; gathered again when backward reads it", c.node,
                                  c.line, c.tag, c.op))
    if stage in (1, 2) and axes:
        axis = axes[0]
        for name, val in shapes.items():
            use = program.use_placements[name]
            d = slice_dim_for(use, val.shape, mesh, axis)
            if d is None:
                continue
            n = torch.Size(local_shape(val.shape, use, mesh)).numel() // mesh.axes[axis] * val.element_size()
            out.append(Collective("all_gather", (axis,), n, "optimizer", display.get(name, name).rsplit(".", 1)[0],
                                  f"ZeRO-{stage}: each rank updated its slice of {display.get(name, name)}; "
                                  f"the updated slices are gathered into the whole parameter", name))
    return out


def bucket_collectives(program, axis, shapes: dict, display: dict, bucket_bytes: int) -> list:
    """One backward all-reduce per gradient bucket (tags after the program's own)."""
    from autoshard.passes.spmd import Collective

    if not program.bucketed:
        return []
    sizes = [(n, shapes[n].numel() * shapes[n].element_size()) for n in program.bucketed]
    first_tag = 1 + max((c.tag for c in program.collectives), default=-1)
    program.buckets = [(first_tag + k, names) for k, names in enumerate(assign_buckets(sizes, bucket_bytes))]
    out = []
    for tag, names in program.buckets:
        size = sum(dict(sizes)[n] for n in names)
        params = [display.get(n, n) for n in names]
        out.append(Collective("all_reduce", (axis,), size, "backward", params[0].rsplit(".", 1)[0],
                              f"gradient bucket of {len(names)} replicated parameters used by per-rank work on "
                              f"{axis} ({', '.join(params[:3])}{', ...' if len(params) > 3 else ''}): backward sums "
                              f"them, started once the bucket is ready so it overlaps the rest of backward",
                              ",".join(names), "", tag, "grad_bucket"))
    return out


def slice_dim_for(use_place, shape, mesh, axis):
    """ZeRO-1's optimizer slice: the first dim no other axis splits that ``axis`` divides."""
    for d, size in enumerate(shape):
        if not any(isinstance(o, Shard) and o.dim == d for o in use_place) and size % mesh.axes[axis] == 0:
            return d
    return None


class LocalModule(nn.Module):
    """One rank's program with its parameters, called like the model (inside a rank context).

    ``parameters()`` are this rank's leaves as stored (shards or whole tensors); outputs come
    back as local pieces (whole where replicated, this rank's block where sharded)."""

    def __init__(self, plan, rank: int):
        super().__init__()
        self._plan, self.rank = plan, rank
        cap, prog, mesh = plan.captured, plan.program, plan.mesh
        self.fqn_of: dict = {}  # parameter attribute -> FQN
        self._values: dict = {}  # placeholder name -> tensor, for non-user inputs
        self._user: list = []  # placeholder positions of user inputs
        fulls = {}
        for name, kind, index in prog.placeholders:
            inp = cap.inputs[index]
            if kind == "full" or inp.kind == "user":
                continue
            src = cap.state[inp.target].detach()
            if not isinstance(src, torch.Tensor):
                self._values[name] = src
                continue
            place = prog.input_placements[index]
            st = prog.storage.get(name)
            if st is not None and st.mode == "persistent":
                # The full copy is the parameter's memory; the trainable shard is a view of it.
                full = local_piece(src, prog.use_placements[name], mesh, rank).clone()
                self.register_buffer(name + "_full", full, persistent=False)
                fulls[name] = full
                i = mesh.coords(rank)[st.axis]
                n = full.shape[st.dim] // mesh.axes[st.axis]
                piece = full.narrow(st.dim, i * n, n)
            else:
                piece = local_piece(src, place, mesh, rank).clone()
            if inp.kind == "parameter":
                p = nn.Parameter(piece, requires_grad=inp.trainable)
                self.register_parameter(name, p)
                self.fqn_of[name] = inp.target
                self._values[name] = p
            else:
                self.register_buffer(name, piece, persistent=False)
                self._values[name] = piece
        for name, kind, index in prog.placeholders:
            if kind == "full":
                self._values[name] = fulls[name[: -len("_full")]]
        if prog.buckets:
            GradBuckets({n: self._values[n] for n in prog.bucketed}, [names for _, names in prog.buckets],
                        plan.data_axes[0], tags=[tag for tag, _ in prog.buckets]).attach()

    def local_inputs(self, args, kwargs) -> list:
        plan = self._plan
        cap, prog, mesh = plan.captured, plan.program, plan.mesh
        users = iter(cap.flatten_args(args, kwargs))
        out = []
        for name, kind, index in prog.placeholders:
            if cap.inputs[index].kind == "user" and kind == "input":
                v = next(users)
                out.append(local_piece(v.detach(), prog.input_placements[index], mesh, self.rank)
                           if isinstance(v, torch.Tensor) else v)
            else:
                out.append(self._values[name])
        return out

    def forward(self, *args, **kwargs):
        """The model's outputs for the global inputs ``args``; each rank slices its block."""
        flat = self.run_flat(args, kwargs)
        return pytree.tree_unflatten(flat, self._plan.captured.out_spec)

    def run_flat(self, args, kwargs) -> list:
        prog = self._plan.program
        inputs = self.local_inputs(args, kwargs)
        if not prog.reshard_tags or not torch.is_grad_enabled():
            return list(prog.graph_module(*inputs))
        ctx = current("LocalModule")
        ctx.reshard_tags = prog.reshard_tags
        with reshard_after_forward():
            return list(prog.graph_module(*inputs))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating on the data axes: the sums are sent,
        once, by the first backward outside this context (linear, so exact)."""
        ctx = current("no_sync")
        old = ctx.defer_axes
        ctx.defer_axes = frozenset(old | set(self._plan.data_axes))
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

    def full_parameters(self) -> dict:
        """{FQN: this rank's stored piece} (for assembling the trained model)."""
        return {self.fqn_of[n]: p.detach().clone() for n, p in self.named_parameters()}


class ShardedOptimizer:
    """A torch optimizer stepping this rank's slice of every parameter, plus the optimizer-phase
    all-gathers of ZeRO-1 and ZeRO-2.

    Example::

        opt = ShardedOptimizer(local, lambda params: torch.optim.AdamW(params, lr=1e-3))
        local(*batch).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, local: LocalModule, factory):
        plan = local._plan
        self.local, self.plan = local, plan
        prog, mesh = plan.program, plan.mesh
        self.slices = []  # ZeRO-1: (slice parameter, whole parameter, axis, dim)
        self.refresh = []  # ZeRO-2: (shard parameter, full copy, axis, dim)
        params = []
        for name, p in local.named_parameters():
            if not p.requires_grad:
                continue
            st = prog.storage.get(name)
            if plan.zero_stage == 1 and plan.data_axes:
                axis = plan.data_axes[0]
                d = slice_dim_for(prog.use_placements[name], plan.global_shape(name), mesh, axis)
                if d is not None:
                    n = p.shape[d] // mesh.axes[axis]
                    start = mesh.coords(local.rank)[axis] * n
                    s = nn.Parameter(p.detach().narrow(d, start, n))  # a view: stepping it updates p
                    self.slices.append((s, p, axis, d, start))
                    params.append(s)
                    continue
            if st is not None and st.mode == "persistent":
                self.refresh.append((p, getattr(local, name + "_full"), st.axis, st.dim))
            params.append(p)
        self.inner = factory(params)
        sharded = any(any(not isinstance(o, Replicate) for o in prog.input_placements[i])
                      for _, kind, i in prog.placeholders if plan.captured.inputs[i].kind == "parameter")
        if (sharded or self.slices) and not isinstance(self.inner, ELEMENTWISE_OPTIMIZERS):
            raise ValueError(f"{type(self.inner).__name__} does not update each element independently, so it cannot "
                             f"step on parameter shards; use one of "
                             f"{sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)} or a plan without sharded state")

    @torch.no_grad()
    def step(self):
        for s, p, _, d, start in self.slices:
            s.grad = None if p.grad is None else p.grad.narrow(d, start, s.shape[d])
        self.inner.step()
        with trace_phase("optimizer"):
            for s, p, axis, d, _ in self.slices:
                p.copy_(all_gather(s, axis, d))
            for shard, full, axis, d in self.refresh:
                full.copy_(all_gather(shard, axis, d))

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)
        self.local.zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (per-element buffers; step counters
        excluded)."""
        total = 0
        for state in self.inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return total
