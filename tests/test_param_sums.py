"""Gradient sums of parameters read nowhere else, added into ``.grad`` when backward ends:
``runtime/primitives/param_sums.py`` with ``mark_varying(..., later=True)`` and ``passes/param_sums.py``
(the pass that marks them). Gradients must be those of the synchronous sums bit for bit, and
on gloo the sum must still be in flight while the rest of backward runs."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import autoshard  # noqa: E402
from autoshard.passes.param_sums import LATER, sum_param_grads_later  # noqa: E402
from autoshard.runtime import DistributedBackend, mark_varying, rank_context, run_simulated  # noqa: E402
from autoshard.runtime.primitives import collectives as C  # noqa: E402
from autoshard.runtime.primitives import param_sums  # noqa: E402
from autoshard.runtime.transport import simulated  # noqa: E402
from autoshard.runtime.transport.backend import Pending  # noqa: E402
from autoshard.runtime.transport.rank_context import current  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from autoshard.runtime.transport.simulated import SimulatedBackend  # noqa: E402
from examples.models import llama_tiny  # noqa: E402
from exactness import assert_training_within_spread  # noqa: E402

SP = {"heads": "tp", "ffn": "tp", "seq": "tp?"}
BF16 = {"param": torch.bfloat16, "reduce": torch.float32}
# llama_tiny's parameters that sequence parallelism reads whole on token rows (one mark_varying each)
ROW_PARAMS = {"embed_tokens.weight", "norm.weight", "lm_head.weight",
              *(f"layers.{b}.{n}.weight" for b in range(2) for n in ("input_layernorm", "post_attention_layernorm"))}


def _sp_plan(mesh, later=True, **options):
    model, args, dims = llama_tiny(with_labels=True)
    layout = dict(SP, **({"batch": "dp"} if "dp" in mesh else {}))
    plan = autoshard.autoshard(copy.deepcopy(model), args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout,
                               train=True, disable_passes=() if later else ("param_sums",), **options)
    return plan, model, args


def _marked(plan):
    """{parameter FQN: axis} of the mark_varying nodes marked later=True."""
    fqn = {i.name: i.target for i in plan.captured.inputs if i.kind == "parameter"}
    return {fqn[n.args[0].name]: n.args[1] for n in plan.graph_module.graph.nodes
            if n.target is C.mark_varying and n.kwargs.get("later")}


# ---- the pass ---------------------------------------------------------------------------------

def test_pass_marks_the_parameters_sequence_parallelism_reads_on_token_rows():
    plan, _, _ = _sp_plan({"tp": 2})
    assert _marked(plan) == {name: "tp" for name in ROW_PARAMS}
    # the plan says so for their backward sums, and only for theirs
    tags = {n.kwargs["tag"] for n in plan.graph_module.graph.nodes if n.kwargs.get("later")}
    for c in plan.collectives:
        assert c.why.endswith(LATER) == (c.tag in tags and c.phase == "backward"), c
    assert "later = True" in plan.graph_module.code


def test_pass_leaves_activation_sums_and_bucketed_parameters_alone():
    # plain tensor parallelism: every mark_varying reads an activation (the linears' inputs)
    model, args, dims = llama_tiny(with_labels=True)
    tp = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=dims,
                             layout={"heads": "tp", "ffn": "tp"}, train=True,
                             disable_passes=("overlap_linear",))  # keep them as mark_varyings
    assert [n for n in tp.graph_module.graph.nodes if n.target is C.mark_varying]
    assert _marked(tp) == {}
    # dp x tp with gradient buckets: the bucket's hook must see the summed gradient
    bucketed, _, _ = _sp_plan({"dp": 2, "tp": 2})
    assert bucketed.program.bucketed and _marked(bucketed) == {}
    # without buckets the data-parallel sums read the parameters (the tp sums read those sums)
    per_param, _, _ = _sp_plan({"dp": 2, "tp": 2}, bucket_mb=0)
    marked = _marked(per_param)
    assert set(marked.values()) == {"dp"} and ROW_PARAMS <= set(marked)


def _graph():
    """Parameters p (read once through mark_varying), q (read twice), r (skipped), a user
    input x read once through mark_varying."""
    g = fx.Graph()
    p, q, r, x = (g.placeholder(n) for n in ("p", "q", "r", "x"))
    outs = [g.call_function(C.mark_varying, (t, "tp"), {"tag": k}) for k, t in enumerate((p, q, r, x))]
    outs.append(g.call_function(torch.ops.aten.mul.Tensor, (q, 2.0)))
    g.output(tuple(outs))
    return g


def test_pass_marks_only_single_use_parameter_reads():
    g = _graph()
    assert sum_param_grads_later(g, {"p", "q", "r"}, skip={"r"}) == [0]
    assert [n.kwargs.get("later", False) for n in g.nodes if n.target is C.mark_varying] == [True, False, False, False]
    assert sum_param_grads_later(g, {"p", "q", "r"}) == [2]  # marked once; r without the skip


# ---- the runtime, against the synchronous sum ------------------------------------------------

P0 = torch.randn(48, generator=torch.Generator().manual_seed(0))
X0 = torch.randn(6, 48, generator=torch.Generator().manual_seed(1))


def _grads(rank, later, dtype=torch.float32, uses=1, backwards=2, accumulate=0, hook=False, grad_call=False,
           reduce_dtype=None):
    """One rank: ``backwards`` backward calls without zeroing (the first ``accumulate`` of them
    under gradient accumulation on tp) of a loss reading p through ``uses`` mark_varyings."""
    ctx = current()
    ctx.reduce_dtype = reduce_dtype
    p = (P0 * (rank + 1)).to(dtype).requires_grad_()
    if hook:
        p.register_post_accumulate_grad_hook(lambda t: None)
    out = []
    for step in range(backwards):
        ctx.defer_axes = frozenset({"tp"}) if step < accumulate else frozenset()
        x = (X0 * (rank + 1) + step).to(dtype)
        loss = sum((mark_varying(p, "tp", tag=k, later=later) * x).sin().sum() * (k + 1) for k in range(uses))
        if grad_call:
            out.append(torch.autograd.grad(loss, [p])[0])
        else:
            loss.backward()
            out.append(p.grad.clone())
    return out


@pytest.mark.parametrize("case", [
    {}, {"uses": 3}, {"accumulate": 2, "backwards": 3}, {"hook": True}, {"grad_call": True},
    {"dtype": torch.bfloat16, "reduce_dtype": torch.float32}, {"mesh": {"tp": 1}}, {"mesh": {"tp": 4}, "uses": 2},
], ids=["plain", "three-uses", "accumulation", "hooked", "autograd-grad", "mixed-precision", "tp1", "tp4"])
def test_later_sums_equal_synchronous_bitwise(case, monkeypatch):
    case = dict(case)
    mesh = autoshard.Mesh(case.pop("mesh", {"tp": 2}))
    started = []
    add = param_sums.SumsLater.add
    monkeypatch.setattr(param_sums.SumsLater, "add", lambda self, *a: (started.append(1), add(self, *a)))
    sync = run_simulated(mesh, lambda r: _grads(r, False, **case))
    assert not started
    later = run_simulated(mesh, lambda r: _grads(r, True, **case))
    for rank, (a, b) in enumerate(zip(sync, later)):
        for step, (ga, gb) in enumerate(zip(a, b)):
            assert ga.dtype == gb.dtype and torch.equal(ga, gb), (rank, step)
    # where the sum may land later it did (once per use and backward outside accumulation)
    landed = case.get("uses", 1) * (case.get("backwards", 2) - case.get("accumulate", 0)) * mesh.size
    asynchronous = not (case.get("hook") or case.get("grad_call") or mesh.size == 1)
    assert len(started) == (landed if asynchronous else 0)


def test_later_sum_lands_when_backward_ends_not_inside_it(monkeypatch):
    """Simulated backend, whose all_reduce_async finishes at once: the sum is started when
    p's gradient exists and waited for when backward ends, after the work still left."""
    logs: dict = {0: [], 1: []}

    class Spy(SimulatedBackend):
        def all_reduce_async(self, x, axis, consume=False):
            log = logs[current().rank]
            log.append("start")
            done = super().all_reduce_async(x, axis, consume)

            class Logged(Pending):
                def wait(self):
                    log.append("wait")
                    return done.wait()
            return Logged(None)

    monkeypatch.setattr(simulated, "SimulatedBackend", Spy)

    def rank(r, later):
        p = P0.clone().requires_grad_()
        x = (X0 * (r + 1)).requires_grad_()
        e = x.exp()  # created before the mark_varying: its backward runs after it
        e.register_hook(lambda g: logs[r].append("after"))
        (mark_varying(p, "tp", tag=0, later=later) * e).sum().backward()
        return p.grad, x.grad

    sync = run_simulated(autoshard.Mesh({"tp": 2}), lambda r: rank(r, False))
    later = run_simulated(autoshard.Mesh({"tp": 2}), lambda r: rank(r, True))
    for log in logs.values():
        assert log == ["after", "start", "after", "wait"], log  # the first "after": the synchronous run
    for (gp, gx), (lp, lx) in zip(sync, later):
        assert torch.equal(gp, lp) and torch.equal(gx, lx)


# ---- plans on the simulated mesh --------------------------------------------------------------

PLANS = {"tp2": ({"tp": 2}, {}), "dp2xtp2": ({"dp": 2, "tp": 2}, {"bucket_mb": 0}),
         "tp2-checkpoint": ({"tp": 2}, {"checkpoint": True}), "tp2-bf16": ({"tp": 2}, {"precision": BF16})}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_training_equals_synchronous_sums_bitwise(name, monkeypatch):
    mesh, options = PLANS[name]
    plan, model, args = _sp_plan(mesh, **options)
    sync, _, _ = _sp_plan(mesh, later=False, **options)
    assert _marked(plan) and not _marked(sync)
    started = []
    add = param_sums.SumsLater.add
    monkeypatch.setattr(param_sums.SumsLater, "add", lambda self, *a: (started.append(1), add(self, *a)))
    out, grads = plan.simulate_grads(*args)
    assert len(started) == len(_marked(plan)) * plan.mesh.size
    ref_out, ref_grads = sync.simulate_grads(*args)
    assert torch.equal(out, ref_out) and grads.keys() == ref_grads.keys()
    for fqn in grads:
        assert torch.equal(grads[fqn], ref_grads[fqn]), fqn
    assert plan.last_trace == sync.last_trace  # the same collectives, records and order
    # three AdamW steps of two microbatches each: the second backward adds into existing .grad
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)  # noqa: E731
    ids, mask, labels = args
    steps = [[args, (ids.flip(0), mask, labels.flip(0))]] * 3
    losses, params = plan.simulate_train(steps, optimizer=make_opt, microbatches=2)
    ref_losses, ref_params = sync.simulate_train(steps, optimizer=make_opt, microbatches=2)
    assert losses == ref_losses
    for fqn in params:
        assert torch.equal(params[fqn], ref_params[fqn]), fqn
    if name == "tp2-bf16":
        return
    # Bit for bit above: the same plan with its sums synchronous (same kernels, same order, on
    # any CPU). The single-device model sums in another order (BLAS kernels differ by CPU), and
    # Adam amplifies rounding in tiny gradients: within single-device training's own float32
    # spread (float32 against float64, per parameter tensor; tests/exactness.py).
    assert_training_within_spread(losses, params, model, steps, make_opt, microbatches=2)


# ---- two gloo processes -----------------------------------------------------------------------

class _LoggingBackend(DistributedBackend):
    """Logs (event, tag) for every backward collective: 'sync' calls, 'start' of an
    asynchronous all-reduce and its 'wait'."""

    def __init__(self, mesh):
        super().__init__(mesh)
        self.log = []

    def _note(self, event):
        op, tag, phase = current().call
        if phase == "backward":
            self.log.append((event, tag))

    def all_reduce(self, x, axis):
        self._note("sync")
        return super().all_reduce(x, axis)

    def all_gather(self, x, axis, dim):
        self._note("sync")
        return super().all_gather(x, axis, dim)

    def reduce_scatter(self, x, axis, dim):
        self._note("sync")
        return super().reduce_scatter(x, axis, dim)

    def reduce_scatter_async(self, x, axis, dim, consume=False):
        self._note("start")  # a fused gather's gradient (overlap_linear): started, waited for in backward
        return super().reduce_scatter_async(x, axis, dim, consume)

    def all_reduce_async(self, x, axis, consume=False):
        self._note("start")
        _, tag, _ = current().call
        pending, log = super().all_reduce_async(x, axis, consume), self.log

        class Logged(Pending):
            def wait(self):
                log.append(("wait", tag))
                return pending.wait()
        return Logged(None)


def _gloo_worker(rank, world_size):
    plan, _, args = _sp_plan({"tp": 2})
    backend = _LoggingBackend(plan.mesh)
    with rank_context(plan.mesh, rank, backend):
        _, grads = plan.run_rank(rank, *args, grads=True)
    return grads, backend.log


@pytest.mark.slow
def test_gloo_sums_run_under_backward_and_equal_the_simulation():
    plan, _, args = _sp_plan({"tp": 2})
    later = {n.kwargs["tag"] for n in plan.graph_module.graph.nodes if n.kwargs.get("later")}
    results = spawn(_gloo_worker, 2, timeout=300)
    for grads, log in results:
        assert not [t for e, t in log if e == "sync" and t in later], log  # none waited for in place
        for tag in later:
            start, wait = log.index(("start", tag)), log.index(("wait", tag))
            assert start < wait and wait > max(i for i, (e, _) in enumerate(log) if e in ("sync", "start")), log
        # the final norm's sum (first in backward) was in flight under the blocks' collectives
        first = log.index(("start", max(later)))
        assert sum(e in ("sync", "start") and t not in later for e, t in log[first:]) >= 8, log
    _, sim = plan.simulate_grads(*args)
    got = plan.assemble_grads([g for g, _ in results])
    for fqn in sim:
        assert torch.equal(got[fqn], sim[fqn]), fqn


@pytest.mark.slow
def test_exported_program_prints_later_and_trains_on_gloo(tmp_path):
    from test_export import torchrun
    plan, _, args = _sp_plan({"tp": 2})
    path = plan.export(tmp_path / "sp", args)
    assert (path / "program.py").read_text().count("later = True") == len(ROW_PARAMS)
    proc, _ = torchrun(path, 2, "--check", "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check passed" in proc.stdout and "losses of 2 adamw steps match" in proc.stdout, proc.stdout
