"""The search's budgeted one-axis rewrites: what they skip, and what they share.

- A rewrite that builds no graph records the nodes before its layout's first touch, and the
  inputs no unit splits, as whole without deciding each (passes/untouched.py). Every one-axis
  rewrite of a search, at a budget or whole, must emit exactly the collectives of the full
  rewrite (which decides every node and builds the graph): all of them when it runs to the end,
  their first ones when the budget stops it; with the same placements when it ends. That holds
  too for the rewrites resumed from another option's saved state (passes/rewrite_state.py).
- An option whose units decide the same as another's up to the node where that one's budgeted
  rewrite stopped takes its records (cost/prefix_records.py): they must equal the records of
  its own budgeted rewrite.
- Every rewrite takes an op whose operands are whole and whose results no axis splits without
  deciding it axis by axis: the programs must be the same as with every op decided.

On an encoder-decoder (soft entries, context-parallel attention among the options) and a
Mixture-of-Experts decoder, with only the inputs named, at the search's own budget (and one model at
ten times it).
"""
import warnings

import pytest

import autoshard
from autoshard.cost import load_hardware
from autoshard.cost.model import CostModel

from tests.helpers.search_cases import hf_planned

WHISPER, QWEN2_MOE = ("whisper", {"tp": 4}), ("qwen2_moe", {"dp": 2, "tp": 2})
# (budget factor, arch, axes): each model at the search's own budget, and one of them at ten
# times it (where rewrites run further before they stop), for each check
BUDGETED = [(1, *WHISPER), (1, *QWEN2_MOE), (10, *WHISPER)]
# (Qwen2-MoE's one-axis rewrites run whole at ten times its budget: nothing to share there)
SHARED = [(1, *WHISPER), (1, *QWEN2_MOE), (10, *WHISPER)]


def _budget(plan, space, factor):
    from autoshard.cost.lazy_search import floors
    costs = sorted(e.cost.step_time for e in [plan.search.best] + plan.search.alternatives)
    return factor * (costs[-1] - sum(floors(space)))


@pytest.mark.parametrize("factor,arch,axes", BUDGETED)
def test_budgeted_rewrites_emit_the_full_rewrites_collectives(monkeypatch, factor, arch, axes):
    import autoshard.cost.search as S
    from autoshard.cost.lazy_search import warm_records
    from autoshard.passes.spmd import lazy_programs, unchanged_graphs

    plan, space = hf_planned(arch, axes)
    real, seen = S.rewrite, {"stopped": 0, "whole": 0, "resumed": 0}

    def both(*a, **k):
        full = real(*a, **{**k, "collectives_only": False, "collectives": None, "stopped": None, "resume": None,
                           "checkpoints": None})
        seen["resumed"] += k.get("resume") is not None
        emitted = k["collectives"]
        try:
            got = real(*a, **k)
        except S._OverBudget:
            assert list(emitted) == full.collectives[:len(emitted)]
            assert len(emitted) <= len(full.collectives)
            seen["stopped"] += 1
            raise
        assert got.collectives == full.collectives
        assert (got.placements, got.input_placements, got.output_placements) == (
            full.placements, full.input_placements, full.output_placements)
        seen["whole"] += 1
        return got

    monkeypatch.setattr(S, "rewrite", both)
    space.records_budget = _budget(plan, space, factor)
    with warnings.catch_warnings(), unchanged_graphs(), lazy_programs():
        warnings.simplefilter("ignore")
        warm_records(space)
    # both kinds met, many times (the budgets are the search's own, not ones that stop nothing),
    # and rewrites resumed from another option's saved state among them (passes/rewrite_state.py)
    assert seen["stopped"] >= 5 and seen["whole"] >= 1 and seen["resumed"] >= 5, seen


@pytest.mark.parametrize("factor,arch,axes", SHARED)
def test_shared_records_equal_the_options_own(factor, arch, axes):
    from autoshard.cost.lazy_search import by_count
    from autoshard.passes.spmd import lazy_programs, unchanged_graphs

    plan, space = hf_planned(arch, axes)
    space.records_budget = _budget(plan, space, factor)
    shared = []
    with warnings.catch_warnings(), unchanged_graphs(), lazy_programs():
        warnings.simplefilter("ignore")
        for axis, opts in zip(space.mesh.names, space.per_axis_options()):
            if space.mesh.axes[axis] == 1:
                continue
            for i in by_count(opts):
                before = space.rewrites
                got = space._axis_records(axis, opts[i].pair[1])
                if space.rewrites == before and got is not None and got[3] is not None and got[3][0] is space:
                    shared.append((axis, opts[i].pair[1], got))

        class NoSharing:  # every option rewrites its own
            def find(self, units, budget):
                return None

            def add(self, *a):
                pass

        space._prefix = NoSharing()
        keys = set()
        for axis, names, got in shared:
            key = space._records_key(axis, names)
            if key in keys:
                continue
            keys.add(key)
            space._shared.pop(key)
            own = space._axis_records(axis, names, got[3][1])
            assert own is not None and own[3] is not None, sorted(names)
            assert own[:3] == got[:3], sorted(names)
    assert len(keys) >= 5  # (not vacuous: options did share)


@pytest.mark.parametrize("case", ["llama-dp2tp2", "gpt-inputs-tp4-train"])
def test_ops_computed_whole_are_rewritten_as_when_decided_one_by_one(monkeypatch, case):
    """The rewrite takes an op whose operands are all whole and whose results no axis splits
    without choosing its modes and converting each operand (``_Rewriter.computed_whole``): the
    programs built for the search's candidates (every ZeRO stage, gradient buckets, soft
    entries) are the same, code, collectives and placements, as with every op decided."""
    from autoshard.cost.search import SearchSpace
    from autoshard.passes import spmd

    from tests.helpers.search_cases import STRUCTURED, prepared

    spec, mesh, hw, _ = STRUCTURED[case]()
    cap, info = prepared(*spec)
    space = SearchSpace(cap.graph, cap.inputs, info, mesh, CostModel(load_hardware(hw)), train=True)
    cands = space.space()
    step = max(1, len(cands) // 40)
    whole = spmd._Rewriter.computed_whole
    taken = {"whole": 0}

    def counted(self, node, ix):
        got = whole(self, node, ix)
        taken["whole"] += got
        return got

    built = 0
    for c in cands[::step]:
        programs = []
        for fn in (counted, lambda self, node, ix: False):
            monkeypatch.setattr(spmd._Rewriter, "computed_whole", fn)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    p, _ = space._build(cap.graph, cap.inputs, info, c.layout(space.names, space.extra),
                                        c.zero_stage, c.reshard)
            except autoshard.LayoutError as e:
                p = str(e)
            programs.append(p)
        fast, slow = programs
        if isinstance(fast, str) or isinstance(slow, str):
            assert fast == slow, c.describe()
            continue
        assert fast.graph_module.code == slow.graph_module.code, c.describe()
        assert fast.collectives == slow.collectives, c.describe()
        assert (fast.placements, fast.input_placements, fast.output_placements) == (
            slow.placements, slow.input_placements, slow.output_placements), c.describe()
        built += 1
    assert built >= 10 and taken["whole"] > 100, (built, taken)
