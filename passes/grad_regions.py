"""Replicated regions whose data-parallel gradient sum can move into the gradient buckets.

A replicated value read by per-rank work on the data axis gets a ``mark_varying`` there: its
gradient is summed over the axis in backward, synchronously, where the value is read. When the
value is computed by replicated work from parameters alone (a position embedding looked up at
``arange(seq)``, a weight reshaped or scaled before use), that sum can move to the parameters:
backward is linear in the incoming gradient and the replicated work's Jacobian is the same on
every rank, so ``sum_r J^T g_r == J^T sum_r g_r``. The parameters' gradients are then summed by
the buckets (overlapped with backward) and the synchronous all-reduce disappears.

That is exact only when *every* gradient reaching the region is a per-rank share: each value in
it is read only by replicated work inside the region or through a ``mark_varying`` on the data
axis (never returned, never read by another kind of conversion), and every gradient-carrying
input of its work is in the region too (so no per-rank or already-summed value feeds it). A
region is taken whole or not at all.

Without buckets (ZeRO-2/3 shard the parameters on the data axis) the same move sends the sum to
the parameters' own reduce-scatters: a ZeRO-3 shard gathered for the region becomes an
``all_gather_varying`` (its backward reduce-scatters the per-rank shares; in a unit with the
others), a ZeRO-2 full copy loses its ``replicated_use`` (:func:`sum_regions_in_storage`).

Example::

    region = bucketable_region(graph, rg, place, uses, axis_ix=0, candidates={"p_pos"})
    # {"p_pos", "embedding_1"}: drop their mark_varying, bucket p_pos
"""
from __future__ import annotations

import dataclasses

from torch import fx

from autoshard.ownership import Replicate
from autoshard.runtime.primitives import collectives as C

from .rules import GETITEM

# How one read of a gradient-carrying value converts it on the data axis (recorded by the rewrite):
MV = "mark_varying"  # replicated, read by per-rank work: backward sums its gradient
REP = "replicated"   # replicated, read by replicated work: no conversion on the axis
OTHER = "other"      # anything else (a slice, a gather, a pending sum ...)


def use_kind(cur, target, varying: bool):
    """The kind of one read, from the value's placement on the data axis, the reader's target
    placement there, and whether the reader's work differs per rank on it."""
    if isinstance(cur, Replicate) and isinstance(target, Replicate):
        return MV if varying else REP
    return OTHER


def bucketable_region(graph: fx.Graph, rg: set, place: dict, uses: dict, axis_ix: int, candidates,
                      stored=()) -> set:
    """Names of the nodes (parameters and replicated values) of every region whose data-axis
    gradient sum can move into the buckets. ``rg``: nodes carrying gradients; ``place``: node ->
    placements per output; ``uses``: node -> [(reader, kind)] for each conversion the rewrite
    made of it; ``candidates``: parameter names the buckets may take; ``stored``: those of them
    stored sharded on the axis (read whole all the same)."""
    candidates, stored = set(candidates), set(stored)

    def replicated(n):
        return n in place and all(p is None or isinstance(p[axis_ix], Replicate) for p in place[n])

    def kinds(src, reader):
        return [k for r, k in uses.get(src, ()) if r is reader]

    # rep: replicated work whose gradient-carrying inputs are all such work or parameters
    rep = set()
    for n in graph.nodes:
        if n not in rg or not (replicated(n) or n.name in stored):
            continue
        if n.op == "placeholder":
            ok = n.name in candidates
        elif n.op == "call_function" and n.target is GETITEM:
            ok = n.args[0] in rep
        elif n.op == "call_function":
            ok = all(i in rep and kinds(i, n) and set(kinds(i, n)) == {REP} for i in n.all_input_nodes if i in rg)
        else:
            ok = False
        if ok:
            rep.add(n)
    # eligible: every read sends back a per-rank share (through mark_varying or eligible work)
    eligible = set()
    for n in reversed(graph.nodes):
        if n not in rep:
            continue
        users = set(n.users)
        ok = all(r in users for r, _ in uses.get(n, ()))
        for u in users:
            if not ok:
                break
            if u.op != "call_function":  # returned: its gradient comes in whole
                ok = False
                continue
            if u.target is GETITEM:
                ok = u in eligible
                continue
            ks = kinds(n, u)
            ok = bool(ks) and all(k == MV or (k == REP and (u not in rg or u in eligible)) for k in ks)
        if ok:
            eligible.add(n)
    # regions: connected through replicated reads; taken only if every member is eligible
    parent = {n: n for n in rep}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in rep:
        for i in n.all_input_nodes:
            if i in rep:
                parent[root(i)] = root(n)
    members: dict = {}
    for n in rep:
        members.setdefault(root(n), []).append(n)
    out = set()
    for group in members.values():
        summed = any(k == MV for n in group for _, k in uses.get(n, ()))
        if summed and all(n in eligible for n in group):
            out |= {n.name for n in group}
    return out


REGION_SUM = ("; the replicated work reading it sends back per-rank gradient shares (the sum where its result "
              "meets per-rank work is dropped), which the reduce-scatter adds")


def sum_regions_in_storage(graph: fx.Graph, program_graph, rg: set, place: dict, uses: dict, axis: str, axes,
                           storage: dict, stored_reads: dict, marks: dict, collectives: list) -> list:
    """Move the data-axis gradient sum of every replicated region computed from parameters
    stored sharded on ``axis`` (ZeRO-2/3) into those parameters' reduce-scatters: drop the
    region's ``mark_varying`` nodes; turn each read of a stored parameter by the region
    (``stored_reads``: a ZeRO-3 ``all_gather``, a ZeRO-2 ``replicated_use``) into one whose
    backward takes the per-rank share. Edits ``program_graph``; returns the collectives updated.

    Example::

        collectives = sum_regions_in_storage(g0, g, rg, place, uses, "dp", ("dp",), storage,
                                             stored_reads, marks, collectives)   # ZeRO-3: p_pos joins a unit
    """
    stored = {n for n, st in storage.items() if st.axis == axis}
    region = bucketable_region(graph, rg, place, uses, list(axes).index(axis), stored, stored=stored)
    dropped = drop_marks(region, marks, program_graph)
    kept_whole, gathered = set(), {}  # tags; gathered: tag -> bytes gathered
    for name in region & stored:
        for read in stored_reads.get(name, ()):
            if read.target is C.replicated_use:
                kept_whole.add(read.args[0].meta["autoshard"]["tag"])  # the use_persistent before it
                read.replace_all_uses_with(read.args[0])
                program_graph.erase_node(read)
            else:
                read.target = C.all_gather_varying
                read.meta["autoshard"]["why"] += REGION_SUM
                val = read.meta["val"]
                gathered[read.meta["autoshard"]["tag"]] = val.numel() * val.element_size()
    out = []
    for c in collectives:
        if c.tag in dropped:
            continue
        if c.tag in gathered:
            c = dataclasses.replace(c, op="all_gather_varying", why=c.why + REGION_SUM)
            out += [c, dataclasses.replace(c, kind="reduce_scatter", phase="backward", why="adjoint: " + c.why,
                                           bytes=gathered[c.tag])]
            continue
        out.append(dataclasses.replace(c, why=c.why + REGION_SUM) if c.tag in kept_whole else c)
    return out


def drop_marks(names, marks: dict, program_graph) -> set:
    """Remove the ``mark_varying`` nodes ``marks[name]`` of every name in ``names`` from the
    program graph (their sum moves to the parameters); returns their tags."""
    tags = set()
    for name in names:
        for mv in marks.get(name, ()):
            tags.add(mv.meta["autoshard"]["tag"])
            mv.replace_all_uses_with(mv.args[0])
            program_graph.erase_node(mv)
    return tags
