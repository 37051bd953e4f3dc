"""The options of ``autoshard.autoshard`` as typed objects (``autoshard/options.py``): keywords and
objects give the same plan, a keyword and an object that disagree are refused, and every
keyword of ``autoshard()`` is a field of an option object (so the command line, made from those
fields, exposes all of them). Fast: one small model, planned a few times."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import autoshard
from autoshard import Mesh
from autoshard.options import (OPTION_TYPES, ContextOptions, ExpertOptions, Options, PipelineOptions,
                               PrecisionOptions, RecomputeOptions, RewriteOptions, SearchOptions, TrainingOptions,
                               collect)
from examples.models import llama_tiny

# autoshard()'s parameters that are not options: what is planned, where, and how it is reported
NOT_OPTIONS = {"model", "args", "kwargs", "mesh", "dims", "layout", "options", "verbose", "captured"}
DICT_KEYWORDS = {"pipeline": PipelineOptions, "precision": PrecisionOptions, "context": ContextOptions,
                 "moe": ExpertOptions}


def test_every_keyword_is_an_option_field():
    params = inspect.signature(autoshard.autoshard).parameters
    fields = {f.name: cls for cls in OPTION_TYPES for f in dataclasses.fields(cls)}
    for name, p in params.items():
        if name in NOT_OPTIONS:
            continue
        if name in DICT_KEYWORDS:
            assert DICT_KEYWORDS[name] in OPTION_TYPES, name
            continue
        assert name in fields, f"autoshard(..., {name}=) is no field of an option object"
        # the keyword's default is the field's: a keyword left as it is never overrides an object
        f = next(f for f in dataclasses.fields(fields[name]) if f.name == name)
        assert p.default == f.default, name
    for cls in OPTION_TYPES:  # frozen, documented, each field with the doc its flag shows
        assert cls.__dataclass_params__.frozen and "Example::" in cls.__doc__, cls
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), (cls.__name__, f.name)


def test_keywords_and_objects_gather_alike():
    by_keywords = collect((), dict(train=True, zero_stage=3, hardware="h100", strict=True, checkpoint=True,
                                   pipeline={"axis": "pp", "microbatches": 4}, precision={"param": torch.bfloat16},
                                   context={"variant": "ring"}, moe={"capacity_factor": 1.5}))
    by_objects = collect([TrainingOptions(train=True, zero_stage=3), SearchOptions(hardware="h100"),
                          RewriteOptions(strict=True), RecomputeOptions(checkpoint=True),
                          PipelineOptions(axis="pp", microbatches=4), PrecisionOptions(param=torch.bfloat16),
                          ContextOptions(variant="ring"), ExpertOptions(capacity_factor=1.5)])
    assert by_keywords == by_objects
    assert by_objects.training == TrainingOptions(True, 3, None, 25.0, None)
    # an object in place of a dict keyword; the same value on both sides is no conflict
    assert collect((), {"pipeline": PipelineOptions(axis="pp")}) == collect(PipelineOptions(axis="pp"))
    assert collect(TrainingOptions(train=True, bucket_mb=0), {"train": True}).training.bucket_mb == 0
    assert collect(by_objects) == by_objects  # an Options passes through
    assert collect().pipeline is None and collect().precision is None  # absent unless asked for


@pytest.mark.parametrize("options,keywords,message", [
    (TrainingOptions(zero_stage=1), {"zero_stage": 3}, r"zero_stage=3 and TrainingOptions\(zero_stage=1\) disagree"),
    (SearchOptions(hardware="h100"), {"hardware": "cpu-gloo"}, r"hardware='cpu-gloo' and SearchOptions"),
    (PipelineOptions(microbatches=2), {"pipeline": {"microbatches": 4}},
     r"pipeline\['microbatches'\]=4 and PipelineOptions\(microbatches=2\) disagree"),
    ([RewriteOptions(), RewriteOptions(strict=True)], {}, "two RewriteOptions"),
])
def test_conflicts_are_refused(options, keywords, message):
    with pytest.raises(ValueError, match=message):
        collect(options, keywords)


def test_wrong_objects_are_refused():
    with pytest.raises(TypeError, match="options= takes option objects"):
        collect([{"train": True}])
    with pytest.raises(ValueError, match=r"precision= takes 'param', 'reduce', not \['dtype'\]"):
        collect((), {"precision": {"dtype": torch.bfloat16}})


def test_a_plan_from_objects_equals_the_plan_from_keywords():
    model, args, dims = llama_tiny(with_labels=True)
    mesh, layout = Mesh({"dp": 2, "tp": 2}), {"batch": "dp", "heads": "tp", "ffn": "tp"}
    kw = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=layout, train=True, zero_stage=3,
                             bucket_mb=1, hardware="h100", precision={"param": torch.bfloat16,
                                                                      "reduce": torch.float32}, checkpoint=True)
    ob = autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=layout, captured=kw.captured, options=[
        TrainingOptions(train=True, zero_stage=3, bucket_mb=1), SearchOptions(hardware="h100"),
        PrecisionOptions(param=torch.bfloat16, reduce=torch.float32), RecomputeOptions(checkpoint=True)])
    assert ob.options == kw.options and isinstance(ob.options, Options)
    assert str(ob) == str(kw) and ob.checkpoint == kw.checkpoint == ["layers.0", "layers.1"]
    assert ob.cost == kw.cost and ob.reduce_dtype is torch.float32 and ob.cost_model.hardware.name == "h100-sxm-8"
    with pytest.raises(ValueError, match="disagree"):
        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout=layout, zero_stage=1,
                            options=TrainingOptions(train=True, zero_stage=3))


def test_the_options_page_lists_every_field_and_flag():
    from pathlib import Path

    from autoshard.options import option_flag

    page = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    for cls in OPTION_TYPES:
        for f in dataclasses.fields(cls):
            assert f"| `{cls.__name__}.{f.name}` |" in page and f"| `{option_flag(f)}` |" in page, f.name


def test_the_examples_in_the_docstrings_run():
    import doctest

    import autoshard.options as module

    result = doctest.testmod(module)
    assert result.attempted >= 10 and result.failed == 0
