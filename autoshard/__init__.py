"""autoshard: a compiler-style sharding pass for PyTorch.

Example::

    >>> import autoshard
    >>> mesh = autoshard.Mesh({"dp": 2, "tp": 2})
    >>> mesh.size
    4
"""
from .mesh import Mesh
from .plan import Plan
from .api import autoshard
from autoshard.passes.spmd import LayoutError, UnsupportedOpWarning

__all__ = ["Mesh", "Plan", "autoshard", "LayoutError", "UnsupportedOpWarning"]
