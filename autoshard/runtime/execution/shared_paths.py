"""Whether every rank of a job sees the same checkpoint directory and token file.

A job on several machines writes its checkpoints into ``--ckpt`` from every rank (each rank its
own pieces, rank 0 the manifest) and reads ``--data`` on every rank: both must be one shared
file system at the same path. A node that has a local directory of that name instead (or
another copy of the data) trains without complaint and leaves checkpoints that never load, or
trains its ranks on other tokens. So before training, once the process group exists:

- ``--ckpt``: rank 0 writes a file with a random token into the directory; every rank reads it
  back through its own ``--ckpt`` path (a node that does not share the directory does not find
  it, or finds another token); rank 0 removes it afterwards;
- ``--data``: every rank compares the file's size and the SHA-256 of its first MiB with rank 0's;
- ``--resume``: the checkpoint every rank resolved (its name and its manifest's SHA-256).

Every rank gets the same list of problems (one all-gather), so all stop together, and the one
line names the ranks (and hosts) that differ.

Example::

    problems = check_shared_paths(dist.get_rank(), ckpt="ck/", data="tokens.bin")
    if problems:
        raise SystemExit(problems[0])      # e.g. "--ckpt ck/ on rank 2 (host b) is not rank 0's ..."
"""
from __future__ import annotations

import hashlib
import os
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from .checkpoint import data_identity

PROBE_PREFIX = ".autoshard-shared-"  # the token file rank 0 writes into --ckpt (removed after the check)


def write_probe(directory) -> tuple:
    """Rank 0's side of the ``--ckpt`` check: a file with a fresh random token in
    ``directory``; returns ``(file name, token)``. Example::

        name, token = write_probe("ck")      # ('.autoshard-shared-1234-…', '9f…')
    """
    token = secrets.token_hex(16)
    name = f"{PROBE_PREFIX}{os.getpid()}-{token[:8]}"
    (Path(directory) / name).write_text(token)
    return name, token


def sees_probe(directory, name: str, token: str) -> bool:
    """Whether ``directory/name`` holds ``token`` as this process reads it."""
    try:
        return (Path(directory) / name).read_text() == token
    except OSError:
        return False


def _manifest_digest(checkpoint) -> str:
    try:
        return hashlib.sha256((Path(checkpoint) / "manifest.json").read_bytes()).hexdigest()
    except OSError:
        return ""


def _what_rank_sees(ckpt, data, resume, probe) -> dict:
    seen = {"host": socket.gethostname()}
    if ckpt is not None:
        seen["ckpt"] = sees_probe(ckpt, *probe)
    if data is not None:
        d = data_identity(data)
        seen["data"] = (d["bytes"], d["sha256_first_mib"])
    if resume is not None:
        seen["resume"] = (Path(resume).name, _manifest_digest(resume))
    return seen


def _ranks(bad: list) -> str:
    return (f"rank{'s' if len(bad) > 1 else ''} " + ", ".join(f"{r} (host {h})" for r, h in bad[:4])
            + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""))


def check_shared_paths(rank: int, *, ckpt=None, data=None, resume=None, group=None) -> list:
    """The problems (one line each, the same list on every rank) where a rank does not see
    rank 0's ``ckpt`` directory, ``data`` file or ``resume`` checkpoint (see the module
    docstring); ``[]`` when every rank does. Collectives of the default process group (or
    ``group``): call on every rank after ``init_process_group``, before training.

    Example::

        check_shared_paths(dist.get_rank(), ckpt=args.ckpt, data=args.data, resume=resolved)   # []
    """
    probe = [write_probe(ckpt) if rank == 0 and ckpt is not None else None]
    dist.broadcast_object_list(probe, src=0, group=group)
    try:
        seen = _what_rank_sees(ckpt, data, resume, probe[0])
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, seen, group=group)  # every rank has read the probe once it returns
    finally:
        if rank == 0 and probe[0] is not None:
            (Path(ckpt) / probe[0][0]).unlink(missing_ok=True)
    first, problems = everyone[0], []
    hint = "(hint: every node must see the same file system at the same path, e.g. a shared mount)"
    bad = [(r, s["host"]) for r, s in enumerate(everyone) if "ckpt" in s and not s["ckpt"]]
    if bad:
        problems.append(f"--ckpt {ckpt} on {_ranks(bad)} is not the directory rank 0 (host {first['host']}) writes "
                        f"its checkpoints to: the file rank 0 wrote there is not there {hint}")
    bad = [(r, s["host"]) for r, s in enumerate(everyone) if "data" in s and s["data"] != first["data"]]
    if bad:
        r = bad[0][0]
        problems.append(f"--data {data} on {_ranks(bad)} is another file than rank 0's (host {first['host']}): "
                        f"{everyone[r]['data'][0]} bytes against {first['data'][0]}"
                        + (", the same size but another first MiB" if everyone[r]["data"][0] == first["data"][0]
                           else "") + f" {hint}")
    bad = [(r, s["host"]) for r, s in enumerate(everyone) if "resume" in s and s["resume"] != first["resume"]]
    if bad:
        r = bad[0][0]
        problems.append(f"--resume on {_ranks(bad)} finds checkpoint {everyone[r]['resume'][0]}, not rank 0's "
                        f"{first['resume'][0]} (host {first['host']}) or another copy of it {hint}")
    return problems
