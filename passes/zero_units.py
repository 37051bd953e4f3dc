"""ZeRO-3 / FSDP units: parameters gathered and reduce-scattered together, one flat buffer each.

The rewrite gathers each ZeRO-3 parameter on its own (``all_gather_varying`` at its first use).
Small parameters make that latency-bound: a block of a transformer has a dozen of them. This
pass groups them into *units* (FSDP's "wrapping"): the gathers of a unit's parameters become one
``gather_unit`` node placed before the first of them, which gathers every member in one flat
all-gather, starts the next unit's gather (forward prefetch), and in backward reduce-scatters
the members' gradients in one flat buffer, asynchronously under the rest of backward
(``autoshard.runtime.primitives.zero_units``). Values are unchanged bit for bit: gathers are copies and sums
are elementwise.

A unit policy says which parameters go together (names are parameter FQNs):

- ``"block"``: one unit per repeated block (``layers.3``), one for the parameters first used
  before the blocks and one for those first used after them;
- ``"model"``: one unit for all;
- ``"param"``: no grouping (one gather and one reduce-scatter per parameter);
- a list of module prefixes or globs (``["layers.*", "embed"]``): a parameter joins the unit of
  the longest prefix it falls under (``*`` is one path component; each module a glob matches is
  its own unit), the rest form one unit.

Example::

    >>> from autoshard.passes.zero_units import unit_of                        # doctest: +SKIP
    >>> unit_of("model.layers.3.attention.wq.weight", "block")
    'model.layers.3'
"""
from __future__ import annotations

import operator
import re

from autoshard.runtime.primitives import collectives as C

from autoshard.passes.spmd import Collective

POLICIES = ("block", "model", "param")


def block_prefix(fqn: str) -> str:
    """The repeated block a parameter belongs to (its path up to the first numeric component,
    ``"layers.3.mlp.w"`` -> ``"layers.3"``), or ``""`` outside blocks."""
    parts = fqn.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and i > 0:
            return ".".join(parts[:i + 1])
    return ""


def unit_of(fqn: str, policy) -> str:
    """The unit name of parameter ``fqn`` under ``policy`` (``""``: the unit of the rest)."""
    if policy == "block":
        return block_prefix(fqn)
    if policy == "model":
        return ""
    if policy == "param":
        return fqn
    parts = fqn.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if any(_module_glob(p).fullmatch(prefix) for p in policy):
            return prefix
    return ""


def _module_glob(pattern: str):
    # "*" stands for one path component ("layers.*" matches "layers.3", not "layers.3.mlp")
    return re.compile(".".join("[^.]*" if c == "*" else re.escape(c) for c in pattern.split(".")))


def check_policy(policy):
    """A clear error for a unit policy that is neither a known name nor a list of prefixes."""
    if policy in POLICIES:
        return policy
    if isinstance(policy, (list, tuple)) and policy and all(isinstance(p, str) and p for p in policy):
        return tuple(policy)
    raise ValueError(f"units={policy!r}: give one of {list(POLICIES)} or a list of module prefixes / globs "
                     f"(e.g. ['layers.*'])")


def parameter_gathers(program) -> dict:
    """{placeholder name: its first ZeRO-3 gather node}, in program order: the
    ``all_gather_varying`` of a stored shard on its storage axis."""
    out = {}
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not C.all_gather_varying:
            continue
        src = node.args[0]
        st = program.storage.get(src.name) if src.op == "placeholder" else None
        if st is not None and st.mode == "gather" and node.args[1] == st.axis and src.name not in out:
            out[src.name] = node
    return out


def group_units(program, policy, mesh, display: dict) -> list:
    """Replace the per-parameter ZeRO-3 gathers of ``program`` by one ``gather_unit`` per unit
    of ``policy`` (see the module docstring), chain them for prefetch, and list one forward
    all-gather and one backward reduce-scatter per unit in ``program.collectives``. Returns the
    units in program order as ``(unit name, tag, [placeholder names])``."""
    policy = check_policy(policy)
    gathers = parameter_gathers(program)
    if policy == "param" or not gathers:
        return []
    members: dict = {}
    in_blocks = False
    for name in gathers:
        unit = unit_of(display.get(name, name), policy)
        in_blocks = in_blocks or bool(unit)
        if policy == "block" and not unit:
            # outside the blocks: the parameters first used before them (embeddings) and after
            # them (final norm, head) are two units, so neither is held through all of forward
            unit = "<after blocks>" if in_blocks else "<before blocks>"
        members.setdefault(unit, []).append(name)
    graph = program.graph_module.graph
    next_tag = 1 + max((c.tag for c in program.collectives), default=-1)
    units, nodes = [], []
    for unit, names in members.items():
        olds = [gathers[n] for n in names]
        axis = olds[0].args[1]
        dims = tuple(program.storage[n].dim for n in names)
        shards = tuple(o.args[0] for o in olds)
        with graph.inserting_before(olds[0]):
            node = graph.call_function(C.gather_unit, (shards, axis, dims), {"tag": next_tag})
            node.meta["val"] = tuple(o.meta["val"] for o in olds)
            for i, old in enumerate(olds):
                got = graph.call_function(operator.getitem, (node, i))
                got.meta = {k: v for k, v in old.meta.items() if k != "autoshard"}
                old.replace_all_uses_with(got)
        old_tags = {o.meta["autoshard"]["tag"] for o in olds}
        for old in olds:
            graph.erase_node(old)
        reshard = any(t in program.reshard_tags for t in old_tags)
        program.reshard_tags = frozenset((program.reshard_tags - old_tags) | ({next_tag} if reshard else set()))
        program.collectives = [c for c in program.collectives if c.tag not in old_tags]
        program.collectives += unit_collectives(unit, names, shards, axis, next_tag, reshard, mesh, display)
        node.meta["autoshard"] = {"where": "" if unit.startswith("<") else unit, "tag": next_tag, "why": program.collectives[-2].why}
        units.append((unit, next_tag, names))
        nodes.append(node)
        next_tag += 1
    for prev, node in zip([None] + nodes, nodes):
        if holds_reduce_scatter(prev, node):
            node.kwargs = {**node.kwargs, "hold": True}
    for node, nxt in zip(nodes, nodes[1:]):
        plain = last_plain_collective(node, nxt)
        if plain is None:
            # (tag last, as in every collective call of the program)
            node.kwargs = {**{k: v for k, v in node.kwargs.items() if k != "tag"},
                           "prefetch": (nxt.args[0], nxt.args[2], nxt.kwargs["tag"]), "tag": node.kwargs["tag"]}
            continue
        # A group runs its collectives one after another: started at ``node``, the next unit's
        # gather would hold up the plain ones in between. Start it after the last of them.
        with graph.inserting_after(plain):
            graph.call_function(C.start_gather_unit, (nxt.args[0], nxt.args[1]), {"tag": nxt.kwargs["tag"]})
    program.graph_module.recompile()
    return units


def holds_reduce_scatter(prev, node) -> bool:
    """Whether a collective between the ``gather_unit`` nodes ``prev`` (None: the program's
    start) and ``node`` communicates on their axis in backward (a gradient sum): backward runs
    it after ``node``'s reduce-scatter is ready, so that reduce-scatter is held until it ran
    rather than queued ahead of it (``gather_unit(..., hold=True)``)."""
    axis = node.args[1]
    cur = prev.next if prev is not None else node.graph._root.next
    while cur is not node:
        fn = cur.target if cur.op == "call_function" else None
        op = getattr(fn, "__name__", None)
        if (op is not None and C.COLLECTIVES.get(op) is fn and len(cur.args) > 1 and cur.args[1] == axis
                and C.backward_collective(op) is not None):
            return True
        cur = cur.next
    return False


def last_plain_collective(node, nxt):
    """The last collective between two ``gather_unit`` nodes whose forward communicates on
    their axis (a parameter gathered for replicated use, a sum), or None."""
    axis, last = node.args[1], None
    cur = node.next
    while cur is not nxt:
        fn = cur.target if cur.op == "call_function" else None
        op = getattr(fn, "__name__", None)
        if C.COLLECTIVES.get(op) is fn and op is not None and len(cur.args) > 1 and cur.args[1] == axis:
            if C.forward_collective(op) is not None:
                last = cur
        elif fn is C.start_all_reduce and cur.args[1] == axis:
            last = cur
        cur = cur.next
    return last


def unit_collectives(unit, names, shards, axis, tag, reshard, mesh, display) -> list:
    """The forward all-gather and backward reduce-scatter records of one unit."""
    nbytes = sum(s.meta["val"].numel() * s.meta["val"].element_size() for s in shards)
    params = tuple(display.get(n, n) for n in names)
    listed = ", ".join(params[:3]) + (f", ... ({len(params)} in all)" if len(params) > 3 else "")
    kept = "released after forward and gathered again for backward" if reshard else "kept through backward"
    why = (f"ZeRO-3 unit {unit or '<root>'}: {len(params)} parameters stored sharded on {axis} ({listed}) are "
           f"gathered in one flat buffer before first use, the next unit's gather started meanwhile; {kept}")
    where = "" if unit.startswith("<") else unit
    return [Collective("all_gather", (axis,), nbytes, "forward", where, why, names[0], "", tag, "gather_unit",
                       params),
            Collective("reduce_scatter", (axis,), nbytes * mesh.axes[axis], "backward", where,
                       f"adjoint: the unit's gradients are reduce-scattered in one flat buffer, started when the "
                       f"last of them is ready, under the rest of backward; {why}", names[0], "", tag,
                       "gather_unit", params)]
