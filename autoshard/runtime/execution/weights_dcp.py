"""Weights from a torch.distributed.checkpoint (DCP) directory, read by region.

``run.py --weights SRC`` (and ``plan.export(path, weights=SRC)``) takes, besides safetensors and
``torch.save`` files, a DCP checkpoint:

- an autoshard checkpoint (``step-NNNNNN/`` with its ``autoshard.json`` manifest: its
  ``model.<FQN>`` tensors, tied aliases as the manifest lists them);
- a training run's ``--ckpt`` directory: its newest complete checkpoint, chosen as ``--resume``
  chooses it (:func:`autoshard.runtime.execution.checkpoint.resolve`);
- a plain ``torch.distributed.checkpoint.save`` directory (``.metadata`` and ``*.distcp``, no
  manifest): of a state dict saved as it is (``dcp.save(model.state_dict())``), its tensors by
  key; of one saved under ``"model"`` (``dcp.save({"model": sd, "optim": ...})``, the layout
  of torch's DCP recipes), the tensors under ``"model"``.

Opening reads DCP's metadata only (names, global shapes, dtypes), so run.py checks the keys
before the process group starts. Each rank then reads, tensor by tensor, only the region it
holds (:meth:`DcpTensor.local_piece`: DCP computes the overlap with the saved chunks), so a
loading process holds its own shard plus the one saved chunk being copied (at most one tensor).

Example::

    state = read_dcp("ck")                         # the newest complete step-* of a --ckpt directory
    block = state["lm_head.weight"].local_piece(place, mesh, rank)
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import checkpoint as ckpt
from .local import SliceSource

NESTED = "model"  # the entry of a nested DCP state dict that holds the model's (torch's DCP recipes)


def is_dcp(src) -> bool:
    """True when ``src`` is a DCP checkpoint, an autoshard one, or a ``--ckpt`` directory of them."""
    src = Path(src)
    if not src.is_dir():
        return False
    if (src / ckpt.METADATA).is_file() or (src / ckpt.MANIFEST).is_file():
        return True
    return any(p.is_dir() for p in src.glob("step-*")) or any(src.glob(".step-*.partial"))


class DcpTensor(SliceSource):
    """One tensor of a DCP checkpoint, read by region: a rank's block is a DCP read of that
    region only. ``convert`` is the plan's dtype when the saved one differs (floats only)."""

    def __init__(self, source: "_Source", key: str, shape, dtype, convert=None):
        self.source, self.key, self.shape, self.dtype, self.convert = source, key, tuple(shape), dtype, convert

    def local_piece(self, place, mesh, rank: int) -> torch.Tensor:
        region = ckpt.held_region(self.shape, place, mesh, rank)
        piece = self.source.read(self.key, self.shape, region)
        return piece.to(self.convert) if self.convert is not None else piece


class _Source:
    """A DCP directory opened once: its metadata, and region reads into fresh tensors."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = FileSystemReader(path)
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - a broken .metadata is a usage error here
            raise ckpt.CheckpointError(f"weights checkpoint {path}: its DCP metadata does not read "
                                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        self.reader.set_up_storage_reader(self.metadata, True, rank=0, use_collectives=False)
        self._lock = threading.Lock()  # ranks of a simulated mesh are threads of one process

    def read(self, key: str, shape, region) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        offsets, sizes = region
        piece = ckpt.Piece(torch.empty(sizes, dtype=md.properties.dtype), tuple(shape), tuple(offsets))
        if piece.local.numel():
            planner = ckpt._LoadPlanner()
            planner.set_up_planner({key: piece}, self.metadata, False)
            plan = planner.finish_plan(self.reader.prepare_local_plan(planner.create_local_plan()))
            with self._lock:
                self.reader.read_data(plan, planner).wait()
        return piece.local


def _plain_keys(metadata) -> dict:
    """{state-dict key: DCP key} of a plain DCP save: the tensors under ``"model"`` when the
    saved state dict nests one there, else its top-level tensors."""
    tensors = [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested = {k: paths[k] for k in tensors if isinstance(paths.get(k), tuple) and len(paths[k]) > 1
              and paths[k][0] == NESTED}
    if nested:
        return {".".join(map(str, p[1:])): k for k, p in nested.items()}
    return {".".join(map(str, paths[k])) if isinstance(paths.get(k), tuple) else k: k for k in tensors
            if not isinstance(paths.get(k), tuple) or len(paths[k]) == 1}


def read_dcp(src, skipped: list | None = None) -> dict:
    """{FQN: DcpTensor} of a DCP checkpoint (see the module docstring); only metadata is read.
    A ``--ckpt`` directory gives its newest complete checkpoint; the newer ones that do not
    verify are appended to ``skipped`` as ``(name, why)``. CheckpointError when none can be read.

    Example::

        skipped = []
        state = read_dcp("ck", skipped)        # ck/step-000004's model tensors
    """
    return open_dcp(src, skipped)[2]


def open_dcp(src, skipped: list | None = None) -> tuple:
    """(the checkpoint directory read, its autoshard manifest or None, {FQN: DcpTensor}) of
    ``src`` (see :func:`read_dcp`).

    Example::

        path, manifest, state = open_dcp("ck")   # path: ck/step-000004
    """
    path = Path(src)
    if not path.exists():
        raise ckpt.CheckpointError(f"checkpoint {path} does not exist (hint: check the path)")
    if not (path / ckpt.METADATA).is_file():
        path = ckpt.resolve(path, skipped)  # a --ckpt directory: its newest complete step-*
    manifest = None
    if (path / ckpt.MANIFEST).is_file() or ckpt.partial_dir(path).is_dir():
        manifest = ckpt.read_manifest(path)  # says "incomplete" for an interrupted save
    elif not (path / ckpt.METADATA).is_file():
        raise ckpt.CheckpointError(f"checkpoint {path} is neither an autoshard checkpoint nor a DCP directory "
                                   f"(no {ckpt.MANIFEST} or {ckpt.METADATA}; hint: check the path)")
    source = _Source(path)
    saved = source.metadata.state_dict_metadata
    if manifest is not None:
        keys = {k[len(ckpt.MODEL):]: k for k, md in saved.items()
                if k.startswith(ckpt.MODEL) and isinstance(md, TensorStorageMetadata)}
        for alias, kept in (manifest.get("aliases") or {}).items():
            if kept in keys:
                keys.setdefault(alias, keys[kept])
    else:
        keys = _plain_keys(source.metadata)
    return path, manifest, {fqn: DcpTensor(source, key, saved[key].size, saved[key].properties.dtype)
                            for fqn, key in keys.items()}

