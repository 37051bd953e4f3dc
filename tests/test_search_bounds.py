"""The search's pruning bounds are lower bounds on the evaluated cost of every candidate.

The branch and bound (``cost.search``) is exact only if no bound exceeds the cost it bounds.
Checked for every candidate (every ZeRO stage) of small training programs, random hardware and
random residual stacks from ``test_search_exhaustive`` included: the communication-stream bound
(``optimizer_bound + stream_bound``) and the partial communication bound from the axes whose
one-axis records are known. The stream bound adds to ``comm_bound`` the gradient syncs and
ZeRO-3 gathers: those alone (with the optimizer) must bound every candidate, and the whole bound
every candidate that the sequential bound (compute + optimizer + ``comm_bound``) bounds. (That
one exceeds the cost of ``dp: seq, tp: hidden`` on the dp=2 x tp=2 Llama by 2.4%:
``comm_bound`` counts more tp all-reduce time than the plan has; an open issue of that bound.)
"""

import pytest

import autoshard
from autoshard.cost import load_hardware
from autoshard.cost.model import CostModel
from autoshard.cost.search import SearchSpace

from tests.helpers.search_cases import STRUCTURED, prepared, random_case

# training cases of random_case with small spaces (1- and 2-axis meshes, overlap on and off)
SEEDS = [0, 1, 3, 4, 9, 20, 29]


def _check_space(space):
    checked = 0
    for c in space.space()[::3]:
        try:
            cost = space.evaluate(c).step_time
            partial, _ = space.cached_comm_bound(c)
            comm = space.comm_bound(c)
            sequential = space.compute_bound(c) + space.optimizer_bound(c) + comm
            stream = space.optimizer_bound(c) + space.stream_bound(c)
            added = space.optimizer_bound(c) + space.stream_bound(c, 0.0)
        except autoshard.LayoutError:
            continue
        tol = cost * 1e-9 + 1e-15
        assert partial <= comm + tol, c.describe()
        assert added <= cost + tol, (c.describe(), added, cost)
        if sequential <= cost + tol:
            assert stream <= cost + tol, (c.describe(), stream, cost)
        checked += 1
    assert checked


@pytest.mark.parametrize("seed", SEEDS)
def test_bounds_on_random_training_programs(seed):
    model, args, dims, mesh, cm, train, _ = random_case(seed)
    assert train
    cap, info = prepared(model, args, dims)
    _check_space(SearchSpace(cap.graph, cap.inputs, info, mesh, cm, train=True))


@pytest.mark.parametrize("name", ["llama-tp4-train", "llama5-tp2-train"])
def test_bounds_on_structured_training_programs(name):
    (model, args, dims), mesh, hw, train = STRUCTURED[name]()
    cap, info = prepared(model, args, dims)
    _check_space(SearchSpace(cap.graph, cap.inputs, info, mesh, CostModel(load_hardware(hw)), train=True))


def test_bounds_on_llama_dp2xtp2_training():
    (model, args, dims), _, _, _ = STRUCTURED["llama-dp2tp2"]()
    cap, info = prepared(model, args, dims)
    _check_space(SearchSpace(cap.graph, cap.inputs, info, autoshard.Mesh({"dp": 2, "tp": 2}),
                             CostModel(load_hardware("h100")), train=True))


@pytest.mark.parametrize("case", ["llama-mask-cp2", "llama-dp2xtp2"])
def test_one_axis_programs_without_graph_equal_the_whole_rewrite(monkeypatch, case):
    """The communication bounds' one-axis programs are rewritten without building their graph
    (``rewrite(collectives_only=True)``): their collectives and placements must be exactly those
    of the full rewrite, for every axis option of the space (soft entries, context parallelism)."""
    import autoshard.cost.search as S
    from autoshard import Mesh
    from examples.models import llama_tiny

    real, compared = S.rewrite, []

    def both(*a, **k):
        got = real(*a, **k)
        if k.get("collectives_only"):
            # its own list, and every node visited (a one-axis rewrite may resume from a saved state)
            full = real(*a, **{**k, "collectives_only": False, "collectives": None, "resume": None,
                               "checkpoints": None})
            assert got.graph_module is None and full.graph_module is not None
            assert got.collectives == full.collectives
            assert (got.placements, got.input_placements, got.output_placements) == (
                full.placements, full.input_placements, full.output_placements)
            compared.append(sorted({c.op for c in got.collectives}))
        return got

    monkeypatch.setattr(S, "rewrite", both)
    if case == "llama-mask-cp2":
        (model, args, dims), mesh = llama_tiny(with_mask=True, with_labels=True, seq=16), Mesh({"cp": 2})
    else:
        (model, args, dims), mesh = llama_tiny(with_labels=True), Mesh({"dp": 2, "tp": 2})
    cap, info = prepared(model, args, dims)
    space = SearchSpace(cap.graph, cap.inputs, info, mesh, CostModel(load_hardware("h100")), train=True)
    for c in space.space():
        try:
            space.comm_bound(c)
            space.stream_bound(c)
        except autoshard.LayoutError:
            continue
    assert len(compared) >= 3 and any(compared)
    if case == "llama-mask-cp2":  # context-parallel attention's lowering ran without a graph too
        assert any({"ring_attention", "allgather_attention"} & set(ops) for ops in compared)


def test_state_memory_shares_equal_the_whole_computation():
    """The search's state (memory bound, evaluation) sums per-input shares cached by placement
    (``state_memory(memo=...)``): equal, to the bit, to the state computed afresh, for every
    candidate and ZeRO stage of a training space."""
    from autoshard import Mesh
    from autoshard.cost.model import state_memory
    from examples.models import llama_tiny

    model, args, dims = llama_tiny(with_labels=True)
    cap, info = prepared(model, args, dims)
    space = SearchSpace(cap.graph, cap.inputs, info, Mesh({"dp": 2, "tp": 2}), CostModel(load_hardware("h100")),
                        train=True)
    checked = 0
    for c in space.space():
        try:
            st, in_places, kw = space.state(c)
        except autoshard.LayoutError:
            continue
        fresh = state_memory(space._st_inputs, space.vals, in_places, space.mesh, space.cm, train=True, **kw)
        assert st == fresh, c.describe()
        checked += 1
    assert checked > 20 and len(space._state_terms) < checked * len(space._st_inputs)


@pytest.mark.parametrize("arch", ["qwen2_moe", "whisper"])
def test_zero3_unit_latency_bounds_the_cost(arch):
    """The stream bound counts the latency of ZeRO-3's units (``SearchSpace._unit_latency``): on
    a Mixture-of-Experts decoder (expert parameters left out) and an encoder-decoder (two stacks
    of blocks), with only the inputs named, it never exceeds the latency of the units' gathers
    and reduce-scatters and of the stored parameters gathered one by one in the program built,
    and the bound never exceeds the evaluated cost, for ZeRO-3 candidates sampled over both axes'
    options. Tolerance: one part in 1e9, for sums of the same terms in another order."""
    import random

    from autoshard.cost.candidate import Candidate
    from autoshard.cost.model import collective_seconds
    from tests.helpers.search_cases import hf_planned

    _, space = hf_planned(arch, {"dp": 2, "tp": 2})
    combos = [(d, t) for d in space.per_axis_options()[0] for t in space.per_axis_options()[1]]
    random.Random(0).shuffle(combos)
    checked = counted = grouped = 0
    for combo in combos:
        if checked >= 16:
            break
        got = space.combination(combo)
        try:
            if got is None or not space._placed(got[0])[1]:
                continue  # (ZeRO needs an axis splitting the batch)
        except autoshard.LayoutError:
            continue
        for reshard in (True, False):
            c = Candidate(got[0].axes, 3, reshard)
            try:
                cost = space.evaluate(c).step_time
                bound = space.optimizer_bound(c) + space.stream_bound(c, 0.0)
                axis = space._placed(c)[1][0]
            except autoshard.LayoutError:
                continue
            program, _ = space._build(space.graph, space.inputs, space.info, c.layout(space.names, space.extra), 3,
                                      reshard)
            # the latency the program's own ZeRO-3 collectives pay: units and single gathers
            units = [x for x in program.collectives if x.op == "gather_unit" and x.axes == (axis,)]
            single = [x for x in program.collectives if x.phase == "forward" and x.kind == "all_gather"
                      and x.axes == (axis,) and x.op != "gather_unit" and x.node in program.storage]
            paid = sum(collective_seconds(space.cm, space.mesh, x.kind, x.axes, 0.0) for x in units + single)
            least = space._unit_latency(c, axis)
            assert least <= paid * (1 + 1e-9), (c.describe(), least, paid)
            assert bound <= cost * (1 + 1e-9) + 1e-15, (c.describe(), bound, cost)
            checked += 1
            counted += least > 0
            grouped += bool(units)
    assert checked >= 16 and counted >= checked // 2
    # (the sampled Qwen2-MoE layouts form units; the Whisper ones gather each parameter alone)
    assert grouped >= checked // 2 if arch == "qwen2_moe" else grouped == 0


@pytest.mark.parametrize("case", ["mixtral-experts", "llama-vocab"])
def test_bound_never_exceeds_the_cost_where_other_passes_lower_nodes(case):
    """The one-axis programs behind the communication bound are rewritten with the lowerings of
    the plan's own build (passes/program.lowered): an MoE layer's dispatch and combine, a
    vocab-parallel cross-entropy. Rewritten op by op instead, the routing code's and the full
    logits' collectives bounded such candidates above their cost (up to 2x on Mixtral, 1.2x on a
    Llama with an 8192-word vocabulary). For every candidate putting the experts (Mixtral, tp=4,
    only the inputs named) or the vocabulary (the Llama, tp=4, dims named) on the axis: compute,
    optimizer and blocking communication in sequence, and the stream bound, never exceed the
    evaluated step time. Tolerance: one part in 1e9 (the same terms summed in another order)."""
    import warnings

    from examples.models import llama_tiny
    from tests.helpers.search_cases import hf_planned

    if case == "mixtral-experts":
        _, space = hf_planned("mixtral", {"tp": 4})
        word = "experts"
    else:
        model, args, dims = llama_tiny(with_labels=True, vocab_size=8192, batch=8, seq=256, hidden_size=256,
                                       intermediate_size=512)
        cap, info = prepared(model, args, dims)
        space = SearchSpace(cap.graph, cap.inputs, info, autoshard.Mesh({"tp": 4}), CostModel(load_hardware("h100")),
                            train=True)
        word = "vocab"
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for c in space.space():
            if word not in c.describe().replace("+", " ").split() and not any(
                    n.split(".")[0] == word or n == word for _, names in c.axes for n in names):
                continue
            try:
                cost = space.evaluate(c).step_time
                comm = space.comm_bound(c)
                serial = space.compute_bound(c) + space.optimizer_bound(c) + comm
                stream = space.optimizer_bound(c) + space.stream_bound(c, comm)
            except autoshard.LayoutError:
                continue
            assert max(serial, stream) <= cost * (1 + 1e-9), (c.describe(), serial, stream, cost)
            checked += 1
            if checked >= 24:
                break
    assert checked >= 10, checked
