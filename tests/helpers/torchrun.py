"""Runs an exported directory under torchrun on this host, one intra-op thread per process, with
a timeout: a hang is a failure."""
from __future__ import annotations

import os
import subprocess
import time

from autoshard.passes.export import torchrun_command

TORCHRUN_TIMEOUT = 120  # a hang is a failure


def torchrun(path, nproc, *run_args):
    """(finished process, seconds): ``torchrun`` of the exported ``path`` on ``nproc`` processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run(torchrun_command(path, nproc, *run_args), env=env, capture_output=True, text=True,
                          timeout=TORCHRUN_TIMEOUT)
    return proc, time.monotonic() - start
