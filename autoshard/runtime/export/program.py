"""This rank's program: the planned module as a ``LocalModule`` over its own blocks, and its steps.

``rank_program`` turns plan.json, the program file and the weights into a ``RankProgram``
(or, for a pipelined export, a ``PipelineProgram``): its forward, its training step with the
sharded optimizer, and the agreed verdicts every rank takes together (a non-finite step under
``--nan-policy``). ``rank_loop`` is the forward or ``--steps`` run that ``--check`` compares.

Example (inside a rank context)::

    rp = rank_program(doc, mesh, rank, program, weights, torch.device("cpu"), train=True)
    res = rank_loop(rp, user, steps=2, ref=ref)     # res["ok"], res["losses"], ...
"""
from __future__ import annotations

import math
import time

import torch

from autoshard.mesh import Mesh
from autoshard.ownership import ParamStorage, Replicate, Shard
from autoshard.runtime import current
from autoshard.runtime.execution import grad_accum
from autoshard.runtime.execution.local import LocalModule, RankSpec, ShardedOptimizer, Slot
from autoshard.runtime.execution.clip import clip_grad_norm_, global_grad_norm

from .checks import compare_grads, compare_outputs, global_sum
from .errors import NonFiniteError
from .inputs import _planned_value
from .memory import trace
from .plan_file import _pipeline, _this
from .weights import Weights

NAN_POLICIES = ("stop", "skip-step", "ignore")  # --nan-policy: what a non-finite loss or gradient norm does


def rank_spec(doc: dict, mesh: Mesh, forward, train: bool) -> RankSpec:
    """The :class:`~autoshard.runtime.execution.local.RankSpec` of plan.json: every argument of the
    program as a slot (how it is stored, trainable when ``train``), the data axes and buckets."""
    slots = []
    for m in doc["inputs"]:
        if m.get("role", "input") == "full":
            slots.append(Slot(m["name"], "full", m["of"], m.get("_place")))
            continue
        st = m.get("storage")
        storage = ParamStorage(m["_place"], st["axis"], st["dim"], st.get("stage", 0), st["mode"],
                               bool(st.get("reshard"))) if st else None
        z1 = m.get("zero1")
        slots.append(Slot(m["name"], m["kind"], m["target"], m.get("_place"), m.get("_use"), storage,
                          bool(train and m.get("trainable")), (z1["axis"], z1["dim"]) if z1 else None,
                          tuple(m["shape"]) if m.get("shape") is not None else None,
                          m.get("_dtype", torch.float32), _planned_value(m)))
    buckets = doc.get("grad_buckets") or {}
    # a pipelined step defers every data-axis gradient sum to its last microbatch (they are in
    # the stage programs, not in buckets); otherwise the data axis is the buckets'
    axes = list(doc.get("data_axes") or []) if doc.get("pipeline") else ([buckets["axis"]] if buckets.get("axis") else [])
    return RankSpec(mesh, forward, slots, axes,
                    frozenset(doc.get("reshard_tags") or ()),
                    [(b["tag"], list(b["params"])) for b in buckets.get("buckets", [])] if train else [],
                    reduce_dtype=getattr(torch, doc["reduce_dtype"]) if doc.get("reduce_dtype") else None)


def weights_lookup(weights: Weights):
    """``lookup(slot)`` for LocalModule: the slot's global tensor from the weights (None for a
    non-tensor value)."""
    return lambda slot: weights.find(slot.target) if slot.shape is not None else None


def rank_program(doc: dict, mesh: Mesh, rank: int, program, weights: Weights, device, train: bool):
    """This rank's :class:`RankProgram`, or for a pipelined export its ``PipelineProgram``."""
    if doc.get("pipeline"):
        return _pipeline().PipelineProgram(doc, mesh, rank, program, weights, device, train, _this())
    return RankProgram(doc, mesh, rank, program, weights, device, train)


class RankProgram:
    """One rank's program with its parameters as stored (whole, a tensor-parallel block, or a
    ZeRO shard) and its optimizer: autoshard's own :class:`~autoshard.runtime.execution.local.LocalModule` and
    :class:`~autoshard.runtime.execution.local.ShardedOptimizer`, built from plan.json instead of a plan."""

    def __init__(self, doc: dict, mesh: Mesh, rank: int, program, weights: Weights, device, train: bool):
        self.doc, self.mesh, self.rank, self.device = doc, mesh, rank, device
        self.local = LocalModule(rank_spec(doc, mesh, program.forward, train), rank, weights_lookup(weights), device)
        self.params = {self.local.fqn_of[n]: p for n, p in self.local.named_parameters() if p.requires_grad}
        self.opt = None

    def forward(self, user: list) -> list:
        """The program's flat local outputs (call inside the rank context)."""
        return self.local.run_flat(user)

    def train_step(self, user: list):
        """Forward and backward of one step on the global inputs ``user``: the local loss."""
        loss = self.forward(user)[self.doc["loss_output"]]
        trace("forward")
        # ones of the local loss shape: right for every owner (see autoshard's Plan.run_rank)
        loss.backward(torch.ones_like(loss))
        trace("backward")
        return loss

    def step_loss(self, loss) -> float:
        """The step's global loss from this rank's block (call on every rank)."""
        return global_sum(loss, self.doc["outputs"][self.doc["loss_output"]]["_place"], self.mesh)

    def train_accumulated(self, microbatches: list, accum: dict) -> float:
        """Forward and backward of the step's microbatches (``--grad-accum``: data-axis sums once,
        with the last; see :mod:`autoshard.runtime.execution.grad_accum`); the step's global loss."""
        pieces = grad_accum.accumulate(self.local, microbatches, loss_index=self.doc["loss_output"],
                                       reduction=accum["reduction"], normalizer=accum["normalizer"],
                                       normalizer_inputs=accum["inputs"])
        return math.fsum(w * self.step_loss(loss) for loss, w in pieces)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients to the global 2-norm ``max_norm``; the norm before clipping."""
        return clip_grad_norm_(self.local, max_norm)

    def grad_norm(self) -> float:
        """The gradients' global 2-norm (the same float on every rank), nothing clipped."""
        return global_grad_norm(self.local)

    def make_optimizer(self, kind: str, lr: float):
        self.opt = ShardedOptimizer.by_name(self.local, kind, lr)

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        trace("optimizer step")


def rank_loop(rp: RankProgram, user: list, *, steps: int, optimizer: str = "adamw", lr: float = 1e-3,
              ref=None, rtol: float = 1e-4, atol: float = 1e-5, say=lambda msg: None,
              nan_policy: str = "stop") -> dict:
    """Forward only (``steps=0``) or ``steps`` training steps of one rank, inside its rank
    context; compares with ``ref`` (outputs, and first-step gradients) when given. A step whose
    loss or gradient norm is not finite is handled by ``nan_policy`` (:func:`nonfinite_step`)."""
    doc, mesh = rp.doc, rp.mesh
    res = dict(ok=True, worst_out=0.0, worst_grad=0.0, problems=[], losses=[], outputs=None, grads=None)
    sync = torch.cuda.synchronize if rp.device.type == "cuda" else (lambda: None)
    if not steps:
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = rp.forward(user)
        sync()
        dt = time.perf_counter() - t0
        say(f"forward  time {dt * 1e3:.1f} ms  outputs: {describe_outputs(outs, doc, mesh)}")
        res["outputs"] = outs
        if ref is not None:
            res["ok"], res["worst_out"], res["problems"] = compare_outputs(doc, mesh, rp.rank, outs, ref, rtol, atol)
        return res
    k_loss = doc["loss_output"]
    loss_place = doc["outputs"][k_loss]["_place"]
    rp.make_optimizer(optimizer, lr)
    for step in range(steps):
        t0 = time.perf_counter()
        outs = rp.forward(user)
        loss = outs[k_loss]
        # ones of the local loss shape: right for every owner (see autoshard's Plan.run_rank)
        loss.backward(torch.ones_like(loss))
        if step == 0:
            res["outputs"] = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
            res["grads"] = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                            for k, p in rp.params.items()}
            if ref is not None:
                o_ok, res["worst_out"], p1 = compare_outputs(doc, mesh, rp.rank, outs, ref, rtol, atol)
                g_ok, res["worst_grad"], p2 = compare_grads(doc, mesh, rp.rank, rp.params, ref, rtol, atol)
                res["ok"], res["problems"] = o_ok and g_ok, p1 + p2
        finish_step(rp, res, step + 1, steps, global_sum(loss, loss_place, mesh), t0,
                    nan_policy=nan_policy, sync=sync, say=say)
    return res


def finish_step(rp, res: dict, step: int, steps: int, value: float, t0: float, *, nan_policy: str, sync, say,
                note: str = "") -> None:
    """The end of training step ``step`` of ``steps`` (1-based) of a ``rank_loop``, plain or
    pipelined, whose global loss is ``value``: the ``--nan-policy`` verdict
    (:func:`nonfinite_step`; it raises under ``stop``), then the optimizer step, or under
    ``skip-step`` the gradients dropped instead; ``sync()`` for the device, the loss appended to
    ``res["losses"]`` and the step's line said: loss, time since ``t0``, ``note`` and why skipped.

    Example::

        finish_step(rp, res, 1, 2, value, t0, nan_policy="stop", sync=lambda: None, say=print)
        # step 1/2  loss 4.399001  time 12.3 ms
    """
    skipped = nonfinite_step(rp, step, value, None, nan_policy)
    if skipped:
        rp.opt.zero_grad(set_to_none=True)
    else:
        rp.step()
    sync()
    dt = time.perf_counter() - t0
    res["losses"].append(value)
    say(f"step {step}/{steps}  loss {value:.6f}  time {dt * 1e3:.1f} ms{note}" + (f"  {skipped}" if skipped else ""))


def agreed(rp, flags) -> list:
    """Whether any rank's flag is set, for each of ``flags``, on every rank (a sum over every
    mesh axis). Call on every rank inside its rank context."""
    backend = current("agreed").backend
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64, device=rp.device)
    for axis in rp.mesh.names:
        t = backend.all_reduce(t, axis)
    return [v > 0 for v in t.tolist()]


def nonfinite_step(rp, step: int, loss: float, norm, policy: str):
    """``--nan-policy`` before step ``step``'s optimizer step, on every rank: None where the
    step's global ``loss`` and gradient ``norm`` (the clipping's, or None: computed here) are
    finite or the policy is ``ignore``; where one is not, NonFiniteError under ``stop``, and
    under ``skip-step`` the words saying why the step is skipped (the caller drops the
    gradients instead of stepping). All ranks agree, so all skip or stop at the same step.

    Example::

        why = nonfinite_step(rp, 7, loss, None, "skip-step")   # e.g. "loss nan: ... skipped ..."
    """
    if policy == "ignore":
        return None
    if norm is None:
        norm = rp.grad_norm()
    bad_loss, bad_norm = agreed(rp, [not math.isfinite(loss), not math.isfinite(norm)])
    if not (bad_loss or bad_norm):
        return None
    what = " and ".join(w for w, bad in ((f"loss {loss}", bad_loss), (f"gradient norm {norm}", bad_norm)) if bad)
    if policy == "stop":
        raise NonFiniteError(f"step {step}: {what}, not finite: stopped before its optimizer step "
                             f"(--nan-policy stop; skip-step skips such steps, ignore trains on)")
    return f"skipped: {what}, not finite (--nan-policy skip-step: no optimizer step)"


def check_finite_state(rp, step: int, path) -> None:
    """NonFiniteError on every rank where any rank's parameters or optimizer state hold a value
    that is not finite: the checkpoint ``path`` due after step ``step`` is not written."""
    def bad(t):
        return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    mine = (any(bad(p) for p in rp.local.parameters())
            or any(bad(v) for state in rp.opt.inner.state.values() for v in state.values()))
    if agreed(rp, [mine])[0]:
        raise NonFiniteError(f"step {step}: the parameters or optimizer state after the optimizer step are not "
                             f"finite: checkpoint {path} not written, stopped")


def describe_outputs(outs, doc, mesh) -> str:
    desc = []
    for o, meta in zip(outs, doc["outputs"]):
        if not isinstance(o, torch.Tensor):
            desc.append(repr(o))
        elif o.numel() == 1 and all(isinstance(p, Replicate) for p in meta["_place"]):
            desc.append(f"{o.item():.6f}")
        else:
            gshape = list(o.shape)
            for p, axis in zip(meta["_place"], mesh.names):
                if isinstance(p, Shard):
                    gshape[p.dim] *= mesh.axes[axis]
            desc.append(f"tensor {gshape} (local {list(o.shape)})")
    return ", ".join(desc)
