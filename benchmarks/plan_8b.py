"""Planning time and memory for the 8B Llama-shaped model on the meta device.

Run: .venv/bin/python benchmarks/plan_8b.py [--layers 32] [--mesh dp=8,tp=8]
Prints capture (torch.export) time, autoshard's own time (dims + rewrite), print time and
peak RSS, side by side in one run.
"""
import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from examples.models import llama_8b_meta  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--mesh", default="dp=8,tp=8")
    ap.add_argument("--quiet", action="store_true", help="do not print the plan tables")
    a = ap.parse_args(argv)
    mesh = autoshard.Mesh({k: int(v) for k, v in (p.split("=") for p in a.mesh.split(","))})
    t0 = time.perf_counter()
    model, args, dims = llama_8b_meta(with_labels=True, num_layers=a.layers)
    t1 = time.perf_counter()
    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"})
    t2 = time.perf_counter()
    text = str(plan)
    t3 = time.perf_counter()
    if not a.quiet:
        print(text)
    n_params = sum(p.numel() for p in model.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB
    print(f"model: {n_params / 1e9:.2f}B parameters, {a.layers} layers, on meta; mesh {mesh}")
    print(f"build model        {t1 - t0:6.2f} s")
    print(f"torch.export       {plan.timings['capture']:6.2f} s")
    print(f"autoshard (dims)   {plan.timings['dims']:6.2f} s")
    print(f"autoshard (spmd)   {plan.timings['rewrite']:6.2f} s")
    print(f"print(plan)        {t3 - t2:6.2f} s  ({len(text.splitlines())} lines, {len(plan.collectives)} collectives)")
    print(f"peak RSS           {rss:6.2f} GB")


if __name__ == "__main__":
    main()
