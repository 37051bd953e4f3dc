"""Which rank stopped answering: heartbeats through the rendezvous store.

A collective that times out (a stalled peer) or fails (a dead peer) tells a rank only that some
peer in its group did not answer. Each process therefore runs a :class:`Heartbeat`, a thread
that increments its counter in the process group's key-value store (torchrun's TCPStore, which
lives in the launcher, not in a rank) once per ``interval``. After a collective fails,
:func:`stalled_ranks` reads every counter twice, ``wait`` seconds apart: ranks whose counter did not
move are stopped (SIGSTOP, a debugger, a hung driver) or dead. :func:`first_to_report` lets one
rank of the job print the line, however many noticed, and :func:`wake` continues a stopped
rank so that the launcher can end it.

Example (inside each process of a job, process group initialised)::

    beat = Heartbeat(dist.distributed_c10d._get_default_store(), rank)
    try:
        train()
    except RuntimeError:
        gone = stalled_ranks(store, world_size)     # e.g. [2]
        if gone and first_to_report(store):
            print(f"rank {gone[0]} stopped answering")
    finally:
        beat.stop()
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

PREFIX = "autoshard/watchdog"


class Heartbeat:
    """A daemon thread adding 1 to ``{PREFIX}/beat/{rank}`` in ``store`` every ``interval`` s."""

    def __init__(self, store, rank: int, interval: float = 0.5):
        self.store, self.key, self.interval = store, f"{PREFIX}/beat/{rank}", interval
        self._stop = threading.Event()
        store.set(f"{PREFIX}/pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self.store.add(self.key, 1)  # present from the start: a rank that never beat is gone
        self._thread = threading.Thread(target=self._run, name=f"autoshard-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1)


def beats(store, world_size: int) -> list:
    """Every rank's heartbeat count (``add(key, 0)`` reads without waiting for a missing key)."""
    return [store.add(f"{PREFIX}/beat/{r}", 0) for r in range(world_size)]


def stalled_ranks(store, world_size: int, wait: float = 2.0) -> list:
    """Ranks whose heartbeat did not move within ``wait`` seconds (stopped or dead), in order."""
    before = beats(store, world_size)
    time.sleep(wait)
    after = beats(store, world_size)
    return [r for r in range(world_size) if after[r] == before[r]]


def wake(store, ranks) -> None:
    """SIGCONT to those ``ranks`` that run on this host: a rank stopped with SIGSTOP ignores the
    launcher's SIGTERM until continued, so torchrun would wait its whole grace period (30 s)
    before killing it. Continuing a stopped process is harmless; it then ends with the job."""
    host = socket.gethostname()
    for r in ranks:
        try:
            where, pid = store.get(f"{PREFIX}/pid/{r}").decode().split()
            if where == host and hasattr(signal, "SIGCONT"):
                os.kill(int(pid), signal.SIGCONT)
        except Exception:  # noqa: BLE001 - gone already, or another host: nothing to do
            pass


def first_to_report(store) -> bool:
    """True for exactly one caller per job (the first)."""
    return store.add(f"{PREFIX}/reported", 1) == 1
