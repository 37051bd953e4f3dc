"""The user inputs of a run: the ones saved at export, a ``--inputs`` file, or ``--synthetic``.

Each is checked against the planned shape and dtype before any rank starts, so a wrong input
is one line naming it instead of a shape error inside a collective.

Example::

    user = load_inputs(root, doc, synthetic=True, seed=0)   # random inputs of the planned shapes
"""
from __future__ import annotations

from pathlib import Path

import torch

from autoshard.runtime.execution.local import UNCHECKED

from .errors import RunError
from .weights import _dt, _load


def load_inputs(root: Path, doc: dict, *, synthetic: bool, path=None, seed: int = 0) -> list:
    """The flat user inputs (global values): saved at export, from ``path``, or random."""
    users = [m for m in doc["inputs"] if m["kind"] == "user"]
    if synthetic:
        gen = torch.Generator().manual_seed(seed)  # every rank draws the same global inputs
        out = []
        for m in users:
            if m.get("shape") is None:
                out.append(m.get("value"))
            elif m["_dtype"].is_floating_point:
                out.append(torch.randn(m["shape"], generator=gen).to(m["_dtype"]))
            elif m["_dtype"] == torch.bool:
                out.append(torch.randint(0, 2, m["shape"], generator=gen).bool())
            else:
                out.append(torch.randint(0, max(int(m.get("high") or 2), 1), m["shape"], generator=gen,
                                         dtype=m["_dtype"]))
        return out
    what = "inputs file"
    if path is None:
        if not doc.get("example_inputs"):
            why = (doc.get("missing") or {}).get("inputs")
            raise RunError("this export has no saved inputs" + (f": {why}" if why else "")
                           + " (hint: run with --synthetic, or --inputs FILE)")
        path, what = root / doc["example_inputs"], "saved inputs file"
    data = _load(Path(path), what)
    flat = data.get("inputs") if isinstance(data, dict) else list(data) if isinstance(data, (list, tuple)) else None
    if flat is None or len(flat) != len(users):
        raise RunError(f"inputs file {path} must hold a list of {len(users)} inputs "
                       f"({', '.join(m['target'] for m in users)})")
    for m, x in zip(users, flat):
        check_input(m, x)
    return list(flat)


def check_input(m: dict, x) -> None:
    """RunError unless input ``x`` is what the program was planned for: a tensor of the planned
    shape and dtype, or the planned non-tensor value (None, a Python scalar)."""
    if m.get("shape") is None:
        planned = m.get("value")
        if isinstance(x, torch.Tensor):
            raise RunError(f"input {m['target']} is a tensor {list(x.shape)}, but the program was planned with "
                           f"{planned!r} there (hint: plan and export again with this input)")
        if "value" in m and x != planned:
            raise RunError(f"input {m['target']} is {x!r}; the program was planned for {planned!r} "
                           f"(hint: plan and export again for this value)")
        return
    if not isinstance(x, torch.Tensor) or list(x.shape) != m["shape"]:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise RunError(f"input {m['target']} is {got}; the program was planned for shape {m['shape']} "
                       f"(hint: plan and export again for this shape)")
    if x.dtype != m["_dtype"]:
        what = " (token ids and labels are integers)" if not m["_dtype"].is_floating_point and \
            x.dtype.is_floating_point else ""
        raise RunError(f"input {m['target']} has dtype {_dt(x.dtype)}; the program was planned for "
                       f"{_dt(m['_dtype'])}{what} (hint: convert it with .to(torch.{_dt(m['_dtype'])}))")


def _planned_value(m: dict):
    """A user input's planned Python value (checked on every call: it is fixed in the program);
    only plain JSON scalars survive plan.json unchanged, other values are not checked."""
    v = m.get("value")
    if m["kind"] == "user" and m.get("shape") is None and isinstance(v, (bool, int, float)):
        return v
    return UNCHECKED
