"""Soft layout entries: per-region ownership, and with it sequence parallelism, as data.

A layout value written with a trailing ``?`` is *soft*: ``{"heads": "tp", "ffn": "tp",
"seq": "tp?"}`` shards ``seq`` on ``tp`` in every activation that ``tp`` is free in, i.e. where no
hard entry claims ``tp`` for a dim of the same tensor. Inside the attention and MLP projections
(tensors carrying heads / ffn) ``tp`` belongs to the hard entries; between them (norms, residual
adds, dropout: the token-wise regions) it splits the token rows. The rewrite
(:mod:`autoshard.passes.spmd`) then converts between regions through the ownership algebra alone:

- ``Partial -> Shard(seq)`` after a row-parallel projection is a reduce-scatter;
- ``Shard(seq) -> Replicate`` before a column-parallel projection is an all-gather (its
  backward a reduce-scatter), done once per value however many projections read it;

which is Megatron's sequence parallelism (Korthikanti et al., 2022), with no rule of its own.

Which tensors a soft entry shards (the *region* rule, :func:`soft_dim`):

- activations only: values that depend on a trainable parameter (not inputs, parameters or
  values computed from inputs alone, such as masks and rotary tables, which stay as they are and
  are sliced locally where a soft-sharded op reads them);
- the axis is free in the tensor: no dim of it starts with the leading atom of a hard unit of
  the axis (``k_proj``'s output on tp=4 with 2 kv heads carries kv heads, which the hard unit
  ``[kv_heads, rep]`` of heads starts with: it stays in the heads region, whole);
- exactly one dim of the tensor starts with a soft unit of the axis.

Hard entries keep their meaning and their errors. Example::

    >>> plan = autoshard.autoshard(model, args, mesh=Mesh({"tp": 2}), dims=dims,
    ...     layout={"heads": "tp", "ffn": "tp", "seq": "tp?"})   # doctest: +SKIP
    >>> [c.kind for c in plan.collectives if c.phase == "forward"][:4]  # doctest: +SKIP
    ['all_gather', 'reduce_scatter', 'all_gather', 'reduce_scatter']
"""
from __future__ import annotations

from typing import Optional

from autoshard.ownership import R
from autoshard.runtime.primitives import collectives as C

from .conversions import register_change

SOFT_MARK = "?"


class SoftLayoutError(ValueError):
    """A soft layout entry that cannot be read (mixed hard and soft axes, a bare ``?``)."""


def is_soft(value) -> bool:
    """True for a soft layout value: ``"tp?"`` or a tuple/list of such names.

    >>> is_soft("tp?"), is_soft("tp"), is_soft(("dp?", "tp?")), is_soft(None)
    (True, False, True, False)
    """
    vals = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else ()
    return bool(vals) and all(isinstance(v, str) and v.endswith(SOFT_MARK) for v in vals)


def split_soft(layout: Optional[dict]) -> tuple[dict, dict]:
    """``(hard entries, soft entries with the '?' removed)``.

    >>> split_soft({"heads": "tp", "seq": "tp?"})
    ({'heads': 'tp'}, {'seq': ('tp',)})
    """
    hard, soft = {}, {}
    for key, value in (layout or {}).items():
        vals = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
        marked = [isinstance(v, str) and v.endswith(SOFT_MARK) for v in vals or ()]
        if vals and all(marked):
            axes = tuple(v[:-1] for v in vals)
            if any(not a for a in axes):
                raise SoftLayoutError(f"layout[{key!r}] = {value!r}: a soft entry names its axis, e.g. 'tp?'")
            soft[key] = axes
        elif any(marked):
            raise SoftLayoutError(f"layout[{key!r}] = {value!r} mixes hard and soft axes; make them all soft "
                                  f"('tp?') or all hard ('tp')")
        else:
            hard[key] = value
    return hard, soft


def soft_layout_value(axes: tuple):
    """The layout value spelling soft ``axes`` (inverse of :func:`split_soft`).

    >>> soft_layout_value(("tp",))
    'tp?'
    """
    names = tuple(a + SOFT_MARK for a in axes)
    return names[0] if len(names) == 1 else names


def touched(info, dims, hard_units) -> bool:
    """Whether a hard unit of the axis claims (or shares the leading atom of) one of ``dims``."""
    firsts = {u[0] for u in hard_units}
    for atoms in dims:
        lv = info.leaves(atoms) if atoms else ()
        if lv and lv[0] in firsts:
            return True
    return False


def soft_unit(info, atoms, soft_units) -> Optional[tuple]:
    """The soft unit ``atoms`` start with, or None."""
    lv = info.leaves(atoms) if atoms else ()
    for u in soft_units:
        if lv[: len(u)] == u:
            return u
    return None


def soft_dim(info, node, out: int, layout, axis: str, activations) -> Optional[int]:
    """The dim of ``node``'s output ``out`` that a soft entry shards on ``axis``, or None
    (the region rule in the module docstring). ``activations``: values that depend on a
    trainable parameter."""
    units = layout.soft.get(axis)
    if not units or node.op == "placeholder" or node not in activations:
        return None
    dims = info.of(node, out)
    if touched(info, dims, layout.units[axis]):
        return None
    hits = [d for d, atoms in enumerate(dims) if atoms and soft_unit(info, atoms, units)]
    return hits[0] if len(hits) == 1 else None


def soft_feasible(info, tensors_dims, letter_dims, layout, axis: str) -> bool:
    """An op may split a loop letter softly on ``axis`` when no operand or output is claimed by
    a hard unit of the axis and every dim carrying the letter starts with one soft unit.
    ``tensors_dims``: dims of every operand and output; ``letter_dims``: the dims carrying it."""
    units = layout.soft.get(axis)
    if not units:
        return False
    if any(touched(info, dims, layout.units[axis]) for dims in tensors_dims):
        return False
    found = {soft_unit(info, atoms, units) for atoms in letter_dims}
    return len(found) == 1 and None not in found


# ---- the rewrite's gather of a soft-sharded activation (a hook of passes/conversions.py) ----------

def soft_split(rw, src, out, dim, axis) -> bool:
    """Whether ``src``'s ``dim`` is split on ``axis`` by a soft entry (not a hard one)."""
    if not rw.layout.soft.get(axis):
        return False
    atoms = rw.info.of(src, out or 0)[dim]
    return bool(atoms) and rw.unit_of(atoms, axis) is None and soft_unit(rw.info, atoms,
                                                                         rw.layout.soft[axis]) is not None


def _gather_once(step, node):
    # A soft-sharded activation is gathered once for all its readers: varying ones (column-
    # parallel projections) take it as is, replicated ones through replicated_use, so the one
    # backward reduce-scatter sums every gradient once.
    step.check_nesting(step.s.dim)
    gathers = step.memo("soft_gathers")  # (local node, axis) -> its one gather
    if (node, step.axis) not in gathers:
        gathers[(node, step.axis)] = step.emit(C.all_gather_varying, node, (step.s.dim,), kwargs=step.undeferred())
    node = gathers[(node, step.axis)]
    if step.axis not in step.varying:
        node = step.emit(C.replicated_use, node, s=R)
    return node


register_change("gather", "S", "R", handler=_gather_once, priority=20,
                applies=lambda step: step.needs_grad and soft_split(step.rw, step.src, step.out, step.s.dim, step.axis))
