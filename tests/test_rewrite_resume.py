"""One-axis rewrites resumed from another option's saved state (passes/rewrite_state.py).

The search takes an axis's options in the order of the nodes where their units start to decide
(``cost.lazy_search.reach_order``) and starts each rewrite from the latest state saved by the
rewrite before it up to which their units decide alike (``cost.prefix_records.ResumePath``).
A resumed rewrite must give exactly the program a rewrite from the first node gives: the same
collectives (kind, bytes, phase, reason, tag), placements of every value, inputs' placements
where stored and where used, and placeholders. Checked on every option of a Mixture-of-Experts
decoder and an encoder-decoder (soft entries and context-parallel attention among the options),
rewritten whole; the budgeted rewrites are checked in ``tests/test_prefix_records.py``.
"""
import math
import warnings

import pytest

from tests.helpers.search_cases import hf_planned


def _program(p):
    return (p.collectives, p.placements, p.input_placements, p.output_placements, p.use_placements, p.placeholders)


@pytest.mark.parametrize("arch,axes", [("qwen2_moe", {"tp": 4}), ("whisper", {"dp": 2, "tp": 2})])
def test_resumed_rewrites_equal_rewrites_from_the_start(monkeypatch, arch, axes):
    import autoshard.cost.search as S
    from autoshard.cost.lazy_search import warm_records
    from autoshard.passes.spmd import lazy_programs, unchanged_graphs

    plan, space = hf_planned(arch, axes)
    real, seen = S.rewrite, {"resumed": 0, "skipped": 0, "visited": 0}

    def both(graph, *a, **k):
        got = real(graph, *a, **k)
        state = k.get("resume")
        if state is not None:
            scratch = real(graph, *a, **{**k, "resume": None, "checkpoints": None, "collectives": []})
            assert _program(got) == _program(scratch)
            seen["resumed"] += 1
            seen["skipped"] += state.position
        seen["visited"] += len(graph.nodes)
        return got

    monkeypatch.setattr(S, "rewrite", both)
    space.records_budget = None  # every rewrite whole
    with warnings.catch_warnings(), unchanged_graphs(), lazy_programs():
        warnings.simplefilter("ignore")
        warm_records(space)
    # most rewrites resumed, and not from their first nodes only
    assert seen["resumed"] >= 20 and seen["skipped"] >= 0.2 * seen["visited"], seen


def test_resume_refused_where_nodes_do_not_decide_alone():
    """Only a rewrite building no graph, of a layout each of whose nodes decides from its own
    values' units, is saved or resumed: elsewhere ``rewrite`` refuses, naming why."""
    from autoshard import Mesh
    from autoshard.passes.rewrite_state import Checkpoints
    from autoshard.passes.spmd import rewrite

    plan, space = hf_planned("llama", {"tp": 4})
    r = space.reduced
    graph, info = (r.graph, r.info) if r is not None else (space.graph, space.info)
    opts = space.per_axis_options()[0]
    resolved = space._resolved1("tp", next(o.pair[1] for o in opts if o.count))
    marks = Checkpoints(frozenset({1}), lambda s: None)
    with pytest.raises(ValueError, match="building no graph"):
        rewrite(graph, info, resolved, Mesh({"axis": 4}), set(), checkpoints=marks)


def test_resume_path_skips_states_past_the_budget():
    """A saved state whose collectives already cost the budget is not resumed from (a rewrite
    of the new units would have stopped before it); an earlier one on the path is."""
    from autoshard.cost.prefix_records import ResumePath
    from autoshard.passes.rewrite_state import RewriteState

    first = {("a",): 2, ("b",): 5, ("c",): 9}
    path = ResumePath(first, [2, 5, 9])
    state, marks = path.start(((("a",), ("b",), ("c",)), ()))
    assert state is None and marks.positions == frozenset({2, 5, 9})

    def saved(position, collectives):
        return RewriteState(position, {}, {}, tuple(collectives), 0, ([], [], {}))

    for position, colls in ((5, ["x"]), (9, ["x", "y"])):
        marks.take(saved(position, colls))
    # units deciding as the first before node 9 ((a), (b)), then (d) at node 9 instead of (c)
    first[("d",)] = 9
    cost = len  # one second a collective
    got, _ = path.start(((("a",), ("b",), ("d",)), ()), cost, budget=3)
    assert got.position == 9
    got, _ = path.start(((("a",), ("b",), ("d",)), ()), cost, budget=2)
    assert got.position == 5  # (node 9's state holds 2 s of collectives: the budget)
    got, _ = path.start(((("a",), ("b",), ("d",)), ()), cost, budget=1)
    assert got is None
    # units deciding as the first before node 5 only ((e) never decides, (b) does at node 5):
    # node 5's state, saved before node 5 is visited, is theirs too
    got, _ = path.start(((("a",), ("e",)), ()), cost, budget=math.inf)
    assert got.position == 5
    # units deciding otherwise from node 2 on: no state of the path is theirs
    got, _ = path.start(((("c",),), ()), cost, budget=math.inf)
    assert got is None


def test_every_table_a_rewrite_adds_to_is_saved():
    """A rewrite's tables that grow while it visits nodes are the ones a saved state copies
    (``rewrite_state.TABLES``, the hooks' memos and the collectives), or memos of the layout's
    units, which a resuming rewrite of another layout derives afresh: a table added to the
    rewriter later and not saved would make resumed rewrites read another layout's entries."""
    from autoshard import Mesh
    from autoshard.passes import spmd
    from autoshard.passes.rewrite_state import TABLES

    plan, space = hf_planned("qwen2_moe", {"tp": 4})
    r = space.reduced
    graph, info = (r.graph, r.info) if r is not None else (space.graph, space.info)
    grew = set()
    for opt in space.per_axis_options()[0][1:40]:
        try:
            resolved = space._resolved1("tp", opt.pair[1])
        except Exception:  # noqa: BLE001 - an option that does not resolve has no rewrite
            continue
        rg = spmd.requires_grad_nodes(graph, {i.name for i in space.inputs if i.kind == "parameter"})
        rw = spmd._Rewriter(graph, info, resolved, Mesh({"axis": 4}), rg, {}, {}, collectives_only=True)
        before = {k: len(v) for k, v in vars(rw).items() if isinstance(v, (dict, set, list))}
        try:
            rw.run()
        except spmd.LayoutError:
            pass
        grew |= {k for k, n in before.items() if len(getattr(rw, k)) > n}
    assert {"local", "place", "collectives"} <= grew  # (the rewrites ran)
    assert grew <= set(TABLES) | {"hook_state", "collectives", "unit_memo", "unit_index"}, grew
