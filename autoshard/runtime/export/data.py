"""``--data``: a token file read as consecutive global batches, each rank reading only its rows.

Each global batch is ``B*S`` consecutive tokens (the planned input's shape); a rank reads
only its own block of each batch.

Example::

    data = TokenData(Path("tokens.bin"), "uint16", doc)   # as prepare_training makes it
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from autoshard.runtime.execution import checkpoint as ckpt

from .errors import RunError


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
