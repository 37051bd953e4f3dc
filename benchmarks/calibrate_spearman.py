"""Predicted vs measured step time on 4 gloo processes, after calibration (Spearman rank correlation).

Run: .venv/bin/python benchmarks/calibrate_spearman.py [--hardware hw.json] [--iters 5]

1. ``autoshard.cost.calibrate({"dp": 2, "tp": 2}, 4, out)``: latency and bandwidth per axis with
   the runtime's own collectives, matmul FLOP/s, copy bandwidth and per-op overhead, all
   measured with 4 processes sharing this machine's cores (skipped with ``--hardware``).
2. A small Llama (fp32, hidden 256, 2 layers, 8 heads / 4 kv heads, ffn 1024, vocab 512,
   batch 8 x seq 64) is planned for training under 9 layouts on 4-rank meshes; each plan's
   predicted forward + backward time (``plan.cost``: compute + exposed communication, on the
   calibrated hardware) is printed.
3. The same plans run on 4 gloo processes (``autoshard.runtime.transport.launch.spawn``; each rank builds
   the plan, ``plan.build(rank)``, then times forward + backward, slowest rank's median).
4. Prints both columns and their Spearman rank correlation (target >= 0.8).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import autoshard  # noqa: E402
import autoshard.cost  # noqa: E402,F401
from examples.models import llama_tiny  # noqa: E402

MODEL = dict(with_labels=True, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=1024,
             vocab_size=512, num_layers=2, batch=8, seq=64)
TP = {"heads": "tp", "kv_heads": "tp", "ffn": "tp"}
PLANS = [
    ("replicated", {"tp": 4}, {"heads": None}),
    ("dp=4", {"dp": 4}, {"batch": "dp"}),
    ("dp=2x2 (batch on both)", {"dp": 2, "tp": 2}, {"batch": ("dp", "tp")}),
    ("tp=4 Megatron", {"tp": 4}, TP),
    ("tp=4 Megatron + vocab", {"tp": 4}, {**TP, "vocab": "tp"}),
    ("dp=2 x tp=2 Megatron", {"dp": 2, "tp": 2}, {"batch": "dp", **TP}),
    ("tp=4 ffn only", {"tp": 4}, {"ffn": "tp"}),
    ("tp=4 hidden", {"tp": 4}, {"hidden": "tp"}),
    ("tp=4 seq", {"tp": 4}, {"seq": "tp"}),
]


def make_plan(mesh, layout, hardware=None):
    model, args, dims = llama_tiny(**MODEL)
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout, train=True,
                               search=False, hardware=hardware)
    return plan, args


def predicted_fwd_bwd(plan) -> float:
    c = plan.cost
    exposed = sum(t for (axis, phase), t in c["comm_exposed"].items() if phase in ("forward", "backward"))
    return c["compute_by_phase"]["forward"] + c["compute_by_phase"]["backward"] + exposed


def _measure(rank, world, iters):
    import torch.distributed as dist
    from autoshard.runtime import DistributedBackend, rank_context

    out = []
    for name, mesh, layout in PLANS:
        plan, args = make_plan(mesh, layout)
        backend = DistributedBackend(plan.mesh)
        times = []
        with rank_context(plan.mesh, rank, backend):
            local = plan.build(rank)
            flat = plan.captured.flatten_args(args, {})
            li = plan.loss_index()
            for it in range(iters + 2):
                dist.barrier()
                t0 = time.perf_counter()
                outs = local.run_flat(flat)
                loss = outs[li]
                loss.backward(torch.ones_like(loss))
                t = time.perf_counter() - t0
                local.zero_grad(set_to_none=True)
                if it >= 2:
                    times.append(t)
        out.append((name, statistics.median(times)))
        dist.barrier()
    return out


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", help="a calibrated hardware JSON (skip calibration)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="where to write the calibrated hardware JSON")
    a = ap.parse_args(argv)
    hw = a.hardware
    if hw is None:
        hw = a.out or os.path.join(tempfile.mkdtemp(), "hw.json")
        t = time.perf_counter()
        autoshard.cost.calibrate({"dp": 2, "tp": 2}, 4, hw)
        print(f"calibrated in {time.perf_counter() - t:.1f} s -> {hw}")
    predicted = {}
    for name, mesh, layout in PLANS:
        plan, _ = make_plan(mesh, layout, hardware=hw)
        predicted[name] = predicted_fwd_bwd(plan)
    t = time.perf_counter()
    from autoshard.runtime.transport.launch import spawn
    results = spawn(_measure, 4, a.iters, timeout=900)
    measured = {name: max(r[k][1] for r in results) for k, (name, _, _) in enumerate(PLANS)}
    print(f"measured on 4 gloo processes in {time.perf_counter() - t:.1f} s\n")
    print(f"{'plan':28s} {'predicted ms':>13s} {'measured ms':>12s}")
    for name, _, _ in PLANS:
        print(f"{name:28s} {predicted[name] * 1e3:13.2f} {measured[name] * 1e3:12.2f}")
    names = [n for n, _, _ in PLANS]
    rho = spearman([predicted[n] for n in names], [measured[n] for n in names])
    print(f"\nSpearman rank correlation over {len(names)} plans: {rho:.3f} (target >= 0.8)")
    return rho


if __name__ == "__main__":
    main()
