"""The pipeline degree search on a 70B-shaped Llama (meta device): Mesh.auto(64, ("pp", "dp", "tp")),
H100 preset, memory_limit 80GB, training (mixed-precision AdamW state, 16 bytes a parameter).

Run: .venv/bin/python benchmarks/search_70b.py [--layers 80] [--batch 32] [--seq 2048]
                                             [--case free|megatron|both] [--memory-limit 80GB] [--cp]

Cases:
* ``free``: every layout and ZeRO stage open. 70B x 16 B = 1.13 TB
  of state; ZeRO-3 over 64 ranks leaves ~17.6 GB a rank, so no pipeline is needed;
* ``megatron``: Megatron's setting: tp shards heads / kv_heads / ffn / vocab, batch
  on dp, ZeRO off, hidden whole, the sequence open (``search=True``): sequence parallelism
  (``seq`` soft on tp) is in the space, and with ``--cp`` context parallelism on a cp axis. A
  rank holds 1.13 TB / tp, over 80 GB for any tp <= 8; the planner pipelines only where nothing
  fits without, recomputing activations (whole blocks or selectively) where they would not fit
  otherwise.

For each: the chosen mesh, the pipeline decision (``plan.explain()``'s pipeline part),
torch.export's time and autoshard's own time beyond it, wall and this process's CPU time (the
target: <= 5 s beyond torch.export). The machine is shared: the load average is printed
before and after; the CPU time does not count waiting for a core.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from examples.models import llama_8b_meta  # noqa: E402

MEGATRON = {"batch": "dp", "heads": "tp", "kv_heads": "tp", "ffn": "tp", "vocab": "tp"}
# Megatron's space: these entries fixed, the hidden dim whole, the sequence open (the search
# tries it soft on tp, sequence parallelism, and as context parallelism on a cp axis if any)
MEGATRON_SPACE = dict(MEGATRON, hidden=None)


def llama_70b_meta(layers: int, batch: int, seq: int):
    """Llama-3-70B widths (hidden 8192, 64 heads, 8 KV heads, ffn 28672) on the meta device."""
    return llama_8b_meta(with_labels=True, num_layers=layers, hidden_size=8192, num_heads=64, num_kv_heads=8,
                         intermediate_size=28672, batch=batch, seq=seq)


def run(case: str, a) -> None:
    model, args, dims = llama_70b_meta(a.layers, a.batch, a.seq)
    n = sum(p.numel() for p in model.parameters())
    extra = dict(layout=MEGATRON_SPACE, search=True, zero_stage=0) if case == "megatron" else {}
    axes = ("pp", "dp", "cp", "tp") if a.cp and case == "megatron" else ("pp", "dp", "tp")
    print(f"\n== {case}: {n / 1e9:.1f}B parameters, {a.layers} layers, batch {a.batch} x seq {a.seq}, "
          f"Mesh.auto({a.devices}, {axes}), memory_limit {a.memory_limit}")
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh.auto(a.devices, axes), dims=dims,
                                   train=True, hardware="h100", memory_limit=a.memory_limit, **extra)
    except ValueError as e:  # nothing fits: the planner says why, per pipeline degree
        print(f"no plan ({time.perf_counter() - w0:.1f} s with export): {e}")
        return
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    t = plan.timings
    d = plan.pipeline_decision
    print(f"chosen: {plan.mesh}" + (f", {plan.schedule_name}, {plan.microbatches} microbatches" if d.pp > 1 else ""))
    if getattr(plan.search, "best", None) is not None:
        print(f"layout: {plan.search.best.candidate.describe()}")
    print("activation recompute: " + (f"{plan.checkpoint_policy} ({len(plan.checkpoint)} blocks)" if plan.checkpoint
                                      else "off"))
    print(f"predicted step {plan.cost['step_time'] * 1e3:.1f} ms, peak {plan.cost['memory']['peak'] / 1e9:.1f} GB "
          f"per rank (activations {plan.cost['memory']['activations'] / 1e9:.1f} GB)")
    print(d.explain())
    # wall time counts waiting for a shared CPU; this process's CPU time does not
    print(f"torch.export {t['capture']:.2f} s wall, {t['capture_cpu']:.2f} s CPU (twice when pipelined: whole batch "
          f"for the search, one microbatch for the stages); autoshard beyond export {wall - t['capture']:.2f} s wall, "
          f"{cpu - t['capture_cpu']:.2f} s CPU (dims {t['dims']:.2f}, search {t.get('search', 0.0):.2f}, final "
          f"rewrite {t['rewrite']:.2f}, wall); load average {os.getloadavg()[0]:.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--memory-limit", default="80GB")
    ap.add_argument("--case", choices=["free", "megatron", "both"], default="both")
    ap.add_argument("--cp", action="store_true", help="megatron case: a cp axis for context parallelism too")
    a = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for case in (["free", "megatron"] if a.case == "both" else [a.case]):
        run(case, a)


if __name__ == "__main__":
    main()
