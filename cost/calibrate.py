"""Calibration: measure this machine's links and compute with real collectives, write a hardware file.

``calibrate(mesh_axes, nprocs, out_path)`` starts ``nprocs`` processes joined by a process group
(gloo on CPU; nccl when ``device="cuda"``), builds the mesh's per-axis groups, and on every axis
times the autoshard runtime's own ``all_reduce`` and ``all_gather`` (the functions plans run,
autograd wrappers and tracing included) over a range of message sizes. Per axis it fits the
alpha-beta model of ``cost.comm`` (``t = steps * alpha + bytes_sent * beta``, least squares on
relative error) and turns it into a :class:`LinkSpec`. On every rank at once (so the ranks
compete for cores as they do when a plan runs) it also measures matmul FLOP/s, copy bandwidth
and the fixed cost of one small op. The result is a :class:`Hardware` (one link tier per axis,
inner axes first, each axis pinned to its tier, fitted on the all-reduces) written as JSON with
``"collective_factors"`` (how much slower than that fit the runtime's all-gather and
reduce-scatter run, at large sizes) and ``"overlap": false`` (CPU ranks share cores, so
asynchronous buckets do not overlap compute), ready for ``autoshard.autoshard(..., hardware=path)``
or ``$AUTOSHARD_HARDWARE``.

Example::

    hw = calibrate({"dp": 2, "tp": 2}, 4, "hw.json")      # 4 gloo processes
    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, hardware="hw.json")

From the command line: ``python -m autoshard calibrate dp=2,tp=2 4 hw.json``.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from autoshard.mesh import Mesh
from autoshard.runtime import DistributedBackend, rank_context
from autoshard.runtime.primitives.collectives import all_gather, all_reduce, reduce_scatter
from autoshard.runtime.transport.launch import spawn

from .comm import R, collective_bytes, collective_steps_formula
from .hardware import DeviceSpec, Hardware, LinkSpec, load_hardware
from .model import payload_bytes

__all__ = ["busy_collective_seconds", "calibrate", "fit_alpha_beta", "link_latency", "parse_mesh"]

DEFAULT_SIZES = (4, 4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20, 8 * 2**20)
# the compute between the collectives of the busy-latency measurement: one fp32 matmul of this
# size (14 MFLOP: about a millisecond on a CPU rank sharing its core, the order of a small
# model's backward between two per-parameter gradient syncs)
BUSY_GAP_M = 192


def parse_mesh(spec) -> dict:
    """``{"dp": 2}``, ``"dp=2,tp=2"`` or ``"4"`` (one axis ``x``) -> {axis: size}."""
    if spec is None:
        return {"x": 2}
    if isinstance(spec, dict):
        return {str(k): int(v) for k, v in spec.items()}
    s = str(spec).strip()
    if s.isdigit():
        return {"x": int(s)}
    out = {}
    for part in s.split(","):
        name, _, size = part.partition("=")
        if not name or not size.strip().isdigit():
            raise ValueError(f"mesh {spec!r}: expected axis=size pairs such as 'dp=2,tp=2'")
        out[name.strip()] = int(size)
    return out


def _steps_and_sent(kind: str, input_bytes: float, ranks: int) -> tuple[float, float]:
    steps = float(collective_steps_formula(kind).subs(R, ranks))
    return steps, collective_bytes(kind, payload_bytes(kind, input_bytes, ranks), ranks)


def fit_alpha_beta(samples) -> tuple[float, float]:
    """Least squares (relative error) of ``t = steps * alpha + sent * beta`` over samples
    ``(steps, bytes_sent, seconds)``; both coefficients kept positive.

    >>> a, b = fit_alpha_beta([(2, 0, 2e-4), (2, 1e6, 2e-4 + 1e-3), (6, 3e6, 6e-4 + 3e-3)])
    >>> round(a * 1e6, 3), round(1 / b / 1e9, 3)     # 100 us per step, 1 GB/s
    (100.0, 1.0)
    """
    rows = [(s / t, b / t) for s, b, t in samples if t > 0]
    A = torch.tensor(rows, dtype=torch.float64)
    y = torch.ones(len(rows), dtype=torch.float64)
    sol = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1)
    alpha, beta = float(sol[0]), float(sol[1])
    if alpha <= 0 or beta <= 0:  # refit one coefficient with the other at a floor
        big = [x for x in samples if x[1] > 0]
        beta = max(beta, min((t / b for s, b, t in big), default=1e-12) * 0.5, 1e-15)
        alpha = max(statistics.median([(t - b * beta) / s for s, b, t in samples if s > 0] or [1e-6]), 1e-9)
    return alpha, beta


def _time(fn, repeats: int, barrier=None) -> float:
    """Median seconds of one call (each call started together on every rank)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rate(fn, work: float, seconds: float = 0.1, windows: int = 5, barrier=None) -> float:
    """Sustained work per second of ``fn`` run back to back (every rank at once, so they share
    the cores as a plan's ranks do): the median over ``windows`` windows of ``seconds``."""
    fn()
    rates = []
    for _ in range(windows):
        if barrier is not None:
            barrier()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        rates.append(n * work / (time.perf_counter() - t0))
    return statistics.median(rates)


def _worker(rank, world, mesh_axes, sizes, repeats, device):
    """One rank: time collectives on every axis, then compute, all ranks together."""
    mesh = Mesh(mesh_axes)
    backend = DistributedBackend(mesh, device_type=device)
    dev = torch.device(device if device == "cpu" else f"{device}:{rank % max(1, torch.cuda.device_count())}")
    out = {"comm": [], "compute": {}}
    with rank_context(mesh, rank, backend), torch.no_grad():
        for axis, n in mesh.axes.items():
            if n == 1:
                continue
            for kind in ("all_reduce", "all_gather", "reduce_scatter"):
                for size in sizes:
                    x = torch.ones(max(n, size // 4 // n * n), dtype=torch.float32, device=dev)
                    fn = {"all_reduce": lambda: all_reduce(x, axis), "all_gather": lambda: all_gather(x, axis, 0),
                          "reduce_scatter": lambda: reduce_scatter(x, axis, 0)}[kind]
                    r = max(3, repeats if size < 2**20 else repeats // 2)
                    t = _time(fn, r, dist.barrier)
                    out["comm"].append((axis, kind, x.numel() * 4, t))
        dist.barrier()
        # compute, every rank at once
        for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            m = 256
            a = torch.randn(m, m, dtype=dtype, device=dev)
            b = torch.randn(m, m, dtype=dtype, device=dev)
            out["compute"][key] = _rate(lambda: a @ b, 2 * m ** 3, barrier=dist.barrier)
        big = torch.randn(4 * 2**20, device=dev)  # 16 MiB
        out["compute"]["mem_bandwidth"] = _rate(lambda: big.clone(), 2 * big.numel() * 4, barrier=dist.barrier)
        tiny = torch.ones(8, device=dev)
        out["compute"]["op_overhead"] = 1.0 / _rate(lambda: tiny + 1, 1.0, 0.05, barrier=dist.barrier)
        # a small all-reduce issued between compute, every rank busy (as in a plan's backward)
        a = torch.randn(BUSY_GAP_M, BUSY_GAP_M, device=dev)
        one = torch.ones(1, device=dev)
        out["busy"] = {axis: busy_collective_seconds(lambda: a @ a, lambda: all_reduce(one, axis),
                                                     barrier=dist.barrier)
                       for axis, n in mesh.axes.items() if n > 1}
    return out


def busy_collective_seconds(compute, collective, calls: int = 20, repeats: int = 5, barrier=None) -> float:
    """The time one ``collective()`` adds when issued between ``compute()`` calls: the median
    of ``calls`` x (compute, collective) minus ``calls`` x compute alone, per call (never < 0).

    Calibration's all-reduce fit times collectives that start together after a barrier, with
    every rank idle. In a plan a collective is issued between ops while every local rank
    computes; where ranks outnumber cores a rank waits until its peers are scheduled, so the
    fixed cost of each collective is larger than the fit's. This measures that cost.

    >>> import time
    >>> s = busy_collective_seconds(lambda: sum(range(1000)), lambda: time.sleep(0.002), calls=5, repeats=3)
    >>> s > 0.001                 # the 2 ms sleep, less the noise of timing the compute alone
    True
    """
    def mixed():
        for _ in range(calls):
            compute()
            collective()

    def alone():
        for _ in range(calls):
            compute()
    t_mixed = _time(mixed, repeats, barrier)
    t_alone = _time(alone, repeats, barrier)
    return max(0.0, (t_mixed - t_alone) / calls)


def link_latency(alpha_fit: float, busy_seconds: Optional[float], ranks: int) -> float:
    """A link's latency per step: the larger of the all-reduce fit's ``alpha`` and the measured
    cost of an all-reduce issued between compute (``busy_seconds``) over its latency steps.

    >>> round(link_latency(1e-4, 2e-3, 2) * 1e3, 3)    # 2 ranks: an all-reduce is 2 steps
    1.0
    >>> link_latency(1e-4, None, 2)
    0.0001
    """
    if not busy_seconds:
        return alpha_fit
    steps = float(collective_steps_formula("all_reduce").subs(R, ranks))
    return max(alpha_fit, busy_seconds / steps)


def calibrate(mesh_axes=None, nprocs=None, out_path: Optional[str] = None, *, base="cpu-gloo",
              sizes=DEFAULT_SIZES, repeats: int = 15, device: str = "cpu", timeout: float = 600.0,
              verbose: bool = True) -> Hardware:
    """Measure latency and bandwidth per mesh axis (and compute) with real collectives; return
    a :class:`Hardware` and write it to ``out_path`` (JSON) when given.

    ``mesh_axes``: ``{"dp": 2, "tp": 2}`` or ``"dp=2,tp=2"`` (default ``{"x": 2}``);
    ``nprocs``: processes to start (default: the mesh size; must equal it); ``base``: the preset
    whose memory capacity is kept; ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (nccl)."""
    mesh_axes = parse_mesh(mesh_axes)
    size = math.prod(mesh_axes.values())
    nprocs = int(nprocs) if nprocs is not None else size
    if nprocs != size:
        raise ValueError(f"calibrate: mesh {mesh_axes} has {size} ranks but nprocs={nprocs}")
    if device != "cpu":  # pragma: no cover - needs GPUs
        raise NotImplementedError("calibrate(device='cuda') needs a launcher with nccl; run it under torchrun")
    t0 = time.perf_counter()
    results = spawn(_worker, nprocs, mesh_axes, tuple(sizes), repeats, device, timeout=timeout)
    # the slowest rank decides each measurement
    per = {}
    for res in results:
        for axis, kind, nbytes, t in res["comm"]:
            key = (axis, kind, nbytes)
            per[key] = max(per.get(key, 0.0), t)
    links, raw, ratios, fits, busy = {}, {}, {}, {}, {}
    for axis, n in mesh_axes.items():
        if n == 1:
            continue
        # the link from the all-reduces (what plans mostly run); other kinds get a factor
        samples = []
        for (a, kind, nbytes), t in per.items():
            if a == axis and kind == "all_reduce":
                steps, sent = _steps_and_sent(kind, nbytes, n)
                samples.append((steps, sent, t))
        alpha, beta = fit_alpha_beta(samples)
        fits[axis] = alpha
        busy[axis] = max(r["busy"][axis] for r in results)
        links[axis] = (link_latency(alpha, busy[axis], n), 1.0 / beta)
        for (a, kind, nbytes), t in per.items():
            if a == axis and nbytes >= 2**18:
                steps, sent = _steps_and_sent(kind, nbytes, n)
                ratios.setdefault(kind, []).append(t / (steps * alpha + sent * beta))
        raw[axis] = [(kind, nbytes, t) for (a, kind, nbytes), t in sorted(per.items()) if a == axis]
    factors = {k: statistics.median(v) / statistics.median(ratios.get("all_reduce", [1.0]))
               for k, v in ratios.items() if k != "all_reduce"}
    comp = {k: min(r["compute"][k] for r in results) for k in ("fp32", "bf16", "mem_bandwidth")}
    overhead = max(r["compute"]["op_overhead"] for r in results)
    basehw = load_hardware(base)
    device_spec = DeviceSpec(name=f"calibrated-{device}", peak_flops={"fp32": comp["fp32"], "bf16": comp["bf16"],
                                                                      "fp16": comp["bf16"], "fp64": comp["fp32"] / 2},
                             mem_bandwidth=comp["mem_bandwidth"], mem_capacity=basehw.device.mem_capacity,
                             op_overhead=overhead)
    hw = _hardware_from_links(mesh_axes, links, device_spec)
    if out_path is not None:
        d = hw.to_dict()
        d["overlap"] = False
        d["collective_factors"] = factors
        d["calibration"] = {"mesh": mesh_axes, "seconds": time.perf_counter() - t0,
                            "collectives": {a: [list(x) for x in v] for a, v in raw.items()},
                            "latency_fit": fits, "busy_all_reduce_seconds": busy,
                            "note": "collective times are the slowest rank's mean over repeats; overlap=false: "
                                    "the runtime's collectives are synchronous"}
        Path(out_path).write_text(json.dumps(d, indent=2) + "\n")
    if verbose:
        for axis, (alpha, bw) in links.items():
            print(f"[autoshard] calibrate {axis}: latency {alpha * 1e6:.1f} us/step (all-reduce fit "
                  f"{fits[axis] * 1e6:.1f}; one issued between compute {busy[axis] * 1e6:.0f} us), "
                  f"bandwidth {bw / 1e9:.3f} GB/s")
        print("[autoshard] calibrate time factors vs the all-reduce fit: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(factors.items())))
        print(f"[autoshard] calibrate compute: fp32 {comp['fp32'] / 1e9:.1f} GFLOP/s, copy {comp['mem_bandwidth'] / 1e9:.2f} "
              f"GB/s, {overhead * 1e6:.1f} us per small op ({time.perf_counter() - t0:.1f} s)")
    return hw


def _hardware_from_links(mesh_axes: dict, links: dict, device: DeviceSpec) -> Hardware:
    """One tier per measured axis: the innermost axis's groups are the smallest domains."""
    names = [a for a in mesh_axes if a in links]
    tiers, pinned, domain = [], {}, 1
    for i, axis in enumerate(reversed(names)):
        domain *= mesh_axes[axis]
        last = i == len(names) - 1
        alpha, bw = links[axis]
        tiers.append(LinkSpec(bandwidth=bw, latency=alpha, domain_size=None if last else domain, name=f"{axis}-link"))
        pinned[axis] = f"{axis}-link"
    if not tiers:
        tiers = [LinkSpec(bandwidth=1e9, latency=0.0, name="none")]
    return Hardware(name="calibrated", device=device, links=tuple(tiers), pinned=pinned)
