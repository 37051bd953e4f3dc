"""Trained weights back to the Hugging Face ecosystem: a checkpoint as a ``save_pretrained``
directory, written one tensor at a time.

``autoshard.consolidate(CKPT, out=OUT, format="safetensors", like=HF_DIR)`` (the command line's
``autoshard consolidate CKPT OUT --format safetensors --like HF_DIR``) writes::

    OUT/
      model.safetensors                  the weights, when they fit in max_shard_size; else
      model-00001-of-0000N.safetensors   shards of at most max_shard_size each (a tensor
      model.safetensors.index.json       larger than it gets a shard of its own), and the index
      config.json ...                    copied from ``like``: config, generation config, tokenizer

``from_pretrained(OUT)`` loads it. CKPT is an autoshard checkpoint written under any plan, a
training run's ``--ckpt`` directory (its newest complete checkpoint, as ``--resume`` chooses)
or a plain ``torch.distributed.checkpoint.save`` directory. The keys are the model's state
dict keys, in its order (non-persistent buffers left out, as ``save_pretrained`` leaves them);
``weights_prefix`` (the attribute under which a training wrapper holds the HF model) is removed
from them. Tied weights (an ``lm_head.weight`` that is ``model.embed_tokens.weight``) are
written once, under the name that comes first in the state dict: the one ``save_pretrained``
keeps; ``from_pretrained`` ties the other to it.

Memory: the headers are computed from DCP's metadata before any data is read; then each tensor
is read whole (DCP gathers it from every rank's pieces), written, and dropped, so the process
holds one tensor at a time (and, while it is read, the saved piece being copied into it).
The directory appears only when complete (written next to OUT and renamed).

Example::

    autoshard.consolidate("ck", out="llama-trained", format="safetensors", like="llama-hf")
    model = LlamaForCausalLM.from_pretrained("llama-trained")
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import weights_dcp

FORMATS = ("safetensors",)
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# what save_pretrained and a tokenizer's save_pretrained write besides the weights
LIKE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
              "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json")
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """Bytes of ``"5GB"`` (decimal, as ``save_pretrained``'s ``max_shard_size``), ``"2GiB"`` or an int.

    Example::

        parse_size("5GB")   # 5_000_000_000
    """
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"max_shard_size {size!r} is not a size (hint: e.g. 5GB, 500MB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _tensors(src, weights_prefix):
    """[(HF name, DcpTensor)] in the model's state-dict order, each saved tensor once."""
    skipped: list = []
    path, manifest, state = weights_dcp.open_dcp(src, skipped)
    order = (manifest or {}).get("state_dict_keys")
    if order is not None:
        missing = [k for k in order if k not in state]
        if missing:
            raise ckpt.CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s) of the model's state dict "
                                       f"({', '.join(missing[:3])})")
        names = list(order)
    else:
        names = list(state)
    prefix = (weights_prefix.rstrip(".") + ".") if weights_prefix else ""
    if prefix:
        outside = [k for k in names if not k.startswith(prefix)]
        if outside:
            raise ckpt.CheckpointError(f"weights_prefix {weights_prefix!r}: {len(outside)} key(s) of {path} are not "
                                       f"under it ({', '.join(outside[:3])}); a Hugging Face directory holds the "
                                       f"model under the prefix only (hint: check the prefix)")
    out, seen = [], set()
    for name in names:
        t = state[name]
        if t.key in seen:  # a tied alias: saved once, under the first name
            continue
        seen.add(t.key)
        if t.dtype not in DTYPES:
            raise ckpt.CheckpointError(f"checkpoint {path}: {name} has the dtype {t.dtype}, which safetensors "
                                       f"files here do not hold")
        out.append((name[len(prefix):], t))
    return path, out, skipped


def _shards(tensors: list, limit: int) -> list:
    """Tensors split greedily into shards of at most ``limit`` bytes (save_pretrained's rule)."""
    shards, size = [[]], 0
    for name, t in tensors:
        n = _nbytes(t)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def _nbytes(t) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n * torch.empty((), dtype=t.dtype).element_size()


def _write_file(file: Path, tensors: list) -> None:
    """One safetensors file, streamed: the header (from shapes and dtypes alone), then each
    tensor read from the checkpoint, written and dropped. Wider dtypes first, so that every
    tensor starts at a multiple of its element size (the header is padded to 8 bytes)."""
    tensors = sorted(tensors, key=lambda nt: -torch.empty((), dtype=nt[1].dtype).element_size())
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors:
        n = _nbytes(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, t in tensors:
            whole = t.source.read(t.key, t.shape, ([0] * len(t.shape), list(t.shape)))  # DCP gathers the pieces
            f.write(memoryview(whole.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del whole
        f.flush()
        os.fsync(f.fileno())


def write_hf(src, out, *, format: str = "safetensors", like=None, max_shard_size="5GB",
             weights_prefix: str | None = None, overwrite: bool = False) -> Path:
    """Write the model of the checkpoint ``src`` to ``out`` as a ``save_pretrained``-style
    directory (see the module docstring); returns ``out``.

    Example::

        write_hf("ck", "llama-trained", like="llama-hf", max_shard_size="5GB")
    """
    if format not in FORMATS:
        raise ValueError(f"format {format!r} is not one consolidate writes (it writes {', '.join(FORMATS)})")
    limit = parse_size(max_shard_size)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ckpt.CheckpointError(f"{out} exists and is not empty (hint: choose a new directory, or replace it "
                                   f"with overwrite=True / --force)")
    like = Path(like) if like is not None else None
    if like is not None and not (like / "config.json").is_file():
        raise ckpt.CheckpointError(f"--like {like} has no config.json (hint: the Hugging Face directory the model "
                                   f"came from, as save_pretrained wrote it)")
    path, tensors, skipped = _tensors(src, weights_prefix)
    for line in ckpt.skipped_warnings(skipped, "consolidate"):  # as consolidate(DIR) without out says them
        print(f"warning: {line}", file=sys.stderr, flush=True)
    shards = _shards(tensors, limit)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        if len(shards) == 1:
            _write_file(tmp / SINGLE, shards[0])
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_file(tmp / name, shard)
                weight_map.update({n: name for n, _ in shard})
            index = {"metadata": {"total_size": sum(_nbytes(t) for _, t in tensors)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for name in LIKE_FILES if like is not None else ():
            if (like / name).is_file():
                shutil.copyfile(like / name, tmp / name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
