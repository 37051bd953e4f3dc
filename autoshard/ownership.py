"""Ownership of a value on one mesh axis: Shard(dim), Replicate, Partial or Owned(index).

A value's *placement* is a tuple with one ownership per mesh axis (in mesh order).

Example::

    >>> place = (Shard(0), Replicate())          # batch split on dp, whole on tp
    >>> describe(place, ("dp", "tp"))
    'S(0)@dp'
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self):
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self):
        return "R"


@dataclass(frozen=True)
class Partial:
    """A pending sum: the value is the sum of every rank's local tensor on the axis."""

    def __str__(self):
        return "P"


@dataclass(frozen=True)
class Owned:
    """Whole on the ranks at coordinate ``index`` of the axis, absent (an empty block: dim 0 of
    size 0) on the others: one expert of a ``ModuleList`` placed by expert parallelism."""

    index: int

    def __str__(self):
        return f"O({self.index})"


R = Replicate()
P = Partial()


def parse(items) -> tuple:
    """A placement from its strings, one per mesh axis: ``["S(0)", "R"]`` -> (Shard(0), R)."""
    out = []
    for s in items:
        m = re.fullmatch(r"([SO])\((\d+)\)", s) if isinstance(s, str) else None
        if m:
            out.append((Shard if m.group(1) == "S" else Owned)(int(m.group(2))))
        elif s in ("R", "P"):
            out.append(R if s == "R" else P)
        else:
            raise ValueError(f"unknown owner {s!r} (expected 'S(d)', 'O(i)', 'R' or 'P')")
    return tuple(out)


def describe(place, axes) -> str:
    parts = [f"{o}@{a}" for o, a in zip(place, axes) if not isinstance(o, Replicate)]
    return ", ".join(parts) if parts else "R"


def shard_axes(place, axes, dim: int) -> list[str]:
    """Mesh axes (in mesh order) that shard ``dim``."""
    return [a for o, a in zip(place, axes) if isinstance(o, Shard) and o.dim == dim]


def local_shape(shape, place, mesh) -> tuple:
    """Shape of the block a rank holds (for an ``Owned`` value: on its owners)."""
    out = list(shape)
    for o, a in zip(place, mesh.names):
        if isinstance(o, Shard):
            out[o.dim] //= mesh.axes[a]
    return tuple(out)


def held_fraction(place, mesh) -> float:
    """Fraction of a rank's ``local_shape`` block it holds on average: ``Owned`` values exist on
    one index of their axis (experts spread evenly, so every rank holds this share)."""
    f = 1.0
    for o, a in zip(place, mesh.names):
        if isinstance(o, Owned):
            f /= mesh.axes[a]
    return f


def holds(place, mesh, coords: dict) -> bool:
    """Whether the rank at ``coords`` holds a value (False where an ``Owned`` axis says not)."""
    return all(not isinstance(o, Owned) or coords[a] == o.index for o, a in zip(place, mesh.names))


def block_index(place, mesh, coords: dict, dim: int) -> tuple[int, int]:
    """(block index, number of blocks) of a rank's chunk along ``dim``: axes sharding one dim
    nest in mesh order (the first is the major split)."""
    idx, n = 0, 1
    for o, a in zip(place, mesh.names):
        if isinstance(o, Shard) and o.dim == dim:
            idx = idx * mesh.axes[a] + coords[a]
            n *= mesh.axes[a]
    return idx, n


def local_piece(full: torch.Tensor, place, mesh, rank: int) -> torch.Tensor:
    """The block of a global tensor that ``rank`` holds under ``place`` (Partial is not an
    input ownership: a global value has no pending sum)."""
    coords = mesh.coords(rank)
    out = full
    if not holds(place, mesh, coords):
        return full.narrow(0, 0, 0)
    for d in range(full.dim()):
        i, n = block_index(place, mesh, coords, d)
        if n > 1:
            out = out.chunk(n, dim=d)[i] if out.shape[d] % n == 0 else _bad_split(full, d, n)
    return out


def _bad_split(full, d, n):
    raise ValueError(f"dim {d} of size {full.shape[d]} is not divisible into {n} shards")


def assemble(pieces: list, place, mesh, shape=None) -> torch.Tensor:
    """Inverse of :func:`local_piece` with Partial summed: the global value from every rank's
    local tensor."""
    first = next((p for r, p in enumerate(pieces) if holds(place, mesh, mesh.coords(r))), pieces[0])
    if not isinstance(first, torch.Tensor):
        return first
    if shape is None:
        shape = list(first.shape)
        for o, a in zip(place, mesh.names):
            if isinstance(o, Shard):
                shape[o.dim] *= mesh.axes[a]
    has_partial = any(isinstance(o, Partial) for o in place)
    out = torch.zeros(shape, dtype=first.dtype, device=first.device)
    if first.dtype == torch.bool and has_partial:
        raise ValueError("a boolean value cannot be a pending sum")
    for rank, piece in enumerate(pieces):
        coords = mesh.coords(rank)
        if any(isinstance(o, Replicate) and coords[a] != 0 for o, a in zip(place, mesh.names)):
            continue
        if not holds(place, mesh, coords):
            continue
        if not has_partial and any(isinstance(o, Partial) for o in place):
            continue
        index = []
        for d in range(len(shape)):
            i, n = block_index(place, mesh, coords, d)
            size = shape[d] // n
            index.append(slice(i * size, (i + 1) * size))
        if has_partial:
            out[tuple(index)] += piece
        else:
            out[tuple(index)] = piece
    return out


@dataclass(frozen=True)
class ParamStorage:
    """How a parameter is stored between uses when its state is sharded on a data axis."""

    placement: tuple  # stored placement: the use placement plus Shard(dim) on ``axis``
    axis: str
    dim: int
    stage: int  # ZeRO stage 2 or 3 (stage 1 stores parameters whole)
    mode: str  # "persistent" (ZeRO-2: full copy refreshed by the optimizer) | "gather" (ZeRO-3)
    reshard: bool = False  # ZeRO-3: release the gathered parameter after forward


def data_axes(user_placements) -> list[str]:
    """Mesh axes that split a user input (the batch): the data-parallel axes."""
    axes = []
    for place, names in user_placements:
        for o, a in zip(place, names):
            if isinstance(o, Shard) and a not in axes:
                axes.append(a)
    return axes


def slice_dim_for(use_place, shape, mesh, axis):
    """ZeRO-1's optimizer slice: the first dim no other axis splits that ``axis`` divides."""
    for d, size in enumerate(shape):
        if not any(isinstance(o, Shard) and o.dim == d for o in use_place) and size % mesh.axes[axis] == 0:
            return d
    return None
