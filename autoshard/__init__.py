"""autoshard: a compiler-style sharding pass for PyTorch.

Example::

    >>> import autoshard
    >>> mesh = autoshard.Mesh({"dp": 2, "tp": 2})
    >>> mesh.size
    4

The planner's names (``autoshard.autoshard``, ``Plan``, ``LayoutError``, ...) load on first use,
so the runtime (``autoshard.runtime``, what an exported run.py needs) and the command line's
``--help`` do not import the planner, the cost model and their dependencies.
"""
import importlib

from .mesh import Mesh

# public name -> module that defines it (imported when the name is first read)
_FACADE = {
    "autoshard": "autoshard.api",
    "Plan": "autoshard.plan",
    "LayoutError": "autoshard.passes.spmd",
    "UnsupportedOpWarning": "autoshard.passes.spmd",
    "UnsupportedModelError": "autoshard.passes.guards",
    "DropoutWarning": "autoshard.passes.guards",
    "IdleAxisWarning": "autoshard.cost.idle",
    "InputMismatchError": "autoshard.runtime.execution.inputs",
    "CaptureError": "autoshard.passes.export_errors",
    "consolidate": "autoshard.runtime.execution.checkpoint",
    "CheckpointError": "autoshard.runtime.execution.checkpoint",
    # the options of autoshard() as typed objects (autoshard/options.py)
    **{name: "autoshard.options" for name in (
        "TrainingOptions", "SearchOptions", "RewriteOptions", "PipelineOptions", "PrecisionOptions",
        "RecomputeOptions", "ContextOptions", "ExpertOptions", "Options")},
}

__all__ = ["Mesh", *_FACADE]


def __getattr__(name):
    if name in _FACADE:
        value = getattr(importlib.import_module(_FACADE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FACADE))
