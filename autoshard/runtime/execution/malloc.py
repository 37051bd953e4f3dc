"""The C allocator's large-block threshold, fixed: freed tensors go back to the system.

torch's CPU tensors come from the C library's ``malloc``. glibc serves a block at or above
its mmap threshold (128 KiB) with a fresh ``mmap`` and unmaps it on ``free``, but the threshold
is *dynamic*: each freed mmapped block raises it to that block's size (up to 32 MiB on 64-bit
Linux). After the first training step nearly every activation, gathered ZeRO-3 unit and
gradient is below the raised threshold and comes from the heap, whose freed space the process
keeps (it is returned only from the top of the heap, and the heap is fragmented by what stays
alive). Each step then leaves the resident set higher than the one before: on the 317M Llama
at ZeRO-3 dp=4, 0.7 GiB per rank more after three steps than the tensors alive account for.

Setting the threshold explicitly (``mallopt(M_MMAP_THRESHOLD, ...)``) turns the dynamic
adjustment off, so a block of 128 KiB or more is always its own mapping and its pages leave the
process when the tensor is freed: the high-water mark is then what the live tensors need, what
the memory prediction counts. Results are unchanged (only where the bytes live changes); each
large block costs its page faults again, the price of not holding freed memory.

A ``MALLOC_MMAP_THRESHOLD_`` set in the environment (glibc's own tunable) is left as it is; on
a C library without ``mallopt`` nothing happens.

Example::

    fixed_mmap_threshold()      # True where glibc took the setting (run.py calls it first)
"""
from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD_BYTES = 128 << 10  # glibc's default, kept fixed


def fixed_mmap_threshold(nbytes: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (module doc); whether it was
    set. Leaves an environment's ``MALLOC_MMAP_THRESHOLD_`` alone (False).

    >>> isinstance(fixed_mmap_threshold(), bool)
    True
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: another C library's mallopt means other things
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1
