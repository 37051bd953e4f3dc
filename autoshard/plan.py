"""Plan: the result of ``autoshard.autoshard`` — inspect it, simulate it, run it.

Example::

    >>> plan = autoshard.autoshard(model, (tokens,), mesh=Mesh({"tp": 2}), dims=..., layout=...)  # doctest: +SKIP
    >>> print(plan)                          # named dims, owners, collectives with reasons  # doctest: +SKIP
    >>> out = plan.simulate(tokens)          # every rank as a thread; equals model(tokens)   # doctest: +SKIP
    >>> out, grads = plan.simulate_grads(tokens)                                              # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from tabulate import tabulate
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from .mesh import Mesh
from .options import Options, parse_bytes
from .ownership import assemble, describe, local_shape
from .runtime import run_simulated
from autoshard.runtime.execution import checkpoint as dist_checkpoint
from autoshard.runtime.execution.clip import clip_grad_norm_
from autoshard.runtime.transport.rank_context import current
from .ownership import slice_dim_for
from autoshard.runtime.execution.local import (UNCHECKED, LocalModule, check_slot, RankSpec, ShardedOptimizer, Slot, predicted_state_bytes)
from autoshard.cost.idle import idle_axes_explained
from autoshard.cost.model import CostModel
from autoshard.cost.pipeline_search import PipelineDecision
from autoshard.cost.search import SearchResult
from autoshard.cost.report import alternatives, cost_report, explain
from autoshard.passes.capture import Captured
from autoshard.passes.recompute import checkpoint_blocks
from autoshard.passes.dims import DimInfo, module_of
from autoshard.passes.export import export_plan
from autoshard.passes.spmd import Layout, Program


# Steps after an export is written, ``hook(plan, path, export options)``, registered by the
# modules that add them (autoshard/block_check.py), which may plan again and so import the façade.
EXPORT_HOOKS: list = []


@dataclass(frozen=True)
class Unsharded:
    """A value the layout shards on ``axis`` that the plan gathers whole in forward (see
    :attr:`Plan.unsharded`)."""

    dim: str  # the named dim that stops being sharded
    axis: str
    value: str  # the graph value gathered
    where: str  # module of the op that needs it whole
    line: str  # that op's source line
    bytes: int  # this rank's input to the gather
    why: str
    tag: int = -1

    def __str__(self):
        return (f"dim {self.dim!r} of {self.value} is gathered whole on {self.axis} ({self.bytes} bytes/rank) "
                f"in {self.where or '<root>'} at {self.line}: {self.why}")


_RANK_SPEC_LOCK = threading.Lock()


@dataclass
class Plan:
    """What ``autoshard.autoshard`` made: the captured program, its named dims, the layout
    resolved on the mesh, the per-rank program, and what they were made with. Every field is set
    when the plan is made (``autoshard.api``); the properties and methods below read them.

    Example::

        plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=dims, layout={"batch": "dp"})
        plan.mesh, plan.layout, plan.options.training.bucket_mb, plan.cost["step_time"]
    """

    model: torch.nn.Module
    mesh: Mesh
    captured: Captured  # the program as torch.export captured it (passes.capture)
    info: DimInfo  # its logical dims and their names (passes.dims)
    resolved: Layout  # the layout on this mesh (passes.spmd.resolve_layout)
    program: Program  # the per-rank program and its collectives (passes.spmd)
    train: bool = False
    timings: dict = field(default_factory=dict)
    last_trace: list = field(default_factory=list)  # per-rank CollectiveRecords of the last simulation
    zero_stage: int = 0
    data_axes: list = field(default_factory=list)  # mesh axes that split the batch
    checkpoint: list = field(default_factory=list)  # blocks recomputed in backward (activation checkpointing)
    checkpoint_policy: str = "block"  # how: passes.recompute.POLICIES
    _rank_spec: Optional[RankSpec] = field(default=None, repr=False)
    # (args, kwargs) the plan was made from (the caller's tensors, not copies): export's default inputs
    example_inputs: Optional[tuple] = field(default=None, repr=False)
    options: Options = field(default_factory=Options, repr=False)  # the options it was planned with
    search: Optional[SearchResult] = field(default=None, repr=False)  # the layout search's result, if it ran
    cost_model: Optional[CostModel] = field(default=None, repr=False)  # what plan.cost prices it with
    bucket_mb: float = 25.0  # data-parallel gradient bucket size (MiB; 0: one sum per parameter)
    units: Union[str, tuple, list] = "block"  # the ZeRO-3 gather units it was built with
    # why a Mesh.auto with a pipeline axis chose its pipeline degree (plan.explain())
    pipeline_decision: Optional[PipelineDecision] = field(default=None, repr=False)
    reduce_dtype: Optional[torch.dtype] = None  # dtype gradient sums run in (mixed precision)
    # values derived from the plan once, by the cost model's reports (cost.plan_cost, cost.idle)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ inspection
    @property
    def layout(self) -> dict:
        """{logical dim name: tuple of mesh axes} for every user-named dim; a soft entry's axes
        end in ``?`` (``("tp?",)``)."""
        out = {name: () for name in sorted(set(self.info.names.values()))}
        for name, axes in self.resolved.assignment.items():
            out[name] = tuple(axes)
        for name, axes in getattr(self.resolved, "soft_assignment", {}).items():
            out[name] = tuple(a + "?" for a in axes)  # soft: where the axis is free (passes/soft.py)
        return out

    @property
    def passes(self) -> list:
        """What each program pass did (``autoshard.passes.manager``): records with ``.name``,
        ``.ran``, ``.collectives`` (marked) and ``.nodes`` (of the program rewritten).

        Example::

            [(p.name, p.collectives) for p in plan.passes if p.ran]   # [('early_sums', 1), ...]
        """
        return list(getattr(self.program, "passes", []))

    @property
    def collectives(self) -> list:
        return list(self.program.collectives)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The per-rank program (aten ops and autoshard collectives)."""
        return self.program.graph_module

    @property
    def unsharded(self) -> list:
        """Where the layout is not carried out: every forward all-gather that makes a value whole
        on an axis its layout shards it on (an op without a rule, or one that needs that dim
        whole), as :class:`Unsharded` records (dim, axis, value, module, source line, bytes, why).
        ZeRO's gathers of stored parameter shards are the plan, not a lapse, and are not listed.
        ``print(plan)`` and ``plan.explain()`` show them; ``autoshard(..., strict=True)`` refuses
        a plan that has any.

        Example::

            for u in plan.unsharded:
                print(u.dim, u.axis, u.where, u.line, u.bytes)
        """
        nodes = {n.name: n for n in self.captured.graph.nodes}
        # an MoE layer that split its tokens on an axis the batch is whole on gathers its output
        # back there: the plan's own gather (passes/experts.py), not a lapse
        planned = {t for moe in getattr(self.program, "experts", ()) for t in moe.tags.get("tokens", ())}
        out = []
        for c in self.program.collectives:
            if c.phase != "forward" or c.kind != "all_gather" or c.op != "all_gather" or c.tag in planned:
                continue
            st = self.program.storage.get(c.node)
            if st is not None and (st.axis,) == c.axes:  # a ZeRO-3 shard gathered for replicated work
                continue
            dim = "?"
            node, place = nodes.get(c.node), self.program.placements.get(c.node)
            if node is not None and place is not None and node in self.info.dims:
                owner = place[0][self.mesh.names.index(c.axes[0])]
                if hasattr(owner, "dim"):
                    dim = self.info.dim_name(self.info.of(node)[owner.dim])
            out.append(Unsharded(dim, c.axes[0], c.node, c.where, c.line, c.bytes, c.why, c.tag))
        return out

    def placement_of(self, name: str):
        """Placement (tuple per mesh axis) of a parameter FQN or a graph value name."""
        for inp, place in zip(self.captured.inputs, self.program.input_placements):
            if inp.target == name or inp.name == name:
                return place
        return self.program.placements[name][0]

    # ------------------------------------------------------------------ running
    def _check_real(self, args, kwargs):
        for t in list(self.captured.state.values()) + pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise ValueError("this plan was made from a model on the meta device: it can be inspected and "
                                 "exported, not simulated; build the model with real weights to simulate")

    def _check_inputs(self, args, kwargs):
        """InputMismatchError unless the inputs match the planned ones (before any rank starts:
        one error, not one per rank; LocalModule checks them again in real runs)."""
        users = iter(self.captured.flatten_args(args, kwargs))
        for slot in self.rank_spec().slots:
            if slot.kind == "user":
                check_slot(slot, next(users))

    def run_rank(self, rank: int, *args, grads: bool = False, **kwargs):
        """Run this rank's program inside the current rank context (simulated thread or a
        torch.distributed process). ``args`` are the global inputs; each rank slices its block.
        Returns the local flat outputs, and with ``grads=True`` also {param FQN: local gradient}
        after backward of the loss (see :meth:`simulate_grads`).

        Example (one process of a 4-process gloo job)::

            backend = DistributedBackend(plan.mesh)
            with rank_context(plan.mesh, rank, backend):
                outs, grads = plan.run_rank(rank, tokens, grads=True)
        """
        return self._run_rank(rank, args, kwargs, grads)[0]

    def _run_rank(self, rank, args, kwargs, grads):
        """:meth:`run_rank`'s result and this rank's pieces of the buffers forward updated."""
        self._check_real(args, kwargs)
        local = self.build(rank)
        if not grads:
            with torch.no_grad():
                return local.run_flat(self.captured.flatten_args(args, kwargs)), local.updated_buffers()
        outs = local.run_flat(self.captured.flatten_args(args, kwargs))
        loss = outs[self.loss_index()]
        # The grad of a Replicate or Partial value is the full gradient, of a Shard its block:
        # ones of the local shape are right in every case (d sum / d out = 1).
        loss.backward(torch.ones_like(loss))
        local_grads = {local.fqn_of[n]: (p.grad if p.grad is not None else torch.zeros_like(p))
                       for n, p in local.named_parameters() if p.requires_grad}
        return ([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], local_grads), local.updated_buffers()

    def assemble_buffers(self, per_rank: list) -> dict:
        """{FQN: global tensor} of the updated buffers from every rank's pieces
        (:meth:`LocalModule.updated_buffers`)."""
        return {fqn: assemble([r[fqn] for r in per_rank], self.placement_of(fqn), self.mesh) for fqn in per_rank[0]}

    def _write_back(self, per_rank: list) -> None:
        """Forward's buffer updates into the model's buffers, as calling the model does."""
        with torch.no_grad():
            for fqn, value in self.assemble_buffers(per_rank).items():
                self.captured.state[fqn].copy_(value)

    def assemble_outputs(self, per_rank: list):
        """Global outputs (the model's structure) from every rank's local flat outputs."""
        flat = [assemble([r[k] for r in per_rank], place, self.mesh) if place is not None else per_rank[0][k]
                for k, place in enumerate(self.program.output_placements)]
        return pytree.tree_unflatten(flat, self.captured.out_spec)

    def assemble_grads(self, per_rank: list) -> dict:
        """Full gradients by FQN (tied aliases included) from every rank's local gradients."""
        grads = {fqn: assemble([r[fqn] for r in per_rank], self.placement_of(fqn), self.mesh) for fqn in per_rank[0]}
        for alias, kept in self.captured.aliases.items():
            if kept in grads:
                grads[alias] = grads[kept]
        return grads

    def simulate(self, *args, **kwargs):
        """Run the plan on a simulated mesh (ranks as threads); returns the model's outputs,
        assembled to global tensors. Buffers forward updates (BatchNorm's running statistics in
        training mode, a counter) are written back into the model, as calling it would."""
        self._check_real(args, kwargs)
        self._check_inputs(args, kwargs)
        results = run_simulated(self.mesh, lambda rank: (*self._run_rank(rank, args, kwargs, False),
                                                         list(current().trace)))
        self.last_trace = [r[2] for r in results]
        self._write_back([r[1] for r in results])
        return self.assemble_outputs([r[0] for r in results])

    def loss_index(self) -> int:
        """Which flat output is the loss: the output itself, its first element, or ``.loss``."""
        return self.captured.loss_output()

    def simulate_grads(self, *args, **kwargs):
        """Forward and backward on the simulated mesh. Returns ``(outputs, {param FQN: full
        gradient})``; the loss is the model's output (its first element, or ``.loss``). A loss
        that is not a scalar is seeded with ones, as ``out.backward(torch.ones_like(out))``
        (the gradients of its sum): a probe of a forward plan's backward; training refuses such a
        loss (``train=True``, :meth:`simulate_train`), as ``loss.backward()`` does."""
        self._check_real(args, kwargs)
        self._check_inputs(args, kwargs)
        results = run_simulated(
            self.mesh, lambda rank: (*self._run_rank(rank, args, kwargs, True), list(current().trace)))
        self.last_trace = [r[2] for r in results]
        self._write_back([r[1] for r in results])
        return self.assemble_outputs([r[0][0] for r in results]), self.assemble_grads([r[0][1] for r in results])

    # ------------------------------------------------------------------ training
    def build(self, rank: int) -> LocalModule:
        """This rank's program with its parameter pieces as stored (call it inside a rank
        context). See :mod:`autoshard.runtime.execution.local`."""
        return LocalModule(self.rank_spec(), rank, lambda slot: self.captured.state[slot.target])

    def rank_spec(self) -> RankSpec:
        """What a rank needs to run this plan's program, without the planner."""
        if self._rank_spec is None:
            with _RANK_SPEC_LOCK:  # simulated ranks (threads) ask at once: one makes it
                if self._rank_spec is None:
                    self._rank_spec = self._new_rank_spec()
        return self._rank_spec

    def _new_rank_spec(self) -> RankSpec:
        prog, mesh, cap = self.program, self.mesh, self.captured
        slots = []
        for name, kind, i in prog.placeholders:
            inp = cap.inputs[i]
            val = self._placeholder(inp.name).meta.get("val")
            if kind == "full":
                slots.append(Slot(name, "full", inp.name, prog.use_placements[inp.name]))
                continue
            shape, dtype = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else (None, torch.float32)
            zero1 = None
            if self.zero_stage == 1 and self.data_axes and inp.kind == "parameter" and inp.trainable:
                d = slice_dim_for(prog.use_placements[name], shape, mesh, self.data_axes[0])
                zero1 = (self.data_axes[0], d) if d is not None else None
            slots.append(Slot(name, inp.kind, inp.target, prog.input_placements[i], prog.use_placements.get(name),
                              prog.storage.get(name), inp.trainable, zero1, shape, dtype,
                              val if inp.kind == "user" and shape is None else UNCHECKED))
        forward = prog.graph_module
        if self.checkpoint:
            users = {i.name for i in cap.inputs if i.kind == "user"}
            forward = checkpoint_blocks(forward, users, set(self.checkpoint), self.checkpoint_policy)[0]
        # A program rewritten lazily (the search, the final build) or a lazy one's checkpointed
        # copy generates its Python code on its first call. Generate it here, in one thread: fx's
        # code generation is not thread-safe, and ranks making that first call at once can get a
        # forward that reads a value before the line that computes it.
        _LazyGraphModule.force_recompile(forward)
        return RankSpec(mesh, forward, slots, list(self.data_axes), prog.reshard_tags, list(prog.buckets),
                        cap.flatten_args, lambda flat: pytree.tree_unflatten(flat, cap.out_spec),
                        self.reduce_dtype, list(cap.mutated))

    def optimizer(self, local: LocalModule, optimizer_cls, **kwargs) -> ShardedOptimizer:
        """The optimizer for ``local``: ``optimizer_cls(params, **kwargs)`` over this rank's
        slices, with the plan's optimizer-phase gathers (ZeRO-1/2).

        Example::

            opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        """
        return ShardedOptimizer(local, lambda params: optimizer_cls(params, **kwargs))

    def clip_grad_norm_(self, local: LocalModule, max_norm: float) -> float:
        """Clip ``local``'s gradients to the global 2-norm ``max_norm`` over every shard and mesh
        axis, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model; returns the norm.
        Call on every rank after backward (see :mod:`autoshard.runtime.execution.clip`).

        Example::

            loss.backward(); plan.clip_grad_norm_(local, 1.0); opt.step()
        """
        return clip_grad_norm_(local, max_norm)

    def simulate_train(self, batches, optimizer=None, microbatches: int = 1, clip_grad_norm=None):
        """Train on the simulated mesh: one step per element of ``batches`` (an argument
        tuple; with ``microbatches=k`` a list of k tuples whose gradients accumulate, each loss
        scaled by 1/k, communicating on the data axes only in the last one); ``clip_grad_norm``:
        clip to that global gradient norm before each step. Returns
        ``(per-step losses, {param FQN: full parameter after the last step})``; the buffers
        forward updates (BatchNorm's running statistics) are in that dict too, by FQN, as after
        the last step (the model's own buffers stay as they were, like its parameters).

        Example::

            losses, params = plan.simulate_train([(ids, None, labels)] * 3,
                                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        """
        factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3))
        steps = [list(b) if microbatches > 1 else [b] for b in batches]
        if any(len(s) != microbatches for s in steps):
            raise ValueError(f"with microbatches={microbatches} every step needs {microbatches} argument tuples")
        for s in steps:
            for mb in s:
                self._check_real(mb, {})
                self._check_inputs(mb, {})
        self.captured.require_scalar_loss("simulate_train")
        li = self.loss_index()

        def rank_fn(rank):
            local = self.build(rank)
            opt = ShardedOptimizer(local, factory)
            losses = []
            for step in steps:
                total = 0.0
                for j, mb in enumerate(step):
                    sync = contextlib.nullcontext() if j == len(step) - 1 else local.no_sync()
                    with sync:
                        loss = local.run_flat(self.captured.flatten_args(tuple(mb), {}))[li]
                        (loss / len(step)).backward()
                    total += loss.item() / len(step)
                if clip_grad_norm is not None:
                    clip_grad_norm_(local, clip_grad_norm)
                opt.step()
                opt.zero_grad()
                losses.append(total)
            return losses, local.full_parameters(), list(current().trace), local.updated_buffers()

        results = run_simulated(self.mesh, rank_fn)
        self.last_trace = [r[2] for r in results]
        params = {fqn: assemble([r[1][fqn] for r in results], self.placement_of(fqn), self.mesh)
                  for fqn in results[0][1]}
        params.update(self.assemble_buffers([r[3] for r in results]))
        for alias, kept in self.captured.aliases.items():
            if kept in params:
                params[alias] = params[kept]
        return results[0][0], params

    # ------------------------------------------------------------------ checkpoints (runtime.checkpoint)
    def checkpoint_info(self) -> dict:
        """What a checkpoint records about the model: tied aliases and its state dict's keys
        (so :func:`autoshard.consolidate` returns exactly what ``load_state_dict`` expects)."""
        return {"model": type(self.model).__name__, "aliases": dict(self.captured.aliases),
                "state_dict_keys": list(self.model.state_dict().keys())}

    def save_checkpoint(self, local: LocalModule, optimizer, path, *, step=None, extra=None):
        """Write this rank's pieces of parameters, buffers and optimizer state to the
        checkpoint directory ``path`` with torch.distributed.checkpoint; call on every rank
        inside its rank context. Atomic: a save killed mid-way never loads. See
        :mod:`autoshard.runtime.execution.checkpoint`.

        Example::

            plan.save_checkpoint(local, opt, "ckpt/step-2", step=2)
        """
        return dist_checkpoint.save(local, optimizer, path, step=step, extra=extra, info=self.checkpoint_info())

    def load_checkpoint(self, local: LocalModule, optimizer, path, *, strict: bool = True) -> dict:
        """Load this rank's pieces from a checkpoint written under any plan (another mesh,
        layout or ZeRO stage); returns its manifest (``step``, ``extra``). Fails with one line
        naming the first missing or mis-shaped tensor, or saying the checkpoint is incomplete.

        Example::

            local = plan.build(rank); opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
            step = plan.load_checkpoint(local, opt, "ckpt/step-2")["step"]
        """
        return dist_checkpoint.load(local, optimizer, path, strict=strict)

    def state_bytes(self, optimizer_states: int = 2) -> dict:
        """Predicted bytes of parameters, gradients and optimizer state per rank, from the
        placements: ``optimizer_states`` per-element buffers (2 for Adam/AdamW, 1 for SGD with
        momentum). Equals what :meth:`build` and :meth:`optimizer` allocate.

        Example::

            plan.state_bytes()   # {'params': ..., 'grads': ..., 'optimizer': ...}
        """
        return predicted_state_bytes(self.rank_spec(), optimizer_states)

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        mesh = self.mesh
        axes = mesh.names
        parts = [f"autoshard plan on {mesh} ({mesh.size} ranks)"]
        lay = self.layout
        rows = []
        for name in sorted(set(list(lay) + list(self.resolved.assignment))):
            rows.append([name, self.resolved.sizes.get(name, self._size_of_name(name)),
                         ", ".join(f"{a} (soft: where {a[:-1]} is free)" if a.endswith("?") else a
                                   for a in lay.get(name, ())) or "-"])
        parts.append("Named dims\n" + tabulate(rows, headers=["dim", "size", "sharded on"]))
        rows = []
        for inp, place in zip(self.captured.inputs, self.program.input_placements):
            node = self._placeholder(inp.name)
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            dims = " ".join(self.info.dim_name(a) for a in self.info.of(node))
            rows.append([inp.target, inp.kind, tuple(val.shape), dims, describe(place, axes),
                         tuple(local_shape(val.shape, place, mesh))])
        parts.append("Inputs and parameters\n" + tabulate(rows, headers=["name", "kind", "shape", "dims", "owner", "local shape"]))
        rows = []
        for node in self.captured.graph.nodes:
            if node.op != "call_function" or node.name not in self.program.placements:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            place = self.program.placements[node.name][0]
            dims = " ".join(self.info.dim_name(a) for a in self.info.of(node)) if node in self.info.dims else ""
            rows.append([node.name, getattr(node.target, "__name__", str(node.target)), module_of(node),
                         tuple(val.shape), dims, describe(place, axes)])
        parts.append("Activations\n" + tabulate(rows, headers=["value", "op", "module", "shape", "dims", "owner"]))
        # a forward-only plan (train=False) runs no backward: its backward collectives (what
        # plan.simulate_grads or a .backward() would add) are counted, not listed as part of it
        shown = [c for c in self.program.collectives if self.train or c.phase != "backward"]
        rows = [[c.tag, c.phase, c.kind, ",".join(c.axes), c.bytes, c.where or "<root>", c.why] for c in shown]
        held = len(self.program.collectives) - len(shown)
        note = (f"; forward only (train=False): the {held} backward collectives a .backward() would add are in "
                f"plan.collectives with phase 'backward'" if held else "")
        parts.append(f"Collectives ({len(rows)}{note})\n" + (tabulate(rows, headers=["#", "phase", "kind", "axis", "bytes/rank", "module", "why"])
                                                             if rows else "none"))
        lapses = self.unsharded
        if lapses:
            rows = [[u.tag, u.dim, u.axis, u.value, u.where or "<root>", u.line, u.bytes, u.why] for u in lapses]
            parts.append(f"Not sharded as the layout asks ({len(rows)} forward gathers; strict=True refuses them)\n"
                         + tabulate(rows, headers=["#", "dim", "axis", "value", "module", "line", "bytes/rank", "why"]))
        if self.program.fallbacks:
            rows = [[op, mod or "<root>", line] for op, mod, line in self.program.fallbacks]
            parts.append("Ops without a rule (run replicated)\n" + tabulate(rows, headers=["op", "module", "line"]))
        idle = idle_axes_explained(self)
        if idle:
            parts.append("Idle mesh axes\n" + "\n".join(idle))
        return "\n\n".join(parts)

    __repr__ = __str__

    def _placeholder(self, name):
        for node in self.captured.graph.nodes:
            if node.op == "placeholder" and node.name == name:
                return node
        raise KeyError(name)

    def _size_of_name(self, name):
        for lv, n in self.info.names.items():
            if n == name:
                s = 1
                for a in lv:
                    s *= self.info.table.size[a]
                return s
        return "?"

    # ------------------------------------------------------------------ export
    def export(self, path, args=None, kwargs=None, **options):
        """Write this plan to the directory ``path``, runnable with
        ``torchrun --nproc-per-node=N path/run.py [--check] [--steps K]``. ``args``/``kwargs``:
        example inputs (saved, and used for the ``--check`` references); without them, the
        inputs the plan was made from (when they are real tensors). Options: see
        :func:`autoshard.passes.export.export_plan`. Returns the directory's Path.

        Example::

            plan.export("out/llama")   # then: torchrun --nproc-per-node=4 out/llama/run.py --check
        """
        if args is None and kwargs is None and self.example_inputs is not None:
            args, kwargs = self.example_inputs
        if options.get("check_budget") is not None:  # bytes, or "2GB" / "2 GiB"
            options["check_budget"] = int(parse_bytes(options["check_budget"]))
        out = export_plan(self, path, args, kwargs, **options)
        for hook in EXPORT_HOOKS:  # e.g. the block check of a model over the check budget
            hook(self, out, options)
        return out

    # ------------------------------------------------------------------ cost model (autoshard.cost)
    @property
    def cost(self):
        """Predicted cost per rank (a dict, see :class:`autoshard.cost.report.CostReport`):
        ``step_time`` = ``compute`` + exposed communication (``comm_exposed`` by (axis, phase)),
        ``memory`` (persistent and peak bytes), plus ``comm_bytes`` by (phase, axis) and
        ``state_bytes_per_rank``. Uses the hardware the plan was made for (``hardware=``)."""
        return cost_report(self)

    @property
    def alternatives(self) -> list:
        """The best other candidates of the layout search, cheapest first (``mesh``,
        ``layout``, ``zero_stage``, ``step_time``, ``cost``); empty when the layout was given."""
        return alternatives(self)

    def explain(self) -> str:
        """Why this plan: its predicted cost, and what makes the runner-up slower (and, for a
        ``Mesh.auto`` with a pipeline axis, why the pipeline degree)."""
        decision = self.pipeline_decision
        if decision is None:
            return explain(self)
        if decision.pp == 1:
            return explain(self) + "\n" + decision.explain()
        return (decision.explain() + "\nThe other axes (costed below for the whole per-rank program, before the "
                "stage cut):\n" + explain(self))
