"""Forward sums returned before they arrive (runtime/primitives/pending_value.py, passes/output_sums.py):
the data waits for its collective when read, autograd never waits for it, and a value read is
always the finished sum, whatever is done to it first."""
import copy
import io
import pickle
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from autoshard.runtime import Backend, all_reduce, rank_context
from autoshard.runtime.transport.backend import Pending
from autoshard.runtime.primitives.pending_value import PendingValue
from passes.output_sums import LAZY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exactness import assert_training_within_spread  # noqa: E402
from test_grad_regions import PosModel, batch, plan_for, train_matches_single_device  # noqa: E402


class _Work:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("waited")


class TwoEqualRanks(Backend):
    """Rank 0 of a dp=2 mesh whose peer holds the same partial: a sum is twice the input.
    ``all_reduce_async`` logs when it starts and when it is waited for."""

    def __init__(self):
        self.log = []

    def all_reduce(self, x, axis):
        self.log.append("sync")
        return x * 2

    def all_reduce_async(self, x, axis, consume=False):
        self.log.append("started")
        return Pending(x * 2, work=_Work(self.log))


def lazy_mean(backend, w):
    with rank_context(Mesh({"dp": 2}), 0, backend):
        return all_reduce((w * w).sum(), "dp", tag=1, lazy=True) / torch.tensor(4)


def test_backward_runs_without_waiting_and_the_sum_is_finished_when_backward_ends():
    backend, w = TwoEqualRanks(), torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = lazy_mean(backend, w)
    assert isinstance(loss, PendingValue) and loss.requires_grad and loss.shape == ()
    assert backend.log == ["started"]  # the division was recorded, nothing waited
    loss.backward()
    assert backend.log == ["started", "waited"]  # at the end of backward, not before it
    torch.testing.assert_close(w.grad, 2 * w.detach() / 4, rtol=0, atol=0)
    assert loss.item() == 2 * 14 / 4


def test_reading_the_value_waits_for_the_sum():
    backend, w = TwoEqualRanks(), torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = lazy_mean(backend, w)
    assert loss.item() == 7.0 and backend.log == ["started", "waited"]
    assert float(loss.detach()) == 7.0
    assert f"{loss:.2f}" == "7.00" and "7." in repr(loss) and loss.detach().tolist() == 7.0
    assert (loss * 2).item() == 14.0
    # ops that return something other than a tensor read the data (equal is tagged pointwise)
    assert torch.equal(lazy_mean(TwoEqualRanks(), w.detach()), torch.tensor(7.0))
    assert torch.allclose(lazy_mean(TwoEqualRanks(), w.detach()), torch.tensor(7.0))
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * w.detach() / 4, rtol=0, atol=0)


def test_values_derived_before_an_in_place_write_keep_what_they_were():
    """``b = loss * 3`` is recorded, not computed; the write into ``loss`` must not reach it."""
    backend, w = TwoEqualRanks(), torch.tensor([1.0, 2.0, 3.0])
    loss = lazy_mean(backend, w)
    tripled, view = loss * 3, loss.view(1)
    loss.add_(1)
    assert tripled.item() == 21.0          # 7 * 3, made before the write
    assert view.tolist() == [8.0]          # a view sees the write, as in eager PyTorch
    assert loss.item() == 8.0


def test_an_operand_written_after_the_op_is_recorded_does_not_change_the_result():
    backend, w = TwoEqualRanks(), torch.tensor([1.0, 2.0, 3.0])
    count = torch.tensor(4.0)
    with rank_context(Mesh({"dp": 2}), 0, backend):
        loss = all_reduce((w * w).sum(), "dp", tag=1, lazy=True) / count
    count.fill_(1.0)
    assert loss.item() == 7.0


def test_copies_and_pickles_hold_the_finished_value():
    backend = TwoEqualRanks()
    loss = lazy_mean(backend, torch.tensor([1.0, 2.0, 3.0]))
    assert type(copy.deepcopy(loss)) is torch.Tensor and copy.deepcopy(loss).item() == 7.0
    assert pickle.loads(pickle.dumps(loss)).item() == 7.0
    buf = io.BytesIO()
    torch.save(lazy_mean(backend, torch.tensor([1.0, 2.0, 3.0])), buf)
    buf.seek(0)
    assert torch.load(buf).item() == 7.0


def test_outside_forward_or_on_a_group_of_one_the_sum_is_plain():
    w = torch.tensor([1.0, 2.0, 3.0])
    backend = TwoEqualRanks()
    with rank_context(Mesh({"dp": 1, "tp": 2}), 0, backend):
        one = all_reduce((w * w).sum(), "dp", tag=1, lazy=True)
    assert type(one) is torch.Tensor and one.item() == 14.0 and backend.log == []


def test_a_data_parallel_loss_is_returned_pending_and_trains_exactly():
    """The loss's sum is marked lazy (its reason says so); the token count, which backward
    reads as the divisor, is not. Training matches the single device."""
    model = PosModel()
    plan = plan_for(model, batch())
    lazy = [c for c in plan.collectives if c.why.endswith(LAZY)]
    assert [(c.kind, c.phase, c.bytes) for c in lazy] == [("all_reduce", "forward", 4)]
    assert plan.graph_module.code.count("lazy = True") == 1
    train_matches_single_device(plan, model)


class StackedLoss(nn.Module):
    """The loss is read by an op a pending value cannot replay (a reduction)."""

    def __init__(self):
        super().__init__()
        self.inner = PosModel()

    def forward(self, ids, labels):
        loss = self.inner(ids, labels)
        return loss.expand(3).sum()


def test_a_sum_read_by_an_op_that_cannot_be_replayed_is_waited_for_as_before():
    model = StackedLoss()
    plan = plan_for(model, batch())
    assert "lazy = True" not in plan.graph_module.code
    assert not any(c.why.endswith(LAZY) for c in plan.collectives)
    train_matches_single_device(plan, model)


class ScaledLoss(nn.Module):
    """A loss read through pointwise ops after its reduction (a scale and ``log1p``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 16)

    def forward(self, x, labels):
        loss = F.cross_entropy(self.lin(x).flatten(0, 1), labels.flatten())
        return torch.log1p(loss * 0.5)


def test_a_loss_read_through_pointwise_ops_stays_pending():
    torch.manual_seed(0)
    model = ScaledLoss()
    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(4, 8, 12, generator=g), torch.randint(0, 16, (4, 8), generator=g)) for _ in range(3)]
    plan = autoshard.autoshard(model, steps[0], mesh=Mesh({"dp": 2}), dims={"x": "batch seq hidden",
                               "labels": "batch seq"}, layout={"batch": "dp"}, train=True, zero_stage=0)
    assert plan.graph_module.code.count("lazy = True") == 1
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    losses, params = plan.simulate_train(steps, optimizer=make_opt)
    assert_training_within_spread(losses, params, model, steps, make_opt)  # float32 spread (tests/exactness.py)
