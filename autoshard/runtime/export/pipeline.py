"""The runner's side of a pipelined export: load the stage programs and run the schedule.

An export of a pipelined plan (:mod:`autoshard.passes.export_pipeline`) has a program file
per stage and a ``"pipeline"`` section in plan.json. The runner (:mod:`autoshard.runtime.export`)
hands such a directory to this module: it rebuilds the :class:`~autoshard.runtime.execution.pipeline.PipelineSpec`
from plan.json and the stage files, and each rank runs its actions with the runtime's
:class:`~autoshard.runtime.execution.pipeline.PipelineRank` (point-to-point sends and receives on the
pipeline axis, data-axis gradient sums once per step), exactly as ``plan.simulate_train`` does
in-process. ``--check`` compares the last stage's outputs (per microbatch), every rank's
gradients after the first step and the losses of every step with the unsharded model.
run.py's training loop (:func:`~autoshard.runtime.export.training.train_loop`: ``--data``, clipping, the lr schedule,
checkpoints, ``--resume``) runs a :class:`PipelineProgram` as it runs a ``RankProgram``, and
``--timeline`` writes the last step's measured actions of every rank (:func:`write_timeline`).

The runner's namespace (the package :mod:`autoshard.runtime.export`, which imports this module
and so is not imported back) is passed in as ``R``: errors found here are its one-line ``RunError``.

Example (inside a rank context, as run.py does)::

    programs = load_stages(root, doc, R)
    pp = PipelineProgram(doc, mesh, rank, programs, weights, torch.device("cpu"), train=True, R=R)
    res = rank_loop(pp, user, steps=2, R=R)       # res["losses"]: the step losses on every rank
    write_timeline(pp, "t.json")                   # rank 0 writes every rank's actions
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from autoshard.ownership import Shard, local_piece
from autoshard.runtime import current
from autoshard.runtime.execution.checkpoint import all_gather_objects
from autoshard.runtime.execution.clip import global_grad_norm
from autoshard.runtime.execution.local import ShardedOptimizer
from autoshard.runtime.execution.pipeline import (BoundarySpec, PipelineRank, PipelineSpec, StageSpec, split_microbatches)
from autoshard.runtime.execution.schedules import Action, check_schedule
from autoshard.runtime.execution.timeline import measured_trace


def validate(doc: dict, mesh, bad) -> None:
    """Raise ``bad(why)`` unless plan.json's ``"pipeline"`` section is complete and its schedule
    runs (every action once, no deadlock); keeps the parsed schedule as ``pipeline["_schedule"]``."""
    p = doc["pipeline"]
    if not isinstance(p, dict):
        raise bad("'pipeline' is not an object")
    for key, typ in (("axis", str), ("microbatches", int), ("stages", list), ("boundaries", list),
                     ("actions", list), ("tied", dict)):
        if not isinstance(p.get(key), typ):
            raise bad(f"pipeline[{key!r}] is missing or not a {typ.__name__}")
    if p["axis"] not in mesh.axes:
        raise bad(f"the pipeline axis {p['axis']!r} is not an axis of {mesh}")
    pp, n, m = mesh.axes[p["axis"]], len(p["stages"]), p["microbatches"]
    if m < 1 or not n or n % pp or len(p["actions"]) != pp:
        raise bad(f"the pipeline has {n} stages, {m} microbatches and actions for {len(p['actions'])} ranks on "
                  f"{p['axis']}={pp}")
    try:
        sched = [[Action(str(k), int(mb), int(s)) for k, mb, s in acts] for acts in p["actions"]]
        check_schedule(sched, n, m)
    except (ValueError, TypeError) as e:
        raise bad(f"the pipeline schedule does not run: {e}") from None
    p["_schedule"] = sched
    names = {x.get("name") for x in doc["inputs"]}
    nb = len(p["boundaries"])
    for k, b in enumerate(p["boundaries"]):
        if not (isinstance(b, dict) and b.get("index") == k and isinstance(b.get("shape"), list)
                and isinstance(getattr(torch, str(b.get("dtype")), None), torch.dtype)):
            raise bad(f"pipeline boundary {k} ({b!r}) lacks its index, shape or dtype")
    for k, st in enumerate(p["stages"]):
        if not (isinstance(st, dict) and st.get("index") == k and isinstance(st.get("file"), str)
                and isinstance(st.get("n_outputs"), int) and isinstance(st.get("inputs"), list)
                and isinstance(st.get("recv"), list) and isinstance(st.get("send"), list)):
            raise bad(f"pipeline stage {k} is not described (index, file, inputs, recv, send, n_outputs)")
        for arg in st["inputs"]:
            kind, ref = arg if isinstance(arg, list) and len(arg) == 2 else (None, None)
            if not ((kind == "slot" and ref in names) or kind == "normalizer"
                    or (kind == "recv" and isinstance(ref, int) and 0 <= ref < len(st["recv"]))):
                raise bad(f"pipeline stage {k} has an argument {arg!r} that is no input, received value "
                          f"or normalizer")
        if not all(isinstance(i, int) and 0 <= i < nb for i in st["recv"] + st["send"]):
            raise bad(f"pipeline stage {k} sends or receives a boundary that is not listed")
    norm = p.get("normalizer")
    if norm is not None and not (isinstance(norm, dict) and set(norm.get("inputs", [None])) <= names):
        raise bad("the pipeline's normalizer does not name the program's inputs")


class StagePrograms:
    """The loaded stage modules (``forward`` each) and the normalizer module, if any. Setting
    ``DEVICE`` sets it in every module (run.py does so for the program file of other exports)."""

    def __init__(self, stages: dict, normalizer=None):
        self.stages, self.normalizer = stages, normalizer

    @property
    def DEVICE(self):  # noqa: N802 - the name the program modules use
        return next(iter(self.stages.values())).DEVICE

    @DEVICE.setter
    def DEVICE(self, device):  # noqa: N802
        for m in list(self.stages.values()) + ([self.normalizer] if self.normalizer is not None else []):
            m.DEVICE = device


def load_stages(root, doc: dict, R) -> StagePrograms:
    """Every stage file of the export (and normalizer.py), each checked to define ``forward``."""
    p = doc["pipeline"]
    stages = {st["index"]: R.load_program(root, st["file"]) for st in p["stages"]}
    norm = R.load_program(root, p["normalizer"]["file"]) if p.get("normalizer") else None
    return StagePrograms(stages, norm)


def pipeline_spec(doc: dict, rank_spec, programs: StagePrograms) -> PipelineSpec:
    """The :class:`PipelineSpec` that ``plan.pipeline_spec()`` gave before export, from plan.json."""
    p = doc["pipeline"]
    bs = [BoundarySpec(b["index"], b["src_stage"], b["name"], tuple(b["shape"]), getattr(torch, b["dtype"]),
                       bool(b["requires_grad"])) for b in p["boundaries"]]  # listed by index (validate)
    stages = [StageSpec(st["index"], programs.stages[st["index"]].forward, [tuple(x) for x in st["inputs"]],
                        [bs[i] for i in st["recv"]], [bs[i] for i in st["send"]], st["n_outputs"],
                        [(lo, hi, list(names)) for lo, hi, names in st.get("weight_groups", [])],
                        list(st.get("early_params", [])), list(st.get("params", [])))
              for st in p["stages"]]
    norm = p.get("normalizer")
    return PipelineSpec(rank_spec, p["axis"], stages, p["_schedule"], p["microbatches"], p.get("loss_index"),
                        programs.normalizer.forward if norm else None, list(norm["inputs"]) if norm else [],
                        {k: list(v) for k, v in p["tied"].items()},
                        p.get("loss_reduction", "sum" if norm else "mean"))


class PipelineProgram:
    """One rank's stages of a pipelined export with their parameters as stored and its
    optimizer: the pipelined counterpart of run.py's ``RankProgram``."""

    def __init__(self, doc: dict, mesh, rank: int, programs: StagePrograms, weights, device, train: bool, R):
        self.doc, self.mesh, self.rank, self.device = doc, mesh, rank, device
        self.spec = pipeline_spec(doc, R.rank_spec(doc, mesh, None, train), programs)
        self.pipe = PipelineRank(self.spec, rank, R.weights_lookup(weights), device)
        self.local = self.pipe.local
        self.params = {self.local.fqn_of[n]: p for n, p in self.local.named_parameters() if p.requires_grad}
        self.last = len(self.spec.stages) - 1 in self.pipe.stages  # holds the outputs and the loss
        self.opt = None

    def make_optimizer(self, kind: str, lr: float):
        self.opt = ShardedOptimizer.by_name(self.local, kind, lr)

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, user: list, train: bool):
        """One pipelined step (this rank's actions) on the step's global inputs ``user``;
        the loss on the last stage's ranks, else None."""
        return self.pipe.step(split_microbatches(user, self.spec.microbatches), train=train)

    def train_step(self, user: list):
        """Forward and backward of one step (the schedule over its microbatches): run.py's
        training loop calls it as it calls ``RankProgram.train_step``."""
        return self.run(user, train=True)

    def train_accumulated(self, steps: list, accum: dict) -> float:
        """``--grad-accum K``: the schedule K times, each over one planned batch of ``steps``
        (the global inputs of each), into one optimizer step: data-axis and tied-parameter sums
        once, with the last pass; a masked mean divided by the count of all K batches; the
        step's global loss. ``accum``: as ``RankProgram.train_accumulated`` takes it (the
        pipeline's own normalizer applies)."""
        passes = [split_microbatches(user, self.spec.microbatches) for user in steps]
        counts = [self.pipe.loss_count(p) for p in passes]
        norm = None
        if counts[0] is not None:  # the last stage's ranks of a masked mean
            norm = counts[0].clone()
            for c in counts[1:]:
                norm = norm + c
        losses = [self.pipe.step(p, train=True, norm=norm, of=(k, len(passes))) for k, p in enumerate(passes)]
        return math.fsum(self.step_loss(loss) for loss in losses)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the step's gradients of every stage to the global norm (see ``PipelineRank``)."""
        return self.pipe.clip_grad_norm_(max_norm)

    def grad_norm(self) -> float:
        """The step's gradients' global 2-norm over every stage (the same float on every rank),
        nothing clipped."""
        return global_grad_norm(self.local, counted=self.pipe.counts_in_norm)

    def step_loss(self, loss) -> float:
        """The step's global loss on every rank (only the last stage's ranks hold it; the others
        add zero on the pipeline axis). Call on every rank inside the rank context."""
        backend = current("step_loss").backend
        place = self.doc["outputs"][self.doc["loss_output"]]["_place"]
        s = (loss.detach().double().sum() if loss is not None
             else torch.zeros((), dtype=torch.float64, device=self.device)).reshape(1)
        for o, axis in zip(place or (), self.mesh.names):
            if isinstance(o, Shard):
                s = backend.all_reduce(s, axis)
        return backend.all_reduce(s, self.spec.axis).item()


def compare_outputs(pp: PipelineProgram, ref: dict, rtol: float, atol: float, R):
    """(ok, max abs diff, problems) for the last stage's outputs of every microbatch against the
    matching microbatch of the references (batch outputs), or the combined step value (scalars:
    a normalized loss summed, others averaged, as ``plan.simulate`` combines them)."""
    if not pp.last:
        return True, 0.0, []
    spec, doc, mesh = pp.spec, pp.doc, pp.mesh
    m_count, outs = spec.microbatches, pp.pipe.outputs
    ok, worst, problems = True, 0.0, []
    tol = R.check_tolerance(doc, rtol, atol)
    for k, (meta, want) in enumerate(zip(doc["outputs"], ref["outputs"])):
        per_mb = [outs[m][k] for m in range(m_count)]
        if not isinstance(per_mb[0], torch.Tensor):
            if per_mb[0] != want:
                ok = False
                problems.append(f"output {k}: {per_mb[0]!r} != {want!r}")
            continue
        if per_mb[0].dim() == 0:
            total = per_mb[0].clone()
            for t in per_mb[1:]:
                total = total + t
            if not (k == spec.loss_index and spec.loss_reduction == "sum"):
                total = total / m_count
            pairs = [(total, want)]
        else:
            pairs = list(zip(per_mb, want.chunk(m_count, 0)))
        for m, (o, w) in enumerate(pairs):
            piece = local_piece(w, meta["_place"], mesh, pp.rank)
            o = o.detach().cpu()
            good, d, why = R.compare(o, piece, tol)
            worst = max(worst, d)
            if not good:
                ok = False
                problems.append(f"output {k}" + (f" of microbatch {m}" if len(pairs) > 1 else "") + f": {why}")
    return ok, worst, problems


def compare_params(pp: PipelineProgram, ref: dict, rtol: float, atol: float, R):
    """(ok, max abs diff, problems) for this rank's parameters as stored after the steps against
    its blocks of the unsharded model's parameters after the same steps."""
    ok, worst, problems = True, 0.0, []
    tol = R.check_tolerance(pp.doc, rtol, atol)
    places = {m["target"]: m["_place"] for m in pp.doc["inputs"]
              if m["kind"] == "parameter" and "_place" in m and m.get("role", "input") == "input"}
    for fqn, p in pp.params.items():
        want = (ref.get("params") or {}).get(fqn)
        if want is None:
            continue
        got = p.detach().cpu()
        piece = local_piece(want, places[fqn], pp.mesh, pp.rank)
        good, d, why = R.compare(got, piece, tol)
        worst = max(worst, d)
        if not good:
            ok = False
            problems.append(f"parameter {fqn} after the steps: {why}")
    return ok, worst, problems


def rank_loop(pp: PipelineProgram, user: list, *, steps: int, optimizer: str = "adamw", lr: float = 1e-3,
              ref=None, rtol: float = 1e-4, atol: float = 1e-5, say=lambda msg: None, R=None,
              nan_policy: str = "stop") -> dict:
    """Forward only (``steps=0``: every microbatch through the stages) or ``steps`` training
    steps (the schedule, then the optimizer) of one rank, inside its rank context; compares with
    ``ref`` (outputs and first-step gradients) when given. ``losses``: the step losses. A step
    whose loss or gradient norm is not finite: ``nan_policy`` (run.py's ``nonfinite_step``)."""
    res = dict(ok=True, worst_out=0.0, worst_grad=0.0, problems=[], losses=[], outputs=None, grads=None)
    sync = torch.cuda.synchronize if pp.device.type == "cuda" else (lambda: None)
    what = f"{pp.spec.microbatches} microbatches, {pp.doc['pipeline'].get('schedule')}"
    if not steps:
        t0 = time.perf_counter()
        loss = pp.run(user, train=False)
        sync()
        dt = time.perf_counter() - t0
        value = pp.step_loss(loss) if pp.spec.loss_index is not None else None
        say(f"forward  time {dt * 1e3:.1f} ms  ({what})" + (f"  loss {value:.6f}" if value is not None else ""))
        res["outputs"] = dict(pp.pipe.outputs) if pp.last else None
        if ref is not None:
            res["ok"], res["worst_out"], res["problems"] = compare_outputs(pp, ref, rtol, atol, R)
        return res
    pp.make_optimizer(optimizer, lr)
    for step in range(steps):
        t0 = time.perf_counter()
        loss = pp.train_step(user)
        if step == 0:
            res["outputs"] = dict(pp.pipe.outputs) if pp.last else None
            res["grads"] = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                            for k, p in pp.params.items()}
            if ref is not None:
                o_ok, res["worst_out"], p1 = compare_outputs(pp, ref, rtol, atol, R)
                g_ok, res["worst_grad"], p2 = R.compare_grads(pp.doc, pp.mesh, pp.rank, pp.params, ref, rtol, atol)
                res["ok"], res["problems"] = o_ok and g_ok, p1 + p2
        R.finish_step(pp, res, step + 1, steps, pp.step_loss(loss), t0, nan_policy=nan_policy, sync=sync, say=say,
                      note=f"  ({what})")
    r = pp.doc.get("reference") or {}
    if ref is not None and ref.get("params") and (steps, optimizer, lr) == (r.get("steps"), r.get("optimizer"),
                                                                         r.get("lr")):
        # the same steps as the references: every parameter as trained, not only the losses
        p_ok, res["worst_param"], p3 = compare_params(pp, ref, rtol, atol, R)
        res["ok"], res["problems"], res["params_checked"] = res["ok"] and p_ok, res["problems"] + p3, True
    return res


def write_timeline(pp: PipelineProgram, path, say=lambda msg: None) -> dict:
    """Gather every rank's measured actions of the last step (``PipelineRank.measured()``:
    wall-clock start and end of each F, B, W) to rank 0, which writes them to ``path`` as a
    Chrome / Perfetto trace, one row per rank (the format of ``plan.timeline``). Call on every
    rank, inside its rank context; returns ``{rank: [(action, start, end)]}``.

    Example::

        write_timeline(pp, "timeline.json", say)     # after rank_loop or train_loop
    """
    rows = dict(enumerate(all_gather_objects(pp.pipe.measured())))
    if pp.rank == 0:
        Path(path).write_text(json.dumps(measured_trace(rows, pp.mesh, pp.spec.axis)))
        say(f"wrote the measured timeline of the last step ({sum(map(len, rows.values()))} actions on "
            f"{len(rows)} ranks) to {path}")
    return rows
