"""Pipeline timelines: the predicted schedule of a plan (cost-model stage times run through its
action lists) reproduces the seeds' bubble figures, and the measured trace of a step records
every action of every rank in dependency order."""
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.cost.pipeline import bubble, schedule_timeline
from autoshard.runtime.execution.schedules import dependencies, make_schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pipeline import masked_batch, pipeline_plan  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Balanced(torch.nn.Module):
    """Identical blocks, nothing before or after them: equal stages."""

    def __init__(self, n, d=32):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()  # a scalar loss (training refuses another, as loss.backward() does)


def balanced_plan(pp, m, schedule, virtual=1):
    model = Balanced(pp * virtual)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # identical blocks in a ModuleList also look like experts
        return autoshard.autoshard(model, (torch.randn(2 * m, 32),), mesh=Mesh({"pp": pp}), dims={}, layout={},
                                   train=True, pipeline={"microbatches": m, "schedule": schedule, "virtual": virtual})


def gpipe_bubble(times, m):
    """GPipe's idle fraction with free transfers for stage times (f, b, w) per stage: the last
    microbatch's forward ends after every stage's forward and M - 1 of the slowest one's, and
    backward likewise. With K equal stages it is the seeds' (K-1)/(M+K-1)."""
    fw, bw = [t[0] for t in times], [t[1] + t[2] for t in times]
    span = sum(fw) + (m - 1) * max(fw) + sum(bw) + (m - 1) * max(bw)
    return 1 - m * (sum(fw) + sum(bw)) / (len(times) * span), span


@pytest.mark.parametrize("k,m,expected", [(4, 8, 3 / 11), (4, 32, 3 / 35), (2, 16, 1 / 17)])
def test_gpipe_bubble_of_the_predicted_timeline_is_the_seeds(k, m, expected):
    """Seed 000/003: GPipe's idle fraction (K-1)/(M+K-1) with equal stages and free transfers;
    the toy's stages are equal but for its scalar loss on the last one, so the timeline has the
    bubble of those stage times, which the loss can only lengthen past the seeds'."""
    plan = balanced_plan(k, m, "gpipe")
    times = plan.stage_times()
    assert len(set(times[:-1])) == 1 and times[0][0] > 0  # the blocks' stages are equal
    assert gpipe_bubble([times[0]] * k, m)[0] == pytest.approx(expected, rel=1e-9)  # the seeds' formula
    tl = plan.predicted_timeline(transfers=False)
    general, span = gpipe_bubble(times, m)
    assert bubble(tl) == pytest.approx(general, rel=0.01) and general >= expected
    makespan = max(e for row in tl.values() for _, _, e in row)
    assert makespan == pytest.approx(span, rel=1e-9)


def test_interleaving_halves_and_zero_bubble_shrinks_the_bubble():
    one = bubble(balanced_plan(4, 8, "1f1b").predicted_timeline(transfers=False))
    inter = bubble(balanced_plan(4, 8, "interleaved", virtual=2).predicted_timeline(transfers=False))
    zb = bubble(balanced_plan(4, 8, "zero_bubble").predicted_timeline(transfers=False))
    assert one >= 3 / 11  # the seeds' 1F1B bubble, lengthened by the last stage's loss
    # idle time relative to work: (K-1)/M for 1F1B, (K-1)/(vM) interleaved (Megatron's paper)
    overhead = lambda b: b / (1 - b)  # noqa: E731
    assert overhead(inter) == pytest.approx(overhead(one) / 2, rel=0.01)
    assert zb < one / 2  # ZB-H1 with F = B = W: about a third of 1F1B's bubble


def test_transfers_lengthen_the_predicted_step():
    u = {"F": 1.0, "B": 1.0, "W": 1.0}
    sched = make_schedule("1f1b", 2, 4)
    free = schedule_timeline(sched, u)
    slow = schedule_timeline(sched, u, transfer=0.5)
    end = lambda tl: max(e for row in tl.values() for _, _, e in row)  # noqa: E731
    # free: (M + K - 1) * (F + B) = 5 * 3. With 0.5 per hop, by hand: rank 1 runs F0 at 1.5,
    # B0 2.5-4.5; rank 0's B0 5-7, F2 7-8; rank 1 F1 4.5, B1 5.5-7.5; rank 0 B1 8-10, F3 10-11;
    # rank 1 F2 8.5, B2 9.5-11.5; rank 0 B2 12-14; rank 1 F3 11.5, B3 12.5-14.5; rank 0 B3 15-17
    assert end(free) == 3 * 5 and end(slow) == pytest.approx(17.0)


def test_predicted_and_measured_traces(tmp_path):
    model, args, dims = masked_batch(batch=8, layers=4)
    m = 4
    plan = pipeline_plan(model, args, dims, "pp2xdp2", "zero_bubble", m)
    with pytest.raises(ValueError, match="needs a step first"):
        plan.timeline(tmp_path / "t.json", measured=True)
    plan.simulate_grads(*args)
    written = plan.timeline(tmp_path / "t.json", measured=True)
    assert written == {"predicted": str(tmp_path / "t.predicted.json"), "measured": str(tmp_path / "t.json")}

    pred = json.loads(Path(written["predicted"]).read_text())["traceEvents"]
    assert sorted({e["tid"] for e in pred}) == [0, 1]  # one row per pipeline rank

    events = json.loads(Path(written["measured"]).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert sorted(names) == [0, 1, 2, 3] and names[2] == "rank 2 (pp 1)"  # one row per rank
    acts = [e for e in events if e["ph"] == "X"]
    span = {}
    for rank in range(4):
        mine = [e for e in acts if e["tid"] == rank]
        stage = plan.mesh.coords(rank)["pp"]
        # every F, B and W of every microbatch of its stage, in the schedule's order, one after another
        assert [(e["args"]["kind"], e["args"]["mb"], e["args"]["stage"]) for e in mine] == \
            [tuple(a) for a in plan.schedule[stage]]
        assert len(mine) == 3 * m
        assert all(x["ts"] + x["dur"] <= y["ts"] + 1e-3 for x, y in zip(mine, mine[1:]))
        for e in mine:
            span[(rank, e["args"]["kind"], e["args"]["mb"], e["args"]["stage"])] = (e["ts"], e["ts"] + e["dur"])
    # across ranks: an action cannot finish before the action it waits for (on a peer of the
    # same data rank) has started
    for (rank, kind, mb, stage), (start, end) in span.items():
        a = plan.schedule[stage][0]._replace(kind=kind, mb=mb, stage=stage)
        for d in dependencies(a, 2, True):
            peer = plan.mesh.rank_of({**plan.mesh.coords(rank), "pp": d.stage})
            assert span[(peer, d.kind, d.mb, d.stage)][0] <= end
