"""Runtime: collectives with their adjoints, the backends that execute them, and the runner of exports.

Four subpackages, by kind:

- :mod:`.transport` — the backends that move bytes between ranks: ``SimulatedBackend`` /
  ``run_simulated`` (ranks as threads, exact), ``DistributedBackend`` (torch.distributed groups
  from a DeviceMesh), same-host shared memory, the watchdog, ``launch.spawn`` (N gloo processes
  for tests), and ``rank_context`` / ``current`` (which rank and backend a thread runs as).
- :mod:`.primitives` — differentiable primitives: ``all_reduce``, ``mark_varying``,
  ``reduce_scatter``, ``all_gather``, ``all_gather_varying``, ``shard_slice``, ``all_to_all``,
  ``to_partial`` with their ``ADJOINTS`` table, and the autograd functions built on them (ZeRO
  units, gradient buckets, ``PendingValue``, ``varying_linears``, ring attention, the
  vocab-parallel loss, expert dispatch, recompute).
- :mod:`.execution` — running a per-rank program: ``LocalModule`` and the sharded optimizer,
  pipeline schedules, distributed checkpoints (saved state), gradient clipping, inputs, the timeline.
- :mod:`.export` — the runner of an exported directory (its run.py calls it).

Example::

    >>> import torch
    >>> from autoshard import Mesh
    >>> from autoshard.runtime import run_simulated, all_gather
    >>> run_simulated(Mesh({"tp": 2}), lambda r: all_gather(torch.tensor([float(r)]), "tp", 0))
    [tensor([0., 1.]), tensor([0., 1.])]
"""
from autoshard.runtime.transport.backend import Backend, CollectiveError
from autoshard.runtime.primitives.collectives import (ADJOINTS, COLLECTIVES, COMM_KINDS, LOCAL_KINDS, Adjoint, all_gather, all_gather_varying, all_reduce, all_to_all, backward_collective, forward_collective, mark_varying, reduce_scatter, reshard_after_forward, shard_slice, to_partial, use_persistent)
from autoshard.runtime.transport.distributed import DistributedBackend
from autoshard.runtime.primitives import experts
from autoshard.runtime.transport.rank_context import (CollectiveRecord, RankContext, current, rank_context, trace_phase)
from autoshard.runtime.transport.simulated import SimulatedBackend, SimulationAborted, run_simulated


__all__ = [
    "ADJOINTS", "Adjoint", "COLLECTIVES", "COMM_KINDS", "LOCAL_KINDS", "Backend",
    "CollectiveError", "CollectiveRecord", "DistributedBackend", "RankContext",
    "SimulatedBackend", "SimulationAborted", "all_gather", "all_gather_varying", "all_reduce",
    "all_to_all", "backward_collective", "current", "forward_collective", "mark_varying",
    "rank_context", "reduce_scatter", "reshard_after_forward", "run_simulated", "shard_slice",
    "to_partial", "trace_phase", "use_persistent",
]
