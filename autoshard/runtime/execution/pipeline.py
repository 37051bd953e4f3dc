"""Pipeline execution: one rank runs its stages' actions of a schedule, microbatch by microbatch.

A pipelined plan is a list of stage programs (``passes/pipeline.py`` cuts them out of the
per-rank program) and a schedule (:mod:`.schedules`: per pipeline rank, the ordered actions
``F``/``B``/``W``). :class:`PipelineRank` executes any such list on one rank:

- ``F(mb, s)``: receive stage s's boundary inputs from the previous stage's rank, run the
  stage program on them as autograd leaves, send its boundary outputs on. The transfers are
  plain messages (``send_value`` / ``recv_value``), not autograd nodes: the stage's graph
  starts at the leaves and ends at the sent values.
- ``B(mb, s)``: receive the sent values' gradients (``recv_gradient``), one
  ``torch.autograd.backward`` from the sent values with them (from the loss on the last
  stage), and send each leaf's ``.grad`` back (``send_gradient``; zeros where the outputs do
  not depend on it). These are the messages of the ``send``/``recv`` adjoint pair, recorded
  under the same names. With a ``W(mb, s)`` in the schedule, ``B`` computes only the input
  gradients and the gradients at the stage's weight roots, which ``W`` then turns into
  parameter gradients.
- Data-axis gradient sums (DDP's all-reduce, ZeRO's reduce-scatter) are deferred and sent once
  per step, by the last backward of each stage; gradients of a parameter read by stages on
  several pipeline ranks (tied embeddings) are exchanged and summed in stage order at the end.

Each action's start and end are recorded (``PipelineRank.timeline``) for the measured trace.

Example (inside a rank context, simulated or torch.distributed)::

    pipe = PipelineRank(spec, rank, lookup=lambda slot: state[slot.target])
    opt = ShardedOptimizer(pipe.local, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    loss = pipe.step(split_microbatches(flat_inputs, spec.microbatches))
    opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from autoshard.ownership import local_piece
from autoshard.runtime.execution.checkpoint import stored_placement
from autoshard.runtime.execution.clip import clip_grad_norm_, counted_here
from autoshard.runtime.primitives.collectives import (post_gradient_recv, post_recv, recv, recv_gradient, recv_value, reshard_after_forward, send, send_gradient, send_value, template)
from autoshard.runtime.transport.rank_context import current, trace_phase
from autoshard.runtime.execution.local import LocalModule, RankSpec
from autoshard.runtime.execution.schedules import Action, stage_rank


@dataclass
class BoundarySpec:
    """One value crossing from stage ``src_stage`` to the next, as this rank holds it."""

    index: int  # messages of microbatch m carry the number index * microbatches + m
    src_stage: int
    name: str  # value in the per-rank program
    shape: tuple  # local shape
    dtype: torch.dtype
    requires_grad: bool  # its gradient comes back in backward


@dataclass
class StageSpec:
    """One stage program and how to feed it."""

    index: int
    forward: Callable  # (*arguments) -> (outputs..., weight roots...)
    inputs: list  # per argument: ("slot", name) | ("recv", j) | ("normalizer", None)
    recv: list  # BoundarySpec from the previous stage, by argument j
    send: list  # BoundarySpec to the next stage: outputs 0..len(send)-1
    n_outputs: int  # outputs before the weight roots (sends, or the program's outputs)
    weight_groups: list = field(default_factory=list)  # (lo, hi, [params]): roots lo..hi-1 feed those params
    early_params: list = field(default_factory=list)  # parameters whose gradient B computes
    params: list = field(default_factory=list)  # trainable parameters it reads


@dataclass
class PipelineSpec:
    """What a rank needs to run a pipelined plan, without the planner (``Plan`` makes it; an
    export rebuilds it from plan.json and the stage files, see ``autoshard/runtime/export/pipeline.py``)."""

    rank_spec: RankSpec  # every slot of the program (a rank keeps those its stages read)
    axis: str
    stages: list  # StageSpec by index
    schedule: list  # per pipeline rank: [Action, ...]
    microbatches: int
    loss_index: Optional[int] = None  # which output of the last stage is the loss
    normalizer: Optional[Callable] = None  # one microbatch's loss count, summed over the step
    normalizer_inputs: list = field(default_factory=list)
    tied: dict = field(default_factory=dict)  # parameter -> stages on several pipeline ranks
    loss_reduction: str = "mean"  # the step's loss: the "sum" of the microbatches' losses or their "mean"

    @property
    def pp(self) -> int:
        return self.rank_spec.mesh.axes[self.axis]


def split_microbatches(flat: list, microbatches: int) -> list:
    """Split each tensor input with a leading (batch) dim into ``microbatches`` equal pieces
    along dim 0; other values are passed to every microbatch.

    >>> [t.tolist() for t in split_microbatches([torch.arange(4)], 2)[1]]
    [[2, 3]]
    """
    out = [[] for _ in range(microbatches)]
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            if v.shape[0] % microbatches:
                raise ValueError(f"an input of shape {tuple(v.shape)} cannot be split into {microbatches} "
                                 f"microbatches along dim 0 (its size is not divisible)")
            for m, piece in enumerate(v.chunk(microbatches, 0)):
                out[m].append(piece)
        else:
            for m in range(microbatches):
                out[m].append(v)
    return out


class PipelineRank:
    """This rank's stages of a pipelined plan: their parameters (a :class:`LocalModule`,
    which the optimizer steps) and the executor of this rank's schedule."""

    def __init__(self, spec: PipelineSpec, rank: int, lookup: Callable, device=None):
        self.spec, self.rank, self.device = spec, rank, device
        mesh = spec.rank_spec.mesh
        self.mesh, self.pp, self.coord = mesh, spec.pp, mesh.coords(rank)[spec.axis]
        self.n_stages = len(spec.stages)
        self.stages = {s.index: s for s in spec.stages if stage_rank(s.index, self.pp) == self.coord}
        names = {ref for s in self.stages.values() for kind, ref in s.inputs if kind == "slot"}
        if self.n_stages - 1 in self.stages:
            names |= set(spec.normalizer_inputs)
        slots = [s for s in spec.rank_spec.slots if s.name in names]
        self.local = LocalModule(dataclasses.replace(spec.rank_spec, slots=slots, buckets=[]), rank, lookup, device)
        self.user = {s.name: (i, s) for i, s in enumerate(s for s in spec.rank_spec.slots if s.kind == "user")}
        self.actions = list(spec.schedule[self.coord])
        self.split = {(a.stage, a.mb) for a in self.actions if a.kind == "W"}
        last_of: dict = {}
        for i, a in enumerate(self.actions):
            if a.kind != "F":
                last_of[(a.kind, a.stage)] = i
        self.final = set(last_of.values())  # backward actions that send the step's data-axis sums
        self.timeline: list = []  # (action, start s, end s) of the last step, from its start
        self.started = 0.0  # wall-clock time (time.time()) of the last step's start
        self.outputs: dict = {}  # mb -> last stage's local outputs (on the last stage's ranks)
        self._state: dict = {}
        self._templates: dict = {}  # boundary index -> receive template

    # ------------------------------------------------------------------ one step
    def step(self, microbatches: list, train: bool = True, *, norm=None, of: tuple = (0, 1)):
        """Run this rank's actions for one step over ``microbatches`` (each a flat list of the
        microbatch's global user inputs). Returns the step's loss (the last stage's ranks; None
        elsewhere): the sum of the normalized microbatch losses. ``train=False`` runs the
        forwards only (no gradients); their outputs are in ``self.outputs``.

        Gradient accumulation (``run.py --grad-accum K``) runs K such passes into one optimizer
        step: ``of=(k, K)`` is pass k of K (the data-axis and tied-parameter sums wait for the
        last pass, a mean loss weighs each microbatch 1 / (K x microbatches), and the K returned
        losses add up to the step's), ``norm`` the loss count of all K passes (see
        :meth:`loss_count`; default: this pass's own)."""
        spec = self.spec
        if len(microbatches) != spec.microbatches:
            raise ValueError(f"the plan runs {spec.microbatches} microbatches per step, got {len(microbatches)}")
        ctx = current("pipeline step")
        self.outputs, self._state, self.timeline = {}, {}, []
        self._losses: dict = {}
        self._of = of
        last_pass = of[0] == of[1] - 1
        if norm is None:
            norm = self.loss_count(microbatches)
        t0, self.started = time.perf_counter(), time.time()
        self._posted_upto = 0
        grad = torch.enable_grad() if train else torch.no_grad()
        with grad:
            for i, a in enumerate(self.actions):
                if a.kind != "F" and not train:
                    continue
                self._post_inputs(i + self.pp)
                start = time.perf_counter()
                if a.kind == "F":
                    self._forward(a, microbatches[a.mb], norm, train)
                else:
                    with self._deferred(ctx, i not in self.final or not last_pass):
                        (self._backward if a.kind == "B" else self._weights)(a)
                self.timeline.append((a, start - t0, time.perf_counter() - t0))
        ctx.backend.wait_sends()
        if train and last_pass:
            self._sum_tied()
        if not self._losses:
            return None
        total = self._losses[0].clone()
        for m in range(1, len(self._losses)):
            total = total + self._losses[m]
        return total if spec.loss_reduction == "sum" else total / (spec.microbatches * of[1])

    def loss_count(self, microbatches: list):
        """The loss count of ``microbatches`` (the normalizer's sum over them, over every data
        rank) on the last stage's ranks; None elsewhere and for a loss without a count."""
        spec = self.spec
        if spec.normalizer is None or self.n_stages - 1 not in self.stages:
            return None
        with torch.no_grad():
            counts = [spec.normalizer(*[self._value(n, mb) for n in spec.normalizer_inputs])[0] for mb in microbatches]
        norm = counts[0].clone()
        for c in counts[1:]:
            norm = norm + c
        return norm

    def measured(self) -> list:
        """The last step's actions as ``(action, start, end)`` in wall-clock seconds
        (``time.time()``), comparable across the processes of one machine: what
        ``plan.timeline(path, measured={rank: pipe.measured(), ...})`` takes."""
        return [(a, self.started + s, self.started + e) for a, s, e in self.timeline]

    def counts_in_norm(self, name: str) -> bool:
        """Whether this rank's gradient of parameter ``name`` counts in the global gradient norm:
        as :func:`~.clip.counted_here` with the pipeline axis apart (each pipeline rank holds
        other stages), and a tied parameter only on the first pipeline rank holding it."""
        slot = next(s for s in self.local.spec.slots if s.name == name)
        tied = self.spec.tied.get(name)
        if tied and self.coord != min(stage_rank(s, self.pp) for s in tied):
            return False
        return counted_here(stored_placement(slot, self.mesh), self.mesh, self.rank, apart=(self.spec.axis,))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip this step's gradients of every stage to the global 2-norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (after :meth:`step`, on every
        rank); returns the norm before clipping."""
        return clip_grad_norm_(self.local, max_norm, counted=self.counts_in_norm)

    @contextlib.contextmanager
    def _deferred(self, ctx, defer: bool):
        old = ctx.defer_axes
        if defer:
            ctx.defer_axes = frozenset(old | set(self.spec.rank_spec.data_axes))
        try:
            yield
        finally:
            ctx.defer_axes = old

    def _value(self, name: str, flat: list):
        if name in self.user:
            i, slot = self.user[name]
            v = flat[i]
            return (local_piece(v.detach(), slot.placement, self.mesh, self.rank).to(device=self.device, copy=True)
                    if isinstance(v, torch.Tensor) else v)
        return self.local._values[name]

    def _post_inputs(self, upto: int):
        """Start receiving the boundary inputs of the forwards among the actions before ``upto``
        (``pp`` actions ahead of the current one): they arrive while this rank computes, as soon
        as the previous stage sends them, instead of after this rank asks."""
        for a in self.actions[self._posted_upto:upto]:
            if a.kind == "F":
                st, prev = self.stages[a.stage], stage_rank(a.stage - 1, self.pp)
                for kind, ref in st.inputs:
                    if kind == "recv":
                        b = st.recv[ref]
                        post_recv(self.spec.axis, prev, self._message(b, a.mb), b.shape, b.dtype, self.device)
        self._posted_upto = max(self._posted_upto, upto)

    def _message(self, b: BoundarySpec, mb: int) -> int:
        return b.index * self.spec.microbatches + mb

    def _template(self, b: BoundarySpec):
        """The receive template of boundary value ``b`` (one per value: templates are never
        written)."""
        t = self._templates.get(b.index)
        if t is None:
            t = self._templates[b.index] = template(b.shape, b.dtype, self.device)
        return t

    def _forward(self, a: Action, flat: list, norm, train: bool):
        st, spec = self.stages[a.stage], self.spec
        args, inputs = [], []
        prev = stage_rank(a.stage - 1, self.pp)
        for kind, ref in st.inputs:
            if kind == "slot":
                args.append(self._value(ref, flat))
            elif kind == "recv":
                # A received value enters the stage as a leaf (as torch.distributed.pipelining
                # does): B sends its .grad back, so no autograd node is needed per message.
                b = st.recv[ref]
                x = recv_value(self._template(b), spec.axis, prev, self._message(b, a.mb), tag=b.index)
                if train and b.requires_grad:
                    x = x.detach().requires_grad_()
                    inputs.append((x, b))
                args.append(x)
            else:
                args.append(norm)
        reshard = contextlib.nullcontext()
        if spec.rank_spec.reshard_tags and train:
            current().reshard_tags = spec.rank_spec.reshard_tags
            reshard = reshard_after_forward()
        tracker = current().saved_tracker if train else None
        with reshard, tracker.hooks() if tracker is not None else contextlib.nullcontext():
            outs = list(st.forward(*args))
        # the weight roots are for a split backward's W only: elsewhere they would hold a
        # recomputed block's outputs (or any stage's) from forward to backward for nothing
        state = {"inputs": inputs, "ys": outs[st.n_outputs:] if (a.stage, a.mb) in self.split else []}
        if a.stage == self.n_stages - 1:
            self.outputs[a.mb] = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs[:st.n_outputs]]
            if spec.loss_index is not None:
                loss = outs[spec.loss_index]
                self._losses[a.mb] = loss.detach()
                scale = 1.0 if spec.loss_reduction == "sum" else 1.0 / (spec.microbatches * self._of[1])
                state["roots"], state["seeds"] = [loss], [torch.full_like(loss, scale)]
        else:
            nxt = stage_rank(a.stage + 1, self.pp)
            roots = []
            for b, x in zip(st.send, outs):
                send_value(x, spec.axis, nxt, self._message(b, a.mb), tag=b.index)
                if train and x.requires_grad:  # its gradient comes back in this microbatch's B
                    roots.append((x, b))
                    post_gradient_recv(x, spec.axis, nxt, self._message(b, a.mb))
            state["roots"], state["sent"] = [x for x, _ in roots], [b for _, b in roots]
        if train:
            # the roots live until this microbatch's backward: what run.py --memory counts
            state["held"] = [tracker.hold(x) for x in state.get("roots", [])] if tracker is not None else []
            self._state[(a.stage, a.mb)] = state

    def _release(self, state: dict) -> None:
        tracker = current().saved_tracker
        for key in state.pop("held", []):
            tracker.release(key)

    def _seeds(self, a: Action, state: dict) -> list:
        """The gradients B starts from: the loss's seed on the last stage, else those of the
        sent values, received from the next stage (posted at F)."""
        if "sent" not in state:
            return state.get("seeds", [])
        nxt = stage_rank(a.stage + 1, self.pp)
        return [recv_gradient(self._template(b), self.spec.axis, nxt, self._message(b, a.mb), tag=b.index)
                for b in state["sent"]]

    def _backward(self, a: Action):
        key = (a.stage, a.mb)
        state = self._state[key]
        roots, inputs = state.get("roots", []), state["inputs"]
        seeds = self._seeds(a, state)
        if key not in self.split:
            if roots:
                torch.autograd.backward(roots, seeds)
            self._release(self._state.pop(key))
            self._send_input_grads(a, [x.grad for x, _ in inputs], inputs)
            return
        st = self.stages[a.stage]
        early = [self.local._values[n] for n in st.early_params]
        ys = state["ys"]
        targets = [x for x, _ in inputs] + early + ys
        grads = (torch.autograd.grad(roots, targets, seeds, retain_graph=True, allow_unused=True)
                 if roots and targets else [None] * len(targets))
        for p, g in zip(early, grads[len(inputs):len(inputs) + len(early)]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        state["y_grads"] = list(grads[len(inputs) + len(early):])
        state["inputs"] = []  # their gradients are sent: W needs only the weight roots
        self._send_input_grads(a, list(grads[:len(inputs)]), inputs)

    def _send_input_grads(self, a: Action, grads: list, inputs: list):
        """Send each received value's gradient back to the previous stage; one the stage's
        outputs do not depend on (no gradient) gets zeros, so the peer is not left waiting."""
        prev = stage_rank(a.stage - 1, self.pp)
        for g, (_, b) in zip(grads, inputs):
            if g is None:
                g = torch.zeros(b.shape, dtype=b.dtype, device=self.device)
            send_gradient(g, self.spec.axis, prev, self._message(b, a.mb), tag=b.index)

    def _weights(self, a: Action):
        state = self._state.pop((a.stage, a.mb))
        self._release(state)
        ys, gs = state["ys"], state["y_grads"]
        for lo, hi, names in self.stages[a.stage].weight_groups:
            pairs = [(y, g) for y, g in zip(ys[lo:hi], gs[lo:hi]) if g is not None]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs],
                                        inputs=[self.local._values[n] for n in names])

    def _sum_tied(self):
        """Each pipeline rank holding a tied parameter sends its gradient to the others; all
        sum the pieces in pipeline-rank order, so every copy gets the same bits."""
        base = (max((b.index for s in self.spec.stages for b in s.send), default=-1) + 1) * self.spec.microbatches
        for k, (name, stages) in enumerate(sorted(self.spec.tied.items())):
            coords = sorted({stage_rank(s, self.pp) for s in stages})
            if self.coord not in coords:
                continue
            p = self.local._values[name]
            mine = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            parts = {self.coord: mine}
            with torch.no_grad(), trace_phase("backward"):
                for c in coords:
                    if c != self.coord:
                        send(mine, self.spec.axis, c, base + k, tag=-1)
                for c in coords:
                    if c != self.coord:
                        parts[c] = recv(torch.empty(0), self.spec.axis, c, base + k, mine.shape, mine.dtype, tag=-1)
                total = parts[coords[0]].clone()
                for c in coords[1:]:
                    total += parts[c]
            p.grad = total
