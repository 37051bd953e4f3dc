"""A pipelined plan: stages, a schedule, and the same inspection and checking as any plan.

``autoshard.autoshard(..., pipeline={"axis": "pp", "microbatches": 8, "schedule": "1f1b"})``
returns a :class:`PipelinePlan`. The per-rank program is rewritten for the other mesh axes as
usual and then cut into stages (``passes/pipeline.py``); each step runs the schedule's actions
(:mod:`autoshard.runtime.execution.pipeline`).

Example::

    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"pp": 2, "dp": 2}), dims=dims,
                               layout={"batch": "dp"}, train=True,
                               pipeline={"axis": "pp", "microbatches": 4, "schedule": "1f1b"})
    print(plan)                      # ... plus the stage table and every boundary transfer
    plan.stages                      # per stage: modules, parameter bytes, ...
    plan.schedule                    # {pp rank: [F(mb=0, stage=0), ...]}
    losses, params = plan.simulate_train([args] * 3, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    plan.export("out/pp", args)      # a program per stage; torchrun --nproc-per-node=4 out/pp/run.py --steps 2 --check
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Optional
from pathlib import Path

import torch
from tabulate import tabulate
from torch.utils import _pytree as pytree

from .options import PipelineOptions
from .ownership import assemble, local_shape
from .plan import Plan
from .runtime import run_simulated
from autoshard.runtime.transport.rank_context import current
from autoshard.runtime.execution.local import ShardedOptimizer
from autoshard.runtime.execution.pipeline import PipelineRank, PipelineSpec, split_microbatches
from autoshard.runtime.execution.schedules import SCHEDULES, make_schedule
from autoshard.runtime.execution.timeline import chrome_trace, measured_trace
from autoshard.cost.model import resolve_cost_model
from autoshard.cost.stage_memory import stage_memory
from autoshard.cost.pipeline import bubble, choose_cuts, schedule_timeline, stage_seconds, unit_seconds
from autoshard.passes.recompute import checkpoint_blocks
from autoshard.passes.pipeline import cut_candidates, cut_profile, even_cuts, split_program
from autoshard.passes.spmd import LayoutError


@dataclass
class StageInfo:
    """One row of ``plan.stages``."""

    index: int
    rank: int  # pipeline rank (coordinate on the pipeline axis)
    modules: str  # e.g. "embed_tokens, layers.0-3"
    params: list  # parameter FQNs it holds
    param_bytes: int  # bytes of those parameters on each of its ranks (as stored)
    sends: int  # values sent to the next stage per microbatch
    send_bytes: int  # their bytes per microbatch on each rank

    def __str__(self):
        return (f"stage {self.index} on pp rank {self.rank}: {self.modules} ({len(self.params)} params, "
                f"{self.param_bytes} B/rank)")


@dataclass
class PipelinePlan(Plan):
    pipe: object = None  # passes.pipeline.PipelineProgram
    schedule_name: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    action_lists: list = field(default_factory=list)  # per pipeline rank
    last_timeline: dict = field(default_factory=dict)  # rank -> [(action, start, end)] of the last simulated step

    # ------------------------------------------------------------------ inspection
    @property
    def axis(self) -> str:
        return self.pipe.axis

    @property
    def collectives(self) -> list:
        return list(self.program.collectives) + list(self.pipe.collectives)

    @property
    def schedule(self) -> dict:
        """{pipeline rank: [Action, ...]}: what each pipeline rank runs in one step, in order."""
        return {r: list(acts) for r, acts in enumerate(self.action_lists)}

    def stage_memory(self) -> list:
        """Predicted bytes per pipeline rank: state, activations as the schedule holds them,
        peak (``autoshard.cost.stage_memory``).

        Example::

            [r["peak"] for r in plan.stage_memory()]     # one per coordinate on the pp axis
        """
        return stage_memory(self, self.cost_model)

    @property
    def stages(self) -> list:
        """Per stage: modules, parameters held, bytes, boundary sends (see :class:`StageInfo`)."""
        out = []
        slots = {s.name: s for s in self.rank_spec().slots}
        pp = self.mesh.axes[self.axis]
        for st, mods in zip(self.pipe.stages, self.pipe.modules):
            names = [ref for kind, ref in st.inputs if kind == "slot" and slots[ref].kind == "parameter"]
            nbytes = 0
            for n in names:
                s = slots[n]
                piece = torch.Size(local_shape(s.shape, s.placement, self.mesh)).numel()
                nbytes += piece * torch.empty((), dtype=s.dtype).element_size()
            out.append(StageInfo(st.index, st.index % pp, mods, [slots[n].target for n in names], nbytes,
                                 len(st.send), sum(torch.Size(b.shape).numel() * b.dtype.itemsize for b in st.send)))
        return out

    def pipeline_spec(self) -> PipelineSpec:
        """What a rank needs to run this plan (see :class:`autoshard.runtime.execution.pipeline.PipelineSpec`)."""
        return PipelineSpec(self.rank_spec(), self.axis, self.pipe.stages, self.action_lists, self.microbatches,
                            self.pipe.loss_index, self.pipe.normalizer, self.pipe.normalizer_inputs, self.pipe.tied,
                            self.pipe.loss_reduction)

    # ------------------------------------------------------------------ running
    def build(self, rank: int) -> PipelineRank:
        """This rank's stages with their parameters as stored (inside a rank context).

        Example::

            pipe = plan.build(rank)
            opt = plan.optimizer(pipe, torch.optim.AdamW, lr=1e-3)
            loss = pipe.step(plan.split(batch)); opt.step(); opt.zero_grad()
        """
        return PipelineRank(self.pipeline_spec(), rank, lambda slot: self.captured.state[slot.target])

    def optimizer(self, local, optimizer_cls, **kwargs) -> ShardedOptimizer:
        return ShardedOptimizer(getattr(local, "local", local), lambda params: optimizer_cls(params, **kwargs))

    def split(self, args, kwargs=None) -> list:
        """The microbatches (flat global user inputs each) of one step's global batch."""
        return split_microbatches(self.captured.flatten_args(args, kwargs), self.microbatches)

    def run_rank(self, rank, *args, grads=False, **kwargs):
        raise NotImplementedError("a pipelined plan runs stage by stage: use plan.build(rank).step(plan.split(args))")

    def _run(self, batches, train: bool, factory=None):
        """Run steps on the simulated mesh; ``batches``: (args, kwargs) of each step."""
        for args, kwargs in batches:
            self._check_real(args, kwargs)

        def rank_fn(rank):
            pipe = self.build(rank)
            opt = ShardedOptimizer(pipe.local, factory) if factory else None
            losses = []
            for args, kwargs in batches:
                loss = pipe.step(self.split(args, kwargs), train=train)
                losses.append(loss)
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
            grads = {pipe.local.fqn_of[n]: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                     for n, p in pipe.local.named_parameters() if p.requires_grad} if train and opt is None else {}
            return (losses, pipe.outputs, grads, pipe.local.full_parameters(), list(current().trace),
                    pipe.measured())

        results = run_simulated(self.mesh, rank_fn)
        self.last_trace = [r[4] for r in results]
        self.last_timeline = {r: res[5] for r, res in enumerate(results)}
        return results

    def _on_coord(self, per_rank: list, coord: int) -> list:
        """``per_rank`` re-indexed so every rank reads the value of its peer at ``coord`` on the
        pipeline axis (assembling then sees the pieces of that pipeline rank)."""
        mesh = self.mesh
        return [per_rank[mesh.rank_of({**mesh.coords(r), self.axis: coord})] for r in range(mesh.size)]

    def _owner_coord(self, fqn: str) -> int:
        pp = self.mesh.axes[self.axis]
        slots = {s.target: s.name for s in self.rank_spec().slots}
        name = slots.get(fqn, slots.get(self.captured.aliases.get(fqn, fqn)))
        return next(st.index % pp for st in self.pipe.stages if any(ref == name for _, ref in st.inputs))

    def assemble_params(self, per_rank: list) -> dict:
        """Whole tensors by FQN from every rank's ``{FQN: local piece}`` (parameters or their
        gradients), each taken from the first pipeline rank holding it."""
        out = {}
        fqns = sorted({f for d in per_rank for f in d})
        for fqn in fqns:
            coord = self._owner_coord(fqn)
            pieces = self._on_coord(per_rank, coord)
            out[fqn] = assemble([p[fqn] for p in pieces], self.placement_of(fqn), self.mesh)
        for alias, kept in self.captured.aliases.items():
            if kept in out:
                out[alias] = out[kept]
        return out

    def _outputs(self, results):
        last = (len(self.pipe.stages) - 1) % self.mesh.axes[self.axis]
        per_rank = self._on_coord([r[1] for r in results], last)
        li = self.pipe.loss_index
        flat = []
        for k, place in enumerate(self.program.output_placements):
            per_mb = [assemble([r[m][k] for r in per_rank], place, self.mesh) if place is not None else per_rank[0][m][k]
                      for m in range(self.microbatches)]
            flat.append(self._combine(per_mb, k))
        return pytree.tree_unflatten(flat, self.captured.out_spec)

    def _combine(self, per_mb: list, k: int):
        first = per_mb[0]
        if not isinstance(first, torch.Tensor):
            return first
        if first.dim() == 0:
            total = per_mb[0].clone()
            for t in per_mb[1:]:
                total = total + t
            how = self.pipe.loss_reduction if k == self.pipe.loss_index else self.pipe.scalar_reductions.get(k)
            if how is None:
                raise ValueError(f"output {k} is a scalar that is neither a sum nor a mean over the batch: its value "
                                 f"for the whole batch cannot be made from the {len(per_mb)} microbatches' values")
            return total if how == "sum" else total / len(per_mb)
        return torch.cat(per_mb, 0)

    def simulate(self, *args, **kwargs):
        """The model's outputs for the global batch ``args``: every microbatch through the
        stages (forwards only) on a simulated mesh; batch outputs concatenated, the loss summed
        over microbatches as normalized."""
        return self._outputs(self._run([(args, kwargs)], train=False))

    def simulate_grads(self, *args, **kwargs):
        """One step's forward and backward (the plan's schedule) on the simulated mesh:
        ``(outputs, {param FQN: full gradient})``."""
        results = self._run([(args, kwargs)], train=True)
        return self._outputs(results), self.assemble_params([r[2] for r in results])

    def simulate_train(self, batches, optimizer=None, microbatches: int = 1):
        """Train on the simulated mesh: one pipelined step (the plan's schedule over its
        microbatches) per global batch in ``batches``. Returns ``(per-step losses, {param FQN:
        full parameter after the last step})``."""
        if microbatches != 1:
            raise ValueError("a pipelined plan splits each batch into its own microbatches "
                             f"({self.microbatches}); pass whole batches")
        self.captured.require_scalar_loss("simulate_train")
        factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=1e-3))
        results = self._run([(tuple(b), {}) for b in batches], train=True, factory=factory)
        last = (len(self.pipe.stages) - 1) % self.mesh.axes[self.axis]
        holder = self.mesh.rank_of({**self.mesh.coords(0), self.axis: last})
        losses = [float(x) for x in results[holder][0]]
        return losses, self.assemble_params([r[3] for r in results])

    # ------------------------------------------------------------------ timelines
    def stage_times(self) -> list:
        """Predicted seconds per stage: ``[(forward, input-gradient backward, weight-gradient
        backward)]`` (the cost model's op times of the stage program; each backward half costs
        about one forward, so an unsplit backward costs two)."""
        cm = self.cost_model or resolve_cost_model(None)
        return [(f, f, f) for f in (stage_seconds(s.forward, cm) for s in self.pipe.stages)]

    def transfer_seconds(self) -> list:
        """Predicted seconds of one microbatch's boundary message after each stage (all its
        values, on the pipeline axis's link: latency + bytes / bandwidth)."""
        cm = self.cost_model or resolve_cost_model(None)
        link = cm.hardware.link_for_axes(self.mesh.axes, (self.axis,))
        out = []
        for st in self.pipe.stages[:-1]:
            nbytes = sum(torch.Size(b.shape).numel() * b.dtype.itemsize for b in st.send)
            out.append(link.latency + nbytes / link.effective_bandwidth if nbytes else 0.0)
        return out

    def predicted_timeline(self, transfers: bool = True) -> dict:
        """``{pp rank: [(action, start s, end s)]}``: the schedule run with the predicted stage
        and transfer times (:func:`autoshard.cost.pipeline.schedule_timeline`).

        Example::

            tl = plan.predicted_timeline()
            autoshard.cost.pipeline.bubble(tl)      # idle fraction of the step
        """
        times = self.stage_times()
        hops = self.transfer_seconds() if transfers else [0.0] * (len(times) - 1)
        return schedule_timeline(self.action_lists, lambda a: times[a.stage]["FBW".index(a.kind)],
                                 lambda stage: hops[stage])

    @property
    def bubble(self) -> float:
        """Predicted idle fraction of one step (fill, drain and transfer waits)."""
        return bubble(self.predicted_timeline())

    def timeline(self, path, measured=None) -> dict:
        """Write a Chrome / Perfetto trace JSON (chrome://tracing, ui.perfetto.dev) of the
        predicted schedule, one row per pipeline rank, to ``path``.

        With ``measured`` (``True``: the last ``simulate*`` step; or ``{rank: [(action, start,
        end)]}`` from each rank's ``pipe.measured()`` of a real run) the measured trace, one row
        per rank with every action it ran, goes to ``path`` and the predicted one next to it
        (``<stem>.predicted.json``). Returns ``{"predicted": path, "measured": path}``.

        Example::

            plan.simulate_grads(*args)
            plan.timeline("t.json", measured=True)   # t.json (measured), t.predicted.json
        """
        path = Path(path)
        written = {}
        pred_path = path if measured is None else path.with_name(path.stem + ".predicted.json")
        pp = self.mesh.axes[self.axis]
        pred = chrome_trace(self.predicted_timeline(), {r: f"{self.axis} rank {r} (predicted)" for r in range(pp)})
        pred_path.write_text(json.dumps(pred))
        written["predicted"] = str(pred_path)
        if measured is not None:
            rows = self.last_timeline if measured is True else measured
            if not rows:
                raise ValueError("plan.timeline(measured=True) needs a step first: run plan.simulate_grads or "
                                 "simulate_train, or pass {rank: pipe.measured()} from a real run")
            path.write_text(json.dumps(measured_trace(rows, self.mesh, self.axis)))
            written["measured"] = str(path)
        return written

    # ------------------------------------------------------------------ printing
    def __str__(self) -> str:
        base = super().__str__()
        rows = [[s.index, s.rank, s.modules, len(s.params), s.param_bytes, s.sends, s.send_bytes] for s in self.stages]
        table = tabulate(rows, headers=["stage", "pp rank", "modules", "params", "param bytes/rank", "sends",
                                        "send bytes/mb"])
        pp = self.mesh.axes[self.axis]
        head = (f"Pipeline on {self.axis}={pp}: {len(self.pipe.stages)} stages (virtual={self.virtual}), "
                f"{self.schedule_name}, {self.microbatches} microbatches per step; cuts at {self.pipe.cuts}; "
                f"predicted bubble {self.bubble:.1%}")
        rows = [[c.phase, c.kind, c.bytes, c.where, c.why] for c in self.pipe.collectives]
        transfers = tabulate(rows, headers=["phase", "kind", "bytes/rank", "module", "why"]) if rows else "none"
        return base + "\n\n" + head + "\n" + table + f"\n\nPipeline transfers ({len(rows)})\n" + transfers

    __repr__ = __str__



# ---------------------------------------------------------------------------- planning

def pipeline_options(pipeline: Optional[PipelineOptions], mesh) -> Optional[PipelineOptions]:
    """``pipeline=`` checked against the mesh, its axis filled in and its cuts a tuple. A mesh
    with a ``pp`` axis pipelines on it even when ``pipeline`` is left out (every choice to the
    planner); None: no pipeline.

    >>> from autoshard.mesh import Mesh
    >>> pipeline_options(None, Mesh({"pp": 2, "dp": 2}))
    PipelineOptions(axis='pp', microbatches=None, schedule=None, virtual=None, cuts=None)
    """
    axes = getattr(mesh, "axes", {})
    if pipeline is None:
        if not isinstance(axes, dict) or axes.get("pp", 1) == 1:
            return None
        pipeline = PipelineOptions()
    axis = pipeline.axis or "pp"
    if isinstance(axes, dict) and axis not in axes:
        raise ValueError(f"pipeline axis {axis!r} is not an axis of {mesh}; name the mesh axis that splits the "
                         f"layer sequence, e.g. Mesh({{'pp': 2, 'dp': 2}}) and pipeline={{'axis': 'pp'}}")
    for key in ("microbatches", "virtual"):
        v = getattr(pipeline, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"pipeline[{key!r}] must be a positive integer, got {v!r}")
    sched = pipeline.schedule
    if sched is not None and sched not in SCHEDULES:
        raise ValueError(f"pipeline schedule {sched!r} is not one of {sorted(SCHEDULES)}")
    cuts = pipeline.cuts
    if cuts is not None and (isinstance(cuts, str) or not all(isinstance(c, str) for c in cuts)):
        raise ValueError(f"pipeline['cuts'] is a list of module names where stages begin, e.g. ['layers.4'], "
                         f"got {cuts!r}")
    return replace(pipeline, axis=axis, cuts=tuple(cuts) if cuts is not None else None)


def auto_pipeline_axis(mesh, pipeline: Optional[PipelineOptions]) -> Optional[str]:
    """The pipeline axis of a ``Mesh.auto`` whose pipeline degree the planner chooses: the
    ``axis`` of ``pipeline=`` or an axis named ``pp``; None when it has neither.

    >>> from autoshard.mesh import Mesh
    >>> auto_pipeline_axis(Mesh.auto(8, ("pp", "dp", "tp")), None), auto_pipeline_axis(Mesh.auto(8), None)
    ('pp', None)
    """
    axes = tuple(getattr(mesh, "axes", ()))
    if pipeline is not None and pipeline.axis:
        if pipeline.axis not in axes:
            raise ValueError(f"pipeline axis {pipeline.axis!r} is not an axis of {mesh}")
        return pipeline.axis
    return "pp" if "pp" in axes else None


def first_microbatch(args, kwargs, microbatches: int):
    """``(args, kwargs)`` of the first of ``microbatches`` equal microbatches (tensors split on
    dim 0): the shapes the stage programs are captured for."""
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    first = split_microbatches(flat, microbatches)[0]
    return pytree.tree_unflatten(first, spec)


def default_microbatches(args, kwargs, stages: int) -> int:
    """Without a cost model's choice: the largest multiple of ``stages`` up to ``4 * stages``
    that divides the batch (dim 0 of the tensor inputs)."""
    sizes = {t.shape[0] for t in pytree.tree_leaves((tuple(args), dict(kwargs or {})))
             if isinstance(t, torch.Tensor) and t.dim() >= 1}
    for m in range(4 * stages, 0, -1):
        if all(s % m == 0 for s in sizes) and m % stages == 0:
            return m
    return 1


def best_cuts(plan, axis: str, n_stages: int, cost_model=None) -> list:
    """Module FQNs where stages 1.. begin: the cost model's best cuts of ``plan.program``
    (slowest predicted stage first, then boundary bytes; see :func:`choose_cuts`).
    ``axis`` names the pipeline axis (its link prices transfers in the predicted timeline)."""
    cm = cost_model or resolve_cost_model(None)
    prof = cut_profile(plan.program, plan.captured.inputs)
    if sum(prof.allowed) < n_stages - 1:
        even_cuts(cut_candidates(plan.program.graph_module.graph), n_stages)  # raises the error naming the blocks
    units = unit_seconds(prof, cm)
    return [prof.candidates[j] for j in choose_cuts(units, prof.cut_bytes, prof.allowed, n_stages)]


def finish_pipeline(plan: PipelinePlan, opts: PipelineOptions, cost_model=None) -> PipelinePlan:
    """Cut ``plan``'s rewritten program into stages and attach the schedule. Cuts left to the
    planner balance the stages' predicted times (:func:`autoshard.cost.pipeline.choose_cuts`)."""
    mesh = plan.mesh
    used = sorted(name for name, axes in plan.resolved.assignment.items() if opts.axis in axes)
    if used:
        raise LayoutError(f"the pipeline axis {opts.axis!r} splits the layer sequence; it cannot also shard dims "
                          f"{used}: use another mesh axis for them")
    pp = mesh.axes[opts.axis]
    schedule = opts.schedule or ("interleaved" if (opts.virtual or 1) > 1 else "1f1b")
    virtual = opts.virtual or (2 if schedule == "interleaved" else 1)
    n_stages = pp * virtual
    graph = plan.program.graph_module.graph
    cuts = list(opts.cuts) if opts.cuts is not None else best_cuts(plan, opts.axis, n_stages, cost_model)
    if len(cuts) != n_stages - 1:
        raise LayoutError(f"pipeline cuts {cuts} make {len(cuts) + 1} stages; {opts.axis}={pp} with "
                          f"virtual={virtual} runs {n_stages}: give {n_stages - 1} cuts")
    display = {i.name: i.target for i in plan.captured.inputs}
    plan.pipe = split_program(plan.program, plan.captured.inputs, mesh, axis=opts.axis, cuts=cuts, virtual=virtual,
                              microbatches=plan.microbatches, loss_index=plan.loss_index(), display=display)
    plan.schedule_name, plan.virtual = schedule, virtual
    plan.action_lists = make_schedule(schedule, pp, plan.microbatches, virtual)
    return plan


def recompute_stages(plan: PipelinePlan) -> PipelinePlan:
    """Activation recompute in every stage program of ``plan``: its blocks listed in
    ``plan.checkpoint`` recomputed by ``plan.checkpoint_policy`` (``passes/recompute.py``).
    A stage's activations are what depends on its user inputs and on the values it receives.
    Schedules that split backward into input- and weight-gradient actions are refused: a
    recomputed block differentiates both at once.

    Example::

        plan.checkpoint, plan.checkpoint_policy = ["layers.0", "layers.1"], "selective"
        recompute_stages(plan)
    """
    if any(a.kind == "W" for acts in plan.action_lists for a in acts):
        raise ValueError(f"activation recompute with the {plan.schedule_name} schedule: it splits backward into "
                         f"input- and weight-gradient actions, which a recomputed block runs at once (hint: "
                         f"schedule='1f1b', or checkpoint=False)")
    users = {s.name for s in plan.rank_spec().slots if s.kind == "user"}
    plan.plain_stage_forwards = [st.forward for st in plan.pipe.stages]  # priced as written (cost/stage_memory.py)
    for st in plan.pipe.stages:
        acts = {st.forward.graph.find_nodes(op="placeholder")[i].name for i, (kind, _) in enumerate(st.inputs)
                if kind == "recv" or (kind == "slot" and _ in users)}
        st.forward = checkpoint_blocks(st.forward, acts, set(plan.checkpoint), plan.checkpoint_policy)[0]
    return plan

