"""Each rank's memory: its measured peak next to the prediction, as run.py prints and ``--metrics`` records.

Measured: on CPU the process's whole high-water mark (``VmHWM`` of ``/proc/self/status``:
heap, mapped file pages and the shared-memory segments it touched, everything the kernel
charges to it), on GPU ``torch.cuda.max_memory_allocated``.

Predicted: plan.json's ``cost.memory`` (the cost model's per-rank peak: parameters,
gradients, optimizer state in its dtype, saved activations, gathered ZeRO-3 units in flight,
the largest collective's buffers) plus what the runtime holds besides, each with its bound
(:func:`predicted_terms`):

- ``baseline``: the process before any of the program (Python, torch, autoshard imported),
  measured at run.py's start (CPU only: a GPU's allocator starts at zero);
- ``grad_buckets``: data-parallel gradient buckets, all in flight at the end of backward
  (this rank's gradients of the bucketed parameters once more);
- ``spare_buffers``: the backend's pool of free collective buffers (``DistributedBackend.
  SPARE_BYTES`` at most; CPU only);
- ``shm_segments``: the same-host transport's segments, one per mesh axis that uses it
  (``SharedMemoryGroup.segment_bytes`` of the largest payload it takes);
- ``optimizer_temps``: the optimizer step's temporaries on top of the state (CPU: torch's
  single-tensor AdamW, per parameter ``sqrt(exp_avg_sq)`` and its quotient by the bias
  correction, while the previous parameter's denominator is still bound: the most of
  ``2 b_i + b_(i-1)`` over the parameters in order; SGD without momentum: none);
- ``grad_norm_temps``: the global gradient norm (``--nan-policy`` and ``--clip-grad-norm``
  take it before the step): the fp64 copy of one gradient, 8 bytes per element of the largest;
- ``loading``: while the weights are read, the file pages a rank touches (its own rows where a
  tensor is split on dim 0 or whole, every page of the tensor where it is split on another
  dim) on top of the parameters already copied. Loading comes before training, so the peak
  is ``baseline + shm + max(loading phase, training phase)``; the training phase is the larger
  of forward/backward (``cost.memory``'s peak) and the optimizer step (the parameters,
  gradients and optimizer state, with the larger of the two temporaries above), plus the
  buckets and the pool.

Example::

    base = process_bytes()["VmRSS"]                  # at the start of run.py
    ...
    terms = predicted_terms(doc, mesh, train=True, device_type="cpu", baseline=base, shm_axes=["dp"])
    print(f"rank 0: {report_line(0, measured_peak('cpu'), terms['total'])}")
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.ownership import Shard
from autoshard.runtime.transport.distributed import DistributedBackend
from autoshard.runtime.transport.shm import SharedMemoryGroup

GIB = float(2 ** 30)


def process_bytes() -> dict:
    """This process's ``Vm*`` / ``Rss*`` lines of ``/proc/self/status`` in bytes ({} where there is none).

    >>> process_bytes().get("VmHWM", 0) >= process_bytes().get("VmRSS", 0) > 0    # on Linux
    True
    """
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key.startswith(("Vm", "Rss")) and rest.strip().endswith("kB"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def measured_peak(device_type: str) -> int:
    """The peak bytes of this rank so far: VmHWM on CPU, ``torch.cuda.max_memory_allocated`` on GPU."""
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return int(process_bytes().get("VmHWM", 0))


def _local_bytes(m: dict, mesh) -> tuple:
    """(bytes this rank keeps of input ``m``, bytes of the file pages reading it touches)."""
    size = math.prod(m["shape"]) * torch.empty((), dtype=m["_dtype"]).element_size()
    st = m.get("storage")
    # a ZeRO-2 parameter keeps its full (use-placement) copy; otherwise the stored placement
    place = m.get("_use") if st and st.get("mode") == "persistent" else m.get("_place")
    split, inner = 1, False
    for axis, p in zip(mesh.names, place or ()):
        if isinstance(p, Shard):
            split *= mesh.axes[axis]
            inner = inner or p.dim != 0
    own = size / split
    # a block of rows is its own pages; a block of columns is a piece of every row's pages
    return own, (size if inner else own)


def spare_bound(doc: dict, mesh, bucket_bytes: float = 0.0) -> int:
    """What the backend's pool of free collective buffers can hold (CPU): ``SPARES`` buffers
    of each size it recycles (a gathered ZeRO-3 unit, a reduce-scatter's received blocks, a
    gradient bucket), ``SPARE_BYTES`` at most."""
    sizes = set()
    for c in doc.get("collectives") or ():
        ranks = math.prod(mesh.axes[a] for a in c["axes"])
        if ranks > 1 and c["kind"] in ("all_gather", "reduce_scatter"):
            sizes.add(c["bytes"] * (ranks if c["kind"] == "all_gather" else 1))
    held = DistributedBackend.SPARES * (sum(sizes) + bucket_bytes)
    return int(min(DistributedBackend.SPARE_BYTES, held))


def shm_bytes(doc: dict, mesh, axis: str) -> int:
    """The shared-memory segment of ``axis``'s group (every rank maps and touches it): sized by
    the largest per-rank payload that goes through it (plan.json's collectives on that axis
    alone and the gradient buckets; ``SharedMemoryGroup``'s limits say which go through gloo
    instead), ``SharedMemoryGroup.segment_bytes`` of it."""
    n = mesh.axes[axis]
    moved_limit = min(SharedMemoryGroup.slot_bytes(n), SharedMemoryGroup.MAX_BYTES)
    payloads = []
    for c in doc.get("collectives") or ():
        if list(c["axes"]) != [axis]:
            continue
        summed = c["kind"] == "all_reduce"  # reduce-scatters move their blocks (an all-to-all)
        if c["bytes"] <= (SharedMemoryGroup.MAX_BYTES if summed else moved_limit):
            payloads.append(c["bytes"])
    buckets = doc.get("grad_buckets") or {}
    if buckets.get("axis") == axis:
        sizes = {m["name"]: _local_bytes(m, mesh)[0] for m in doc.get("inputs", ()) if m.get("shape")}
        payloads += [b for b in (sum(sizes.get(p, 0) for p in bk["params"]) for bk in buckets.get("buckets", []))
                     if b <= SharedMemoryGroup.MAX_BYTES]
    return SharedMemoryGroup.segment_bytes(n, max(payloads + [1]))


def step_temporaries(doc: dict, mesh, optimizer: str = "adamw") -> tuple:
    """(optimizer step's, gradient norm's) temporaries in bytes on top of the state a CPU rank
    holds at its optimizer step (module doc: ``optimizer_temps``, ``grad_norm_temps``).

    The optimizer steps each trainable parameter as this rank stores it (a ZeRO-1 parameter:
    its slice of the data axis), in plan.json's order; the norm reads each local gradient.

    >>> from autoshard.mesh import Mesh
    >>> step_temporaries({"inputs": []}, Mesh({"dp": 2}))
    (0.0, 0.0)
    """
    stepped, norm = [], 0.0
    for m in doc.get("inputs", ()):
        if m["kind"] != "parameter" or not m.get("trainable") or m.get("role", "input") != "input" or not m.get("shape"):
            continue
        own = _local_bytes(m, mesh)[0]
        z1 = m.get("zero1")
        stepped.append(own / (mesh.axes[z1["axis"]] if z1 else 1))
        norm = max(norm, 8.0 * own / torch.empty((), dtype=m["_dtype"]).element_size())
    if optimizer != "adamw":  # SGD without momentum updates in place
        return 0.0, norm
    # AdamW: sqrt(v) and sqrt(v) / c are alive together, the previous denominator still bound
    return float(max([2 * b + a for a, b in zip([0.0] + stepped, stepped)] + [0.0])), norm


def predicted_terms(doc: dict, mesh, *, train: bool, device_type: str, baseline: float,
                    shm_axes=(), optimizer: str = "adamw", grad_norm: bool = True) -> dict:
    """The predicted per-rank peak of this export and its terms, in bytes (see the module doc);
    ``total`` is the prediction. ``shm_axes``: the mesh axes whose collectives go through
    shared memory (``DistributedBackend.transports``); ``optimizer``: run.py's ``--optimizer``;
    ``grad_norm``: whether the step takes the global gradient norm (``--nan-policy`` other
    than ``ignore``, or ``--clip-grad-norm``)."""
    mem = (doc.get("cost") or {}).get("memory") or {}
    if "peak" not in mem:
        return {}
    cpu = device_type != "cuda"
    terms = {"baseline": float(baseline) if cpu else 0.0}
    for k in ("params", "buffers", "grads", "optimizer", "activations", "gathered_params", "comm_buffers"):
        terms[k] = float(mem.get(k, 0.0))
    # the training phase, as cost.memory's peak composes it
    compute = float(mem["peak"])
    buckets = doc.get("grad_buckets") or {}
    bucketed = {n for b in buckets.get("buckets", []) for n in b["params"]}
    if train and bucketed and mesh.axes.get(buckets.get("axis"), 1) > 1:
        terms["grad_buckets"] = sum(_local_bytes(m, mesh)[0] for m in doc.get("inputs", ())
                                    if m.get("name") in bucketed)
    else:
        terms["grad_buckets"] = 0.0
    terms["spare_buffers"] = float(spare_bound(doc, mesh, terms["grad_buckets"])) if cpu and train else 0.0
    terms["shm_segments"] = float(sum(shm_bytes(doc, mesh, a) for a in shm_axes)) if cpu else 0.0
    state = [_local_bytes(m, mesh) for m in doc.get("inputs", ())
             if m["kind"] in ("parameter", "buffer") and m.get("role", "input") == "input" and m.get("shape")]
    own, touched = sum(s[0] for s in state), sum(s[1] for s in state)
    # while loading: the blocks already copied and the pages of the file touched (own rows, or
    # the whole tensor where a rank's block is columns)
    terms["loading"] = float(own + touched)
    opt_temps, norm_temps = step_temporaries(doc, mesh, optimizer) if cpu and train else (0.0, 0.0)
    terms["optimizer_temps"] = opt_temps
    terms["grad_norm_temps"] = norm_temps if grad_norm else 0.0
    # at the optimizer step the activations and gathered units are gone; the state and the
    # step's temporaries are there
    held = terms["params"] + terms["buffers"] + terms["grads"] + terms["optimizer"]
    step = held + max(terms["optimizer_temps"], terms["grad_norm_temps"])
    training = max(compute, step) + terms["grad_buckets"] + terms["spare_buffers"]
    terms["training"] = training
    terms["total"] = terms["baseline"] + terms["shm_segments"] + max(terms["loading"], training)
    return terms


def report_line(rank: int, measured: float, predicted: float) -> str:
    """``rank R: peak X GiB measured, Y GiB predicted`` (run.py's line).

    >>> report_line(1, 3 * 2**30, 2.5 * 2**30)
    'rank 1: peak 3.00 GiB measured, 2.50 GiB predicted'
    """
    pred = f"{predicted / GIB:.2f} GiB predicted" if predicted else "no prediction (plan.json has no cost)"
    return f"rank {rank}: peak {measured / GIB:.2f} GiB measured, {pred}"


def report(rank: int, mesh, doc: dict, *, train: bool, device, baseline: float, shm_axes=(), metrics=None,
           say=print, optimizer: str = "adamw", grad_norm: bool = True) -> list:
    """Every rank's measured peak and prediction, gathered on every rank (a collective: call on
    all); rank 0 prints one :func:`report_line` per rank (``say``) and records them in the
    ``metrics`` file: its last line (the last step's) gets ``"memory": [{"rank",
    "measured_bytes", "predicted_bytes"}, ...]`` and ``"memory_terms"`` (rank 0's prediction
    by term), so the file stays one JSON line per step. Returns [(measured, predicted), ...]."""
    terms = predicted_terms(doc, mesh, train=train, device_type=device.type, baseline=baseline, shm_axes=shm_axes,
                            optimizer=optimizer, grad_norm=grad_norm)
    mine = torch.tensor([float(measured_peak(device.type)), terms.get("total", 0.0)], dtype=torch.float64,
                        device=device)
    rows = [torch.empty_like(mine) for _ in range(mesh.size)]
    dist.all_gather(rows, mine)
    got = [(float(r[0]), float(r[1])) for r in rows]
    if rank == 0:
        for r, (m, p) in enumerate(got):
            say(report_line(r, m, p))
        if metrics:
            _record(metrics, [{"rank": r, "measured_bytes": m, "predicted_bytes": p} for r, (m, p) in enumerate(got)],
                    {"measured": "VmHWM" if device.type != "cuda" else "cuda.max_memory_allocated", **terms})
    return got


def _record(path, ranks: list, terms: dict) -> None:
    p = Path(path)
    lines = p.read_text().splitlines() if p.exists() else []
    if not lines:
        return
    last = json.loads(lines[-1])
    last.update(memory=ranks, memory_terms=terms)
    lines[-1] = json.dumps(last)
    p.write_text("\n".join(lines) + "\n")


def trace(phase: str) -> None:
    """With ``AUTOSHARD_MEMORY_TRACE=1`` in the environment, one stderr line per call and rank:
    ``memtrace rank R PHASE rss X hwm Y`` (MiB), where a step's high-water mark rises (a
    debugging aid for the prediction's terms; nothing otherwise).

    >>> trace("forward")    # silent unless AUTOSHARD_MEMORY_TRACE=1
    """
    if os.environ.get("AUTOSHARD_MEMORY_TRACE") != "1":
        return
    b = process_bytes()
    print(f"memtrace rank {os.environ.get('RANK', '0')} {phase} rss {b.get('VmRSS', 0) / 2**20:.0f} "
          f"hwm {b.get('VmHWM', 0) / 2**20:.0f}", file=sys.stderr, flush=True)
