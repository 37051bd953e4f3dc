"""Pipeline split: cut the per-rank program into stage programs at module boundaries.

The SPMD rewrite shards the whole captured graph on the mesh's other axes (the pipeline axis
shards nothing, so every value is whole on it); this pass then cuts the rewritten program in
program order. A stage is a subgraph, so whatever the rewrite decided about tp, dp or ZeRO
holds inside it unchanged, and a boundary tensor keeps its ownership on the other axes: each
tp rank sends its own block to the same tp rank of the next stage.

Which values cross a boundary:

- *activations* (values that depend on a user input and on a trainable parameter) belong to
  the stage where they are computed and are sent to the next stage while a later stage reads
  them (relayed stage to stage, so each stage talks only to its neighbours);
- everything else is recomputed where it is read, never sent: parameter-side values (a
  parameter and its gathers, transposes, casts: every stage that reads a tied parameter holds
  it) and input-side values (rotary tables, masks, label shifts);
- a loss ``sum / count`` with an input-side ``count`` (a mean cross-entropy) is divided by the
  count over the whole step instead (every microbatch and data rank), computed up front by a
  small *normalizer* program, so microbatch losses add up to the global batch's loss.

For zero-bubble schedules each stage also returns the outputs of the ops that read a
parameter ("weight roots"): backward first computes input gradients and the gradients at those
roots (B), and later the parameters' gradients from them alone (W). A parameter read by two
ops of one stage gets its gradient in B (its W would double count through the other op).

Example::

    >>> pipe = split_program(program, inputs, mesh, axis="pp", cuts=["layers.4"], virtual=1,
    ...                      microbatches=4, loss_index=0)                    # doctest: +SKIP
    >>> [s.index for s in pipe.stages], [b.name for b in pipe.boundaries]    # doctest: +SKIP
    ([0, 1], ['add_15'])
"""
from __future__ import annotations

import bisect
import operator
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from autoshard.ownership import describe
from autoshard.runtime.execution.pipeline import BoundarySpec, StageSpec

from .dims import module_of, source_line
from .rules import _is_view, is_inplace
from .spmd import Collective, LayoutError, requires_grad_nodes

aten = torch.ops.aten

ORIGIN = "autoshard_origin"  # node meta key: the captured node a rewritten node comes from


def tag_origins(graph: fx.Graph) -> None:
    """Record each captured node's name in its meta; the rewrite copies meta to the nodes it
    makes, so a stage boundary can name the captured value (and its owner) it carries."""
    for node in graph.nodes:
        node.meta[ORIGIN] = node.name


# Loss ops by their reduction argument (position, default): 1 = mean over every element, 2 = sum
_REDUCING_LOSSES = {aten.mse_loss.default: (2, 1), aten.l1_loss.default: (2, 1), aten.smooth_l1_loss.default: (2, 1),
                    aten.huber_loss.default: (2, 1), aten.binary_cross_entropy.default: (3, 1),
                    aten.binary_cross_entropy_with_logits.default: (4, 1), aten.soft_margin_loss.default: (2, 1)}
# Losses whose mean is weighted (class weights, ignored targets): only their sum splits exactly
_SUM_ONLY_LOSSES = {aten.cross_entropy_loss.default: (3, 1), aten.nll_loss.default: (3, 1)}


def microbatch_reduction(loss: fx.Node, strict: bool = True) -> Optional[str]:
    """How the losses of equal microbatches make the step's loss: ``"sum"`` (a sum over the
    batch) or ``"mean"`` (a mean over every element), read from the op that reduces the loss
    to a scalar, past the rewrite's collectives and mean rescaling. Any other last step (a
    scale by a constant, which may be the microbatch's own size, a weighted mean, a
    nonlinearity) raises (returns None unless ``strict``): the step's value would not follow
    from the microbatches' exactly. A masked mean ``sum / count`` with an input-side count is
    handled by the normalizer.

    >>> microbatch_reduction(program.graph.output_node().args[0][0])   # doctest: +SKIP
    'mean'
    """
    n = loss
    while isinstance(n, fx.Node) and (_is_collective(n) or n.meta.get("mean_rescale")):
        n = n.args[0]
    if isinstance(n, fx.Node) and n.op == "call_function":
        if n.target in (aten.sum.default, aten.sum.dim_IntList) and _is_scalar(n):
            return "sum"
        if n.target in (aten.mean.default, aten.mean.dim) and _is_scalar(n):
            return "mean"
        for table, ok in ((_REDUCING_LOSSES, {1: "mean", 2: "sum"}), (_SUM_ONLY_LOSSES, {2: "sum"})):
            if n.target in table:
                pos, default = table[n.target]
                reduction = n.args[pos] if len(n.args) > pos else n.kwargs.get("reduction", default)
                if reduction in ok:
                    return ok[reduction]
    if not strict:
        return None
    what = f"{n.target} ({n.name})" if isinstance(n, fx.Node) else repr(n)
    where = f" in {module_of(n) or 'the root module'} at {source_line(n)}" if isinstance(n, fx.Node) else ""
    raise LayoutError(
        f"pipeline: the loss comes from {what}{where}, and the step's loss cannot be made exactly from the "
        f"microbatches' losses: a pipelined loss must end in a sum or a mean over the batch (x.sum(), x.mean(), "
        f"F.mse_loss, ...), or a masked mean sum / count with the count computed from the inputs (as "
        f"F.cross_entropy(..., ignore_index=...) is), not scaled afterwards (a constant may be the microbatch's "
        f"size). Divide by the global count in the loss, or plan without a pipeline.")


def _is_scalar(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 0


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__module__", "") == "autoshard.runtime.primitives.collectives"


def block_start(fqn: str) -> Optional[str]:
    """The repeated block a module lies in, e.g. ``"layers.3.mlp"`` -> ``"layers.3"``."""
    parts = fqn.split(".")
    for i, p in enumerate(parts):
        if i > 0 and p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def cut_candidates(graph: fx.Graph) -> list:
    """Module FQNs where a stage may begin, in program order: the start of every block of the
    largest repeated family (``layers.0`` ... ``layers.N-1``) and the first module after the
    last block (the head), each with its position among the graph's nodes.

    Example::

        [(fqn, pos) for fqn, pos in cut_candidates(program.graph_module.graph)][:2]
        # [('layers.0', 61), ('layers.1', 140)]
    """
    first: dict = {}
    order = []
    for i, node in enumerate(graph.nodes):
        if node.op != "call_function" or _is_collective(node):
            continue
        mod = module_of(node)
        if mod and mod not in first:
            first[mod] = i
            order.append(mod)
    blocks: dict = {}
    for mod in order:
        b = block_start(mod)
        if b is not None and b not in blocks:
            blocks[b] = first[mod]
    families: dict = {}
    for b in blocks:
        families.setdefault(b.rsplit(".", 1)[0], []).append(b)
    if not families:
        return []
    family = max(families.values(), key=len)
    out = [(b, blocks[b]) for b in family]
    end = max(p for _, p in out)
    after = [m for m in order if first[m] > end and block_start(m) not in family]
    if after:
        top = after[0].split(".")[0]
        out.append((top, first[after[0]]))
    return sorted(out, key=lambda x: x[1])


def even_cuts(candidates: list, stages: int) -> list:
    """``stages - 1`` cuts that give each stage an equal share of the blocks (the head stays
    with the last block)."""
    blocks = [c for c in candidates if block_start(c[0]) == c[0]]
    if len(blocks) < stages:
        raise LayoutError(f"a {stages}-stage pipeline needs at least {stages} blocks to cut between; "
                          f"found {len(blocks)} ({[b for b, _ in blocks][:4]}...)")
    n = len(blocks)
    return [blocks[(n * k) // stages][0] for k in range(1, stages)]


def activations(program, inputs) -> set:
    """Nodes of the rewritten program that depend on a user input and on a trainable
    parameter: what a stage computes and may have to send on."""
    kinds = {}
    for name, kind, i in program.placeholders:
        kinds[name] = ("full", False) if kind == "full" else (inputs[i].kind, inputs[i].trainable)
    dep_user, dep_train = {}, {}
    for n in program.graph_module.graph.nodes:
        if n.op == "placeholder":
            k, t = kinds[n.name]
            dep_user[n], dep_train[n] = k == "user", k == "parameter" and t
        elif n.op == "call_function":
            ins = n.all_input_nodes
            dep_user[n] = any(dep_user[a] for a in ins)
            dep_train[n] = any(dep_train[a] for a in ins)
    return {n for n in dep_user if n.op == "call_function" and dep_user[n] and dep_train[n]}


@dataclass
class CutProfile:
    """What the cut search needs from a program: the candidate cuts in program order and,
    for each, the nodes of the *unit* it begins (up to the next candidate) and the bytes of the
    activations live across it (what a stage boundary there would send per microbatch on each
    rank). ``units[0]`` is what precedes the first candidate (the embedding)."""

    candidates: list  # module FQNs
    units: list  # len(candidates) + 1 lists of nodes
    cut_bytes: list  # per candidate
    allowed: list  # per candidate: a stage may begin there (it leaves activations before it)


def cut_profile(program, inputs) -> CutProfile:
    """The :class:`CutProfile` of a rewritten program (see :func:`cut_candidates`).

    Example::

        prof = cut_profile(plan.program, plan.captured.inputs)
        prof.candidates[:2], prof.cut_bytes[:2]      # (['layers.0', 'layers.1'], [1024, 1024])
    """
    graph = program.graph_module.graph
    nodes = list(graph.nodes)
    act = activations(program, inputs)
    cands = cut_candidates(graph)
    bounds = [p for _, p in cands]
    units = [[] for _ in range(len(cands) + 1)]
    for i, n in enumerate(nodes):
        if n.op == "call_function":
            units[bisect.bisect_right(bounds, i)].append(n)
    pos = {n: i for i, n in enumerate(nodes)}
    last_read = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in act:
                last_read[a] = max(last_read.get(a, -1), pos[n])
    cut_bytes, allowed = [], []
    for _, p in cands:
        live = [a for a in act if pos[a] < p and last_read.get(a, -1) >= p and not _is_collective(a)
                and isinstance(a.meta.get("val"), torch.Tensor)]
        cut_bytes.append(sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in live))
        allowed.append(any(pos[a] < p for a in act))
    return CutProfile([c for c, _ in cands], units, cut_bytes, allowed)


@dataclass
class PipelineProgram:
    """The stages of a pipelined program and what crosses between them."""

    axis: str
    stages: list  # StageSpec, by stage index
    boundaries: list  # BoundarySpec, in stage order
    cuts: list  # module FQNs where stages 1.. begin
    modules: list  # per stage: short description of its modules ("embed_tokens, layers.0-3")
    stage_of: dict  # rewritten node name -> stage (activations)
    normalizer: Optional[fx.GraphModule] = None
    normalizer_inputs: list = field(default_factory=list)
    tied: dict = field(default_factory=dict)  # trainable param -> stages (on >1 pipeline ranks) reading it
    collectives: list = field(default_factory=list)  # send / recv records
    loss_index: Optional[int] = None
    loss_reduction: str = "mean"  # how microbatch losses make the step's: "sum" or "mean" (microbatch_reduction)
    scalar_reductions: dict = field(default_factory=dict)  # other scalar outputs: index -> "sum" | "mean" | None


def split_program(program, inputs, mesh, *, axis: str, cuts: list, virtual: int, microbatches: int,
                  loss_index: Optional[int], display: Optional[dict] = None) -> PipelineProgram:
    """Cut ``program`` (the rewritten per-rank program) into ``len(cuts) + 1`` stage programs.

    ``inputs``: the captured inputs (``.kind``, ``.trainable``) that ``program.placeholders``
    index; ``cuts``: module FQNs where stages 1, 2, ... begin, in program order; stage ``k``
    runs on pipeline rank ``k % pp``; ``loss_index``: the flat output that is the loss."""
    graph = program.graph_module.graph
    display = display or {}
    pp = mesh.axes[axis]
    n_stages = len(cuts) + 1
    if n_stages != pp * virtual:
        raise LayoutError(f"{len(cuts)} cuts make {n_stages} stages, but {axis}={pp} with virtual={virtual} "
                          f"needs {pp * virtual}")
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    kinds = {}  # placeholder name -> (input kind, trainable)
    for name, kind, i in program.placeholders:
        kinds[name] = ("full", False) if kind == "full" else (inputs[i].kind, inputs[i].trainable)
    trainable = {n for n, (k, t) in kinds.items() if k == "parameter" and t}

    # -- classify: activations depend on a user input and on a trainable parameter
    dep_user, dep_train, params_of = {}, {}, {}
    for n in nodes:
        if n.op == "placeholder":
            dep_user[n] = kinds[n.name][0] == "user"
            dep_train[n] = n.name in trainable
            params_of[n] = frozenset([n.name]) if n.name in trainable else frozenset()
        elif n.op == "call_function":
            ins = n.all_input_nodes
            dep_user[n] = any(dep_user[a] for a in ins)
            dep_train[n] = any(dep_train[a] for a in ins)
            params_of[n] = frozenset().union(*[params_of[a] for a in ins if not dep_user[a]]) if ins else frozenset()
    act = {n for n in nodes if n.op == "call_function" and dep_user[n] and dep_train[n]}
    out_node = nodes[-1]
    last = n_stages - 1

    # -- stages of activations: by position against the cuts; collectives, getitems and
    # root-level code where their first reader is
    cut_pos = []
    for c in cuts:
        hit = next((pos[n] for n in nodes if n in act and not _is_collective(n)
                    and (module_of(n) == c or module_of(n).startswith(c + "."))), None)
        if hit is None:
            known = sorted({block_start(module_of(n)) or module_of(n).split(".")[0] for n in act} - {""})
            raise LayoutError(f"pipeline cut {c!r} names no module of the program; cut where a module begins, "
                              f"e.g. one of {known[:8]}")
        if cut_pos and hit <= cut_pos[-1]:
            raise LayoutError(f"pipeline cuts must be in program order and distinct: {cuts}")
        cut_pos.append(hit)
    stage: dict = {}
    for n in nodes:
        if n in act and module_of(n) and not _is_collective(n) and n.target is not operator.getitem:
            stage[n] = bisect.bisect_right(cut_pos, pos[n])
    for n in reversed(nodes):
        if n in act and n not in stage:
            readers = [stage[u] for u in n.users if u in stage]
            stage[n] = min(readers + ([last] if out_node in n.users or not readers else []))
    for n in nodes:  # a getitem stays with its tuple; no value may flow to an earlier stage
        if n in act:
            if n.target is operator.getitem:
                stage[n] = stage[n.args[0]]
            stage[n] = max([stage[n]] + [stage[a] for a in n.all_input_nodes if a in act])

    def read_at(v) -> list:
        return [stage[u] for u in v.users if u in act] + ([last] if out_node in v.users else [])

    crossing = [[v for v in nodes if v in act and stage[v] <= k and any(s > k for s in read_at(v))]
                for k in range(last)]
    for k, vals in enumerate(crossing):
        for v in vals:
            if not isinstance(v.meta.get("val"), torch.Tensor):
                raise LayoutError(f"pipeline cut {cuts[k]!r} would send {v.name} ({v.target}), which is not a "
                                  f"tensor; cut at another module")

    # -- the loss normalizer
    norm_node = div_node = None
    loss_reduction = "mean"
    if loss_index is not None:
        n = out_node.args[0][loss_index]
        while isinstance(n, fx.Node) and _is_collective(n):
            n = n.args[0]
        if (isinstance(n, fx.Node) and n.target is aten.div.Tensor and isinstance(n.args[1], fx.Node)
                and not dep_train[n.args[1]]):
            div_node, norm_node = n, n.args[1]
        # a masked mean's numerator must add up over microbatches, as a plain loss must; a
        # loss that is not a scalar is trained as its sum (gradient seeds of ones), as unpipelined
        loss = out_node.args[0][loss_index]
        loss_reduction = microbatch_reduction(div_node.args[0] if div_node is not None else loss) \
            if _is_scalar(loss) else "sum"
        if div_node is not None and loss_reduction != "sum":
            div_node = norm_node = None
            microbatch_reduction(loss)  # raises: a mean divided again

    rg = requires_grad_nodes(graph, trainable)
    boundaries, stages, collectives = [], [], []
    tags = 1 + max((c.tag for c in program.collectives), default=-1)
    for k in range(last):
        for v in crossing[k]:
            val = v.meta["val"]
            b = BoundarySpec(len(boundaries), k, v.name, tuple(val.shape), val.dtype, v in rg)
            boundaries.append(b)
            collectives += _boundary_records(b, v, program, mesh, axis, tags + b.index, microbatches)
    by_value = {(b.src_stage, b.name): b for b in boundaries}
    for k in range(n_stages):
        recv = [by_value[(k - 1, v.name)] for v in crossing[k - 1]] if k else []
        send = [by_value[(k, v.name)] for v in crossing[k]] if k < last else []
        roots = list(out_node.args[0]) if k == last else [n for n in crossing[k]]
        stages.append(_stage_graph(k, nodes, act, stage, roots, recv, send, kinds, trainable, rg, params_of,
                                   dep_user, div_node, norm_node, n_stages))
    normalizer, norm_inputs = (_normalizer_graph(nodes, norm_node, kinds) if norm_node is not None else (None, []))
    holders: dict = {}
    for s in stages:
        for p in s.params:
            holders.setdefault(p, []).append(s.index)
    tied = {p: ss for p, ss in holders.items() if len({x % pp for x in ss}) > 1}
    for p, ss in tied.items():
        collectives += _tied_records(p, ss, program, mesh, axis, display)
    modules = [_describe_modules([n for n in nodes if n in act and stage[n] == k and not _is_collective(n)])
               for k in range(n_stages)]
    return PipelineProgram(axis, stages, boundaries, list(cuts), modules, {n.name: s for n, s in stage.items()},
                           normalizer, norm_inputs, tied, collectives, loss_index, loss_reduction,
                           {k: microbatch_reduction(o, strict=False) for k, o in enumerate(out_node.args[0])
                            if k != loss_index and _is_scalar(o)})


def _stage_graph(k, nodes, act, stage, roots, recv, send, kinds, trainable, rg, params_of, dep_user, div_node,
                 norm_node, n_stages) -> StageSpec:
    """Stage k's program: its activations, the parameter- and input-side values they read,
    received boundary values as arguments; returns its sends (or the program's outputs) and
    the weight roots."""
    recv_names = {b.name for b in recv}
    own = [n for n in nodes if n in act and stage[n] == k]
    need: set = set()

    def visit(a):
        if not isinstance(a, fx.Node) or a in need or a.name in recv_names:
            return
        if a in act and stage[a] != k:
            raise AssertionError(f"stage {k} reads {a.name} of stage {stage[a]} without receiving it")  # pragma: no cover
        need.add(a)
        if a in act:
            return
        for b in a.all_input_nodes:
            visit(b)

    for n in own:
        need.add(n)
        for a in n.all_input_nodes:
            if n is div_node and a is norm_node:
                continue
            visit(a)
    for r in roots:
        visit(r)
    # weight roots: ops of this stage that read a trainable parameter through parameter-side values
    consumers = []
    for n in own:
        ps = frozenset().union(*[params_of[a] for a in n.all_input_nodes if not dep_user[a]])
        if ps and n in rg:
            consumers.append((n, ps))
    count: dict = {}
    for _, ps in consumers:
        for p in ps:
            count[p] = count.get(p, 0) + 1
    early = {p for p, c in count.items() if c > 1}
    changed = True
    while changed:
        changed = False
        for _, ps in consumers:
            if ps & early and not ps <= early:
                early |= ps
                changed = True
    g = fx.Graph()
    env: dict = {}
    args = []
    for n in nodes:
        if n.op == "placeholder" and n in need:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
            args.append(("slot", n.name))
    for j, b in enumerate(recv):
        src = next(n for n in nodes if n.name == b.name)
        env[src] = g.placeholder("recv_" + b.name)
        env[src].meta = dict(src.meta)
        args.append(("recv", j))
    norm_ph = None
    if norm_node is not None and div_node is not None and div_node in need:
        norm_ph = g.placeholder("loss_normalizer")
        norm_ph.meta = dict(norm_node.meta)
        args.append(("normalizer", None))
    for b in recv:
        src = next(n for n in nodes if n.name == b.name)
        if _written_in_place(src, need):
            # The runtime passes a received value in as a leaf (its .grad is what goes back),
            # which autograd does not let an op overwrite: the stage writes into a copy.
            copy = g.call_function(aten.clone.default, (env[src],))
            copy.meta = dict(src.meta)
            env[src] = copy
    for n in nodes:
        if n.op != "call_function" or n not in need or n.name in recv_names:
            continue
        if n is div_node and norm_ph is not None:
            env[n] = g.node_copy(n, lambda a: norm_ph if a is norm_node else env[a])
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[r] if isinstance(r, fx.Node) else r for r in roots]
    groups = []
    for n, ps in consumers:
        if ps & early:
            continue
        ys = [n] if isinstance(n.meta.get("val"), torch.Tensor) else [u for u in n.users if u in need and u in rg]
        if ys:
            groups.append((len(outs) - len(roots), len(outs) - len(roots) + len(ys), sorted(ps)))
            outs += [env[y] for y in ys]
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    used = {n.name for n in nodes if n.op == "placeholder" and n in need}
    return StageSpec(index=k, forward=gm, inputs=args, recv=recv, send=send, n_outputs=len(roots),
                     weight_groups=groups, early_params=sorted(early & used),
                     params=sorted(p for p in used if p in trainable))


def _written_in_place(value: fx.Node, need: set) -> bool:
    """Whether an op among ``need`` writes into ``value`` in place, directly or through a view."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for u in v.users:
            if u not in need or not u.args or u.args[0] is not v:
                continue
            if is_inplace(u.target):
                return True
            if _is_view(u):
                todo.append(u)
    return False


def _normalizer_graph(nodes, norm_node, kinds):
    """The loss count of one microbatch as its own program (input-side values only)."""
    need: set = set()

    def visit(a):
        if isinstance(a, fx.Node) and a not in need:
            need.add(a)
            for b in a.all_input_nodes:
                visit(b)

    visit(norm_node)
    g = fx.Graph()
    env, names = {}, []
    for n in nodes:
        if n in need:
            if n.op == "placeholder":
                env[n] = g.placeholder(n.name)
                names.append(n.name)
            else:
                env[n] = g.node_copy(n, lambda a: env[a])
    g.output((env[norm_node],))
    return fx.GraphModule(torch.nn.Module(), g), names


def _owner(v: fx.Node, program, mesh) -> str:
    src, hops = v, []
    while ORIGIN not in src.meta and _is_collective(src):
        hops.append(src.target.__name__)
        src = src.args[0]
    place = program.placements.get(src.meta.get(ORIGIN, ""), [None])[0]
    owner = describe(place, mesh.names) if place is not None else "?"
    return owner + (f" then {' / '.join(reversed(hops))}" if hops else "")


def _boundary_records(b: BoundarySpec, v: fx.Node, program, mesh, axis, tag, microbatches) -> list:
    nbytes = torch.Size(b.shape).numel() * b.dtype.itemsize
    where = module_of(v) or "<root>"
    what = f"{v.meta.get(ORIGIN, v.name)} ({where}, {_owner(v, program, mesh)}, local {list(b.shape)})"
    hop = f"stage {b.src_stage} -> stage {b.src_stage + 1}"
    per = f"once per microbatch ({microbatches} per step)"
    out = [Collective("send", (axis,), nbytes, "forward", where, f"{hop}: {what} is read by a later stage; {per}",
                      v.name, "", tag, "send"),
           Collective("recv", (axis,), nbytes, "forward", where, f"{hop}: receives {what}; {per}", v.name, "", tag,
                      "recv")]
    if b.requires_grad:
        back = f"stage {b.src_stage + 1} -> stage {b.src_stage}"
        out += [Collective("send", (axis,), nbytes, "backward", where,
                           f"{back}: adjoint of the forward send: the gradient of {what}; {per}", v.name, "", tag, "recv"),
                Collective("recv", (axis,), nbytes, "backward", where,
                           f"{back}: adjoint of the forward send: receives the gradient of {what}; {per}",
                           v.name, "", tag, "send")]
    return out


def _tied_records(p, stages, program, mesh, axis, display) -> list:
    from_ph = next(n for n in program.graph_module.graph.nodes if n.op == "placeholder" and n.name == p)
    v = from_ph.meta.get("val")
    nbytes = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
    name = display.get(p, p)
    why = (f"tied parameter {name} is read by stages {stages}: each sends its gradient to the others and all "
           f"sum them in stage order, once per step after the last backward")
    return [Collective("send", (axis,), nbytes, "backward", name.rsplit(".", 1)[0], why, p, "", -1, "tied_grad"),
            Collective("recv", (axis,), nbytes, "backward", name.rsplit(".", 1)[0], why, p, "", -1, "tied_grad")]


def _describe_modules(acts: list) -> str:
    """``"embed_tokens, layers.0-3"``: the modules of a stage, repeated blocks as ranges."""
    seen = []
    for n in acts:
        mod = module_of(n)
        key = block_start(mod) or (mod.split(".")[0] if mod else "<root>")
        if key not in seen:
            seen.append(key)
    out, run = [], []

    def flush():
        if run:
            pre = run[0].rsplit(".", 1)[0]
            a, b = run[0].rsplit(".", 1)[1], run[-1].rsplit(".", 1)[1]
            out.append(run[0] if a == b else f"{pre}.{a}-{b}")
            run.clear()

    for key in seen:
        m = re.fullmatch(r"(.+)\.(\d+)", key)
        if m and run and run[-1].rsplit(".", 1)[0] == m.group(1) and int(run[-1].rsplit(".", 1)[1]) + 1 == int(m.group(2)):
            run.append(key)
            continue
        flush()
        if m:
            run.append(key)
        else:
            out.append(key)
    flush()
    return ", ".join(out)
