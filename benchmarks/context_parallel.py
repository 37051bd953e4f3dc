"""Ring attention step time on gloo processes vs the all-gather-KV variant, unsharded attention,
and PyTorch's own ``torch.distributed.tensor.experimental.context_parallel``.

Run (note the load average with the figures)::

    .venv/bin/python benchmarks/context_parallel.py [--seq 4096] [--ranks 2 4]

One step = forward + backward of causal GQA attention (batch 1, 8 query heads, 2 kv heads, head
width 64, fp32) over a sequence of ``--seq`` positions, zigzag order. Each of the ``R`` gloo
processes holds ``seq / R`` positions and one intra-op thread; the step time is the slowest
rank's median over ``--steps`` steps after a warm-up. The unsharded baseline is one process (one
thread) running ``F.scaled_dot_product_attention`` on the whole sequence. Every sharded output is
checked against the unsharded one before timing.

The last column is PyTorch's ``context_parallel`` on the same inputs (q, k, v as its ``buffers``,
is_causal, GQA via ``enable_gqa``), its output gathered with ``context_parallel_unshard`` and
checked against the unsharded one; where it does not run, the column is the one-line error. On
CPU it does not: SDPA on CPU dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no DTensor sharding strategy (torch 2.13 registers its ring only for the flash /
efficient / cuDNN ops, whose kernels are CUDA-only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from autoshard import Mesh  # noqa: E402
from autoshard.runtime import DistributedBackend, rank_context  # noqa: E402
from autoshard.runtime.transport.launch import spawn  # noqa: E402
from autoshard.runtime.primitives.ring_attention import allgather_attention, order_index, ring_attention  # noqa: E402

H, G, D = 8, 2, 64


def _inputs(seq):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, seq, D, generator=g) for h in (H, G, G)]


def _time(fn, steps, warmup=1):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _worker(rank, world, seq, steps):
    import torch.distributed as dist
    mesh = Mesh({"cp": world})
    q, k, v = _inputs(seq)
    idx = order_index(seq, world, "zigzag").view(world, -1)[rank]
    mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    res = {}
    with rank_context(mesh, rank, DistributedBackend(mesh)):
        for name, fn in (("ring", ring_attention), ("allgather", allgather_attention)):
            def step(fn=fn):
                out = fn(*mine, None, "cp", True, "zigzag")
                out.backward(torch.ones_like(out))
                dist.barrier()
                return out
            res[name + "_out"] = step().detach()
            res[name] = _time(step, steps)
    res["torch_cp"] = _torch_context_parallel(world, q, k, v, steps)
    return res


def _torch_context_parallel(world, q, k, v, steps):
    """PyTorch's ``context_parallel`` on the same attention, if it runs on CPU / gloo.

    Its ``buffers`` are sharded in place along ``buffer_seq_dims`` (head-tail order, i.e. zigzag,
    when the sequence divides by 2R) and restored on exit, so they must be plain inputs: here
    copies of q, k, v that do not require grad. Inside the context, where
    ``F.scaled_dot_product_attention`` is patched to its ring, each rank makes leaves of its
    shards and runs forward + backward; the step time is measured inside one context, as ours is
    on pre-sharded inputs. Returns (step seconds, whole output gathered back in sequence order)
    or the one-line reason it does not run.
    """
    import torch.distributed as dist
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        bufs = [x.detach().clone() for x in (q, k, v)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            mine = [b.detach().requires_grad_() for b in bufs]

            def step():
                out = F.scaled_dot_product_attention(*mine, is_causal=True, enable_gqa=True)
                out.backward(torch.ones_like(out))
                dist.barrier()
                return out

            out = step().detach()
            t = _time(step, steps)
        whole = context_parallel_unshard(mesh, [out], [2])[0]
        return t, whole
    except Exception as e:  # report why, do not fail the benchmark
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # under torchrun every rank would spawn its own ring
        sys.exit("run with python, not torchrun: the script starts its own gloo processes (--ranks)")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1/5/15 min), "
          f"{os.cpu_count()} cores; seq {a.seq}, heads {H}/{G} kv, head dim {D}, fp32, causal, zigzag")
    torch.set_num_threads(1)
    q, k, v = (x.requires_grad_() for x in _inputs(a.seq))

    def whole():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))
        return out
    ref = whole().detach()
    t_whole = _time(whole, a.steps)
    print(f"{'ranks':>5}  {'ring ms':>9}  {'all-gather ms':>13}  {'unsharded ms':>12}  {'ring/unsh':>9}  "
          f"{'ring/ag':>7}  torch context_parallel")
    for n in a.ranks:
        res = spawn(_worker, n, a.seq, a.steps, timeout=900)
        idx = order_index(a.seq, n, "zigzag").view(n, -1)
        for name in ("ring", "allgather"):
            out = torch.zeros_like(ref)
            for r in range(n):
                out[:, :, idx[r]] = res[r][name + "_out"]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        ring = max(r["ring"] for r in res) * 1e3
        ag = max(r["allgather"] for r in res) * 1e3
        tcp = res[0]["torch_cp"]
        if isinstance(tcp, str):
            tcp = f"does not run on CPU/gloo: {tcp}"
        else:  # a number only for a run whose output equals the unsharded one
            torch.testing.assert_close(tcp[1], ref, rtol=1e-4, atol=1e-5)
            t = max(r["torch_cp"][0] for r in res) * 1e3
            tcp = f"{t:.1f} ms (ring/torch {ring / t:.2f}x)"
        print(f"{n:>5}  {ring:>9.1f}  {ag:>13.1f}  {t_whole * 1e3:>12.1f}  {ring / (t_whole * 1e3):>8.2f}x  "
              f"{ring / ag:>6.2f}x  {tcp}", flush=True)

if __name__ == "__main__":
    main()
