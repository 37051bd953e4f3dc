"""Pipeline parallelism: schedules as data, the point-to-point adjoint pair, stage cuts, and
pipelined training against single-device training on the simulated mesh.

The exactness matrix covers every schedule, every composition (pp alone, pp x dp, pp x tp,
pp x dp x tp, ZeRO-1/2/3 per stage, tied embeddings) and M=4 and M=8 at least once each,
not their full product."""
import collections
import sys
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.passes.spmd import LayoutError
from autoshard.runtime import CollectiveError, current, run_simulated
from autoshard.runtime.primitives.collectives import recv, send
from autoshard.runtime.execution.schedules import Action, B, F, W, check_schedule, make_schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.models import llama_tiny  # noqa: E402
from exactness import assert_training_within_spread  # noqa: E402

SCHEDULE_NAMES = ["gpipe", "1f1b", "interleaved", "zero_bubble"]


# --------------------------------------------------------------------------- schedules as data


def in_flight(actions) -> tuple:
    """(most microbatches between F and B, most between F and W-or-B-when-unsplit)."""
    split = any(a.kind == "W" for a in actions)
    fb = fw = top_fb = top_fw = 0
    for a in actions:
        fb += (a.kind == "F") - (a.kind == "B")
        fw += (a.kind == "F") - (a.kind == ("W" if split else "B"))
        top_fb, top_fw = max(top_fb, fb), max(top_fw, fw)
    return top_fb, top_fw


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 6)])
def test_schedules_are_complete_and_bound_activations(pp, m):
    for name in SCHEDULE_NAMES:
        v = 2 if name == "interleaved" else 1
        sched = make_schedule(name, pp, m, v)  # check_schedule runs inside
        assert len(sched) == pp
        for r, acts in enumerate(sched):
            fb, fw = in_flight(acts)
            if name == "gpipe":
                assert fb == m * v
            if name in ("1f1b", "zero_bubble"):
                assert fb == min(pp - r, m)  # 1F1B's bound on full activations
            if name == "zero_bubble":
                assert fw <= pp  # never more than 1F1B's peak (rank 0) waiting for W
    assert [str(a) for a in make_schedule("1f1b", 2, 2)[1]] == ["F(mb=0, stage=1)", "B(mb=0, stage=1)",
                                                                "F(mb=1, stage=1)", "B(mb=1, stage=1)"]
    # interleaved: rank 0 holds stages 0 and 2; forwards go through chunk 0 for pp microbatches first
    assert make_schedule("interleaved", 2, 4, 2)[0][:4] == [F(0, 0), F(1, 0), F(0, 2), F(1, 2)]


def test_check_schedule_rejects_broken_lists():
    good = make_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="incomplete"):
        check_schedule([good[0][:-1], good[1]], 2, 2)
    # rank 1 wants B(0) of stage 1 before stage 0's forward of microbatch 0 could reach it
    swapped = [[B(0, 0), F(0, 0), F(1, 0), B(1, 0)], good[1]]
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(swapped, 2, 2)
    with pytest.raises(ValueError, match="multiple of it"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="interleaved"):
        make_schedule("1f1b", 2, 4, 2)
    assert isinstance(make_schedule("zero_bubble", 2, 2)[0][0], Action)
    assert W(0, 1).kind == "W"


# --------------------------------------------------------------------------- send / recv


def test_send_recv_are_an_adjoint_pair():
    """tanh(x @ w0) on pp rank 0, (h @ w1).sum() on pp rank 1: gradients equal one device's,
    bit for bit; the trace shows send/recv forward and their adjoints backward."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(3, 3, generator=gen), torch.randn(3, 3, generator=gen)]
    x = torch.randn(2, 3, generator=gen)
    w0, w1 = (w.clone().requires_grad_() for w in ws)
    (torch.tanh(x @ w0) @ w1).sum().backward()

    def rank_fn(rank):
        c = current().coords["pp"]
        w = ws[c].clone().requires_grad_()
        if c == 0:
            token = send(torch.tanh(x @ w), "pp", 1, message=5)
            torch.autograd.backward([token], [torch.empty(0)])
        else:
            h = recv(torch.empty(0, requires_grad=True), "pp", 0, 5, (2, 3), torch.float32)
            (h @ w).sum().backward()
        return w.grad, [(t.kind, t.phase, t.bytes) for t in current().trace]

    out = run_simulated(Mesh({"pp": 2, "dp": 2}), rank_fn)
    assert torch.equal(out[0][0], w0.grad) and torch.equal(out[2][0], w1.grad)
    assert out[0][1] == [("send", "forward", 24), ("recv", "backward", 24)]
    assert out[3][1] == [("recv", "forward", 24), ("send", "backward", 24)]


def test_stage_writing_a_received_value_in_place_writes_a_copy():
    """The runtime passes received values into a stage as autograd leaves, which an in-place op
    may not overwrite: a stage that writes into one (here through ``detach()`` at the cut, a
    write capture leaves in place) clones it first, and only then; an ``add_`` is made
    functional at capture (``passes/functionalize.py``) and writes nothing."""
    class Block(torch.nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.lin, self.inplace = torch.nn.Linear(8, 8), inplace

        def forward(self, x):
            if self.inplace == "detach":
                x.detach().add_(1.0)
            elif self.inplace == "add_":
                x.add_(1.0)
            return torch.tanh(self.lin(x)) * 0.5

    class Net(torch.nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block(inplace) for _ in range(2))

        def forward(self, x):
            x = x * 2.0  # not the user's input: layer 0 writes into an activation too
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    for inplace in ("detach", "add_", None):
        plan = autoshard.autoshard(Net(inplace), (x,), mesh=Mesh({"pp": 2}), dims={"x": ("batch", None)},
                                   layout={"batch": None}, train=True,
                                   pipeline={"microbatches": 2, "schedule": "1f1b", "cuts": ["layers.1"]})
        received = next(n for n in plan.pipe.stages[1].forward.graph.nodes if n.name.startswith("recv_"))
        copies = [u for u in received.users if u.target is torch.ops.aten.clone.default]
        assert len(copies) == (inplace == "detach")
        losses, _ = plan.simulate_train([(x,)] * 2, optimizer=SGD)  # raised "a leaf Variable ... in-place" before
        assert all(torch.isfinite(torch.tensor(losses)))


class _ScalarLoss(torch.nn.Module):
    """Two tanh blocks and a scalar loss chosen by ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.kind = kind

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.kind == "sum":
            return (x * y).sum()
        if self.kind == "mean":
            return (x * y).mean()
        if self.kind == "mse":
            return torch.nn.functional.mse_loss(x, y)
        return (x * y).sum() / x.shape[0]  # per-sample mean by the batch's size: a constant when captured


@pytest.mark.parametrize("kind", ["sum", "mean", "mse"])
@pytest.mark.parametrize("mesh", [{"pp": 2}, {"pp": 2, "dp": 2}])
def test_sum_and_mean_losses_train_like_single_device(kind, mesh):
    """Microbatch losses are added for a sum over the batch and averaged for a mean: a sum loss
    was averaged over the microbatches before, half the loss and gradients at M=2."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    torch.manual_seed(0)
    model = _ScalarLoss(kind)
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims={"x": ("batch", None), "y": ("batch", None)},
                               layout={"batch": "dp" if "dp" in mesh else None}, train=True,
                               pipeline={"microbatches": 2, "schedule": "1f1b", "cuts": ["layers.1"]})
    assert plan.pipe.loss_reduction == ("sum" if kind == "sum" else "mean")
    torch.testing.assert_close(plan.simulate(*args), model(*args), rtol=1e-5, atol=1e-6)
    assert_trains_like(plan, model, args, SGD)


def test_a_loss_scaled_after_its_reduction_is_refused_when_pipelined():
    """``sum / x.shape[0]`` divides by the captured microbatch's size: neither the sum nor the
    mean of the microbatches' losses is the batch's, so planning says so (node and line)."""
    args = (torch.randn(8, 8), torch.randn(8, 8))
    with pytest.raises(LayoutError, match=r"(?s)pipeline: the loss comes from .*div.*test_pipeline.py.*sum or a mean"):
        autoshard.autoshard(_ScalarLoss("scaled"), args, mesh=Mesh({"pp": 2}),
                            dims={"x": ("batch", None), "y": ("batch", None)}, layout={"batch": None}, train=True,
                            pipeline={"microbatches": 2, "schedule": "1f1b", "cuts": ["layers.1"]})


def test_point_to_point_failures_are_reported():
    def crossed(rank):
        c = current().coords["pp"]
        recv(torch.empty(0), "pp", 1 - c, 1, (2,), torch.float32)

    with pytest.raises(CollectiveError, match="deadlock"):
        run_simulated(Mesh({"pp": 2}), crossed)

    def lost(rank):
        if current().coords["pp"] == 0:
            send(torch.zeros(2), "pp", 1, 3)

    with pytest.raises(CollectiveError, match="never received"):
        run_simulated(Mesh({"pp": 2}), lost)


# --------------------------------------------------------------------------- training


def masked_batch(batch=16, layers=8, **config):
    """Llama-style model with 8 layers; labels masked so microbatches have different numbers
    of valid tokens (one row entirely masked)."""
    model, (ids, _, labels), dims = llama_tiny(with_labels=True, batch=batch, num_layers=layers, **config)
    labels = labels.clone()
    for row in range(batch):
        labels[row, : row % 5] = -100
    labels[3] = -100
    return model, (ids, None, labels), dims


MESHES = {
    "pp2": ({"pp": 2}, {"batch": None}),
    "pp4": ({"pp": 4}, {"batch": None}),
    "pp2xdp2": ({"pp": 2, "dp": 2}, {"batch": "dp"}),
    "pp2xtp2": ({"pp": 2, "tp": 2}, {"batch": None, "heads": "tp", "ffn": "tp"}),
    "pp2xdp2xtp2": ({"pp": 2, "dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"}),
}


def pipeline_plan(model, args, dims, mesh, schedule, m, zero=None, **pipeline):
    axes, layout = MESHES[mesh]
    return autoshard.autoshard(model, args, mesh=Mesh(axes), dims=dims, layout=layout, train=True, zero_stage=zero,
                               pipeline={"microbatches": m, "schedule": schedule, **pipeline})


SGD = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731


def assert_trains_like(plan, model, args, make_opt):
    """3 steps on the simulated mesh equal 3 single-device steps on the whole batch, within the
    float32 spread of single-device training (float32 against float64: tests/exactness.py)."""
    losses, params = plan.simulate_train([args] * 3, optimizer=make_opt)
    assert_training_within_spread(losses, params, model, [args] * 3, make_opt)

# (mesh, schedule, microbatches, zero stage): every schedule, composition, M=4 and M=8.
CASES = [
    ("pp2", "gpipe", 8, None),
    ("pp4", "1f1b", 4, None),
    ("pp2xdp2", "zero_bubble", 4, 1),
    ("pp2xtp2", "interleaved", 4, None),
    ("pp2xdp2xtp2", "1f1b", 8, 2),
    ("pp2xdp2", "interleaved", 8, 3),
]


@pytest.mark.parametrize("mesh,schedule,m,zero", CASES, ids=[f"{c[0]}-{c[1]}-M{c[2]}-zero{c[3]}" for c in CASES])
def test_sgd_training_equals_single_device(mesh, schedule, m, zero):
    """3 steps of SGD with momentum on a masked loss: losses and every parameter equal
    single-device training on the whole batch (fp32 bounds; SGD is linear in the gradient)."""
    model, args, dims = masked_batch()
    assert_trains_like(pipeline_plan(model, args, dims, mesh, schedule, m, zero), model, args, SGD)


def test_adamw_zero_bubble_with_zero3_is_within_the_fp32_bound():
    model, args, dims = masked_batch()
    plan = pipeline_plan(model, args, dims, "pp2xdp2", "zero_bubble", 8, 3)
    lr = 1e-3
    adamw = lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1)  # noqa: E731
    # Adam divides by sqrt(v) + eps: an element whose gradient is a few eps moves by a fraction
    # of lr for a rounding-level gradient difference, which the float32 spread bound includes
    assert_trains_like(plan, model, args, adamw)


def test_tied_embeddings_on_first_and_last_stage():
    model, args, dims = masked_batch(tie_embeddings=True)
    plan = pipeline_plan(model, args, dims, "pp2", "1f1b", 4)
    assert list(plan.pipe.tied.values()) == [[0, 1]]  # embed_tokens.weight, read by both stages
    assert_trains_like(plan, model, args, SGD)
    kinds = [(c.kind, c.phase) for c in plan.collectives if c.op == "tied_grad"]
    assert kinds == [("send", "backward"), ("recv", "backward")]


def test_transfers_and_data_parallel_syncs_per_step():
    """Per step every boundary carries M forward and M backward messages each way, the
    data-parallel gradient sum runs once per parameter (not once per microbatch), and
    plan.collectives lists the transfers with phase, bytes and reason."""
    model, args, dims = masked_batch(layers=4)
    m = 4
    plan = pipeline_plan(model, args, dims, "pp2xdp2", "1f1b", m)
    out, grads = plan.simulate_grads(*args)
    ref = model(*args)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    (boundary,) = plan.pipe.boundaries
    nbytes = torch.Size(boundary.shape).numel() * 4
    for rank, trace in enumerate(plan.last_trace):
        stage = plan.mesh.coords(rank)["pp"]
        count = collections.Counter((t.kind, t.phase) for t in trace if t.axis == "pp")
        assert count == ({("send", "forward"): m, ("recv", "backward"): m} if stage == 0
                         else {("recv", "forward"): m, ("send", "backward"): m})
        assert all(t.bytes == nbytes for t in trace if t.axis == "pp")
        syncs = collections.Counter(t.tag for t in trace if t.axis == "dp" and t.phase == "backward")
        n_params = len(plan.pipe.stages[stage].params)
        assert len(syncs) == n_params and set(syncs.values()) == {1}
    records = [c for c in plan.collectives if c.axes == ("pp",)]
    assert sorted((c.kind, c.phase) for c in records) == [("recv", "backward"), ("recv", "forward"),
                                                           ("send", "backward"), ("send", "forward")]
    assert all(c.bytes == nbytes and "stage 0" in c.why and f"{m} per step" in c.why for c in records)
    ref.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name}: {s}")


def test_stage_table_and_schedule():
    model, args, dims = masked_batch(layers=4)
    plan = pipeline_plan(model, args, dims, "pp2", "zero_bubble", 4, cuts=["layers.1"])
    stages = plan.stages
    assert [s.modules for s in stages] == ["embed_tokens, layers.0", "layers.1-3, norm, lm_head, <root>"]
    assert stages[0].params[0] == "embed_tokens.weight" and "lm_head.weight" in stages[1].params
    assert [s.rank for s in stages] == [0, 1]
    assert sum(s.param_bytes for s in stages) == sum(p.numel() * 4 for p in model.parameters())
    assert plan.schedule[1][:3] == [F(0, 1), B(0, 1), F(1, 1)]
    text = str(plan)
    assert "Pipeline on pp=2: 2 stages" in text and "zero_bubble" in text and "layers.1-3" in text


def test_pipeline_errors_name_the_problem():
    model, args, dims = masked_batch(layers=4)
    mesh = Mesh({"pp": 2, "dp": 2})
    with pytest.raises(LayoutError, match="pipeline axis 'pp'"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "pp"}, train=True,
                            pipeline={"microbatches": 4})
    with pytest.raises(LayoutError, match="names no module"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, train=True,
                            pipeline={"microbatches": 4, "cuts": ["layers.9"]})
    with pytest.raises(LayoutError, match="give 1 cuts"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, train=True,
                            pipeline={"microbatches": 4, "cuts": ["layers.1", "layers.2"]})
    with pytest.raises(ValueError, match="unknown keys"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, pipeline={"stages": 2})
    with pytest.raises(ValueError, match="not one of"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, pipeline={"schedule": "x"})


# --------------------------------------------------------------------------- real processes

GLOO_SCHEDULES = ("1f1b", "interleaved")


def gloo_plan(schedule):
    model, args, dims = masked_batch(batch=8, layers=4)
    return pipeline_plan(model, args, dims, "pp2xdp2", schedule, 4), args


def gloo_worker(rank, world_size):
    from autoshard.runtime import DistributedBackend, rank_context
    out = {}
    for schedule in GLOO_SCHEDULES:
        plan, args = gloo_plan(schedule)
        with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)) as ctx:
            pipe = plan.build(rank)
            opt = plan.optimizer(pipe, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
            losses = []
            for _ in range(2):
                loss = pipe.step(plan.split(args))
                opt.step()
                opt.zero_grad()
                losses.append(None if loss is None else loss.item())
        out[schedule] = (losses, pipe.local.full_parameters(), [(r.kind, r.axis, r.phase, r.tag) for r in ctx.trace])
    return out


@pytest.mark.slow
def test_pipeline_on_gloo_equals_simulation():
    """pp=2 x dp=2 on 4 gloo processes, 1F1B and interleaved: losses, parameters and the
    executed transfers and collectives equal the simulation's bit for bit."""
    from autoshard.runtime.transport.launch import spawn
    results = spawn(gloo_worker, 4, timeout=240)
    for schedule in GLOO_SCHEDULES:
        plan, args = gloo_plan(schedule)
        sim_losses, sim_params = plan.simulate_train([args] * 2, optimizer=SGD)
        per_rank = [r[schedule] for r in results]
        last = [r for r in range(4) if plan.mesh.coords(r)["pp"] == 1]
        for rank, (losses, params, trace) in enumerate(per_rank):
            assert losses == (sim_losses if rank in last else [None, None])
            assert trace == [(r.kind, r.axis, r.phase, r.tag) for r in plan.last_trace[rank]]
        got = plan.assemble_params([p for _, p, _ in per_rank])
        for fqn, full in sim_params.items():
            assert torch.equal(got[fqn], full), fqn
