"""Reading an export's plan.json (format and version, validated) and its program files.

plan.json is the contract between the planner that wrote the export and this runtime: the
mesh, every input's owners and storage, the outputs, the weights and (pipelined) the schedule.
``read_plan`` checks all of it before anything runs, so a corrupted or foreign file is one
``RunError`` naming the field, never a traceback under torchrun. ``VERSION`` is the format this
runtime reads; an export of another version is refused with "export again with this autoshard".

Example::

    doc = read_plan(Path("out"))           # the validated plan.json
    program = load_programs(Path("out"), doc)
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from autoshard import ownership
from autoshard.mesh import Mesh
from autoshard.ownership import Shard

from . import pipeline
from .errors import RunError


# 2: run.py is a launcher that calls this runtime (1: run.py was a full copy of the runner)
FORMAT, VERSION = "autoshard-export", 2


def parse_placement(items, n_axes: int, what: str) -> tuple:
    if not isinstance(items, list) or len(items) != n_axes:
        raise RunError(f"plan.json is corrupted: {what} has owners {items!r}, expected one per mesh axis "
                       f"({n_axes}) (hint: export the plan again)")
    try:
        return ownership.parse(items)
    except ValueError as e:
        raise RunError(f"plan.json is corrupted: {what} has an {e} (hint: export the plan again)") from None


def _check_dims_in_range(place, ndim: int, what: str, bad) -> None:
    """A Shard(d) owner must name one of the value's dims (an edited or foreign plan.json may not)."""
    for o in place or ():
        if isinstance(o, Shard) and not 0 <= o.dim < ndim:
            raise bad(f"{what} is sharded on dim {o.dim}, but it has {ndim} dim{'s' if ndim != 1 else ''}")


def loss_shape(doc: dict, mesh: Mesh):
    """The global shape of the loss output (its local block's, times the axes that shard it;
    None if it is not a tensor)."""
    out = doc["outputs"][doc["loss_output"]]
    shape = out.get("local_shape")
    if not isinstance(shape, list):
        return None
    shape = list(shape)
    for o, axis in zip(out.get("_place") or (), mesh.names):
        if isinstance(o, Shard):
            shape[o.dim] *= mesh.axes[axis]
    return shape


def read_plan(root: Path) -> dict:
    """plan.json, validated enough that nothing later fails on its structure."""
    path = root / "plan.json"
    if not path.is_file():
        raise RunError(f"{path} is missing (hint: this directory is not a complete autoshard export; export again)")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{path} is corrupted: {e} (hint: export the plan again)") from None
    bad = lambda why: RunError(f"{path} is corrupted: {why} (hint: export the plan again)")  # noqa: E731
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad("it is not an autoshard export description")
    if doc.get("version") != VERSION:
        raise RunError(f"{path} has export format version {doc.get('version')!r}; this run.py reads version "
                       f"{VERSION} (hint: export again with this autoshard)")
    for key, typ in (("mesh", dict), ("world_size", int), ("inputs", list), ("outputs", list),
                     ("weights", dict), ("loss_output", int)):
        if not isinstance(doc.get(key), typ):
            raise bad(f"{key!r} is missing or not a {typ.__name__}")
    try:
        mesh = Mesh(doc["mesh"])
    except (ValueError, TypeError) as e:
        raise bad(f"mesh: {e}") from None
    if mesh.size != doc["world_size"]:
        raise bad(f"mesh {mesh} has {mesh.size} ranks but world_size says {doc['world_size']}")
    n = len(mesh.names)
    names = {m.get("name") for m in doc["inputs"] if isinstance(m, dict)}
    for k, m in enumerate(doc["inputs"]):
        if not isinstance(m, dict) or not {"name", "kind", "target"} <= set(m):
            raise bad(f"input {k} lacks name/kind/target")
        if m.get("role", "input") not in ("input", "full"):
            raise bad(f"input {m['target']!r} has an unknown role {m.get('role')!r}")
        if m.get("role") == "full" and m.get("of") not in names:
            raise bad(f"input {m['name']!r} is the full copy of an unknown parameter {m.get('of')!r}")
        if m.get("use_placement") is not None:
            m["_use"] = parse_placement(m["use_placement"], n, f"input {m['target']!r}")
        if m.get("storage") is not None and not ({"mode", "axis", "dim"} <= set(m["storage"]) and
                                                 m["storage"]["axis"] in mesh.axes):
            raise bad(f"input {m['target']!r} has storage {m['storage']!r}")
        if (m.get("storage") or {}).get("mode") == "persistent" and "_use" not in m:
            raise bad(f"input {m['target']!r} is stored with a full copy but has no use_placement")
        if m.get("shape") is not None:
            m["_place"] = parse_placement(m.get("placement"), n, f"input {m['target']!r}")
            if not isinstance(m["shape"], list) or not all(isinstance(s, int) for s in m["shape"]):
                raise bad(f"input {m['target']!r} has shape {m['shape']!r}")
            try:
                m["_dtype"] = getattr(torch, m["dtype"])
            except (AttributeError, TypeError):
                raise bad(f"input {m['target']!r} has dtype {m.get('dtype')!r}") from None
            if not isinstance(m["_dtype"], torch.dtype):
                raise bad(f"input {m['target']!r} has dtype {m.get('dtype')!r}")
            ndim = len(m["shape"])
            _check_dims_in_range(m["_place"], ndim, f"input {m['target']!r}", bad)
            _check_dims_in_range(m.get("_use"), ndim, f"input {m['target']!r} (as used)", bad)
            for key in ("storage", "zero1"):
                d = (m.get(key) or {}).get("dim")
                if d is not None and not (isinstance(d, int) and 0 <= d < ndim):
                    raise bad(f"input {m['target']!r} has {key} dim {d!r}, but it has {ndim} dims")
    if not doc["outputs"]:
        raise bad("'outputs' is empty: the program returns nothing to run or check")
    for k, o in enumerate(doc["outputs"]):
        if not isinstance(o, dict):
            raise bad(f"output {k} is not an object")
        o["_place"] = parse_placement(o["placement"], n, f"output {k}") if o.get("placement") is not None else None
        if o["_place"] is not None and isinstance(o.get("local_shape"), list):
            _check_dims_in_range(o["_place"], len(o["local_shape"]), f"output {k}", bad)
    gb = doc.get("grad_buckets")
    if gb is not None:
        trainable = {m["name"] for m in doc["inputs"] if m["kind"] == "parameter" and m.get("trainable")}
        if not (isinstance(gb, dict) and gb.get("axis") in mesh.axes and isinstance(gb.get("buckets"), list)
                and all(isinstance(b, dict) and set(b.get("params", [None])) <= trainable for b in gb["buckets"])):
            raise bad("grad_buckets does not name the mesh's axes and trainable parameters")
    if not 0 <= doc["loss_output"] < len(doc["outputs"]):
        raise bad(f"loss_output {doc['loss_output']} is not an output")
    if doc.get("pipeline") is not None:
        _pipeline().validate(doc, mesh, bad)
    return doc


def _pipeline():
    """The runner of pipelined exports (a program file per stage, the schedule in plan.json)."""
    return pipeline


def _this():
    """The runner's namespace (this package), handed to the pipelined runner as ``R``: the
    pipeline module is imported by this package, so it does not import the package back."""
    return sys.modules[__package__]


def load_programs(root: Path, doc: dict):
    """program.py, or for a pipelined export every stage file (one ``DEVICE`` for them all)."""
    return _pipeline().load_stages(root, doc, _this()) if doc.get("pipeline") else load_program(root)


def load_program(root: Path, name: str = "program.py"):
    path = root / name
    if not path.is_file():
        raise RunError(f"{path} is missing (hint: export the plan again)")
    spec = importlib.util.spec_from_file_location(f"autoshard_program_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a broken program file is a usage error here
        raise RunError(f"{path} does not load: {type(e).__name__}: {e} (hint: export the plan again)") from None
    if not callable(getattr(module, "forward", None)):
        raise RunError(f"{path} has no forward function (hint: export the plan again)")
    return module
