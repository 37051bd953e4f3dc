"""The reason the plan gives for each collective a placement change inserts: what the value is
(a pending sum, a stored parameter, a shard), and why its consumer needs it otherwise.

``print(plan)``, ``plan.explain()`` and the ``why`` of ``plan.collectives`` read these texts;
an adjoint's reason is its forward's, prefixed ``adjoint:``.

Example::

    >>> [c.why for c in plan.collectives if c.kind == "all_reduce"][0]   # doctest: +SKIP
    'contracted dim ffn is sharded on tp in layers.0.mlp.down_proj -> partial sum; add needs it whole'
"""
from __future__ import annotations


def explain(rw, fn: str, src, consumer, axis: str, s, t, reason: str) -> str:
    """Why runtime function ``fn`` changes ``src`` from ``s`` to ``t`` on ``axis`` for
    ``consumer`` (``reason``: what the consumer's rule needs)."""
    op = getattr(consumer.target, "__name__", str(consumer.target)).split(".")[0]
    name = rw.display.get(src.name, src.name)
    if fn == "all_reduce":
        return f"{rw.partial_why.get((src, axis), name + ' is a partial sum')}; {op} needs it whole"
    if fn == "mark_varying":
        return f"replicated {name} feeds per-rank work on {axis} in {op}: backward sums its gradient"
    if fn == "replicated_use":
        kept = "kept whole (ZeRO-2)" if src.name in rw.zero.full_copies else "gathered"
        return (f"{kept} {name} is also read whole by {op} on {axis}: rank 0 carries its gradient into the "
                f"reduce-scatter, which would otherwise add that whole gradient once per rank")
    st = rw.zero.storage.get(src.name)
    if st is not None and axis == st.axis and fn in ("all_gather", "all_gather_varying", "use_persistent"):
        when = {"use_persistent": "kept whole since the last optimizer step",
                "all_gather_varying": "gathered for use" + (", released after forward" if st.reshard else
                                                             ", kept through backward")}.get(fn, "gathered")
        return f"parameter {name} is stored sharded on {axis} (ZeRO-{st.stage}), {when}; {op} needs it whole"
    if fn in ("all_gather", "all_gather_varying"):
        return f"{name} is sharded on {axis} but {op} needs that dim whole ({reason})"
    if fn == "reduce_scatter":
        return f"{rw.partial_why.get((src, axis), name + ' is a partial sum')}; {op} needs it sharded ({reason})"
    if fn == "all_to_all":
        return f"{name} changes its sharded dim on {axis} from {s} to {t} for {op} ({reason})"
    if fn == "shard_slice":
        return f"{op} works on a block of {name} on {axis} ({reason})"
    return f"{name} becomes a pending sum on {axis} for {op} ({reason})"
