"""Named device meshes.

A mesh is an ordered set of named axes whose sizes multiply to the world size. Ranks are laid
out row-major over the axes (the last axis varies fastest), as torch's ``init_device_mesh``
does, so a rank's coordinate on each axis and the ranks sharing an axis group are pure
arithmetic.

Example::

    >>> mesh = Mesh({"dp": 2, "tp": 2})
    >>> mesh.size, mesh.coords(3), mesh.group("tp", 2)
    (4, {'dp': 1, 'tp': 1}, [2, 3])
"""
from __future__ import annotations

import math
from typing import Mapping


class Mesh:
    """Named mesh axes, e.g. ``Mesh({"dp": 2, "tp": 2})``; also ``Mesh(device_mesh)``."""

    def __init__(self, axes):
        device_mesh = None
        if not isinstance(axes, Mapping):
            if not hasattr(axes, "mesh_dim_names"):
                raise TypeError(f"a mesh is a dict of named axes, e.g. Mesh({{'dp': 2, 'tp': 2}}), or a torch "
                                f"DeviceMesh; got {type(axes).__name__} {_example(axes)}")
            device_mesh = axes
            names = getattr(axes, "mesh_dim_names", None)
            if not names:
                raise ValueError("a torch DeviceMesh needs mesh_dim_names to become an autoshard.Mesh")
            axes = dict(zip(names, axes.mesh.shape))
        if not axes:
            raise ValueError("a mesh needs at least one axis")
        for name, size in axes.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} must be an identifier such as 'dp' or 'tp'")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes must be positive integers")
        self.axes: dict[str, int] = dict(axes)
        self.device_mesh = device_mesh

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.axes.values())

    @property
    def size(self) -> int:
        return math.prod(self.axes.values())

    def axis_size(self, axis: str) -> int:
        self.check_axis(axis)
        return self.axes[axis]

    def check_axis(self, axis: str) -> None:
        if axis not in self.axes:
            raise ValueError(f"unknown mesh axis {axis!r}; this mesh has axes {list(self.axes)}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` on every axis (row-major, last axis fastest)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        out = {}
        for name in reversed(self.names):
            out[name] = rank % self.axes[name]
            rank //= self.axes[name]
        return {name: out[name] for name in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name in self.names:
            rank = rank * self.axes[name] + coords[name]
        return rank

    def group(self, axis: str, rank: int) -> list[int]:
        """Ranks that share every coordinate with ``rank`` except ``axis``, in axis order."""
        self.check_axis(axis)
        c = self.coords(rank)
        return [self.rank_of({**c, axis: i}) for i in range(self.axes[axis])]

    def groups(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (each a list of ranks), in order of first rank."""
        seen, out = set(), []
        for r in range(self.size):
            g = self.group(axis, r)
            if g[0] not in seen:
                seen.add(g[0])
                out.append(g)
        return out

    def __eq__(self, other):
        return isinstance(other, Mesh) and self.axes == other.axes

    def __hash__(self):
        return hash(tuple(self.axes.items()))

    def __repr__(self):
        return "Mesh(" + ", ".join(f"{k}={v}" for k, v in self.axes.items()) + ")"

    @staticmethod
    def auto(n_devices: int, axes=("dp", "tp")) -> "AutoMesh":
        """A mesh shape left to the search: pass it as ``mesh=`` and ``autoshard.autoshard``
        tries every factorization of ``n_devices`` over ``axes`` (sizes in axis order, 1
        allowed) and returns the best plan; ``plan.mesh`` is the chosen shape.

        >>> [m.axes for m in Mesh.auto(4).meshes()]
        [{'dp': 1, 'tp': 4}, {'dp': 2, 'tp': 2}, {'dp': 4, 'tp': 1}]
        """
        return AutoMesh(n_devices, tuple(axes))


def _example(axes) -> str:
    """``{!r}`` of a mistaken mesh value, with the dict it probably meant when that is clear."""
    text = repr(axes) if len(repr(axes)) <= 60 else repr(axes)[:57] + "..."
    if isinstance(axes, str):
        pairs = [p.partition("=") for p in axes.replace(" ", "").split(",") if p]
        if pairs and all(eq and v.isdigit() for _, eq, v in pairs):
            return f"{text} (write Mesh({{{', '.join(f'{k!r}: {v}' for k, _, v in pairs)}}}))"
        return text
    try:
        as_dict = dict(axes)
    except (TypeError, ValueError):
        return text
    return f"{text} (write Mesh({as_dict!r}))"


class AutoMesh:
    """``Mesh.auto(n, axes)``: every mesh of ``n`` devices over ``axes``, for the search."""

    def __init__(self, n_devices: int, axes: tuple):
        if not isinstance(n_devices, int) or n_devices < 1:
            raise ValueError(f"Mesh.auto needs a positive device count, got {n_devices!r}")
        if not axes or len(set(axes)) != len(axes):
            raise ValueError(f"Mesh.auto needs distinct axis names, got {axes!r}")
        self.n_devices, self.axes = n_devices, tuple(axes)
        self.meshes()  # validates the names

    def meshes(self) -> list:
        """One :class:`Mesh` per ordered factorization of the device count."""
        return [Mesh(dict(zip(self.axes, f))) for f in factorizations(self.n_devices, len(self.axes))]

    @property
    def size(self) -> int:
        return self.n_devices

    def __repr__(self):
        return f"Mesh.auto({self.n_devices}, axes={self.axes})"


def factorizations(n: int, k: int) -> list:
    """Every way to write ``n`` as an ordered product of ``k`` positive integers.

    >>> factorizations(8, 2)
    [(1, 8), (2, 4), (4, 2), (8, 1)]
    """
    if k == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [(d,) + rest for rest in factorizations(n // d, k - 1)]
    return out
