"""run.py --grad-accum K on the simulated mesh (``simulate_run`` loads everything as run.py does):
K accumulated microbatches of a masked-mean loss train exactly like one single-device batch K
times as large, on every ZeRO stage, with padding that gives each microbatch (and each data
rank) another count of valid tokens. The torchrun version: test_gloo_grad_accum.py."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import autoshard
from autoshard.runtime import export as R
from autoshard.passes.export import simulate_run
from autoshard.runtime.execution.checkpoint import read_manifest
from autoshard.runtime.execution.grad_accum import microbatch_weights, split_rows
from examples.models import llama_tiny
from tests.helpers.exactness import assert_training_within_spread, reference_train, within_spread
from tests.helpers.grad_accum import B, K, LR, OPTIMIZERS, S, STEPS, adamw, padded_batch, sgd


def export(tmp_path, mesh, layout, zero_stage):
    model, args, dims = llama_tiny(with_labels=True, batch=B, seq=S)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout, train=True,
                               zero_stage=zero_stage)
    return model, plan.export(tmp_path / "out", args)


def run_accumulated(path, tmp_path, ids, labels, *extra, optimizer="adamw"):
    torch.save([ids, None, labels], tmp_path / "big.pt")
    res = simulate_run(path, "--steps", str(STEPS), "--grad-accum", str(K), "--inputs", str(tmp_path / "big.pt"),
                       *OPTIMIZERS[optimizer][0], "--ckpt", str(tmp_path / "ck"), "--metrics", str(tmp_path / "m.jsonl"),
                       *extra)
    params = autoshard.consolidate(tmp_path / "ck" / f"step-{STEPS:06d}")
    return res, params


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_accumulated_microbatches_train_like_one_big_batch(tmp_path, zero_stage, optimizer):
    model, path = export(tmp_path, {"dp": 2}, {"batch": "dp"}, zero_stage)
    doc = json.loads((path / "plan.json").read_text())
    assert doc["accumulation"] == {"reduction": "count", "normalizer": {"file": "normalizer.py", "inputs": ["labels"]}}
    ids, labels = padded_batch(K * B)
    res, params = run_accumulated(path, tmp_path, ids, labels, optimizer=optimizer)
    losses = res[0]["losses"]
    assert all(r["losses"] == losses for r in res)
    steps = [(ids, None, labels)] * STEPS
    make_opt = OPTIMIZERS[optimizer][1]
    ref32 = reference_train(model, steps, make_opt)
    assert_training_within_spread(losses, params, model, steps, make_opt, reference32=ref32)
    # --metrics records the step's loss (of both microbatches together)
    assert [json.loads(l)["loss"] for l in (tmp_path / "m.jsonl").read_text().splitlines()] == losses
    lines = res[0]["lines"]
    assert any(l.startswith("gradient accumulation: 2 microbatches per optimizer step (--inputs") for l in lines)
    if zero_stage == 0 and optimizer == "adamw":
        # what the test tells apart: two separately normalized means (each microbatch's own count)
        # train differently, far beyond the bound
        halves = [[(ids[:B], None, labels[:B]), (ids[B:], None, labels[B:])]] * STEPS
        means, means_params = reference_train(model, halves, adamw, microbatches=K)
        with pytest.raises(AssertionError, match="beyond the float32 spread bound"):
            assert_training_within_spread(means, means_params, model, steps, adamw, reference32=ref32)


def clipped_train(model, steps, max_norm):
    """Single-device SGD training of a copy of ``model`` with torch's own clipping."""
    m = copy.deepcopy(model)
    opt = sgd(list(m.parameters()))
    losses = []
    for args in steps:
        loss = m(*args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in m.named_parameters()}


def test_accumulation_on_dp_and_tp_with_clipping(tmp_path):
    model, path = export(tmp_path, {"dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"}, 3)
    ids, labels = padded_batch(K * B, seed=11)
    res, params = run_accumulated(path, tmp_path, ids, labels, "--clip-grad-norm", "0.5", optimizer="sgd")
    steps = [(ids, None, labels)] * STEPS
    ref32 = clipped_train(model, steps, 0.5)
    ref64 = clipped_train(copy.deepcopy(model).double(), steps, 0.5)  # integer inputs: nothing to widen
    within_spread(torch.tensor(res[0]["losses"], dtype=torch.float64), torch.tensor(ref32[0]),
                  torch.tensor(ref64[0]), "losses")
    for name, p in ref32[1].items():
        within_spread(params[name], p, ref64[1][name], name)


def test_data_reads_k_consecutive_batches(tmp_path):
    """With --data a step reads the next K planned batches: 2 steps of K=2 read what 4 steps
    of K=1 read, and the step's loss is the mean over its K batches (no padding: equal counts)."""
    model, path = export(tmp_path, {"dp": 2}, {"batch": "dp"}, 1)
    tokens = torch.randint(0, 64, (B * S * 4,), generator=torch.Generator().manual_seed(2))
    tokens.numpy().astype(np.uint16).tofile(tmp_path / "tokens.bin")
    res = simulate_run(path, "--steps", "2", "--grad-accum", "2", "--data", str(tmp_path / "tokens.bin"),
                       "--lr", str(LR), "--ckpt", str(tmp_path / "ck"))
    params = autoshard.consolidate(tmp_path / "ck" / "step-000002")
    big = [tokens[k * 2 * B * S:(k + 1) * 2 * B * S].view(2 * B, S) for k in range(2)]
    steps = [(ids, None, ids) for ids in big]
    assert_training_within_spread(res[0]["losses"], params, model, steps, adamw)
    extra = read_manifest(tmp_path / "ck" / "step-000002")["extra"]
    assert (extra["data_position"], extra["grad_accum"]) == (4 * B * S, 2)
    # resumed after step 1, step 2 reads the same two batches: bit for bit
    data = ["--data", str(tmp_path / "tokens.bin"), "--lr", str(LR)]
    simulate_run(path, "--steps", "1", "--total-steps", "2", "--grad-accum", "2", "--ckpt", str(tmp_path / "c1"), *data)
    again = simulate_run(path, "--steps", "1", "--grad-accum", "2", "--resume", str(tmp_path / "c1"), *data)[0]
    assert again["losses"] == res[0]["losses"][1:]
    other = simulate_run(path, "--steps", "1", "--resume", str(tmp_path / "c1"), *data)[0]["lines"]
    assert "warning: --resume: " in other[0] and "took 2 planned batches per optimizer step; this one takes 1" in other[0]


def test_saved_and_synthetic_inputs(tmp_path):
    """The saved inputs taken K times train as the saved batch alone (the same gradient);
    --synthetic draws K batches with seeds --seed, --seed + 1."""
    model, path = export(tmp_path, {"dp": 2}, {"batch": "dp"}, 0)
    once = simulate_run(path, "--steps", "2", "--lr", str(LR), "--metrics", str(tmp_path / "a.jsonl"))[0]["losses"]
    twice = simulate_run(path, "--steps", "2", "--grad-accum", "2", "--lr", str(LR))[0]
    assert twice["losses"] == pytest.approx(once, rel=1e-5)
    assert any("(the saved inputs, 2 times)" in l for l in twice["lines"])
    syn = simulate_run(path, "--steps", "1", "--grad-accum", "2", "--synthetic", "--seed", "4", "--lr", str(LR))[0]
    doc = R.read_plan(path)
    parts = [R.load_inputs(path, doc, synthetic=True, seed=s) for s in (4, 5)]
    single = [simulate_run(path, "--steps", "1", "--synthetic", "--seed", str(s), "--lr", str(LR),
                           "--metrics", str(tmp_path / f"s{s}.jsonl"))[0]["losses"][0] for s in (4, 5)]
    assert not torch.equal(parts[0][0], parts[1][0])
    # the llama's labels are its ids (no padding): equal counts, the step's loss is the mean
    assert syn["losses"][0] == pytest.approx(sum(single) / 2, rel=1e-5)


def test_refusals(tmp_path):
    model, path = export(tmp_path, {"dp": 2}, {"batch": "dp"}, 0)
    ids, labels = padded_batch(B + 1)
    torch.save([ids, None, labels], tmp_path / "odd.pt")
    with pytest.raises(R.RunError, match=r"input input_ids has 5 rows; --grad-accum 2 needs 2 x the planned 4 = 8"):
        simulate_run(path, "--steps", "1", "--grad-accum", "2", "--inputs", str(tmp_path / "odd.pt"))
    with pytest.raises(R.RunError, match="--grad-accum must be >= 1"):
        simulate_run(path, "--steps", "1", "--grad-accum", "0")
    doc = json.loads((path / "plan.json").read_text())
    doc["accumulation"]["reduction"] = None
    (path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(R.RunError, match="does not end in a sum, a mean or a masked mean"):
        simulate_run(path, "--steps", "1", "--grad-accum", "2")


def test_weights_and_split():
    assert microbatch_weights("count", 2, [torch.tensor(3), torch.tensor(1)]) == [0.75, 0.25]
    assert microbatch_weights("mean", 4) == [0.25] * 4
    assert microbatch_weights("sum", 2) == [1.0, 1.0]
    x = torch.arange(12).view(6, 2)
    parts = split_rows([x, None, torch.tensor(2.0)], 3)
    assert [p[0].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert all(p[1] is None and float(p[2]) == 2.0 for p in parts)
    with pytest.raises(ValueError, match="input 0 has 6 rows, which do not split into 4 microbatches"):
        split_rows([x], 4)


class _Tail(torch.nn.Module):
    """A linear layer whose loss ends in ``tail`` (a reduction of its [batch, 4] output)."""

    def __init__(self, tail):
        super().__init__()
        self.lin, self.tail = torch.nn.Linear(4, 4), tail

    def forward(self, x):
        return self.tail(self.lin(x))


@pytest.mark.parametrize("tail, want", [
    (lambda y: y.sum(), "sum"),
    (lambda y: (y ** 2).mean(), "mean"),
    (lambda y: torch.nn.functional.mse_loss(y, torch.zeros_like(y)), "mean"),
    (lambda y: y.mean() * 3.0, None),          # a scale after the mean: it may be the batch size
    (lambda y: torch.log(y.exp().sum()), None),  # not linear in the microbatches' losses
])
def test_loss_reductions_read_at_export(tail, want):
    from autoshard.passes.loss_count import loss_accumulation
    model = _Tail(tail)
    x = torch.randn(4, 4)
    plan = autoshard.autoshard(model, (x,), mesh=autoshard.Mesh({"dp": 2}), dims={"x": "batch in"},
                               layout={"batch": "dp"}, train=True)
    acc = loss_accumulation(plan.program, plan.captured.inputs, plan.loss_index())
    assert (acc.reduction, acc.normalizer) == (want, None)


def test_a_plain_mean_loss_averages_the_microbatches(tmp_path):
    model = _Tail(lambda y: torch.nn.functional.mse_loss(y, torch.ones_like(y)))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    plan = autoshard.autoshard(model, (x,), mesh=autoshard.Mesh({"dp": 2}), dims={"x": "batch in"},
                               layout={"batch": "dp"}, train=True, zero_stage=1)
    path = plan.export(tmp_path / "out", (x,))
    big = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    torch.save([big], tmp_path / "big.pt")
    res = simulate_run(path, "--steps", "3", "--grad-accum", "2", "--inputs", str(tmp_path / "big.pt"),
                       "--lr", str(LR), "--ckpt", str(tmp_path / "ck"))
    params = autoshard.consolidate(tmp_path / "ck" / "step-000003")
    assert_training_within_spread(res[0]["losses"], params, model, [(big,)] * 3, adamw)


@pytest.mark.parametrize("mesh, schedule", [({"pp": 2, "dp": 2}, "1f1b"), ({"pp": 2}, "zero_bubble")])
def test_pipelined_export_runs_its_schedule_k_times(tmp_path, mesh, schedule):
    """2 microbatches per schedule, tied embeddings (their gradient summed across the pipeline
    once, after the last pass: on pp=2 alone, where nothing defers it, summing after every pass
    counts the first pass twice): K=2 passes train like the 8-row batch at once."""
    model, args, dims = llama_tiny(with_labels=True, batch=B, seq=S, tie_embeddings=True)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(mesh), dims=dims,
                               layout={"batch": "dp" if "dp" in mesh else None}, train=True,
                               pipeline={"microbatches": 2, "schedule": schedule})
    path = plan.export(tmp_path / "out", args)
    ids, labels = padded_batch(K * B, seed=3)
    res, params = run_accumulated(path, tmp_path, ids, labels, optimizer="sgd")
    assert all(r["losses"] == res[0]["losses"] for r in res)
    assert_training_within_spread(res[0]["losses"], params, model, [(ids, None, labels)] * STEPS, sgd)
