"""Plan: the result of ``autoshard.autoshard`` — inspect it, simulate it, run it.

Example::

    >>> plan = autoshard.autoshard(model, (tokens,), mesh=Mesh({"tp": 2}), dims=..., layout=...)  # doctest: +SKIP
    >>> print(plan)                          # named dims, owners, collectives with reasons  # doctest: +SKIP
    >>> out = plan.simulate(tokens)          # every rank as a thread; equals model(tokens)   # doctest: +SKIP
    >>> out, grads = plan.simulate_grads(tokens)                                              # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tabulate import tabulate
from torch.utils import _pytree as pytree

from .mesh import Mesh
from .ownership import Partial, Replicate, Shard, assemble, describe, local_piece, local_shape
from .runtime import run_simulated
from .runtime.context import current
from autoshard.passes.dims import module_of


@dataclass
class Plan:
    model: torch.nn.Module
    mesh: Mesh
    captured: object
    info: object
    resolved: object
    program: object
    train: bool = False
    timings: dict = field(default_factory=dict)
    last_trace: list = field(default_factory=list)  # per-rank CollectiveRecords of the last simulation

    # ------------------------------------------------------------------ inspection
    @property
    def layout(self) -> dict:
        """{logical dim name: tuple of mesh axes} for every user-named dim."""
        out = {name: () for name in sorted(set(self.info.names.values()))}
        for name, axes in self.resolved.assignment.items():
            out[name] = tuple(axes)
        return out

    @property
    def collectives(self) -> list:
        return list(self.program.collectives)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The per-rank program (aten ops and autoshard collectives)."""
        return self.program.graph_module

    @property
    def cost(self) -> dict:
        """Bytes each rank moves, by phase and axis, and the bytes of state it holds.
        (Times come with the cost model.)"""
        comm: dict = {}
        for c in self.program.collectives:
            key = (c.phase, c.axes[0])
            comm[key] = comm.get(key, 0) + c.bytes
        state = 0
        for inp, place in zip(self.captured.inputs, self.program.input_placements):
            if inp.kind != "user":
                t = self.captured.state[inp.target]
                state += torch.Size(local_shape(t.shape, place, self.mesh)).numel() * t.element_size()
        return {"comm_bytes": comm, "state_bytes_per_rank": state}

    def placement_of(self, name: str):
        """Placement (tuple per mesh axis) of a parameter FQN or a graph value name."""
        for inp, place in zip(self.captured.inputs, self.program.input_placements):
            if inp.target == name or inp.name == name:
                return place
        return self.program.placements[name][0]

    # ------------------------------------------------------------------ running
    def _local_inputs(self, rank: int, args, kwargs, grads: bool):
        flat = self.captured.flatten_args(args, kwargs)
        users = iter(flat)
        out, params = [], {}
        for inp, place in zip(self.captured.inputs, self.program.input_placements):
            full = self.captured.state[inp.target] if inp.kind != "user" else next(users)
            if not isinstance(full, torch.Tensor):
                out.append(full)
                continue
            piece = local_piece(full.detach(), place, self.mesh, rank).clone()
            if grads and inp.kind == "parameter" and inp.trainable:
                piece.requires_grad_(True)
                params[inp.target] = piece
            out.append(piece)
        return out, params

    def _check_real(self, args, kwargs):
        for t in list(self.captured.state.values()) + pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise ValueError("this plan was made from a model on the meta device: it can be inspected and "
                                 "exported, not simulated; build the model with real weights to simulate")

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
        self._check_real(args, kwargs)
        inputs, params = self._local_inputs(rank, args, kwargs, grads=grads)
        gm = self.program.graph_module
        if not grads:
            with torch.no_grad():
                return list(gm(*inputs))
        outs = list(gm(*inputs))
        loss = outs[self.loss_index()]
        # The grad of a Replicate or Partial value is the full gradient, of a Shard its block:
        # ones of the local shape are right in every case (d sum / d out = 1).
        loss.backward(torch.ones_like(loss))
        local_grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], local_grads

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
        assembled to global tensors."""
        self._check_real(args, kwargs)
        results = run_simulated(self.mesh, lambda rank: (self.run_rank(rank, *args, **kwargs), list(current().trace)))
        self.last_trace = [r[1] for r in results]
        return self.assemble_outputs([r[0] for r in results])

    def loss_index(self) -> int:
        """Which flat output is the loss: the output itself, its first element, or ``.loss``."""
        n = len(self.program.output_placements)
        tree = pytree.tree_unflatten(list(range(n)), self.captured.out_spec)
        if isinstance(tree, int):
            return tree
        if hasattr(tree, "loss") and isinstance(getattr(tree, "loss"), int):
            return tree.loss
        if isinstance(tree, dict):
            return tree["loss"] if "loss" in tree else next(iter(tree.values()))
        return pytree.tree_leaves(tree[0])[0]

    def simulate_grads(self, *args, **kwargs):
        """Forward and backward on the simulated mesh. Returns ``(outputs, {param FQN: full
        gradient})``; the loss is the model's output (its first element, or ``.loss``), summed
        if it is not a scalar."""
        self._check_real(args, kwargs)
        results = run_simulated(
            self.mesh, lambda rank: (*self.run_rank(rank, *args, grads=True, **kwargs), list(current().trace)))
        self.last_trace = [r[2] for r in results]
        return self.assemble_outputs([r[0] for r in results]), self.assemble_grads([r[1] for r in results])

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        mesh = self.mesh
        axes = mesh.names
        parts = [f"autoshard plan on {mesh} ({mesh.size} ranks)"]
        lay = self.layout
        rows = []
        for name in sorted(set(list(lay) + list(self.resolved.assignment))):
            rows.append([name, self.resolved.sizes.get(name, self._size_of_name(name)),
                         ", ".join(lay.get(name, ())) or "-"])
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
        rows = [[c.tag, c.phase, c.kind, ",".join(c.axes), c.bytes, c.where or "<root>", c.why]
                for c in self.program.collectives]
        parts.append(f"Collectives ({len(rows)})\n" + (tabulate(rows, headers=["#", "phase", "kind", "axis", "bytes/rank", "module", "why"])
                                                     if rows else "none"))
        if self.program.fallbacks:
            rows = [[op, mod or "<root>", line] for op, mod, line in self.program.fallbacks]
            parts.append("Ops without a rule (run replicated)\n" + tabulate(rows, headers=["op", "module", "line"]))
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
