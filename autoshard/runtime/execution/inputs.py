"""Checks of a call's inputs against the planned ones.

A plan is made for the example inputs: their shapes are baked into the program (a division by
``x.shape[0]``, a view to ``[batch, seq, heads, head_dim]``) and so are Python values (a
scalar ``scale``, a ``flag`` that chose a branch at capture). Running it on other inputs would
give another model's result, so every call checks each user input against the planned one and
raises :class:`InputMismatchError` naming the input, the planned and the given value.

Example::

    >>> import torch
    >>> check_input("x", torch.zeros(8, 4), (4, 4), torch.float32, None)
    Traceback (most recent call last):
    ...
    autoshard.runtime.execution.inputs.InputMismatchError: input x has shape (8, 4); the plan was made for shape (4, 4) (plan again for these inputs)
"""
from __future__ import annotations

import math

import torch

_HINT = "(plan again for these inputs)"


class InputMismatchError(ValueError):
    """A call's input differs from the one the plan was made for (a tensor's shape or dtype, or
    a Python value baked into the captured program)."""


def _same_value(given, planned) -> bool:
    if type(given) is not type(planned):  # 2 and 2.0 and True trace differently
        return False
    if isinstance(planned, float) and math.isnan(planned):
        return math.isnan(given)
    try:
        return bool(given == planned)
    except Exception:  # values without a plain equality: compare their text
        return repr(given) == repr(planned)


def check_input(name: str, given, shape, dtype, value, *, cast_floats: bool = False) -> None:
    """Raise :class:`InputMismatchError` unless ``given`` matches the planned input: a tensor
    of ``shape`` and ``dtype`` (any floating dtype when ``cast_floats``: mixed precision casts
    floating inputs to the program's dtype), or, when ``shape`` is None, the Python ``value``."""
    if shape is None:
        if isinstance(given, torch.Tensor):
            raise InputMismatchError(f"input {name} is a tensor of shape {tuple(given.shape)}; the plan was made "
                                     f"for the value {value!r} {_HINT}")
        if not _same_value(given, value):
            raise InputMismatchError(f"input {name} is {given!r}; the plan was made for {value!r} (Python values "
                                     f"are fixed in the captured program) {_HINT}")
        return
    if not isinstance(given, torch.Tensor):
        raise InputMismatchError(f"input {name} is {given!r}; the plan was made for a tensor of shape "
                                 f"{tuple(shape)} {_HINT}")
    if tuple(given.shape) != tuple(shape):
        raise InputMismatchError(f"input {name} has shape {tuple(given.shape)}; the plan was made for shape "
                                 f"{tuple(shape)} {_HINT}")
    same = given.is_floating_point() and dtype.is_floating_point if cast_floats else given.dtype == dtype
    if not same:
        raise InputMismatchError(f"input {name} has dtype {str(given.dtype).replace('torch.', '')}; the plan was "
                                 f"made for {str(dtype).replace('torch.', '')} {_HINT}")
