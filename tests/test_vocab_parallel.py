"""Vocab-parallel cross-entropy (passes/vocab_parallel.py, runtime/primitives/vocab_parallel.py): a loss over
logits split by class on a mesh axis sends the softmax statistics, not the logits, and stays
exact against the unsharded model (fp32 bounds: the sum of exp is added per rank, then across
ranks)."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from autoshard.runtime import DistributedBackend, rank_context, run_simulated
from autoshard.runtime.transport.launch import spawn
from autoshard.runtime.primitives.vocab_parallel import vocab_parallel_cross_entropy
from autoshard.cost.model import Comm, program_events, resolve_cost_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exactness import assert_exact, assert_trains_like_single_device, train_steps  # noqa: E402
from examples.models import llama_tiny  # noqa: E402

VOCAB, DIM = 32, 12


@pytest.mark.parametrize("n", [2, 4])
def test_runtime_loss_and_gradient_equal_torch(n):
    torch.manual_seed(0)
    x = torch.randn(40, VOCAB) * 4
    target = torch.randint(0, VOCAB, (40,))
    target[[0, 1, 2]] = torch.tensor([0, VOCAB - 1, -100])  # first and last class, an ignored row
    g = torch.randn(40)
    whole = x.clone().requires_grad_()
    ref = F.cross_entropy(whole, target, reduction="none")
    ref.backward(g)

    def rank(r):
        mine = x.chunk(n, 1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, "tp")
        loss.backward(g)
        return loss.detach(), mine.grad

    for r, (loss, grad) in enumerate(run_simulated(Mesh({"tp": n}), rank)):
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, whole.grad.chunk(n, 1)[r], rtol=1e-5, atol=1e-6)
        assert loss[2] == 0 and not grad[2].any()


class TiedLM(nn.Module):
    """Embedding, a nonlinearity, the tied head, a mean cross-entropy (ignore_index rows too)."""

    def __init__(self, smoothing=0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.smoothing = smoothing

    def forward(self, ids, labels):
        logits = F.linear(torch.tanh(self.mix(self.emb(ids))), self.emb.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=self.smoothing)


DIMS = {"ids": "batch seq", "labels": "batch seq", "emb.weight": "vocab hidden"}


def lm_batch():
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, VOCAB, (4, 6), generator=g), torch.randint(0, VOCAB, (4, 6), generator=g)
    labels[0, :2] = -100
    return ids, labels


@pytest.mark.parametrize("mesh,layout", [({"tp": 2}, {"vocab": "tp"}), ({"tp": 4}, {"vocab": "tp"}),
                                         ({"dp": 2, "tp": 2}, {"batch": "dp", "vocab": "tp"})])
def test_plan_sends_statistics_not_logits_and_is_exact(mesh, layout):
    torch.manual_seed(0)
    model, args = TiedLM(), lm_batch()
    plan = autoshard.autoshard(model, args, mesh=Mesh(mesh), dims=DIMS, layout=layout, train=True)
    assert_exact(plan, model, args)
    ops = [n.target for n in plan.program.graph_module.graph.nodes if n.op == "call_function"]
    assert vocab_parallel_cross_entropy in ops and torch.ops.aten.cross_entropy_loss.default not in ops
    rows = 24 // (2 if "dp" in mesh else 1)
    vp = [(c.kind, c.phase, c.bytes) for c in plan.collectives if c.op == "vocab_parallel_cross_entropy"]
    assert vp == [("all_gather", "forward", rows * 4), ("all_reduce", "forward", 2 * rows * 4)]
    # the logits are not gathered: the only gather left is the embedding's lookup of its table
    assert [u.where for u in plan.unsharded] == ["emb"]
    # the cost model counts both as blocking forward collectives (what a search compares layouts by)
    segs = program_events(plan.program, plan.mesh, resolve_cost_model(None), set())
    comms = [(c.fwd_kind, c.fwd_bytes) for s in segs for c in s.items if isinstance(c, Comm) and c.fwd_s > 0]
    assert ("all_gather", rows * 4) in comms and ("all_reduce", 2 * rows * 4) in comms


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_sharded_state_gathers_a_vocab_split_table_for_its_lookup(zero_stage):
    """The table is split by vocab on tp and its state by hidden on dp. Under ZeRO-2 the lookup
    reads the full copy kept since the last step (the tp piece) and then gathers tp from it;
    it once took the full copy on tp as well, dropping the tp gather (a table of half the rows:
    an index error, or rows of the wrong half where the ids were small)."""
    torch.manual_seed(0)
    model, args = TiedLM(), lm_batch()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=DIMS, train=True,
                               layout={"batch": "dp", "vocab": "tp"}, zero_stage=zero_stage)
    assert plan.program.storage["p_emb_weight"].axis == "dp"
    assert_exact(plan, model, args)
    assert_trains_like_single_device(plan, model, [args, tuple(t.roll(1, 0) for t in args), args])


def test_label_smoothing_keeps_the_gather():
    """Outside the lowering's cases (here label smoothing) the rule's gather stays, exactly."""
    torch.manual_seed(0)
    model, args = TiedLM(smoothing=0.1), lm_batch()
    plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=DIMS, layout={"vocab": "tp"}, train=True)
    assert_exact(plan, model, args)
    assert not [c for c in plan.collectives if c.op == "vocab_parallel_cross_entropy"]
    assert len(plan.unsharded) == 2


def make_llama_plan():
    model, args, dims = llama_tiny(with_labels=True)
    plan = autoshard.autoshard(model, args, mesh=Mesh({"dp": 2, "tp": 2}), dims=dims, train=True,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp", "vocab": "tp"})
    return plan, args


def train_worker(rank, world_size):
    plan, args = make_llama_plan()
    with rank_context(plan.mesh, rank, DistributedBackend(plan.mesh)) as ctx:
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        losses = train_steps(local, opt, [args] * 3)
    return losses, [(r.kind, r.axis, r.phase, r.tag) for r in ctx.trace]


@pytest.mark.slow
def test_llama_vocab_parallel_training_on_gloo_equals_simulation():
    plan, args = make_llama_plan()
    assert [c.op for c in plan.collectives].count("vocab_parallel_cross_entropy") == 2
    results = spawn(train_worker, 4, timeout=120)
    sim_losses, _ = plan.simulate_train([args] * 3, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    for rank, (losses, trace) in enumerate(results):
        assert losses == sim_losses  # sums over 2 ranks are order-free in fp32
        assert trace == [(r.kind, r.axis, r.phase, r.tag) for r in plan.last_trace[rank]]
