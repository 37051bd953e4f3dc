"""Expert parallelism on gloo: training step time of ep=N (each rank holds E/N experts, tokens
travel by all-to-all) against replicated experts (data parallel, every rank holds every expert),
and the all-to-all time the cost model predicts against the time measured.

For N in --procs: N gloo processes (1 thread each) run both plans of the MoE example
(``examples.models.moe_tiny``, stacked experts), alternately, ``--rounds`` rounds of ``--steps``
training steps (forward, backward, AdamW) after one warm-up step; the median step time is
reported. Measured all-to-all time: wall time inside the backend's all-to-all calls (count
exchange, dispatch and combine, forward and backward) per step, rank 0. Predicted: the plan's
listed all-to-alls timed by the cost model (``cost.comm.collective_time`` on the hardware's link
for the axis, ``--hardware``, default the ``cpu-gloo`` preset), and the model's whole step
(``plan.cost``)::

    .venv/bin/python benchmarks/moe.py            # N = 2 and 4
    .venv/bin/python benchmarks/moe.py --procs 2 --steps 2 --rounds 1    # quick
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import autoshard  # noqa: E402
from autoshard.cost.comm import collective_time  # noqa: E402
from autoshard.runtime import DistributedBackend, rank_context  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from examples.models import moe_tiny  # noqa: E402


def build(n, kind, opts):
    model, args, dims = moe_tiny(experts="grouped", batch=opts.batch, seq=opts.seq, hidden_size=opts.hidden,
                                 intermediate_size=2 * opts.hidden, num_heads=4, num_kv_heads=2,
                                 num_experts=opts.experts, expert_size=opts.expert_size, num_layers=opts.layers,
                                 max_seq_len=opts.seq, with_labels=True)
    if kind == "ep":
        mesh, layout = {"ep": n}, {"batch": "ep", "experts": "ep"}
    else:  # replicated experts: plain data parallelism
        mesh, layout = {"dp": n}, {"batch": "dp"}
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh(mesh), dims=dims, layout=layout, train=True,
                               hardware=opts.hardware)
    return plan, args


def predicted_all_to_all(plan) -> float:
    """Seconds per step of the plan's all-to-alls under its cost model's hardware."""
    hw = plan.cost_model.hardware
    return sum(collective_time("all_to_all", c.bytes, plan.mesh.axes[c.axes[0]], hw.link_for_axis(plan.mesh, c.axes[0]))
               for c in plan.collectives if c.kind == "all_to_all")


def worker(rank, world, opts):
    torch.manual_seed(0)
    results = {}
    runs = {}
    for kind in ("replicated", "ep"):
        plan, args = build(world, kind, opts)
        backend = DistributedBackend(plan.mesh)
        spent = [0.0]
        for name in ("all_to_all", "all_to_all_v"):  # time inside the backend's all-to-alls
            fn = getattr(backend, name)

            def timed(*a, _fn=fn, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[0] += time.perf_counter() - t
            setattr(backend, name, timed)
        with rank_context(plan.mesh, rank, backend):
            local = plan.build(rank)
            opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)
        runs[kind] = (plan, args, backend, local, opt, spent)
        results[kind] = {"steps": [], "a2a": [], "predicted_step": plan.cost["step_time"],
                         "predicted_a2a": predicted_all_to_all(plan)}

    def step(kind):
        plan, args, backend, local, opt, spent = runs[kind]
        torch.distributed.barrier()
        with rank_context(plan.mesh, rank, backend):  # one plan's context at a time
            spent[0] = 0.0
            t = time.perf_counter()
            loss = local(*args)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t, spent[0]

    for kind in runs:
        step(kind)  # warm-up
    for _ in range(opts.rounds):
        for kind in runs:  # alternate, so background load hits both alike
            for _ in range(opts.steps):
                seconds, a2a = step(kind)
                results[kind]["steps"].append(seconds)
                results[kind]["a2a"].append(a2a)
    return results if rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hardware", default="cpu-gloo")
    opts = p.parse_args(argv)
    print(f"MoE example: {opts.layers} layers, hidden {opts.hidden}, {opts.experts} experts of {opts.expert_size}, "
          f"top-2, batch {opts.batch} x seq {opts.seq}; {opts.rounds} rounds x {opts.steps} steps, medians")
    header = (f"{'procs':>5}  {'experts':<10} {'step ms':>8} {'pred ms':>8} {'a2a ms':>7} {'a2a pred':>8}"
              f"  {'vs replicated':>13}")
    print(header)
    for n in opts.procs:
        res = spawn(worker, n, opts, timeout=900)[0]
        base = statistics.median(res["replicated"]["steps"])
        for kind in ("replicated", "ep"):
            r = res[kind]
            med = statistics.median(r["steps"])
            print(f"{n:>5}  {kind if kind == 'replicated' else f'ep={n}':<10} {med * 1e3:8.1f} "
                  f"{r['predicted_step'] * 1e3:8.1f} {statistics.median(r['a2a']) * 1e3:7.2f} "
                  f"{r['predicted_a2a'] * 1e3:8.2f}  {med / base:13.2f}")


if __name__ == "__main__":
    main()
