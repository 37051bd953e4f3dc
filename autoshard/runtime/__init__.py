"""Runtime: collectives with their adjoints, and the backends that execute them.

- :mod:`.collectives` — ``all_reduce``, ``mark_varying``, ``reduce_scatter``, ``all_gather``,
  ``all_gather_varying``, ``shard_slice``, ``all_to_all``, ``to_partial``; the ``ADJOINTS`` table.
- :mod:`.context` — ``rank_context`` / ``current``: which rank and backend a thread runs as.
- :mod:`.overlap_linear` — ``varying_linears``: ``mark_varying`` and the column-parallel linears
  reading it, with the gradient sum run under the weight gradients.
- :mod:`.pending_value` — ``PendingValue``: a forward sum returned before it arrives (a loss).
- :mod:`.simulated` — ``SimulatedBackend`` and ``run_simulated``: ranks as threads, exact.
- :mod:`.distributed` — ``DistributedBackend``: torch.distributed groups from a DeviceMesh.
- :mod:`.launch` — ``spawn``: N gloo processes for tests.

Example::

    >>> import torch
    >>> from autoshard import Mesh
    >>> from autoshard.runtime import run_simulated, all_gather
    >>> run_simulated(Mesh({"tp": 2}), lambda r: all_gather(torch.tensor([float(r)]), "tp", 0))
    [tensor([0., 1.]), tensor([0., 1.])]
"""
from .backend import Backend, CollectiveError
from .collectives import (ADJOINTS, COLLECTIVES, COMM_KINDS, LOCAL_KINDS, Adjoint, all_gather,
                          all_gather_varying, all_reduce, all_to_all, backward_collective,
                          forward_collective, mark_varying, reduce_scatter, reshard_after_forward,
                          shard_slice, to_partial, use_persistent)
from .distributed import DistributedBackend
from . import experts
from .context import CollectiveRecord, RankContext, current, rank_context, trace_phase
from .simulated import SimulatedBackend, SimulationAborted, run_simulated


__all__ = [
    "ADJOINTS", "Adjoint", "COLLECTIVES", "COMM_KINDS", "LOCAL_KINDS", "Backend",
    "CollectiveError", "CollectiveRecord", "DistributedBackend", "RankContext",
    "SimulatedBackend", "SimulationAborted", "all_gather", "all_gather_varying", "all_reduce",
    "all_to_all", "backward_collective", "current", "forward_collective", "mark_varying",
    "rank_context", "reduce_scatter", "reshard_after_forward", "run_simulated", "shard_slice",
    "to_partial", "trace_phase", "use_persistent",
]
