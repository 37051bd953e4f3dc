"""One-device check: autoshard's program at mesh size 1 against the eager model, and MFU.

Run by ``benchmarks/gpu_check.sh`` on a machine with one CUDA device (bf16); runs on CPU too
(``--device cpu``, fp32 by default), which is how its logic is tested here. Prints one summary
line::

    gpu_check: device=NVIDIA H100 dtype=bfloat16 model=8x1024 seq=1024 batch=8 eager=41.2ms program=41.6ms
    overhead=1.010 mfu=0.412 (peak 989 TFLOP/s) ranks=1

The model is torch's test Transformer (as in ``vs_pytorch.py``) with a mean cross-entropy loss.
A step is forward + backward + AdamW. The eager model and the program (``plan.build(0)`` on a
mesh of size 1, one simulated rank, so no process group is needed) are timed alternately
(``--rounds`` rounds of ``--steps`` steps, after warm-up); the overhead is the ratio of medians.
MFU = model FLOPs per step (:func:`step_flops`) / program step time / the device's peak.
Two ranks on one GPU are not run: nccl needs a device per rank.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# Dense bf16 peak FLOP/s by device name (vendor data sheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_flops(device_name: str, override: float | None = None) -> float | None:
    """The device's dense bf16 peak, from ``override`` or the name table; None if unknown."""
    if override:
        return override
    for key, v in PEAK_BF16.items():
        if key in device_name:
            return v
    return None


def step_flops(layers: int, dim: int, seq: int, batch: int, vocab: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) of the test
    Transformer: per token 2 FLOPs per weight of the matmuls (4 d^2 attention projections,
    8 d^2 MLP, d x vocab head) plus causal attention scores and values (2 * 2 * seq * d per
    layer, halved by the mask)."""
    tokens = batch * seq
    matmul = 2 * tokens * (layers * 12 * dim * dim + dim * vocab)
    attention = 2 * tokens * layers * 2 * seq * dim / 2
    return 3 * (matmul + attention)


def summary_line(device: str, dtype, layers, dim, seq, batch, eager_s, program_s, peak) -> str:
    overhead = program_s / eager_s
    flops = step_flops(layers, dim, seq, batch, 512)
    mfu = f"{flops / program_s / peak:.3f} (peak {peak / 1e12:.0f} TFLOP/s)" if peak else "n/a (unknown peak)"
    return (f"gpu_check: device={device} dtype={str(dtype).replace('torch.', '')} model={layers}x{dim} seq={seq} "
            f"batch={batch} eager={eager_s * 1e3:.1f}ms program={program_s * 1e3:.1f}ms overhead={overhead:.3f} "
            f"mfu={mfu} ranks=1")


def run(device: str, dtype, layers: int, dim: int, seq: int, batch: int, rounds: int, steps: int,
        warmup: int = 2, peak: float | None = None) -> str:
    import autoshard
    import vs_pytorch as V
    from autoshard.runtime import SimulatedBackend, rank_context
    from autoshard.runtime.execution.local import LocalModule
    dev = torch.device(device)
    model, _ = V.build_model(layers, dim, seq)
    tokens, labels = V.batch(seq, batch)
    mesh = autoshard.Mesh({"dp": 1})
    plan = autoshard.autoshard(copy.deepcopy(model), (tokens, labels), mesh=mesh, dims=V.DIMS,
                               layout={"batch": "dp"}, train=True, search=False)
    eager = copy.deepcopy(model).to(device=dev, dtype=dtype)
    tokens, labels = tokens.to(dev), labels.to(dev)
    backend = SimulatedBackend(mesh)
    def lookup(slot):  # the model's tensors, in the run's dtype
        t = plan.captured.state[slot.target]
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    with rank_context(mesh, 0, backend):
        local = LocalModule(plan.rank_spec(), 0, lookup, device=dev)
        opt_p = plan.optimizer(local, torch.optim.AdamW, lr=1e-4)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)

    def eager_step():
        eager(tokens, labels).backward()
        opt_e.step()
        opt_e.zero_grad()

    def program_step():
        with rank_context(mesh, 0, backend):
            local(tokens, labels).backward()
            opt_p.step()
            opt_p.zero_grad()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        return (time.perf_counter() - t0) / steps

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        eager_step()
        program_step()
    te, tp = [], []
    for r in range(rounds):
        pair = (eager_step, program_step) if r % 2 == 0 else (program_step, eager_step)
        for fn in pair:
            (te if fn is eager_step else tp).append(timed(fn))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return summary_line(name, dtype, layers, dim, seq, batch, statistics.median(te), statistics.median(tp),
                        peak_flops(name, peak) if dev.type == "cuda" else peak)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU runs: 1 matches vs_pytorch.py)")
    ap.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s, if not in the table")
    o = ap.parse_args(argv)
    if o.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: error: no CUDA device (hint: --device cpu runs the same check on the CPU)")
    if o.threads:
        torch.set_num_threads(o.threads)
    dtype = getattr(torch, o.dtype or ("bfloat16" if o.device.startswith("cuda") else "float32"))
    print(run(o.device, dtype, o.layers, o.dim, o.seq, o.batch, o.rounds, o.steps, peak=o.peak_flops), flush=True)


if __name__ == "__main__":
    main()
