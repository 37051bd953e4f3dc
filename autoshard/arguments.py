"""Checks of ``autoshard.autoshard``'s plain-data arguments, before anything is captured.

A wrong type (``layout={"batch": 2}``, ``dims=5``, ``zero_stage=True``) gets a one-line
``TypeError`` naming the argument, the entry and what is expected, instead of an error from deep
inside the planner.

Example::

    >>> check_layout({"batch": "dp", "ffn": ("dp", "tp"), "seq": None})
    >>> check_layout({"batch": 2})
    Traceback (most recent call last):
    ...
    TypeError: layout['batch'] is 2 (int); give a mesh axis name ('dp'), a tuple of names (('dp', 'tp')) or None
"""
from __future__ import annotations

from typing import Mapping

_LAYOUT_HINT = "give a mesh axis name ('dp'), a tuple of names (('dp', 'tp')) or None"


def _what(v) -> str:
    return f"{v!r} ({type(v).__name__})"


def check_layout(layout) -> None:
    """``layout`` is None or ``{dim name or glob: None | axis | (axis, ...)}``."""
    if layout is None:
        return
    if not isinstance(layout, Mapping):
        raise TypeError(f"layout is {_what(layout)}; give a dict such as {{'batch': 'dp', 'heads': 'tp'}}")
    for key, axes in layout.items():
        if not isinstance(key, str):
            raise TypeError(f"layout key {_what(key)} is not a dim name; keys are dim names or globs "
                            f"such as 'batch' or 'layers.*.mlp.gate_proj.weight:0'")
        if axes is None or isinstance(axes, str):
            continue
        if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
            continue
        raise TypeError(f"layout[{key!r}] is {_what(axes)}; {_LAYOUT_HINT}")


def check_dims(dims) -> None:
    """``dims`` is None, a list (one entry per positional argument: a string of space-separated
    names, a list of names, or None) or a dict ``{argument / parameter FQN glob: names}``."""
    if dims is None:
        return
    hint = ("give a dict such as {'input_ids': 'batch seq', '*.q_proj.weight': 'heads hidden'} "
            "or a list with one string per positional argument")
    if isinstance(dims, Mapping):
        items = list(dims.items())
        for key, _ in items:
            if not isinstance(key, str):
                raise TypeError(f"dims key {_what(key)} is not an argument name or FQN glob; {hint}")
    elif isinstance(dims, (list, tuple)):
        items = [(f"[{k}]", spec) for k, spec in enumerate(dims)]
    else:
        raise TypeError(f"dims is {_what(dims)}; {hint}")
    for key, spec in items:
        if spec is None or isinstance(spec, str):
            continue
        if isinstance(spec, (list, tuple)) and all(w is None or isinstance(w, str) for w in spec):
            continue
        where = f"dims{key}" if key.startswith("[") else f"dims[{key!r}]"
        raise TypeError(f"{where} is {_what(spec)}; give space-separated dim names such as 'batch seq' "
                        f"('-' for a dim left unnamed)")


def check_zero_stage(zero_stage) -> None:
    """``zero_stage`` is None or the int 0, 1, 2 or 3 (a bool is refused: True is not a stage)."""
    if zero_stage is None:
        return
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (or None), not {_what(zero_stage)}")
