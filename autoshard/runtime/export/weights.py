"""Where a rank's parameters and buffers come from: the export's files or a ``--weights`` checkpoint.

A torch.save file is memory-mapped and a safetensors file (or a Hugging Face save_pretrained
directory, sharded or not) is read by region, so each rank reads only the blocks it owns.
``--weights-prefix`` places a checkpoint's keys under an FQN of the planned module; keys that
do not match are reported with the prefix that would fix them.

Example::

    weights = open_weights(root, doc, "llama-hf", prefix="model")
    state = read_checkpoint("llama-hf", "model")   # {plan FQN: SafetensorsTensor or tensor}
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from autoshard.runtime.execution import checkpoint as ckpt
from autoshard.runtime.execution.checkpoint import skipped_warnings
from autoshard.runtime.execution import weights_dcp
from autoshard.runtime.execution.local import SliceSource

from .errors import RunError


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

    def local_piece(self, place, mesh, rank: int) -> torch.Tensor:
        from safetensors import safe_open  # only where a safetensors source is read
        region = ckpt.held_region(self.shape, place, mesh, rank)
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
                           f"model.safetensors.index.json (hint: a Hugging Face save_pretrained directory, a DCP "
                           f"checkpoint, a .safetensors file or a torch.save state dict)")
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


def read_checkpoint(src, prefix: str | None = None, skipped: list | None = None) -> dict:
    """The ``--weights`` state by plan FQN: a torch.save state dict (memory-mapped), a
    ``.safetensors`` file, a Hugging Face checkpoint directory or a DCP checkpoint (autoshard's,
    a ``--ckpt`` directory's newest, or a plain ``torch.distributed.checkpoint.save`` directory:
    :mod:`autoshard.runtime.execution.weights_dcp`), the last three read by region; another
    export's directory gives the ``weights.pt`` it wrote. ``prefix``
    (``--weights-prefix``) is where the checkpoint's keys live in the planned module: it is
    prepended to every key, so with ``self.model = hf_model`` and prefix ``model`` the
    checkpoint's ``lm_head.weight`` is the plan's ``model.lm_head.weight``. The newer checkpoints
    of a ``--ckpt`` directory that do not verify are appended to ``skipped`` as ``(name, why)``."""
    src = Path(src)
    if (src / "plan.json").is_file() and (src / "weights.pt").is_file():
        src = src / "weights.pt"  # another export of the same model: the weights it wrote
    if weights_dcp.is_dcp(src):  # an autoshard or plain DCP checkpoint, or a --ckpt directory
        try:
            state = weights_dcp.read_dcp(src, skipped)
        except ckpt.CheckpointError as e:
            raise RunError(str(e) if "hint:" in str(e) else f"{e} (hint: check the --weights path)") from None
    elif src.is_dir() or src.suffix == ".safetensors":
        state = read_safetensors(src)
    else:
        state = _load(src, "weights checkpoint")
        if not isinstance(state, dict):
            raise RunError(f"weights checkpoint {src} holds a {type(state).__name__}, not a state dict")
    if prefix:
        prefix = prefix if prefix.endswith(".") else prefix + "."
        state = {prefix + k: v for k, v in state.items()}
    return state


def recorded_checkpoint(root: Path, doc: dict):
    """The checkpoint plan.json points at (``plan.export(path, weights=SRC)``), or None: recorded
    relative to the export directory, resolved against ``root`` (an absolute one as it is)."""
    rel = doc["weights"].get("checkpoint")
    if not rel:
        return None
    src = Path(root) / rel
    if not src.exists():
        raise RunError(f"this export reads its weights from {rel} (relative to {root}), which does not exist "
                       f"(hint: move the weights with the export, or give run.py --weights SRC)")
    return src


class Weights:
    """Tensors by FQN from the weights file (and a checkpoint, for parameters: see
    :func:`read_checkpoint`), memory-mapped or, from safetensors, read by region: a rank's
    slice of a tensor reads only that slice. An export of a model planned
    on the meta device has no weights file: parameters come from the checkpoint, and the
    buffers no checkpoint has from ``buffers.pt`` (recomputed at export)."""

    def __init__(self, root: Path, doc: dict, checkpoint=None, allow_partial: bool = False, prefix: str | None = None):
        sources = []
        ckpt = checkpoint or recorded_checkpoint(root, doc)
        self.partial_note = None
        self.warnings: list = []  # e.g. the newer incomplete checkpoints of a --ckpt directory skipped
        w = doc["weights"]
        files = [(w.get("file", "weights.pt"), "weights file")] if w.get("file", "weights.pt") else []
        if w.get("buffers"):
            files.append((w["buffers"], "buffers file"))
        if not ckpt and not w.get("file", "weights.pt"):
            why = (doc.get("missing") or {}).get("weights") or "the export was made without weights"
            raise RunError(f"this export has no weights: {why} (hint: run.py --weights SRC)")
        if ckpt:
            # the export's checkpoint comes with the export's prefix; a --weights one with its own
            skipped: list = []
            state = read_checkpoint(ckpt, prefix if checkpoint else w.get("prefix"), skipped)
            self.warnings = skipped_warnings(skipped, "--weights" if checkpoint else "the export's checkpoint")
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
