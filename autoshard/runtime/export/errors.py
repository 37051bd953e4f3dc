"""How a run of an export fails: one-line errors, exit codes, and the lost-peer diagnosis.

Every problem run.py can find is one line on stderr and an exit code a script can act on:
2 (``RunError``: a usage problem found before running, or by every rank at the same point),
3 (a peer stopped answering: the first rank to notice names the silent ranks, never a hang),
4 (``NonFiniteError``: a non-finite loss or gradient norm under ``--nan-policy stop``).

Example::

    try:
        ctx = prepare(root, args)
    except RunError as e:
        print(f"run.py: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from autoshard.runtime.transport.watchdog import first_to_report, stalled_ranks, wake


EXIT_USAGE = 2
EXIT_PEER = 3
EXIT_NONFINITE = 4
# words of a failed collective's error (gloo's, nccl's, the store's) when a peer may be gone
_PEER_ERRORS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "gloo", "nccl",
                "socket", "peer")


class RunError(Exception):
    """A problem found before running (bad files, wrong world size): one line, exit code 2."""


class NonFiniteError(Exception):
    """A training step whose loss or gradient norm is not finite under ``--nan-policy stop``, or
    trained state that is not finite where a checkpoint is due: one line, exit code 4. Every
    rank raises it at the same step (the verdict is agreed)."""


def _env_int(name: str, default: int) -> int:
    """torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` (``default`` outside torchrun): which
    process prints a job's one line, and the world size that ``prepare`` checks."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


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
