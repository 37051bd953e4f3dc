"""run.py of an autoshard export: run the per-rank program under torchrun.

This file is copied verbatim into every exported directory as ``run.py`` (and importable as
``autoshard.passes.export_runner``, which tests and ``simulate_export`` use). Usage::

    torchrun --nproc-per-node=4 out/run.py                 # one forward on the saved inputs
    torchrun --nproc-per-node=4 out/run.py --check         # ... compared with the unsharded model
    torchrun --nproc-per-node=4 out/run.py --steps 2 --check   # 2 training steps (AdamW)
    torchrun --nproc-per-node=4 out/run.py --steps 20 --data tokens.bin --ckpt ck/   # the training loop
    torchrun --nproc-per-node=4 out/pp/run.py --steps 2 --timeline t.json   # pipelined: the measured trace
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 out/run.py --synthetic

Each process: reads plan.json and checks everything it can before joining the process group
(world size against the mesh, files, shapes: a clear one-line error and exit code 2, never a
hang); initializes torch.distributed (nccl when CUDA is available, else gloo), builds the
DeviceMesh, loads only its own blocks of the weights (the weights file is memory-mapped, so
slicing reads only those pages), and runs ``program.forward`` inside a rank context. Rank 0
prints per-step loss and time. ``--check`` compares every rank's outputs (and, with
``--steps``, gradients of the first step and the losses of every step) with the references of
the unsharded model saved at export, and prints "check passed" only if every rank passed.
A training step whose loss or gradient norm is not finite stops every process with exit code 4
before its optimizer step (``--nan-policy``; ``skip-step`` skips it, ``ignore`` trains on).

It needs the installed autoshard runtime (collectives, DistributedBackend), not the planner.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import threading
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.mesh import Mesh
from autoshard import ownership
from autoshard.ownership import ParamStorage, Replicate, Shard, local_piece
from autoshard.runtime import DistributedBackend, current, rank_context
from autoshard.runtime.local import OPTIMIZERS, UNCHECKED, LocalModule, RankSpec, ShardedOptimizer, SliceSource, Slot
from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime.clip import clip_grad_norm_, global_grad_norm
from autoshard.runtime import step_memory
from autoshard.runtime.watchdog import Heartbeat, first_to_report, stalled_ranks, wake
from autoshard.passes import export_pipeline_runner

FORMAT, VERSION = "autoshard-export", 1
EXIT_USAGE = 2
EXIT_NONFINITE = 4
NAN_POLICIES = ("stop", "skip-step", "ignore")  # --nan-policy: what a non-finite loss or gradient norm does


class RunError(Exception):
    """A problem found before running (bad files, wrong world size): one line, exit code 2."""


class NonFiniteError(Exception):
    """A training step whose loss or gradient norm is not finite under ``--nan-policy stop``, or
    trained state that is not finite where a checkpoint is due: one line, exit code 4. Every
    rank raises it at the same step (the verdict is agreed)."""


# ------------------------------------------------------------------------------------------------
# reading the export
# ------------------------------------------------------------------------------------------------

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
    return export_pipeline_runner


def _this():
    """This module (run.py runs it as __main__): its RunError is the one run() reports."""
    return sys.modules[__name__]


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


_HINTS = {"weights file": "export the plan again", "weights checkpoint": "check the --weights path",
          "inputs file": "check the --inputs path, or run with --synthetic",
          "reference file": "export again with example inputs, or run without --check"}


def _load(path: Path, what: str):
    if not path.is_file():
        raise RunError(f"{what} {path} is missing (hint: {_HINTS.get(what, 'export the plan again')})")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise RunError(f"{what} {path} cannot be read: {type(e).__name__}: {str(e).splitlines()[0]} "
                       f"(hint: a file written by torch.save, loadable with weights_only=True)") from None


# safetensors' dtype names (``get_slice(key).get_dtype()``) as torch dtypes
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsTensor(SliceSource):
    """One tensor of a safetensors file, read by region: a rank's block is
    ``safe_open(file).get_slice(key)[its slices]``, so no rank reads (or holds) a whole tensor
    it shards. ``convert`` is the plan's dtype when the file's differs (floats only)."""

    def __init__(self, file: Path, key: str, shape, dtype, convert=None):
        self.file, self.key, self.shape, self.dtype, self.convert = file, key, tuple(shape), dtype, convert

    def as_dtype(self, dtype) -> "SafetensorsTensor":
        return SafetensorsTensor(self.file, self.key, self.shape, dtype, convert=dtype)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def local_piece(self, place, mesh, rank: int) -> torch.Tensor:
        from safetensors import safe_open  # only where a safetensors source is read
        region = ckpt.block_region(self.shape, place, mesh, rank)
        if region is None:  # an Owned axis: this rank holds none of it
            region = [0] * len(self.shape), [0] + list(self.shape[1:])
        index = tuple(slice(o, o + n) for o, n in zip(*region))
        with safe_open(str(self.file), framework="pt") as f:
            piece = f.get_slice(self.key)[index] if index else f.get_tensor(self.key)
        return piece.to(self.convert) if self.convert is not None else piece


def read_safetensors(src: Path) -> dict:
    """{key: SafetensorsTensor} of a ``.safetensors`` file or of a Hugging Face checkpoint
    directory (``save_pretrained``'s ``model.safetensors``, or its shards listed by
    ``model.safetensors.index.json``); only the headers are read here.

    Example::

        state = read_safetensors(Path("llama-hf"))   # {"model.layers.0.mlp.up_proj.weight": ..., ...}
    """
    from safetensors import safe_open  # only where a safetensors source is read
    if src.is_dir():
        index = src / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise RunError(f"weights checkpoint {index} cannot be read: {type(e).__name__}: {e} "
                               f"(hint: a save_pretrained index with a weight_map)") from None
            files = sorted(set(weight_map.values()))
        elif (src / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise RunError(f"weights checkpoint {src} is a directory without model.safetensors or "
                           f"model.safetensors.index.json (hint: a Hugging Face save_pretrained directory, a "
                           f".safetensors file or a torch.save state dict)")
        paths = [src / f for f in files]
    else:
        paths = [src]
    state: dict = {}
    for path in paths:
        if not path.is_file():
            raise RunError(f"weights checkpoint {path} is missing (hint: check the --weights path; a sharded "
                           f"checkpoint needs every file its index lists)")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise RunError(f"weights checkpoint {path}: {key} has the dtype {sl.get_dtype()}, which "
                                       f"run.py does not read (hint: save it as a float or integer tensor)")
                    state[key] = SafetensorsTensor(path, key, sl.get_shape(), dtype)
        except RunError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file is a usage error here
            raise RunError(f"weights checkpoint {path} cannot be read: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''} (hint: a file written by safetensors)") from None
    return state


def read_checkpoint(src, prefix: str | None = None) -> dict:
    """The ``--weights`` state by plan FQN: a torch.save state dict (memory-mapped), a
    ``.safetensors`` file or a Hugging Face checkpoint directory (read by region). ``prefix``
    (``--weights-prefix``) is where the checkpoint's keys live in the planned module: it is
    prepended to every key, so with ``self.model = hf_model`` and prefix ``model`` the
    checkpoint's ``lm_head.weight`` is the plan's ``model.lm_head.weight``."""
    src = Path(src)
    if src.is_dir() or src.suffix == ".safetensors":
        state = read_safetensors(src)
    else:
        state = _load(src, "weights checkpoint")
        if not isinstance(state, dict):
            raise RunError(f"weights checkpoint {src} holds a {type(state).__name__}, not a state dict")
    if prefix:
        prefix = prefix if prefix.endswith(".") else prefix + "."
        state = {prefix + k: v for k, v in state.items()}
    return state


class Weights:
    """Tensors by FQN from the weights file (and a checkpoint, for parameters: see
    :func:`read_checkpoint`), memory-mapped or, from safetensors, read by region: a rank's
    slice of a tensor reads only that slice. An export of a model planned
    on the meta device has no weights file: parameters come from the checkpoint, and the
    buffers no checkpoint has from ``buffers.pt`` (recomputed at export)."""

    def __init__(self, root: Path, doc: dict, checkpoint=None, allow_partial: bool = False, prefix: str | None = None):
        sources = []
        ckpt = checkpoint or doc["weights"].get("checkpoint")
        self.partial_note = None
        w = doc["weights"]
        files = [(w.get("file", "weights.pt"), "weights file")] if w.get("file", "weights.pt") else []
        if w.get("buffers"):
            files.append((w["buffers"], "buffers file"))
        if not ckpt and not w.get("file", "weights.pt"):
            why = (doc.get("missing") or {}).get("weights") or "the export was made without weights"
            raise RunError(f"this export has no weights: {why} (hint: run.py --weights SRC)")
        if ckpt:
            # the export's checkpoint comes with the export's prefix; a --weights one with its own
            state = read_checkpoint(ckpt, prefix if checkpoint else w.get("prefix"))
            self.partial_note = check_checkpoint_keys(state, doc, ckpt, allow_partial)
            sources.append(state)
        for name, what in files:
            state = _load(root / name, what)
            if not isinstance(state, dict):
                raise RunError(f"{what} {root / name} holds a {type(state).__name__}, "
                               f"not a state dict (hint: export the plan again)")
            sources.append(state)
        self.sources = sources
        self.aliases: dict = {}
        for alias, kept in (doc.get("aliases") or {}).items():
            self.aliases.setdefault(kept, []).append(alias)
        self.dtypes = {m["target"]: m["_dtype"] for m in doc["inputs"]
                       if m["kind"] != "user" and m.get("role", "input") == "input" and m.get("shape") is not None}
        missing, wrong, dtypes, meta = [], [], [], []
        for m in doc["inputs"]:
            if m["kind"] == "user" or m.get("role", "input") != "input" or m.get("shape") is None:
                continue
            t = self.find(m["target"])
            if t is None:
                missing.append(m["target"])
            elif not isinstance(t, (torch.Tensor, SliceSource)):
                wrong.append(f"{m['target']} is a {type(t).__name__}, not a tensor")
            elif t.is_meta:  # no data to copy out (an export of a meta model made without checks)
                meta.append(m["target"])
            elif list(t.shape) != m["shape"]:
                wrong.append(f"{m['target']} is {list(t.shape)}, the plan has {m['shape']}")
            elif t.dtype != m["_dtype"]:
                dtypes.append(f"{m['target']} is {_dt(t.dtype)}, the plan has {_dt(m['_dtype'])}")
        if missing:
            raise RunError(f"the weights have no tensor for {len(missing)} name(s), e.g. {missing[:3]} "
                           f"(hint: pass --weights with a state dict keyed by parameter name)")
        if meta:
            raise RunError(f"the weights hold {len(meta)} tensor(s) on the meta device (shapes, no data): "
                           f"{_names(meta, 3)} (hint: pass --weights with a state dict of real tensors, or export "
                           f"the plan again)")
        if wrong:
            raise RunError(f"weights of the wrong shape: {'; '.join(wrong[:3])} (hint: this export was planned "
                           f"for another model configuration)")
        if dtypes:
            raise RunError(f"weights of the wrong dtype: {'; '.join(dtypes[:3])}"
                           + (f" and {len(dtypes) - 3} more" if len(dtypes) > 3 else "")
                           + " (hint: floating point and integer tensors do not convert into each other; "
                             "check that the checkpoint is of this model)")

    def find(self, fqn: str):
        for name in [fqn] + self.aliases.get(fqn, []):
            for s in self.sources:
                if name in s:
                    t = s[name]
                    want = self.dtypes.get(fqn)
                    if isinstance(t, (torch.Tensor, SliceSource)) and want is not None and t.dtype != want \
                            and t.is_floating_point() and want.is_floating_point:
                        # another float dtype (an fp32 checkpoint of a bf16 plan): converted as
                        # model.load_state_dict would; integer <-> float mismatches are refused
                        # (a file's tensor converts each rank's block as it is read)
                        t = t.as_dtype(want) if isinstance(t, SliceSource) else t.to(want)
                    return t
        return None


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _names(keys, n: int = 4) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def _common_prefix_fix(unexpected, missing, prefix_option: str = "run with --weights-prefix {}") -> str:
    """``"strip the prefix 'model.'"`` when removing one dotted prefix from the unexpected keys
    gives the missing ones; '' otherwise."""
    prefixes = {k.split(".", 1)[0] + "." for k in unexpected if "." in k}
    for pre in sorted(prefixes):
        if {k[len(pre):] for k in unexpected if k.startswith(pre)} & set(missing):
            return f"its keys carry the prefix {pre!r}: strip it, e.g. {{k.removeprefix({pre!r}): v for k, v in " \
                   f"state.items()}}"
    # the other way round: the planned module holds the checkpoint's model under an attribute
    for pre in sorted({k.split(".", 1)[0] + "." for k in missing if "." in k}):
        if {k[len(pre):] for k in missing if k.startswith(pre)} & set(unexpected):
            return f"the program's names carry the prefix {pre!r} its keys lack: " + prefix_option.format(pre[:-1])
    return ""


def check_checkpoint_keys(state: dict, doc: dict, ckpt, allow_partial: bool):
    """RunError unless the checkpoint has every parameter the program reads (under its name or a
    tied alias): a checkpoint with other keys (a ``model.`` prefix, another model, only some
    layers) must not silently fall back to the exported weights. With ``allow_partial`` the
    parameters it lacks come from the export, and a one-line note (returned) says how many."""
    aliases: dict = {}
    for alias, kept in (doc.get("aliases") or {}).items():
        aliases.setdefault(kept, []).append(alias)
    known, missing = set(), []
    for m in doc["inputs"]:
        if m["kind"] == "user" or m.get("role", "input") != "input":
            continue
        names = [m["target"]] + aliases.get(m["target"], [])
        known.update(names)
        if m["kind"] == "parameter" and m.get("shape") is not None and not any(k in state for k in names):
            missing.append(m["target"])
    unexpected = [k for k in state if k not in known]
    if not missing:
        return None
    if allow_partial:
        return (f"--allow-partial: {len(missing)} of the program's parameters are not in {ckpt} and come from the "
                f"export ({_names(missing, 2)})" + (f"; {len(unexpected)} of its keys are not used" if unexpected else ""))
    fix = _common_prefix_fix(unexpected, missing)
    raise RunError(f"weights checkpoint {ckpt} does not match the program: missing {len(missing)} parameter(s) "
                   f"({_names(missing)})" + (f"; unexpected key(s) ({_names(unexpected)})" if unexpected else "")
                   + f" (hint: {fix or 'a state dict keyed by parameter name, as model.state_dict() gives'}; "
                     f"--allow-partial takes the missing ones from the export)")


def open_weights(root: Path, doc: dict, checkpoint=None, allow_partial: bool = False,
                 prefix: str | None = None) -> Weights:
    """The export's weights, parameters from ``checkpoint`` (run.py's ``--weights``: see
    :func:`read_checkpoint`, ``prefix`` is ``--weights-prefix``) where given.

    Example::

        weights = open_weights(Path("out"), read_plan(Path("out")), "llama-hf/", prefix="model")
    """
    if prefix and not (checkpoint or doc["weights"].get("checkpoint")):
        raise RunError("--weights-prefix applies to a --weights checkpoint")
    return Weights(root, doc, checkpoint, allow_partial, prefix)


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


def rank_spec(doc: dict, mesh: Mesh, forward, train: bool) -> RankSpec:
    """The :class:`~autoshard.runtime.local.RankSpec` of plan.json: every argument of the
    program as a slot (how it is stored, trainable when ``train``), the data axes and buckets."""
    slots = []
    for m in doc["inputs"]:
        if m.get("role", "input") == "full":
            slots.append(Slot(m["name"], "full", m["of"], m.get("_place")))
            continue
        st = m.get("storage")
        storage = ParamStorage(m["_place"], st["axis"], st["dim"], st.get("stage", 0), st["mode"],
                               bool(st.get("reshard"))) if st else None
        z1 = m.get("zero1")
        slots.append(Slot(m["name"], m["kind"], m["target"], m.get("_place"), m.get("_use"), storage,
                          bool(train and m.get("trainable")), (z1["axis"], z1["dim"]) if z1 else None,
                          tuple(m["shape"]) if m.get("shape") is not None else None,
                          m.get("_dtype", torch.float32), _planned_value(m)))
    buckets = doc.get("grad_buckets") or {}
    # a pipelined step defers every data-axis gradient sum to its last microbatch (they are in
    # the stage programs, not in buckets); otherwise the data axis is the buckets'
    axes = list(doc.get("data_axes") or []) if doc.get("pipeline") else ([buckets["axis"]] if buckets.get("axis") else [])
    return RankSpec(mesh, forward, slots, axes,
                    frozenset(doc.get("reshard_tags") or ()),
                    [(b["tag"], list(b["params"])) for b in buckets.get("buckets", [])] if train else [],
                    reduce_dtype=getattr(torch, doc["reduce_dtype"]) if doc.get("reduce_dtype") else None)


def weights_lookup(weights: Weights):
    """``lookup(slot)`` for LocalModule: the slot's global tensor from the weights (None for a
    non-tensor value)."""
    return lambda slot: weights.find(slot.target) if slot.shape is not None else None


def rank_program(doc: dict, mesh: Mesh, rank: int, program, weights: Weights, device, train: bool):
    """This rank's :class:`RankProgram`, or for a pipelined export its ``PipelineProgram``."""
    if doc.get("pipeline"):
        return _pipeline().PipelineProgram(doc, mesh, rank, program, weights, device, train, _this())
    return RankProgram(doc, mesh, rank, program, weights, device, train)


class RankProgram:
    """One rank's program with its parameters as stored (whole, a tensor-parallel block, or a
    ZeRO shard) and its optimizer: autoshard's own :class:`~autoshard.runtime.local.LocalModule` and
    :class:`~autoshard.runtime.local.ShardedOptimizer`, built from plan.json instead of a plan."""

    def __init__(self, doc: dict, mesh: Mesh, rank: int, program, weights: Weights, device, train: bool):
        self.doc, self.mesh, self.rank, self.device = doc, mesh, rank, device
        self.local = LocalModule(rank_spec(doc, mesh, program.forward, train), rank, weights_lookup(weights), device)
        self.params = {self.local.fqn_of[n]: p for n, p in self.local.named_parameters() if p.requires_grad}
        self.opt = None

    def forward(self, user: list) -> list:
        """The program's flat local outputs (call inside the rank context)."""
        return self.local.run_flat(user)

    def train_step(self, user: list):
        """Forward and backward of one step on the global inputs ``user``: the local loss."""
        loss = self.forward(user)[self.doc["loss_output"]]
        # ones of the local loss shape: right for every owner (see autoshard's Plan.run_rank)
        loss.backward(torch.ones_like(loss))
        return loss

    def step_loss(self, loss) -> float:
        """The step's global loss from this rank's block (call on every rank)."""
        return global_sum(loss, self.doc["outputs"][self.doc["loss_output"]]["_place"], self.mesh)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients to the global 2-norm ``max_norm``; the norm before clipping."""
        return clip_grad_norm_(self.local, max_norm)

    def grad_norm(self) -> float:
        """The gradients' global 2-norm (the same float on every rank), nothing clipped."""
        return global_grad_norm(self.local)

    def make_optimizer(self, kind: str, lr: float):
        self.opt = ShardedOptimizer.by_name(self.local, kind, lr)

    def step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def rank_loop(rp: RankProgram, user: list, *, steps: int, optimizer: str = "adamw", lr: float = 1e-3,
              ref=None, rtol: float = 1e-4, atol: float = 1e-5, say=lambda msg: None,
              nan_policy: str = "stop") -> dict:
    """Forward only (``steps=0``) or ``steps`` training steps of one rank, inside its rank
    context; compares with ``ref`` (outputs, and first-step gradients) when given. A step whose
    loss or gradient norm is not finite is handled by ``nan_policy`` (:func:`nonfinite_step`)."""
    doc, mesh = rp.doc, rp.mesh
    res = dict(ok=True, worst_out=0.0, worst_grad=0.0, problems=[], losses=[], outputs=None, grads=None)
    sync = torch.cuda.synchronize if rp.device.type == "cuda" else (lambda: None)
    if not steps:
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = rp.forward(user)
        sync()
        dt = time.perf_counter() - t0
        say(f"forward  time {dt * 1e3:.1f} ms  outputs: {describe_outputs(outs, doc, mesh)}")
        res["outputs"] = outs
        if ref is not None:
            res["ok"], res["worst_out"], res["problems"] = compare_outputs(doc, mesh, rp.rank, outs, ref, rtol, atol)
        return res
    k_loss = doc["loss_output"]
    loss_place = doc["outputs"][k_loss]["_place"]
    rp.make_optimizer(optimizer, lr)
    for step in range(steps):
        t0 = time.perf_counter()
        outs = rp.forward(user)
        loss = outs[k_loss]
        # ones of the local loss shape: right for every owner (see autoshard's Plan.run_rank)
        loss.backward(torch.ones_like(loss))
        if step == 0:
            res["outputs"] = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
            res["grads"] = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                            for k, p in rp.params.items()}
            if ref is not None:
                o_ok, res["worst_out"], p1 = compare_outputs(doc, mesh, rp.rank, outs, ref, rtol, atol)
                g_ok, res["worst_grad"], p2 = compare_grads(doc, mesh, rp.rank, rp.params, ref, rtol, atol)
                res["ok"], res["problems"] = o_ok and g_ok, p1 + p2
        value = global_sum(loss, loss_place, mesh)
        skipped = nonfinite_step(rp, step + 1, value, None, nan_policy)
        if skipped:
            rp.opt.zero_grad(set_to_none=True)
        else:
            rp.step()
        sync()
        dt = time.perf_counter() - t0
        res["losses"].append(value)
        say(f"step {step + 1}/{steps}  loss {value:.6f}  time {dt * 1e3:.1f} ms" + (f"  {skipped}" if skipped else ""))
    return res


def agreed(rp, flags) -> list:
    """Whether any rank's flag is set, for each of ``flags``, on every rank (a sum over every
    mesh axis). Call on every rank inside its rank context."""
    backend = current("agreed").backend
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64, device=rp.device)
    for axis in rp.mesh.names:
        t = backend.all_reduce(t, axis)
    return [v > 0 for v in t.tolist()]


def nonfinite_step(rp, step: int, loss: float, norm, policy: str):
    """``--nan-policy`` before step ``step``'s optimizer step, on every rank: None where the
    step's global ``loss`` and gradient ``norm`` (the clipping's, or None: computed here) are
    finite or the policy is ``ignore``; where one is not, NonFiniteError under ``stop``, and
    under ``skip-step`` the words saying why the step is skipped (the caller drops the
    gradients instead of stepping). All ranks agree, so all skip or stop at the same step.

    Example::

        why = nonfinite_step(rp, 7, loss, None, "skip-step")   # e.g. "loss nan: ... skipped ..."
    """
    if policy == "ignore":
        return None
    if norm is None:
        norm = rp.grad_norm()
    bad_loss, bad_norm = agreed(rp, [not math.isfinite(loss), not math.isfinite(norm)])
    if not (bad_loss or bad_norm):
        return None
    what = " and ".join(w for w, bad in ((f"loss {loss}", bad_loss), (f"gradient norm {norm}", bad_norm)) if bad)
    if policy == "stop":
        raise NonFiniteError(f"step {step}: {what}, not finite: stopped before its optimizer step "
                             f"(--nan-policy stop; skip-step skips such steps, ignore trains on)")
    return f"skipped: {what}, not finite (--nan-policy skip-step: no optimizer step)"


def check_finite_state(rp, step: int, path) -> None:
    """NonFiniteError on every rank where any rank's parameters or optimizer state hold a value
    that is not finite: the checkpoint ``path`` due after step ``step`` is not written."""
    def bad(t):
        return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    mine = (any(bad(p) for p in rp.local.parameters())
            or any(bad(v) for state in rp.opt.inner.state.values() for v in state.values()))
    if agreed(rp, [mine])[0]:
        raise NonFiniteError(f"step {step}: the parameters or optimizer state after the optimizer step are not "
                             f"finite: checkpoint {path} not written, stopped")


def describe_outputs(outs, doc, mesh) -> str:
    desc = []
    for o, meta in zip(outs, doc["outputs"]):
        if not isinstance(o, torch.Tensor):
            desc.append(repr(o))
        elif o.numel() == 1 and all(isinstance(p, Replicate) for p in meta["_place"]):
            desc.append(f"{o.item():.6f}")
        else:
            gshape = list(o.shape)
            for p, axis in zip(meta["_place"], mesh.names):
                if isinstance(p, Shard):
                    gshape[p.dim] *= mesh.axes[axis]
            desc.append(f"tensor {gshape} (local {list(o.shape)})")
    return ", ".join(desc)


# ------------------------------------------------------------------------------------------------
# running under torchrun
# ------------------------------------------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser(
        prog="run.py", description="Run an exported autoshard plan: torchrun --nproc-per-node=N run.py [options]")
    p.add_argument("--check", action="store_true",
                   help="compare outputs (and gradients and losses with --steps) with the unsharded model")
    p.add_argument("--steps", type=int, default=0, help="training steps (forward, backward, optimizer); "
                                                        "default: one forward only")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nan-policy", choices=NAN_POLICIES, default="stop",
                   help="a training step whose global loss or gradient norm is not finite: stop (every process "
                        "exits 4, naming the step, before its optimizer step), skip-step (no optimizer step, "
                        "said on its line), ignore (train on; no check)")
    p.add_argument("--synthetic", action="store_true", help="random inputs of the planned shapes")
    p.add_argument("--inputs", help="a torch.save'd list of the (global) inputs, in the planned order")
    p.add_argument("--weights", help="where the parameters come from: a torch.save state dict by parameter name, a "
                                     ".safetensors file, or a Hugging Face save_pretrained directory (sharded or not)")
    p.add_argument("--weights-prefix", metavar="PREFIX",
                   help="with --weights: the FQN in the planned module under which the checkpoint's keys live "
                        "(prepended to them: 'model' when the planned module holds the HF model as self.model)")
    p.add_argument("--allow-partial", action="store_true",
                   help="with --weights: parameters the checkpoint lacks come from the export (default: an error)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic inputs")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda (nccl) when available, else cpu (gloo)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--memory", action="store_true",
                   help="with --steps: measure each rank's peak of saved activations + parameters + gradients + "
                        "optimizer state and print it next to the plan's prediction")
    p.add_argument("--timeline", help="a pipelined export: rank 0 writes the last step's measured actions of every "
                                      "rank here (Chrome / Perfetto trace JSON, one row per rank)")
    add_training_args(p)
    return p


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _say(msg: str) -> None:
    print(msg, flush=True)


def prepare(root: Path, args) -> dict:
    """Everything that can fail without talking to other ranks; raises RunError."""
    doc = read_plan(root)
    mesh = Mesh(doc["mesh"])
    world = _env_int("WORLD_SIZE", 1)
    if world != mesh.size:
        launched = "torchrun started" if "WORLD_SIZE" in os.environ else "run without torchrun, that is"
        raise RunError(f"this program is planned for {mesh}, {mesh.size} ranks, but {launched} {world} "
                       f"process{'es' if world != 1 else ''} (hint: torchrun --nproc-per-node={mesh.size} "
                       f"{root / 'run.py'}, or with --nnodes, nodes x procs = {mesh.size})")
    if args.steps < 0:
        raise RunError("--steps must be >= 0")
    if args.steps and not any(m["kind"] == "parameter" and m.get("trainable") for m in doc["inputs"]):
        raise RunError("--steps trains parameters, but this program has no trainable ones")
    if args.steps and doc.get("pipeline") is None:
        shape = loss_shape(doc, mesh)
        if shape is None or math.prod(shape) != 1:
            raise RunError(f"--steps trains on output {doc['loss_output']} (the loss), of shape {shape}: grad can be "
                           f"implicitly created only for scalar outputs, as torch's loss.backward() says (hint: "
                           f"reduce the loss to a scalar in the model's forward and export again)")
    if args.synthetic and args.inputs:
        raise RunError("--synthetic and --inputs exclude each other")
    if args.timeline and not doc.get("pipeline"):
        raise RunError("--timeline records the actions of a pipeline schedule; this export is not pipelined")
    program = load_programs(root, doc)
    if args.allow_partial and not (args.weights or doc["weights"].get("checkpoint")):
        raise RunError("--allow-partial applies to a --weights checkpoint")
    if args.check and not doc.get("reference"):  # before the weights: a meta export has neither
        why = (doc.get("missing") or {}).get("reference")
        raise RunError("this export has no references to check against" + (f": {why}" if why else "")
                       + " (hint: export a model with real weights and example inputs, reference=True; "
                       "models over 2 GiB skip them)")
    weights = open_weights(root, doc, args.weights, args.allow_partial, args.weights_prefix)
    loop = prepare_training(root, doc, args)  # the training loop's options (--data, --resume, ...)
    user = None if loop.get("data") else load_inputs(root, doc, synthetic=args.synthetic, path=args.inputs,
                                                      seed=args.seed)
    ref = None
    if args.check:
        if args.synthetic or args.inputs:
            raise RunError("--check compares with references made from the saved example inputs "
                           "(hint: drop --synthetic / --inputs)")
        if args.weights:
            raise RunError("--check compares with references made from the exported weights (hint: drop --weights)")
        r = doc["reference"]
        ref = _load(root / r["file"], "reference file")
        if not isinstance(ref, dict) or "outputs" not in ref:
            raise RunError(f"reference file {root / r['file']} is corrupted (hint: export the plan again)")
    return dict(doc=doc, mesh=mesh, program=program, weights=weights, user=user, ref=ref, loop=loop)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b|; inf where either side holds a NaN or an infinity (Python's max()
    of the per-tensor values would drop a NaN)."""
    if not a.numel():
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return d if math.isfinite(d) else math.inf


# A 16-bit program rounds each rank's partial sum (half a unit, eps, of its magnitude) and each
# addition of the collective once more: about one unit of the tensor's largest magnitude per rank
# per sum, against the unsharded model's single rounding. A parameter's gradient passes through
# the sums of the layers above it, which compound this a few times (measured on a 4-rank bf16
# dp x tp llama: up to 3.8 units of the tensor's scale). Allowed: UNITS_PER_RANK x ranks eps of
# the dtype, relative to each value and to its tensor's largest magnitude. A wrong layout is off
# by a share of the tensor (a lost partial sum: a quarter to a half of it).
UNITS_PER_RANK = 4


def check_dtype(doc) -> torch.dtype:
    """The least precise floating dtype among the program's parameters and inputs: the rounding
    every value of the run carries (an fp32 loss of a bf16 model is as coarse as bf16)."""
    dtypes = [m["_dtype"] for m in doc["inputs"] if m.get("_dtype") is not None and m["_dtype"].is_floating_point]
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def check_tolerance(doc, rtol: float, atol: float) -> dict:
    """--check's tolerance for this export: ``rtol``/``atol`` (run.py's --rtol/--atol) for a
    float32 program; for a 16-bit one ``units`` eps of its dtype (UNITS_PER_RANK per rank),
    relative to each value and to its tensor's largest magnitude, and losses within one eps
    relative (a loss is a mean: its rounding is far below one unit). Example::

        tol = check_tolerance(doc, 1e-4, 1e-5)   # {'dtype': torch.bfloat16, 'units': 16, ...}
    """
    dtype = check_dtype(doc)
    if dtype not in (torch.bfloat16, torch.float16):
        return {"dtype": dtype, "units": 0, "eps": 0.0, "rtol": rtol, "atol": atol,
                "text": f"{_dt(dtype)} tolerance: rtol {rtol:g}, atol {atol:g}"}
    eps, units = torch.finfo(dtype).eps, UNITS_PER_RANK * doc["world_size"]
    return {"dtype": dtype, "units": units, "eps": eps, "rtol": max(rtol, units * eps), "atol": atol,
            "text": f"{_dt(dtype)} tolerance: {units} eps ({units * eps:.2g}) of each value and of its tensor's "
                    f"largest magnitude, losses {eps:.2g} relative"}


def compare(a: torch.Tensor, b: torch.Tensor, tol: dict):
    """(ok, max abs diff, why) for a run's tensor ``a`` against the reference's ``b`` under
    ``check_tolerance``'s ``tol``: NaN or infinity on either side fails and says which side."""
    if a.shape != b.shape:
        return False, math.inf, f"shape {list(a.shape)} != the reference's {list(b.shape)}"
    for t, side in ((b, "the unsharded reference"), (a, "this run")):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n = int((~torch.isfinite(t)).sum())
            return False, math.inf, f"non-finite in {side} ({n} of {t.numel()} values NaN or infinite)"
    d = _max_diff(a, b)
    atol = tol["atol"]
    if tol["units"] and b.numel():
        atol = max(atol, tol["units"] * tol["eps"] * b.double().abs().max().item())
    ok = torch.allclose(a.double(), b.double(), rtol=tol["rtol"], atol=atol)
    return ok, d, f"max abs diff {d:.3g}"


def compare_outputs(doc, mesh, rank, outs, ref, rtol, atol):
    """(ok, max abs diff, problems) for this rank's outputs against its blocks of the references."""
    ok, worst, problems = True, 0.0, []
    tol = check_tolerance(doc, rtol, atol)
    for k, (o, meta, want) in enumerate(zip(outs, doc["outputs"], ref["outputs"])):
        if not isinstance(o, torch.Tensor):
            if o != want:
                ok = False
                problems.append(f"output {k}: {o!r} != {want!r}")
            continue
        piece = local_piece(want, meta["_place"], mesh, rank)
        good, d, why = compare(o.detach().cpu(), piece, tol)
        worst = max(worst, d)
        if not good:
            ok = False
            problems.append(f"output {k}: {why}")
    return ok, worst, problems


def compare_grads(doc, mesh, rank, params, ref, rtol, atol):
    """(ok, max abs diff, problems) for this rank's gradients of the first step against its
    blocks of the reference's."""
    ok, worst, problems = True, 0.0, []
    tol = check_tolerance(doc, rtol, atol)
    places = {m["target"]: m["_place"] for m in doc["inputs"]
              if m["kind"] == "parameter" and "_place" in m and m.get("role", "input") == "input"}
    for fqn, p in params.items():
        want = ref["grads"].get(fqn)
        if want is None:
            continue
        g = p.grad.detach().cpu() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
        piece = local_piece(want, places[fqn], mesh, rank)
        good, d, why = compare(g, piece, tol)
        worst = max(worst, d)
        if not good:
            ok = False
            problems.append(f"gradient of {fqn}: {why}")
    return ok, worst, problems


def global_sum(x: torch.Tensor, place, mesh: Mesh) -> float:
    """Sum of a value's global tensor from this rank's block (summed over its sharding axes);
    call inside the rank context."""
    backend = current("global_sum").backend
    s = x.detach().double().sum().reshape(1)
    for o, axis in zip(place or (), mesh.names):
        if isinstance(o, Shard):
            s = backend.all_reduce(s, axis)
    return s.item()


def run(root: Path, args) -> int:
    local_rank = _env_int("LOCAL_RANK", 0)
    try:
        ctx = prepare(root, args)
    except RunError as e:
        if local_rank == 0:  # one message per node, not one per process
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops the node's other processes at the first exit: give local rank 0,
            # which found the same problem, the moment it needs to print it
            time.sleep(2.0)
        return EXIT_USAGE
    doc, mesh = ctx["doc"], ctx["mesh"]
    if ctx["weights"].partial_note and local_rank == 0:
        print(f"run.py: note: {ctx['weights'].partial_note}", file=sys.stderr, flush=True)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    ctx["program"].DEVICE = device
    if "WORLD_SIZE" not in os.environ:  # `python run.py` on a one-rank mesh: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    beat = Heartbeat(store, rank)
    try:
        rc = _run_ranks(root, args, ctx, doc, mesh, rank, device, use_cuda)
    except RunError as e:  # found by every rank at the same point (a bad token in --data)
        if rank == 0:
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        rc = EXIT_USAGE
    except NonFiniteError as e:  # on every rank at the same step (--nan-policy stop)
        if rank == 0:
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        rc = EXIT_NONFINITE
    except Stopped as e:  # SIGTERM / SIGINT agreed at a step's end; the checkpoint is saved
        rc = 128 + e.signum
    except Exception as e:  # noqa: BLE001 - a peer that stopped answering: one line, not a hang
        if _report_lost_peer(e, store, rank, mesh.size, args.timeout):
            # peers are stopped or gone: tearing the group down could block or abort
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEER)
        beat.stop()
        dist.destroy_process_group()
        raise
    # Leave together: a rank that destroys its groups while a peer still talks to it makes the
    # peer's gloo threads abort ("terminate called without an active exception").
    dist.barrier()
    beat.stop()
    dist.destroy_process_group()
    if ctx["loop"].get("lock"):
        ctx["loop"]["lock"].release()
    return rc


EXIT_PEER = 3
_PEER_ERRORS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo", "nccl",
                "socket", "peer")


def _report_lost_peer(e: BaseException, store, rank: int, world: int, timeout: float) -> bool:
    """If ``e`` is a collective failing because some rank stopped answering, print one line for
    the job (the first rank to notice prints it) and return True."""
    text = f"{type(e).__name__}: {e}"
    if not (isinstance(e, getattr(dist, "DistError", ())) or any(w in text.lower() for w in _PEER_ERRORS)):
        return False
    try:
        gone = [r for r in stalled_ranks(store, world) if r != rank]
    except Exception:  # noqa: BLE001 - the store itself is gone (the launcher is tearing down)
        return True
    if not gone:
        return False
    if first_to_report(store):
        wake(store, gone)
        first = " ".join(str(e).split())[:160]
        ranks = ", ".join(map(str, gone))
        print(f"run.py: error: rank{'s' if len(gone) > 1 else ''} {ranks} stopped answering (stalled or dead); "
              f"rank {rank}'s collective failed within --timeout {timeout:g}s: {type(e).__name__}: {first}",
              file=sys.stderr, flush=True)
    return True


def _run_ranks(root, args, ctx, doc, mesh, rank, device, use_cuda) -> int:
    say = _say if rank == 0 else (lambda msg: None)
    backend = DistributedBackend(mesh, device_type="cuda" if use_cuda else "cpu", timeout=args.timeout)
    train = args.steps > 0
    zero = f", ZeRO-{doc['zero_stage']}" if doc.get("zero_stage") else ""
    transports = backend.connect()  # every rank: the segments are made now, so the line says what is used
    say(f"autoshard export {root.name}: {doc.get('model', 'model')} on {mesh}{zero} "
        f"({mesh.size} {'nccl' if use_cuda else 'gloo'} processes"
        f"{', collectives through shared memory' if 'shared memory' in transports.values() else ''}), "
        + (f"{args.steps} training step{'s' if args.steps != 1 else ''} ({args.optimizer}, lr {args.lr:g})"
           if train else "forward only"))
    if doc.get("pipeline"):
        p = doc["pipeline"]
        say(f"pipeline on {p['axis']}: {len(p['stages'])} stages, {p.get('schedule')}, {p['microbatches']} "
            f"microbatches per step")
    with rank_context(mesh, rank, backend):
        rp = rank_program(doc, mesh, rank, ctx["program"], ctx["weights"], device, train)
        meter = step_memory.watch(rp) if args.memory and train else None
        if ctx["loop"]:
            res = train_loop(rp, ctx["user"], ctx["loop"], args, say=say)
        elif doc.get("pipeline"):
            res = _pipeline().rank_loop(rp, ctx["user"], steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                                        ref=ctx["ref"], rtol=args.rtol, atol=args.atol, say=say, R=_this(),
                                        nan_policy=args.nan_policy)
        else:
            res = rank_loop(rp, ctx["user"], steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                            ref=ctx["ref"], rtol=args.rtol, atol=args.atol, say=say, nan_policy=args.nan_policy)
        if args.timeline:
            _pipeline().write_timeline(rp, args.timeline, say)
        if meter is not None:
            say(step_memory.report(meter, doc, mesh.coords(rank), lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)))
    if ctx["ref"] is None:
        return 0
    flags = torch.tensor([1.0 if res["ok"] else 0.0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    worst = torch.tensor([res["worst_out"], res["worst_grad"]], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    for msg in res["problems"][:5]:
        print(f"run.py: rank {rank}: {msg}", file=sys.stderr, flush=True)
    ok, text = summarize_check(doc, ctx["ref"], args, flags.item() == 1.0, worst.tolist(), res["losses"],
                               mesh.size)
    if ok and res.get("params_checked"):  # a pipelined export also checks the trained parameters
        text += f"; parameters after {args.steps} steps match"
    say(text)
    return 0 if ok else 1


def summarize_check(doc, ref, args, ok: bool, worst, losses, n_ranks):
    """(passed, one line) for --check: outputs (and gradients) on every rank, and losses, at
    ``check_tolerance``'s tolerance (which the line names). A NaN or infinity on either side
    fails, naming the side and the step (the first step's outputs and gradients, or a loss)."""
    train = args.steps > 0
    tol = check_tolerance(doc, args.rtol, args.atol)
    what = "outputs" + (" and gradients" if train else "")
    diff = "max abs diff " + " / ".join("non-finite" if not math.isfinite(w) else f"{w:.2e}"
                                        for w in worst[:2 if train else 1])
    loss_msg, nonfinite = "", []
    if not all(math.isfinite(w) for w in worst[:2]):
        nonfinite.append(f"{'step 1' if train else 'forward'}: {what} non-finite (or of another shape) on some rank "
                         f"(its run.py: rank line names the tensor and the side)")
    r = doc.get("reference") or {}
    ref_losses = ref.get("losses") or []
    if train and ref_losses and args.optimizer == r.get("optimizer") and args.lr == r.get("lr"):
        n = min(len(ref_losses), len(losses))
        pairs = list(zip(losses[:n], ref_losses[:n]))
        bad = next(((step, a, b) for step, (a, b) in enumerate(pairs, 1)
                    if not (math.isfinite(a) and math.isfinite(b))), None)
        if bad:
            step, a, b = bad
            nonfinite.append(f"the unsharded reference's loss of step {step} is {b}" if not math.isfinite(b)
                             else f"this run's loss of step {step} is {a}")
        ld = max((abs(a - b) for a, b in pairs), default=0.0)
        rtol = tol["eps"] if tol["units"] else args.rtol
        loss_ok = not nonfinite and all(abs(a - b) <= args.atol + rtol * abs(b) for a, b in pairs)
        ok = ok and loss_ok
        loss_msg = (f"; losses of {n} {args.optimizer} step{'s' if n != 1 else ''} "
                    f"{'match' if loss_ok else 'DIFFER FROM'} single-device training (max abs diff {ld:.2e})")
    elif train:
        loss_msg = (f"; losses not checked (the references were made with {r.get('optimizer')} lr "
                    f"{r.get('lr')})")
    if ok and not nonfinite:
        return True, (f"check passed: {what} equal the unsharded model's on all {n_ranks} ranks ({diff}){loss_msg}"
                      f" ({tol['text']})")
    if nonfinite:
        return False, f"CHECK FAILED: {'; '.join(nonfinite)} ({tol['text']})"
    return False, f"CHECK FAILED: {what} differ from the unsharded model's ({diff}){loss_msg} ({tol['text']})"


# ------------------------------------------------------------------------------------------------
# the training loop: --data, --lr-schedule, --clip-grad-norm, --save-every/--ckpt, --resume
# ------------------------------------------------------------------------------------------------

def add_training_args(p) -> None:
    g = p.add_argument_group("training loop (with --steps N)")
    g.add_argument("--data", help="token file: a 1-D integer tensor saved with torch.save, or a .npy / .bin of "
                                  "uint16/uint32 token ids; each step reads the next global batch, each rank its block")
    g.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16",
                   help="element type of a raw .bin token file")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="cosine: linear warmup over --warmup steps, then cosine decay to --min-lr at --total-steps")
    g.add_argument("--warmup", type=int, default=0, help="warmup steps of the schedule")
    g.add_argument("--total-steps", type=int, default=None,
                   help="the schedule's length (default: --steps, counted from the resumed step)")
    g.add_argument("--min-lr", type=float, default=0.0, help="the cosine schedule's final learning rate")
    g.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip gradients to this global 2-norm (over every shard and mesh axis)")
    g.add_argument("--ckpt", help="directory for checkpoints: step-NNNNNN/ written at --save-every and at the end")
    g.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (needs --ckpt)")
    g.add_argument("--resume", help="a checkpoint, or a --ckpt directory (its newest complete step-*): restores "
                                    "weights, optimizer, schedule and data position")
    g.add_argument("--metrics", help="rank 0 writes one JSON line per step here (step, loss, lr, grad_norm, "
                                     "tokens_per_s, seconds)")
    g.add_argument("--term-timeout", type=float, default=20.0,
                   help="with --ckpt: on SIGTERM/SIGINT, every process finishes its step, saves a checkpoint and "
                        "exits 143/130 within this many seconds (keep it below the launcher's grace period before "
                        "SIGKILL: torchrun's is 30 s)")


class Stopped(Exception):
    """Every rank received SIGTERM or SIGINT (one of them did, and they agreed at a step's end):
    the job saved its checkpoint and ends with exit code 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Preemption:
    """SIGTERM / SIGINT during a training loop with ``--ckpt``: the handler only notes the signal
    (and arms a timer that ends the process after ``--term-timeout`` seconds, whatever it is
    doing); at the end of each step the ranks agree whether any of them was signalled, and if so
    all save a checkpoint of that step and stop (:class:`Stopped`). Installed in the main thread
    only (simulated ranks are threads: they never see a signal).

    Example::

        with Preemption(timeout=20) as pre:
            for step in ...:
                ...
                if pre.agreed(rp):       # every rank, each step
                    save(); raise Stopped(pre.signum)
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, timeout: float):
        self.timeout, self.signum, self.old, self.timer = timeout, None, {}, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.old[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        # once signalled the deadline stays: leaving the process group must end within it too
        return False

    def _note(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            self.timer = threading.Timer(self.timeout, lambda: os._exit(128 + signum))
            self.timer.daemon = True
            self.timer.start()

    def agreed(self, rp) -> bool:
        """Whether any rank was signalled (the same answer on every rank; a collective); the
        signal of the job is then SIGTERM if any rank got it, else SIGINT."""
        if not self.old:
            return False
        term, intr = agreed(rp, [self.signum == signal.SIGTERM, self.signum == signal.SIGINT])
        if term or intr:
            self.signum = signal.SIGTERM if term else signal.SIGINT
            if self.timer is None:  # a peer was signalled first: this rank's deadline starts now
                self._note(self.signum, None)
            return True
        return False


def uses_training_loop(args) -> bool:
    return bool(args.data or args.ckpt or args.resume or args.save_every or args.metrics
                or args.clip_grad_norm is not None or args.lr_schedule != "constant" or args.total_steps)


def prepare_training(root: Path, doc: dict, args) -> dict:
    """The training loop's inputs, checked before any process group exists: {} when no loop
    option is given; else the token source, the checkpoint to resume and the schedule."""
    if not uses_training_loop(args):
        return {}
    if args.steps <= 0:
        raise RunError("the training loop options (--data, --ckpt, --resume, --lr-schedule, ...) need --steps N > 0")
    if args.check:
        raise RunError("--check compares with references of the saved batch; it excludes the training loop options")
    if args.save_every < 0 or args.warmup < 0 or (args.total_steps is not None and args.total_steps <= 0):
        raise RunError("--save-every and --warmup must be >= 0 and --total-steps > 0")
    if args.save_every and not args.ckpt:
        raise RunError("--save-every needs --ckpt DIR")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise RunError("--clip-grad-norm must be > 0")
    loop = {"schedule": {"kind": args.lr_schedule, "warmup": args.warmup, "total": args.total_steps,
                         "min_lr": args.min_lr, "lr": args.lr}}
    if args.data:
        if args.synthetic or args.inputs:
            raise RunError("--data excludes --synthetic and --inputs")
        loop["data"] = TokenData(Path(args.data), args.data_dtype, doc)
    loop["warnings"] = []
    if args.resume:
        skipped = []
        try:
            loop["resume"] = ckpt.resolve(args.resume, skipped)
            manifest = ckpt.read_manifest(loop["resume"])
        except ckpt.CheckpointError as e:
            raise RunError(f"--resume: {e}") from None
        loop["warnings"] += [f"--resume skipped {name}: {why}" for name, why in skipped]
        loop["warnings"] += resume_mismatches(loop["resume"], manifest, args)
    if args.ckpt:
        check_ckpt_dir(Path(args.ckpt), checkpoint_bytes(doc, args.optimizer))
        if _env_int("RANK", 0) == 0:  # the job's first process holds the directory for the job
            try:
                loop["lock"], dead = ckpt.DirectoryLock.take(args.ckpt)
            except ckpt.DirectoryHeld as e:
                raise RunError(f"--ckpt {e}") from None
            if dead is not None:
                loop["warnings"].append(f"--ckpt {args.ckpt} was held by a job that ended without releasing it "
                                        f"({ckpt.describe_holder(dead)}); this job takes it over")
    return loop


def resume_mismatches(path: Path, manifest: dict, args) -> list:
    """Warnings where the resumed run differs from the checkpoint's run in its data (another
    token file, or none); RunError where the checkpoint's state cannot apply (another optimizer)."""
    extra = manifest.get("extra") or {}
    saved_opt, saved_data = extra.get("optimizer"), extra.get("data")
    if saved_opt is not None and saved_opt != args.optimizer:
        raise RunError(f"--resume: {path} was trained with --optimizer {saved_opt}; its optimizer state does not "
                       f"apply to --optimizer {args.optimizer} (hint: --optimizer {saved_opt})")
    if saved_data is None:
        return [f"--resume: {path}'s run had no --data; this one reads {args.data}"] if args.data else []
    if not args.data:
        return [f"--resume: {path}'s run read --data {saved_data['file']} (to token {extra.get('data_position', 0)}); "
                f"this one has no --data and trains on its saved inputs"]
    now = ckpt.data_identity(args.data)
    if (now["bytes"], now["sha256_first_mib"]) != (saved_data["bytes"], saved_data["sha256_first_mib"]):
        return [f"--resume: --data {args.data} ({now['bytes']} bytes) is not the file {path}'s run read "
                f"({saved_data['file']}, {saved_data['bytes']} bytes): training goes on from token "
                f"{extra.get('data_position', 0)} of another file"]
    return []


def checkpoint_bytes(doc: dict, optimizer: str) -> int:
    """Bytes of one whole checkpoint of this program (all ranks' pieces together): parameters
    and buffers in their dtypes, and per trainable parameter the optimizer's per-element state
    (AdamW 2, plain SGD none), in fp32 with an fp32 master copy for 16-bit parameters."""
    states = {"adamw": 2, "sgd": 0}.get(optimizer, 2)
    total = 0
    for m in doc["inputs"]:
        if m["kind"] not in ("parameter", "buffer") or m.get("shape") is None or m.get("role") == "full":
            continue
        n = math.prod(m["shape"])
        size = torch.empty((), dtype=m["_dtype"]).element_size()
        total += n * size
        if m["kind"] == "parameter" and m.get("trainable"):
            low = m["_dtype"] in (torch.bfloat16, torch.float16)
            total += 4 * n * (states + (1 if low else 0)) if low else size * n * states
    return total


def check_ckpt_dir(path: Path, need: int) -> None:
    """RunError unless ``--ckpt`` can take a checkpoint: the directory exists or can be made,
    a file can be written in it, and its file system has ``need`` bytes free (one checkpoint's
    size), so a run does not spend its training time before the first save fails."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise RunError(f"--ckpt {path} is not writable: {e.strerror or e}") from None
    free = shutil.disk_usage(path).free
    if free < need:
        raise RunError(f"--ckpt {path} has {free / 2**20:,.1f} MiB free; one checkpoint of this program takes "
                       f"{need / 2**20:,.1f} MiB (hint: free space or choose another --ckpt)")


class TokenData:
    """A token file read as consecutive global batches: batch k is tokens ``[pos, pos + B*S)``
    viewed as the planned ``[B, S]`` (wrapping to the start when the file is used up). Every
    integer input of that shape gets it (``input_ids``, and ``labels``: the models shift labels
    themselves), except masks (``*mask*``: ones); a rank reads only its own block of it (of each
    microbatch's piece, for a pipelined export: the schedule splits the batch on dim 0 first).

    Example::

        data = TokenData(Path("tokens.bin"), "uint16", doc)
        user, pos = data.batch(0, mesh, rank)       # the flat user inputs, the next position
    """

    def __init__(self, path: Path, dtype: str, doc: dict):
        self.path = path
        users = [m for m in doc["inputs"] if m["kind"] == "user"]
        ints = [m for m in users if m.get("shape") is not None and not m["_dtype"].is_floating_point]
        tokens = [m for m in ints if "mask" not in m["target"]]
        if not tokens:
            raise RunError("--data fills integer token inputs, but this program has none")
        self.shape = tokens[0]["shape"]
        self.users = users
        for m in users:
            if m.get("shape") is not None and (m not in ints or m["shape"] != self.shape):
                raise RunError(f"--data cannot fill input {m['target']} ({m['dtype']} {m['shape']}): it fills token "
                               f"inputs of shape {self.shape} (and masks of that shape with ones)")
        self.per_batch = math.prod(self.shape)
        bounds = [(m["vocab"], m["target"]) for m in tokens if m.get("vocab")]
        self.vocab, self.vocab_input = min(bounds) if bounds else (None, None)
        self.microbatches = (doc.get("pipeline") or {}).get("microbatches", 1)
        if not path.is_file():
            raise RunError(f"--data {path} does not exist")
        suffix = path.suffix.lower()
        try:
            if suffix in (".pt", ".pth"):
                t = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
                    raise RunError(f"--data {path} must hold a 1-D integer tensor (torch.save), not "
                                   f"{type(t).__name__} {list(getattr(t, 'shape', []))}")
                self.tokens = t
            else:
                import numpy as np

                arr = (np.load(path, mmap_mode="r") if suffix == ".npy"
                       else np.memmap(path, dtype=getattr(np, dtype), mode="r"))
                if arr.ndim != 1 or arr.dtype.kind not in "iu":
                    raise RunError(f"--data {path} must be a 1-D array of integer token ids, not {arr.dtype} "
                                   f"{list(arr.shape)}")
                self.tokens = arr
        except RunError:
            raise
        except Exception as e:  # noqa: BLE001 - an unreadable file is a usage error
            raise RunError(f"--data {path} cannot be read: {type(e).__name__}: {str(e).splitlines()[0]}") from None
        self.n = int(self.tokens.shape[0])
        if self.n < self.per_batch:
            raise RunError(f"--data {path} has {self.n} tokens, fewer than one global batch "
                           f"({'x'.join(map(str, self.shape))} = {self.per_batch})")

    def check_vocab(self, chunk, pos: int) -> None:
        """RunError naming the file, the position and the vocabulary when a token of the global
        batch starting at ``pos`` indexes outside the embedding its input feeds. Every rank
        checks the whole global batch (a few thousand ids), so all stop at the same step."""
        if self.vocab is None:
            return
        ids = torch.as_tensor(chunk if isinstance(chunk, torch.Tensor) else chunk.astype("int64")).reshape(-1)
        bad = ((ids < 0) | (ids >= self.vocab)).nonzero()
        if bad.numel():
            k = int(bad[0])
            raise RunError(f"--data {self.path}: token {int(ids[k])} at position {pos + k} is outside the "
                           f"vocabulary of {self.vocab} ids (the embedding that {self.vocab_input} indexes)")

    def batch(self, pos: int, mesh, rank: int):
        """(flat user inputs, next position): each token input is a global-shaped tensor in which
        only this rank's block was read from the file (the rest is never looked at)."""
        if pos + self.per_batch > self.n:
            pos = 0  # next epoch
        chunk = self.tokens[pos:pos + self.per_batch].reshape(self.shape)  # a view: nothing read yet
        self.check_vocab(chunk, pos)
        out, cache = [], {}
        for m in self.users:
            if m.get("shape") is None:
                out.append(m.get("value"))
                continue
            if "mask" in m["target"]:
                out.append(torch.ones(self.shape, dtype=m["_dtype"]))
                continue
            key = tuple(m["_place"])
            if key not in cache:
                g = torch.zeros(self.shape, dtype=m["_dtype"])
                rows = self.shape[0] // self.microbatches  # this rank's block of each microbatch
                region = ckpt.block_region([rows] + list(self.shape[1:]), m["_place"], mesh, rank)
                for first in range(0, self.shape[0], rows) if region is not None else ():
                    (o0, *offsets), (n0, *sizes) = region
                    index = (slice(first + o0, first + o0 + n0),
                             *(slice(o, o + n) for o, n in zip(offsets, sizes)))
                    block = chunk[index]
                    g[index] = block.to(torch.int64) if isinstance(block, torch.Tensor) else \
                        torch.from_numpy(block.astype("int64"))
                cache[key] = g
            out.append(cache[key])
        return out, pos + self.per_batch


def lr_factor(schedule: dict, total: int):
    """The multiplier of the base lr at step index s (0-based): linear warmup to 1 over
    ``warmup`` steps, then constant, or cosine down to ``min_lr / lr`` at ``total``."""
    warmup, kind = schedule["warmup"], schedule["kind"]
    floor = schedule["min_lr"] / schedule["lr"] if schedule["lr"] else 0.0

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min((s - warmup) / max(1, total - warmup), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def train_loop(rp, user, loop: dict, args, say=lambda msg: None) -> dict:
    """``args.steps`` training steps of one rank inside its rank context, with the loop's data,
    schedule, clipping and checkpoints; returns ``losses`` (and ``grad_norms``, ``lrs``, and
    ``skipped``: the steps ``--nan-policy skip-step`` skipped).
    ``rp``: a :class:`RankProgram`, or a pipelined export's ``PipelineProgram`` (each step its
    schedule over the step's microbatches); both give ``train_step``, ``step_loss``,
    ``clip_grad_norm_``, ``step`` and ``local``."""
    doc, mesh = rp.doc, rp.mesh
    for warning in loop.get("warnings", ()):
        say(f"warning: {warning}")
    rp.make_optimizer(args.optimizer, args.lr)
    opt, start, pos, schedule, manifest = rp.opt, 0, 0, dict(loop["schedule"]), None
    if loop.get("resume"):
        manifest = ckpt.read_manifest(loop["resume"])
        start = int(manifest.get("step") or 0)
        schedule = (manifest.get("extra") or {}).get("schedule") or schedule  # the run's own schedule continues
    if schedule.get("total") is None:
        schedule["total"] = start + args.steps
    # the scheduler first: creating it sets the lr to the schedule's start, which the checkpoint's
    # param groups (its current lr) and the scheduler's saved state then overwrite
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt.inner, lr_factor(schedule, schedule["total"]))
    if manifest is not None:
        ckpt.load(rp.local, opt, loop["resume"])
        extra = manifest.get("extra") or {}
        pos = int(extra.get("data_position", 0))
        if extra.get("scheduler"):
            scheduler.load_state_dict(extra["scheduler"])
        say(f"resumed from {loop['resume']} at step {start}" + (f", token {pos}" if loop.get("data") else ""))
    data, end = loop.get("data"), start + args.steps
    data_id = ckpt.data_identity(data.path) if data else None
    tokens = data.per_batch if data else None
    info = {"model": doc.get("model"), "aliases": doc.get("aliases") or {},
            "state_dict_keys": doc.get("state_dict_keys")}
    metrics = open(args.metrics, "a") if args.metrics and rp.rank == 0 else None
    res = dict(ok=True, losses=[], grad_norms=[], lrs=[], skipped=[], worst_out=0.0, worst_grad=0.0, problems=[])
    sync = torch.cuda.synchronize if rp.device.type == "cuda" else (lambda: None)
    t_start = time.perf_counter()
    preemption = Preemption(args.term_timeout) if args.ckpt else None
    try:
        if preemption is not None:
            preemption.__enter__()
        for step in range(start + 1, end + 1):
            t0 = time.perf_counter()
            if data:
                user, pos = data.batch(pos, mesh, rp.rank)
            loss = rp.train_step(user)
            norm = rp.clip_grad_norm_(args.clip_grad_norm) if args.clip_grad_norm is not None else None
            lr = opt.inner.param_groups[0]["lr"]
            value = rp.step_loss(loss)
            skipped = nonfinite_step(rp, step, value, norm, args.nan_policy)
            if skipped:
                opt.zero_grad(set_to_none=True)
                res["skipped"].append(step)
                with warnings.catch_warnings():  # the schedule follows the step count, stepped or not
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before")
                    scheduler.step()
            else:
                rp.step()
                scheduler.step()
            sync()
            dt = time.perf_counter() - t0
            res["losses"].append(value)
            res["grad_norms"].append(norm)
            res["lrs"].append(lr)
            line = f"step {step}/{end}  loss {value:.6f}  time {dt * 1e3:.1f} ms  lr {lr:.3e}"
            if norm is not None:
                line += f"  grad-norm {norm:.4f}"
            if tokens:
                line += f"  tokens/s {tokens / dt:,.0f}"
            say(line + (f"  {skipped}" if skipped else ""))
            if metrics:
                metrics.write(json.dumps({"step": step, "loss": value, "lr": lr, "grad_norm": norm,
                                          "tokens_per_s": tokens / dt if tokens else None, "seconds": dt}) + "\n")
                metrics.flush()
            stop = preemption is not None and preemption.agreed(rp)
            if args.ckpt and ((args.save_every and step % args.save_every == 0) or step == end or stop):
                path = Path(args.ckpt) / f"step-{step:06d}"
                if args.nan_policy != "ignore":
                    check_finite_state(rp, step, path)
                ckpt.save(rp.local, opt, path, step=step, info=info,
                          extra={"data_position": pos, "schedule": schedule, "scheduler": scheduler.state_dict(),
                                 "optimizer": args.optimizer, "data": data_id})
                say(f"saved checkpoint {path}")
            if stop:
                say(f"stopping on {signal.Signals(preemption.signum).name} after step {step}: its checkpoint is "
                    f"saved; --resume {args.ckpt} continues")
                raise Stopped(preemption.signum)
    finally:
        if metrics:
            metrics.close()
        if preemption is not None:
            preemption.__exit__(None, None, None)
    took = time.perf_counter() - t_start
    if res["losses"]:
        say(f"done: {args.steps} step{'s' if args.steps != 1 else ''} in {took:.1f} s"
            + (f", {tokens * args.steps / took:,.0f} tokens/s" if tokens else "")
            + f", final loss {res['losses'][-1]:.6f}")
    return res


def main(argv=None, root=None) -> int:
    args = _parser().parse_args(argv)
    return run(Path(root) if root is not None else Path(__file__).resolve().parent, args)


if __name__ == "__main__":
    sys.exit(main(root=Path(__file__).resolve().parent))
