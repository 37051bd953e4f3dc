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

Example::

    region = bucketable_region(graph, rg, place, uses, axis_ix=0, candidates={"p_pos"})
    # {"p_pos", "embedding_1"}: drop their mark_varying, bucket p_pos
"""
from __future__ import annotations

from torch import fx

from autoshard.ownership import Replicate

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


def bucketable_region(graph: fx.Graph, rg: set, place: dict, uses: dict, axis_ix: int, candidates) -> set:
    """Names of the nodes (parameters and replicated values) of every region whose data-axis
    gradient sum can move into the buckets. ``rg``: nodes carrying gradients; ``place``: node ->
    placements per output; ``uses``: node -> [(reader, kind)] for each conversion the rewrite
    made of it; ``candidates``: parameter names the buckets may take."""
    candidates = set(candidates)

    def replicated(n):
        return n in place and all(p is None or isinstance(p[axis_ix], Replicate) for p in place[n])

    def kinds(src, reader):
        return [k for r, k in uses.get(src, ()) if r is reader]

    # rep: replicated work whose gradient-carrying inputs are all such work or parameters
    rep = set()
    for n in graph.nodes:
        if n not in rg or not replicated(n):
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
