"""Data-parallel gradient sync of replicated regions (passes/grad_regions.py) and forward sums
started early (passes/early_sums.py): fewer synchronous collectives, the same training."""

import pytest
import torch


from tests.helpers.pos_model import PosModel, batch, plan_for, train_matches_single_device


def bucketed(plan) -> set:
    names = {i.name: i.target for i in plan.captured.inputs}
    return {names[n] for _, ns in plan.program.buckets for n in ns}


def syncs_on_dp(plan) -> list:
    return [c for c in plan.collectives if c.op == "mark_varying" and c.axes == ("dp",)]


@pytest.mark.parametrize("bucket_mb", [25.0, 1e-4], ids=["one-bucket", "per-param"])
def test_position_table_is_summed_in_the_buckets(bucket_mb):
    model = PosModel()
    plan = plan_for(model, batch(), bucket_mb=bucket_mb)
    # every parameter, including the ones only replicated work reads, is in a bucket; no
    # synchronous gradient sum is left in the program
    assert bucketed(plan) == {n for n, _ in model.named_parameters()}
    assert syncs_on_dp(plan) == []
    assert "mark_varying" not in plan.graph_module.code
    train_matches_single_device(plan, model)


def test_buckets_of_a_region_under_gradient_accumulation():
    model = PosModel()
    ids, labels = batch()
    plan = plan_for(model, (ids[0::2], labels[0::2]))
    assert syncs_on_dp(plan) == []
    train_matches_single_device(plan, model, microbatches=2)


def test_region_with_a_whole_gradient_keeps_its_sum():
    """The auxiliary term reads the replicated value outside per-rank work: its gradient is the
    same on every rank, so summing it in a bucket would count it twice. The region (position
    table and scale, linked through their product) keeps its synchronous sum."""
    model = PosModel(aux=True)
    plan = plan_for(model, batch())
    assert {"pos.weight", "scale"}.isdisjoint(bucketed(plan))
    assert {"tok.weight", "out.weight", "out.bias"} <= bucketed(plan)
    assert syncs_on_dp(plan)
    train_matches_single_device(plan, model)


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("aux", [False, True], ids=["shares", "whole"])
def test_sharded_state_counts_a_replicated_read_once(zero_stage, aux, microbatches):
    """Sharded parameters read by replicated work (the position table at ``arange(seq)``, the
    scale in that product): their gradient is summed once over the data axis. Under ZeRO-2 the
    persistent full copy is reduce-scattered in backward; a whole gradient entering it from
    every rank was once added twice (the losses of steps 2 and 3 were off by 2e-4). Where every
    gradient reaching the region is a per-rank share, its sum moves into the reduce-scatters
    (ZeRO-3: the position table joins a unit), and no synchronous sum is left; where one comes
    in whole (``aux``), the region keeps its sum and rank 0 alone carries the whole gradient."""
    model = PosModel(aux=aux)
    ids, labels = batch()
    plan = plan_for(model, (ids[::microbatches], labels[::microbatches]), zero_stage=zero_stage)
    code = plan.graph_module.code
    assert bool(syncs_on_dp(plan)) == aux
    if zero_stage == 2:
        assert [c for c in plan.collectives if c.op == "replicated_use"] == []  # it zeroes, sends nothing
        assert code.count("replicated_use(") == (2 if aux else 0)  # pos.weight and scale
    if zero_stage == 3 and not aux:
        assert "all_gather(" not in code  # every shard gathered as a per-rank share, in units
        assert any("pos.weight" in c.params for c in plan.collectives if c.op == "gather_unit")
    train_matches_single_device(plan, model, microbatches=microbatches)


def test_token_count_is_summed_before_the_model_runs():
    """The mean's token count depends on the labels alone: its all-reduce starts before the
    first op of the model, the loss's sum still ends forward; the loss is exact although the
    ranks count different numbers of tokens."""
    model = PosModel()
    plan = plan_for(model, batch())
    code = plan.graph_module.code
    assert code.index("start_all_reduce") < code.index("embedding")
    forward_sums = [c for c in plan.collectives if c.phase == "forward" and c.kind == "all_reduce"]
    assert len(forward_sums) == 2  # still listed, with their reasons; the count's says it starts early
    assert [c.bytes for c in forward_sums if "started as soon as its inputs exist" in c.why] == [8]
    train_matches_single_device(plan, model)
    trace = plan.last_trace[0]
    fwd = [r for r in trace if r.phase == "forward"]
    assert [r.dtype for r in fwd[:2]] == [torch.int64, torch.float32]
