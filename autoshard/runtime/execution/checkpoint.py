"""Distributed checkpoints: each rank writes its own pieces with torch.distributed.checkpoint
(DCP), and any other plan (or one device) reads them back.

A checkpoint is a DCP directory (``.metadata`` + one ``__<rank>_0.distcp`` file per writing
rank) plus ``autoshard.json``, the manifest, written last. Keys are

- ``model.<FQN>``: parameters and persistent buffers (tied aliases saved once, under the FQN
  the plan keeps; the manifest lists the aliases);
- ``optim.<FQN>.<state>``: the optimizer's per-element state (``exp_avg``, ``exp_avg_sq``,
  ``momentum_buffer``, ...) with the parameter's global shape, and its scalars (``step``);
  ``optim.<FQN>.fp32_master`` for the fp32 master copies of mixed precision.

Every piece is recorded in DCP's metadata by its global shape and its offsets in it (a
``ChunkStorageMetadata``, as DTensor pieces are), so a reader with any other placement asks DCP
for the overlapping regions: a checkpoint written under dp=2 x tp=2 ZeRO-3 loads under tp=4,
ZeRO-1, or one device. Replicated pieces are written once (DCP deduplicates equal chunks).

Atomic: ranks write into ``.<name>.partial`` next to ``path``; when every rank has written,
rank 0 writes DCP's metadata and the manifest (the completion marker, with every file's size)
and renames the directory to ``path``. A save killed mid-way leaves only the ``.partial``
directory, which never loads: :func:`load` says the checkpoint is incomplete.

Saving talks to the other ranks through the rank context's backend (threads of the simulated
mesh, or torch.distributed processes), so it runs on both; loading reads only this rank's
regions and needs no communication. Every rank must see the same file system.

Example (inside each rank's context)::

    local = plan.build(rank); opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
    ...
    save(local, opt, "ckpt/step-2", step=2)                 # every rank
    info = load(local2, opt2, "ckpt/step-2")                 # under any other plan; info["step"] == 2
    state = consolidate("ckpt/step-2")                       # one process: a plain state dict
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autoshard.ownership import Owned, Shard, block_index, holds
from autoshard.runtime.transport.rank_context import current
from autoshard.runtime.transport.distributed import DistributedBackend

FORMAT, VERSION = "autoshard-checkpoint", 1
MANIFEST = "autoshard.json"
METADATA = ".metadata"  # DCP's own file (its FileSystemWriter's name)
MODEL, OPTIM = "model.", "optim."
MASTER = "fp32_master"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here: incomplete, missing, or not matching the plan."""


# ------------------------------------------------------------------------------------------------
# a rank's piece of a global tensor, as DCP sees it
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Piece:
    """``local`` is the block ``[offsets, offsets + local.shape)`` of a tensor of ``global_shape``.
    It implements DCP's checkpointable hooks (as DTensor does), so DCP's planners write it as a
    shard of the global tensor and read any region of a saved one into it."""

    local: torch.Tensor
    global_shape: tuple
    offsets: tuple

    def size(self) -> torch.Size:
        return torch.Size(self.global_shape)

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self.chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size()))]

    def __create_chunk_list__(self) -> list:
        return [self.chunk()]


def block_region(shape, place, mesh, rank: int):
    """(offsets, sizes) of the block ``rank`` holds of a tensor of ``shape`` under ``place``
    (the block :func:`autoshard.ownership.local_piece` cuts), or None where it holds nothing."""
    coords = mesh.coords(rank)
    if not holds(place, mesh, coords):
        return None
    offsets, sizes = [], []
    for d, n_d in enumerate(shape):
        i, n = block_index(place, mesh, coords, d)
        offsets.append(i * (n_d // n))
        sizes.append(n_d // n)
    return offsets, sizes


def held_region(shape, place, mesh, rank: int):
    """:func:`block_region`, with an empty region (no rows) where ``rank`` holds nothing (an
    Owned axis), so a reader reads a block of the right rank and dtype either way."""
    region = block_region(shape, place, mesh, rank)
    return region if region is not None else ([0] * len(shape), [0] + list(shape[1:]))


def _narrow(region, dim: int, start: int, length: int):
    offsets, sizes = list(region[0]), list(region[1])
    offsets[dim] += start
    sizes[dim] = length
    return offsets, sizes


def stored_placement(slot, mesh) -> tuple:
    """Where a slot's stored tensor lives: its placement, or for ZeRO-2's persistent storage
    the use placement plus Shard(dim) on the data axis."""
    st = slot.storage
    if st is not None and st.mode == "persistent":
        return tuple(Shard(st.dim) if a == st.axis else o for o, a in zip(slot.use_placement, mesh.names))
    return tuple(slot.placement)


def _param_region(local, name: str):
    """(global shape, region) of the tensor parameter ``name`` of ``local`` holds."""
    slot = local._slots[name]
    mesh, rank = local.spec.mesh, local.rank
    st = slot.storage
    if st is not None and st.mode == "persistent":
        region = block_region(slot.shape, slot.use_placement, mesh, rank)
        n = region[1][st.dim] // mesh.axes[st.axis]
        return slot.shape, _narrow(region, st.dim, mesh.coords(rank)[st.axis] * n, n)
    return slot.shape, block_region(slot.shape, slot.placement, mesh, rank)


def _slots(local) -> dict:
    if not hasattr(local, "_slots"):
        local._slots = {s.name: s for s in local.spec.slots}
    return local._slots


def model_pieces(local) -> dict:
    """{``model.<FQN>``: Piece} of this rank's parameters and buffers as stored (for ZeRO-2 the
    full copy, of which the trainable shard is a view)."""
    slots, mesh, rank = _slots(local), local.spec.mesh, local.rank
    out = {}
    for slot in slots.values():
        if slot.kind not in ("parameter", "buffer") or slot.shape is None:
            continue
        st = slot.storage
        if st is not None and st.mode == "persistent":
            tensor = getattr(local, slot.name + "_full")
            region = block_region(slot.shape, slot.use_placement, mesh, rank)
        else:
            tensor = local._values.get(slot.name)
            region = block_region(slot.shape, slot.placement, mesh, rank)
        if region is None or not isinstance(tensor, torch.Tensor):
            continue  # an expert this rank does not own
        out[MODEL + slot.target] = Piece(tensor.detach(), tuple(slot.shape), tuple(region[0]))
    return out


def optimizer_params(local, optimizer) -> list:
    """(FQN, global shape, region, the tensor the inner optimizer steps) for every parameter
    of ``optimizer`` (a :class:`~autoshard.runtime.execution.local.ShardedOptimizer`): a stored piece,
    ZeRO-1's slice of it, or the fp32 master of either."""
    _slots(local)
    name_of = {id(p): n for n, p in local.named_parameters()}
    master_of = {id(m): p for m, p in optimizer.masters}
    slice_of = {id(s): (p, d, start) for s, p, _, d, start in optimizer.slices}
    out = []
    for group in optimizer.inner.param_groups:
        for q in group["params"]:
            base = master_of.get(id(q), q)
            if id(base) in slice_of:
                p, d, start = slice_of[id(base)]
                shape, region = _param_region(local, name_of[id(p)])
                region = _narrow(region, d, start, base.shape[d])
                name = name_of[id(p)]
            else:
                name = name_of[id(base)]
                shape, region = _param_region(local, name)
            out.append((local.fqn_of[name], tuple(shape), region, q))
    return out


def optimizer_pieces(local, optimizer) -> dict:
    """{``optim.<FQN>.<state>``: Piece}: per-element state at the parameter's region, scalars
    (``step``) whole, fp32 masters of mixed precision."""
    masters = {id(m) for m, _ in optimizer.masters}
    out = {}
    for fqn, shape, region, q in optimizer_params(local, optimizer):
        if region is None:
            continue
        if id(q) in masters:
            out[f"{OPTIM}{fqn}.{MASTER}"] = Piece(q.detach(), shape, tuple(region[0]))
        for key, v in optimizer.inner.state.get(q, {}).items():
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() == 0:
                out[f"{OPTIM}{fqn}.{key}"] = Piece(v.detach(), (), ())
            elif tuple(v.shape) == tuple(q.shape):
                out[f"{OPTIM}{fqn}.{key}"] = Piece(v.detach(), shape, tuple(region[0]))
            else:
                raise CheckpointError(f"optimizer state {key!r} of {fqn} has shape {list(v.shape)}, neither a scalar "
                                      f"nor the parameter's {list(q.shape)}: it cannot be saved by region")
    return out


# ------------------------------------------------------------------------------------------------
# talking to the other ranks through the rank context's backend
# ------------------------------------------------------------------------------------------------

def _all_gather_bytes(payload: bytes) -> list:
    """Every rank's ``payload``, in rank order (all-gathers along each mesh axis, last first:
    the result is rank-major)."""
    ctx = current("checkpoint")
    mesh, backend = ctx.mesh, ctx.backend
    n = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = n.reshape(1, 1)
    for axis in reversed(mesh.names):
        lengths = backend.all_gather(lengths, axis, 0)
    lengths = lengths.reshape(-1).tolist()
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
    rows = buf.reshape(1, -1)
    for axis in reversed(mesh.names):
        rows = backend.all_gather(rows, axis, 0)
    return [bytes(rows[r, :lengths[r]].tolist()) for r in range(mesh.size)]


def all_gather_objects(obj) -> list:
    """Every rank's picklable ``obj``, in rank order (call on every rank). On torch.distributed
    it is torch's own object gather (global rank order is the mesh's row-major order, which
    ``DistributedBackend`` checks), which moves the bytes to the GPU where nccl needs them."""
    if isinstance(current("checkpoint").backend, DistributedBackend):
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, obj)
        return rows
    return [pickle.loads(b) for b in _all_gather_bytes(pickle.dumps(obj))]


def barrier() -> None:
    all_gather_objects(None)


# ------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------

class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (dedup of equal chunks, metadata, validation that the chunks
    tile every tensor) over :class:`Piece` values."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def resolve_data(self, write_item):
        return self.state_dict[write_item.index.fqn].local


def partial_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def save(local, optimizer, path, *, step: int | None = None, extra: dict | None = None,
         info: dict | None = None) -> Path:
    """Write this rank's pieces of ``local`` (a LocalModule) and ``optimizer`` (a
    ShardedOptimizer, or None) to the checkpoint directory ``path``; call on every rank, inside
    its rank context. ``step`` and ``extra`` (JSON: scheduler state, data position, ...) go to the
    manifest; ``info`` records the model (``aliases``, ``state_dict_keys``). Returns ``path``.

    Example::

        save(local, opt, "ckpt/step-10", step=10, extra={"scheduler": sched.state_dict()})
    """
    ctx = current("save_checkpoint")
    rank = ctx.rank
    path = Path(path)
    tmp = partial_dir(path)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
        tmp.mkdir(parents=True)
    barrier()
    state = model_pieces(local)
    if optimizer is not None:
        state.update(optimizer_pieces(local, optimizer))
    planner = _SavePlanner()
    planner.set_up_planner(state, None, rank == 0)
    writer = FileSystemWriter(tmp, sync_files=True, overwrite=True)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    # every rank plans the same global plan from everybody's local plans (deterministic)
    global_plan, metadata = planner.create_global_plan(all_gather_objects(local_plan))
    global_plan = writer.prepare_global_plan(global_plan)
    results = writer.write_data(planner.finish_plan(global_plan[rank]), planner).value()
    all_results = all_gather_objects(results)
    if rank == 0:
        writer.finish(metadata, all_results)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.inner.param_groups] \
            if optimizer is not None else None
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra or {},
                    "mesh": dict(ctx.mesh.axes), "param_groups": groups, **(info or {}),
                    "files": written_files(tmp, all_results)}
        text = json.dumps(manifest, indent=1, default=_json_default) + "\n"
        (tmp / (MANIFEST + ".tmp")).write_text(text)
        with open(tmp / (MANIFEST + ".tmp"), "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp / (MANIFEST + ".tmp"), tmp / MANIFEST)  # the completion marker
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    barrier()  # nobody reads the checkpoint before it is complete
    return path


def written_files(directory: Path, results: list) -> dict:
    """{file name: bytes} of what DCP reports it wrote (every rank's write results: file, offset
    and length of each item) and of its metadata file; not a listing of ``directory``, which
    another writer could have changed. A file shorter than DCP's report fails the save."""
    files: dict = {}
    for rank_results in results:
        for r in rank_results:
            info = r.storage_data
            name = Path(info.relative_path).name
            files[name] = max(files.get(name, 0), int(info.offset) + int(info.length))
    if not files:
        raise CheckpointError(f"checkpoint {directory}: DCP reports no data written")
    for name, size in files.items():
        got = (directory / name).stat().st_size if (directory / name).is_file() else None
        if got is None or got < size:
            raise CheckpointError(f"checkpoint {directory}: {name} is {got if got is not None else 'missing'} "
                                  f"bytes after the save; DCP wrote {size}")
    files[METADATA] = (directory / METADATA).stat().st_size
    return dict(sorted(files.items()))


def _json_default(x):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if isinstance(x, (tuple, set)):
        return list(x)
    raise TypeError(f"{type(x).__name__} {x!r} is not JSON-serializable (checkpoint manifest)")


# ------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------

def read_manifest(path) -> dict:
    """The manifest of the complete checkpoint at ``path``; CheckpointError (saying the
    checkpoint is incomplete, or missing) otherwise."""
    path = Path(path)
    if not path.is_dir():
        if partial_dir(path).is_dir():
            raise CheckpointError(f"checkpoint {path} is incomplete: its save was interrupted "
                                  f"({partial_dir(path).name} has no {MANIFEST}); nothing was loaded")
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {MANIFEST} (the save was interrupted "
                              f"or this is not an autoshard checkpoint); nothing was loaded")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST}: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}; this autoshard reads {FORMAT!r} version {VERSION}")
    files = manifest.get("files") or {}
    if METADATA not in files or not any(n != METADATA for n in files):
        raise CheckpointError(f"checkpoint {path} is corrupted: its {MANIFEST} lists no data files "
                              f"(written while another job used the directory?); nothing was loaded")
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            got = f"{f.stat().st_size} bytes" if f.is_file() else "missing"
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is {got}, the save wrote {size} bytes")
    return manifest


class _LoadPlanner(DefaultLoadPlanner):
    """Reads the regions each :class:`Piece` covers (DCP computes the overlaps with the saved
    chunks) straight into its tensor."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.original_state_dict = state_dict, state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, piece in self.state_dict.items():
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [piece.chunk()])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn].local


def _check(path, metadata, key: str, shape) -> None:
    md = metadata.state_dict_metadata.get(key)
    if md is None:
        raise CheckpointError(f"checkpoint {path} has no {key!r} (this plan needs it; the checkpoint holds "
                              f"{len(metadata.state_dict_metadata)} tensors, e.g. "
                              f"{sorted(metadata.state_dict_metadata)[:3]})")
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape):
        got = list(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
        raise CheckpointError(f"checkpoint {path}: {key} has shape {got}, this plan has {list(shape)}")


def load(local, optimizer, path, *, strict: bool = True) -> dict:
    """Read this rank's pieces of ``local``'s parameters and buffers and of ``optimizer``'s state
    (created as needed) from the checkpoint at ``path``, whatever plan wrote it; returns the
    manifest (``step``, ``extra``, ...). Call inside the rank context (no communication).
    ``path`` may be a run's ``--ckpt`` directory: its newest complete checkpoint, as
    ``--resume`` chooses (:func:`resolve`). ``strict``: every parameter, buffer and optimizer state must be in the checkpoint (with
    ``strict=False`` missing buffers keep their values). Raises CheckpointError naming the
    first missing or mis-shaped tensor, before anything is read.

    Example::

        info = load(local, opt, "ckpt/step-10")     # info["step"] == 10
        info = load(local, opt, "ckpt")             # the newest complete step-* of a --ckpt directory
    """
    ctx = current("load_checkpoint")
    path = resolve(path)
    manifest = read_manifest(path)
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - a broken .metadata is an incomplete checkpoint
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupted: its DCP metadata does not "
                              f"read ({type(e).__name__}: {e})") from None
    reader.set_up_storage_reader(metadata, ctx.rank == 0, rank=ctx.rank, use_collectives=False)
    saved = metadata.state_dict_metadata
    state = {}
    kinds = {MODEL + s.target: s.kind for s in local.spec.slots}
    for key, piece in model_pieces(local).items():
        if key not in saved and not strict and kinds[key] == "buffer":
            continue  # parameters are always needed; buffers only when strict
        _check(path, metadata, key, piece.global_shape)
        state[key] = piece
    after = []
    if optimizer is not None:
        inner = optimizer.inner
        any_optim = any(k.startswith(OPTIM) for k in saved)  # none: saved without (stateful) optimizer
        masters = {id(m): p for m, p in optimizer.masters}
        for fqn, shape, region, q in optimizer_params(local, optimizer):
            if region is None:
                continue
            prefix = f"{OPTIM}{fqn}."
            keys = sorted(k for k in saved if k.startswith(prefix) and "." not in k[len(prefix):])
            if not keys and strict and any_optim:
                raise CheckpointError(f"checkpoint {path} has no optimizer state for {fqn}")
            st = {}
            for key in keys:
                name, md = key[len(prefix):], saved[key]
                if name == MASTER:
                    if id(q) in masters:
                        _check(path, metadata, key, shape)
                        state[key] = Piece(q.data, shape, tuple(region[0]))
                    continue
                if tuple(md.size) == ():
                    t = torch.zeros((), dtype=md.properties.dtype)
                    state[key] = Piece(t, (), ())
                else:
                    _check(path, metadata, key, shape)
                    t = torch.zeros(q.shape, dtype=md.properties.dtype, device=q.device)
                    state[key] = Piece(t, shape, tuple(region[0]))
                st[name] = t
            if id(q) in masters and f"{prefix}{MASTER}" not in saved:
                after.append((q, masters[id(q)]))  # no master saved: start it from the parameter
            if st:
                inner.state[q] = st
    planner = _LoadPlanner()
    planner.set_up_planner(state, metadata, ctx.rank == 0)
    plan = planner.finish_plan(reader.prepare_local_plan(planner.create_local_plan()))
    with torch.no_grad():
        reader.read_data(plan, planner).wait()
        for m, p in after:
            m.copy_(p.float())
    groups = manifest.get("param_groups")
    if optimizer is not None and groups and len(groups) == len(optimizer.inner.param_groups):
        for group, saved_group in zip(optimizer.inner.param_groups, groups):
            for k, v in saved_group.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
    return manifest


# ------------------------------------------------------------------------------------------------
# one process: whole tensors
# ------------------------------------------------------------------------------------------------

def load_global(path, prefix: str = "") -> dict:
    """{key: whole tensor} of every saved tensor whose key starts with ``prefix`` (one process;
    no rank context needed). Reads everything: for models that fit in this process's memory.
    ``path`` may be a ``--ckpt`` directory (its newest complete checkpoint)."""
    path = resolve(path)
    read_manifest(path)
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=False)
    state = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            state[key] = Piece(torch.empty(tuple(md.size), dtype=md.properties.dtype), tuple(md.size),
                               (0,) * len(md.size))
    planner = _LoadPlanner()
    planner.set_up_planner(state, metadata, True)
    reader.read_data(planner.finish_plan(planner.create_local_plan()), planner).wait()
    return {k: p.local for k, p in state.items()}


def consolidate(path, out=None, *, format: str = "safetensors", like=None, max_shard_size="5GB",
                weights_prefix: str | None = None, overwrite: bool = False):
    """The model's state dict from a checkpoint written under any plan: {FQN: whole tensor},
    tied aliases included, loadable with ``model.load_state_dict(state, strict=True)``.

    With ``out``: the model written to the directory ``out`` as ``save_pretrained`` writes it
    (``format="safetensors"``: shards of at most ``max_shard_size`` and their index, config and
    tokenizer files copied from the Hugging Face directory ``like``, ``weights_prefix`` removed
    from the keys), one tensor in memory at a time; returns ``out``
    (:mod:`autoshard.runtime.execution.hf_consolidate`). ``path`` may be a run's ``--ckpt`` directory:
    its newest complete checkpoint, as ``--resume`` chooses.

    Example::

        model.load_state_dict(autoshard.consolidate("ckpt/step-10"))
        model.load_state_dict(autoshard.consolidate("ckpt"))   # a run's --ckpt: its newest verified one
        autoshard.consolidate("ckpt", out="llama-trained", like="llama-hf")   # from_pretrained("llama-trained")
    """
    if out is not None:
        # deferred: hf_consolidate builds on this module (a cycle at import time)
        from .hf_consolidate import write_hf
        return write_hf(path, out, format=format, like=like, max_shard_size=max_shard_size,
                        weights_prefix=weights_prefix, overwrite=overwrite)
    skipped: list = []
    path = resolve(path, skipped)
    for line in skipped_warnings(skipped, "consolidate"):  # the newer checkpoints it did not take
        print(f"warning: {line}", file=sys.stderr, flush=True)
    manifest = read_manifest(path)
    state = {k[len(MODEL):]: v for k, v in load_global(path, MODEL).items()}
    for alias, kept in (manifest.get("aliases") or {}).items():
        if kept in state:
            state[alias] = state[kept]
    keys = manifest.get("state_dict_keys")
    if keys is not None:
        missing = [k for k in keys if k not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {missing[0]!r} of the model's state dict "
                                  f"({len(missing)} missing)")
        state = {k: state[k] for k in keys}  # the model's order; non-persistent buffers left out
    return state


def consolidate_optimizer(path) -> dict:
    """{FQN: {state name: whole tensor}} of the optimizer state in a checkpoint (``step``,
    ``exp_avg``, ``exp_avg_sq`` for Adam), for a single-device optimizer.

    Example::

        moments = consolidate_optimizer("ckpt/step-10")["embed.weight"]["exp_avg"]
    """
    out: dict = {}
    for key, t in load_global(resolve(path), OPTIM).items():
        fqn, name = key[len(OPTIM):].rsplit(".", 1)
        out.setdefault(fqn, {})[name] = t
    return out


def load_into_module(model, optimizer, path) -> dict:
    """Load a checkpoint written under any plan into an unsharded ``model`` (strict) and, when
    given, a torch ``optimizer`` over its parameters (its state and hyperparameters): training
    continues on one device. Returns the manifest.

    Example::

        info = load_into_module(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "ckpt/step-10")
    """
    path = resolve(path)
    manifest = read_manifest(path)
    model.load_state_dict(consolidate(path), strict=True)
    if optimizer is not None:
        moments = consolidate_optimizer(path)
        names = {id(p): n for n, p in model.named_parameters()}
        aliases = manifest.get("aliases") or {}
        for group, saved in zip(optimizer.param_groups, manifest.get("param_groups") or []):
            for p in group["params"]:
                fqn = names[id(p)]
                st = moments.get(aliases.get(fqn, fqn), {})
                st = {k: v.clone() for k, v in st.items() if k != MASTER}
                if st:
                    optimizer.state[p] = st
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
    return manifest


def resolve(path, skipped: list | None = None) -> Path:
    """``path`` itself when it is a checkpoint, else the newest ``step-*`` checkpoint of a
    training run's ``--ckpt`` directory that verifies (its manifest and every file it lists, at
    the size the save wrote); the newer ones that do not are appended to ``skipped`` as
    ``(name, why)``. CheckpointError when none verifies.

    Example::

        skipped = []
        newest = resolve("ck", skipped)     # ck/step-000004, skipped [("step-000006", "... incomplete ...")]
    """
    path = Path(path)
    if (path / MANIFEST).is_file() or partial_dir(path).is_dir() or not path.is_dir() \
            or (path / METADATA).is_file() or any(path.glob("*.distcp")):
        return path  # a checkpoint (complete or not: read_manifest says which), not a --ckpt directory
    steps = sorted((p for p in path.glob("step-*") if p.is_dir()), key=lambda p: p.name)
    partial = sorted(path.glob(".step-*.partial"))
    passed = []
    for p in reversed(steps):
        try:
            read_manifest(p)
        except CheckpointError as e:
            passed.append((p.name, str(e)))
            continue
        if skipped is not None:
            skipped.extend(passed)
        return p
    if partial or steps:
        last = passed[0][1] if passed else f"{partial[-1].name}: its save was interrupted"
        raise CheckpointError(f"{path} holds only incomplete checkpoints (newest: {last}); nothing to load")
    raise CheckpointError(f"{path} is not a checkpoint and holds no step-* checkpoints")


def skipped_warnings(skipped: list, who: str) -> list:
    """One warning per newer checkpoint that :func:`resolve` skipped (``skipped``: its
    ``(name, why)`` pairs), saying who skipped it and why: what ``--resume``, ``--weights`` and
    :func:`consolidate` of a ``--ckpt`` directory print after ``warning:``.

    Example::

        skipped = []
        resolve("ck", skipped)
        skipped_warnings(skipped, "--resume")   # ["--resume skipped step-000006: checkpoint ... is incomplete: ..."]
    """
    return [f"{who} skipped {name}: {why}" for name, why in skipped]


# ------------------------------------------------------------------------------------------------
# one job per --ckpt directory
# ------------------------------------------------------------------------------------------------

LOCK = ".autoshard-lock"


class DirectoryHeld(CheckpointError):
    """The ``--ckpt`` directory is held by another live job."""


class DirectoryLock:
    """A job's hold on a checkpoint directory: a POSIX record lock on ``<dir>/.autoshard-lock``
    (released by the kernel when the holding process ends, however it ends; also on NFS), with
    the holder written into the file so that a second job can name it.

    Example (the job's first process, before training)::

        lock, dead = DirectoryLock.take("ck")      # DirectoryHeld if a live job holds it
        ...
        lock.release()
    """

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def take(cls, directory) -> tuple["DirectoryLock", dict | None]:
        """The lock, and the record of the job that held it before and died without releasing
        it (None if there was none)."""
        path = Path(directory) / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise DirectoryHeld(f"{directory} is in use by another job: {describe_holder(holder)} (hint: let it "
                                f"finish, or give this job another --ckpt directory)") from None
        previous = _holder(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(fd, path), previous

    def release(self) -> None:
        """Give the directory up (the record is cleared first: an empty lock file is a clean end)."""
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)  # (a POSIX lock ends when any descriptor of the file closes: this is the only one)
        self.fd = None


def _holder(fd: int) -> dict | None:
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"record": text[:100]}


def describe_holder(holder: dict | None) -> str:
    if not holder:
        return "a job that has not written its record yet"
    if "pid" not in holder:
        return f"an unreadable record ({holder.get('record')!r})"
    return f"pid {holder['pid']} on {holder.get('host')} since {holder.get('since')} ({holder.get('command', '')})"


def data_identity(path) -> dict:
    """What a resumed run compares to tell whether it reads the same token file: its size and the
    SHA-256 of its first MiB (not the whole file: data files are large)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return {"file": path.name, "bytes": path.stat().st_size, "sha256_first_mib": head}
