"""Training the Llama-style decoder on 4 real gloo processes (dp=2 x tp=2) equals the simulated
mesh: per-step losses, the trained parameters, and the collectives each rank ran. ZeRO-3 with
resharding, and DDP with small gradient buckets (asynchronous all-reduces on gloo). Collectives
go through shared memory (all ranks on this host), ZeRO-3 once more through gloo's sockets."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from autoshard.runtime import DistributedBackend, rank_context  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from examples.models import llama_tiny  # noqa: E402
from exactness import train_steps  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 3


CONFIGS = {"zero3": dict(zero_stage=3, reshard_after_forward=True),
           "ddp-buckets": dict(zero_stage=0, bucket_mb=0.01),
           # sequence parallelism: token rows gathered on dim 1 for linears that start the
           # gradient's reduce-scatter before their weight gradients (overlap_linear)
           "sp": dict(zero_stage=0, layout={"seq": "tp?"})}


def make_plan(config):
    if config == "embedded":
        return embedded_plan()
    if config.startswith("positions"):
        return positions_plan(int(config[-1]))
    model, args, dims = llama_tiny(with_labels=True)
    options = dict(CONFIGS[config])
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"dp": 2, "tp": 2}), dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp", **options.pop("layout", {})},
                               train=True, **options)
    return plan, args


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def train_worker(rank, world_size, config, shared_memory=True):
    plan, args = make_plan(config)
    backend = DistributedBackend(plan.mesh, shared_memory=shared_memory)
    assert set(backend.transports.values()) == {"shared memory" if shared_memory else "gloo"}
    with rank_context(plan.mesh, rank, backend) as ctx:
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        losses = train_steps(local, opt, [args] * STEPS)
    return losses, local.full_parameters(), [(r.kind, r.axis, r.phase, r.tag) for r in ctx.trace]


def assert_equals_simulation(results, plan, args):
    """Every rank's losses and collectives, and the assembled parameters, equal the simulation's."""
    sim_losses, sim_params = plan.simulate_train([args] * STEPS, optimizer=make_optimizer)
    for rank, (losses, _, trace) in enumerate(results):
        # Sums over 2 ranks are order-free in fp32, so gloo and the simulation agree exactly
        # (and through shared memory, sums in rank order, at any group size).
        assert losses == sim_losses
        assert trace == [(r.kind, r.axis, r.phase, r.tag) for r in plan.last_trace[rank]]
    for fqn, full in sim_params.items():
        if fqn in plan.captured.aliases:
            continue
        got = autoshard.ownership.assemble([r[1][fqn] for r in results], plan.placement_of(fqn), plan.mesh)
        torch.testing.assert_close(got, full, rtol=0, atol=0, msg=lambda m: f"{fqn}: {m}")


@pytest.mark.parametrize("config,shared_memory", [(c, True) for c in CONFIGS] + [("zero3", False)],
                         ids=[*CONFIGS, "zero3-gloo-sockets"])
def test_training_on_gloo_equals_simulation(config, shared_memory):
    results = spawn(train_worker, 4, config, shared_memory, timeout=120)
    plan, args = make_plan(config)
    assert_equals_simulation(results, plan, args)
    assert {r.phase for r in plan.last_trace[0]} >= {"forward", "backward"}
    if config == "sp":
        from autoshard.runtime.primitives.overlap_linear import varying_linears
        assert [n for n in plan.graph_module.graph.nodes
                if n.target is varying_linears and n.kwargs.get("gather_dim") == 1]


def embedded_plan(zero_stage=3):
    # token and position embeddings: the position table's all_gather and its gradient sum run
    # between two units, so the next unit's gather has its own start and its reduce-scatter is held
    # (zero_stage=0: the gradients summed by buckets of a few parameters each instead)
    from test_units import _Embedded
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g))
    plan = autoshard.autoshard(_Embedded(), args, mesh=autoshard.Mesh({"dp": 2}),
                               dims={"tokens": "batch seq", "labels": "batch seq"}, layout={"batch": "dp"},
                               train=True, search=False, zero_stage=zero_stage,
                               **(dict(reshard_after_forward=True) if zero_stage == 3 else dict(bucket_mb=0.001)))
    return plan, args


def test_units_started_after_plain_collectives_on_gloo_equal_simulation():
    results = spawn(train_worker, 2, "embedded", timeout=120)
    plan, args = embedded_plan()
    code = plan.program.graph_module.code
    assert "start_gather_unit" in code and "hold = True" in code
    assert_equals_simulation(results, plan, args)


def positions_plan(zero_stage):
    # a position table at arange and a scale read by it and by the tokens: a replicated region
    # whose gradient sum goes into the sharded state's reduce-scatters (grad_regions)
    from test_grad_regions import DIMS, PosModel, batch
    torch.manual_seed(0)
    model = PosModel()
    plan = autoshard.autoshard(model, batch(), mesh=autoshard.Mesh({"dp": 2}), dims=DIMS, layout={"batch": "dp"},
                               train=True, search=False, zero_stage=zero_stage)
    return plan, batch()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_region_sums_in_sharded_state_on_gloo_equal_simulation(zero_stage):
    results = spawn(train_worker, 2, f"positions{zero_stage}", timeout=120)
    plan, args = positions_plan(zero_stage)
    assert not [c for c in plan.collectives if c.op == "mark_varying"]
    assert_equals_simulation(results, plan, args)


def spares_worker(rank, world_size, zero_stage):
    """Buffer reuse on gloo: what ``recycle`` keeps and what ``buffer`` hands out again, and
    training drawing its buffers (ZeRO-3 units, ZeRO-0 gradient buckets) from the spares after
    the first step."""
    plan, args = embedded_plan(zero_stage)
    backend = DistributedBackend(plan.mesh)
    a = backend.buffer((4, 6), torch.float32)
    backend.recycle(a)
    backend.recycle(a)  # given back twice: kept once
    b, c = backend.buffer((24,), torch.float32), backend.buffer((24,), torch.float32)
    whole = b.data_ptr() == a.data_ptr() and c.data_ptr() != a.data_ptr()
    backend.recycle(torch.zeros(48)[:24])  # a view of something larger is not kept
    view_kept = bool(backend._spares.get((24, torch.float32)))
    reused = []
    take = backend.buffer

    def counting(shape, dtype, device=None):
        spare = {t.data_ptr() for t in backend._spares.get((math.prod(shape), dtype), ())}
        t = take(shape, dtype, device)
        reused.append(t.data_ptr() in spare)
        return t
    backend.buffer = counting
    with rank_context(plan.mesh, rank, backend):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        per_step = []
        for _ in range(STEPS):
            reused.clear()
            local(*args).backward()
            # no gradient is a view of a buffer the backend may hand out again
            spare = {t.data_ptr() for free in backend._spares.values() for t in free}
            aliased = [n for n, p in local.named_parameters()
                       if p.grad is not None and p.grad.untyped_storage().data_ptr() in spare]
            opt.step()
            opt.zero_grad()
            per_step.append((len(reused), sum(reused), aliased))
    return whole, view_kept, per_step


@pytest.mark.parametrize("zero_stage", [3, 0])
def test_gloo_backend_reuses_unit_and_bucket_buffers(zero_stage):
    """After the first step, every unit or bucket buffer comes from the spares, except the
    gathered buffers of one-parameter units, which become that parameter (forward and
    backward); no gradient is left a view of one."""
    plan, _ = embedded_plan(zero_stage)
    singles = sum(len(members) == 1 for _, _, members in plan.program.units) if zero_stage == 3 else 0
    assert zero_stage == 3 or len(plan.program.buckets) > 1
    for whole, view_kept, per_step in spawn(spares_worker, 2, zero_stage, timeout=120):
        assert whole and not view_kept
        (first, _, aliased), *later = per_step
        assert first > 0 and not aliased
        for n, reused, aliased in later:
            assert n == first and n - reused <= 2 * singles and not aliased
