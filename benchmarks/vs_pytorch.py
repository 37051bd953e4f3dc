"""autoshard's training programs against PyTorch's own data and tensor parallelism, side by side.

Run (on a quiet machine; the benchmark launches one torchrun job per world size)::

    .venv/bin/pip install expecttest      # torch's test model module imports it
    .venv/bin/python benchmarks/vs_pytorch.py            # 2 and 4 processes
    .venv/bin/python benchmarks/vs_pytorch.py --world 2 --configs 8x128 --rounds 3   # a subset
    .venv/bin/python benchmarks/vs_pytorch.py --world 2 --configs 2x512 --pairs tp/dtensor --profile 3

The model is PyTorch's own test Transformer (``torch.testing._internal.distributed._tensor.
common_dtensor.Transformer``: token + position embeddings, pre-norm blocks of attention and a
GELU MLP, tied output head), wrapped with a mean cross-entropy loss, dropout 0. Each config is
built once per process from one seed; every runtime gets a copy of the same weights and the
same global batch (data-parallel runtimes split it across ranks, tensor-parallel ones read it
whole). A step is forward + backward + AdamW. One thread per process, gloo. autoshard's
collectives go through shared memory (all ranks run on this host; ``runtime/transport/shm.py``), PyTorch's
through gloo's sockets; ``AUTOSHARD_SHARED_MEMORY=0`` puts autoshard's on gloo's sockets too.

Pairs (each autoshard runtime against the PyTorch runtime a user would otherwise write):

=============  ==========================================  ========================================
pair           PyTorch                                     autoshard
=============  ==========================================  ========================================
zero0/ddp      ``DistributedDataParallel``                 ``layout={"batch": "dp"}, zero_stage=0``
zero3/fsdp2    ``fully_shard`` per block, then the root,   ``zero_stage=3,
               ``reshard_after_forward=True``              reshard_after_forward=True``
zero3-keep/    the same with ``reshard_after_forward=      the same with ``reshard_after_forward=
fsdp2-keep     False``                                     False``
tp/dtensor     ``Transformer.parallelize`` (Colwise /      ``layout={"heads": "tp", "ffn": "tp",
               Rowwise ``parallelize_module``, vocab too)  "vocab": "tp"}``
tp-sp/         the same with ``use_seq_parallel=True``     the same plus ``"seq": "tp?"`` (sequence
dtensor-sp     (norms on sequence shards)                  parallelism: norms on token rows)
=============  ==========================================  ========================================

The two runtimes of a pair are timed alternately in the same processes (``--rounds`` rounds of
``--steps`` steps each, more where steps are short so a round lasts ``--min-round`` seconds,
after warm-up), so background load hits both alike; a round's time is
rank 0's wall time between two barriers. The ratio is autoshard's median round time over the
peer's: below 1 means autoshard is faster. In brackets, the lowest and highest ratio of one
round of each runtime run back to back: how far the ratio moves on this machine from one
round to the next. ``--profile N`` then runs N more steps of each runtime under
``torch.profiler`` and prints rank 0's CPU time per op, side by side (where a ratio comes
from: the matmuls, the collectives waited for, DTensor's dispatch). ``--floor`` also times
autoshard's program with every collective's transfer removed (a local copy in its place: wrong
values, the same compute) against the peer: no transport can bring the ratio below that.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# (layers, dim, seq, global batch) -> which pairs run; "8x128" style keys select on the command line.
CONFIGS = {
    "4x256": ((4, 256, 128, 8), ("zero0/ddp", "zero3/fsdp2", "zero3-keep/fsdp2-keep", "tp/dtensor",
                          "tp-sp/dtensor-sp")),
    "2x512": ((2, 512, 256, 8), ("zero0/ddp", "zero3/fsdp2", "zero3-keep/fsdp2-keep", "tp/dtensor",
                          "tp-sp/dtensor-sp")),
    "8x128": ((8, 128, 64, 4), ("zero0/ddp", "zero3/fsdp2", "zero3-keep/fsdp2-keep")),
    "4x128tp": ((4, 128, 64, 4), ("tp/dtensor", "tp-sp/dtensor-sp")),
    "16x64": ((16, 64, 64, 4), ("zero0/ddp", "zero3/fsdp2", "zero3-keep/fsdp2-keep", "tp/dtensor",
                          "tp-sp/dtensor-sp")),
}
VOCAB = 512
LR = 1e-3
DIMS = {"tokens": "batch seq", "labels": "batch seq", "model.tok_embeddings.weight": "vocab hidden",
        "*.wq.weight": "heads hidden", "*.wk.weight": "heads hidden", "*.wv.weight": "heads hidden",
        "*.wo.weight": "hidden heads", "*.w1.weight": "ffn hidden", "*.w2.weight": "hidden ffn"}


class WithLoss(nn.Module):
    """The test Transformer with a mean cross-entropy over every token."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        return F.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten())


def build_model(layers, dim, seq):
    # deferred: torch's test module imports expecttest and much of the test harness
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
    torch.manual_seed(0)
    args = ModelArgs(n_layers=layers, vocab_size=VOCAB, max_seq_len=seq, dim=dim, n_heads=max(4, dim // 32),
                     dropout_p=0.0)
    return WithLoss(Transformer(args)), args


def batch(seq, global_batch):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (global_batch, seq), generator=g),
            torch.randint(0, VOCAB, (global_batch, seq), generator=g))


# ---- the runtimes: each returns a step function (forward + backward + optimizer) ---------------

def ddp_step(model, tokens, labels, rank, world):
    from torch.nn.parallel import DistributedDataParallel
    m = DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    t, lab = tokens.chunk(world)[rank], labels.chunk(world)[rank]

    def step():
        m(t, lab).backward()
        opt.step()
        opt.zero_grad()
    return step


def fsdp2_step(model, tokens, labels, rank, world, reshard, mesh):
    from torch.distributed.fsdp import fully_shard
    m = copy.deepcopy(model)
    for block in m.model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    t, lab = tokens.chunk(world)[rank], labels.chunk(world)[rank]

    def step():
        m(t, lab).backward()
        opt.step()
        opt.zero_grad()
    return step


def dtensor_tp_step(model, tokens, labels, mesh, seq_parallel=False):
    from torch.testing._internal.distributed._tensor.common_dtensor import Transformer
    m = copy.deepcopy(model)
    Transformer.parallelize(m.model, mesh, use_seq_parallel=seq_parallel, local_output_for_attn=True)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)

    def step():
        m(tokens, labels).backward()
        opt.step()
        opt.zero_grad()
    return step


def autoshard_step(model, tokens, labels, rank, mesh, layout, **options):
    import autoshard
    from autoshard.runtime import DistributedBackend, rank_context
    plan = autoshard.autoshard(copy.deepcopy(model), (tokens, labels), mesh=mesh, dims=DIMS, layout=layout,
                               train=True, search=False, **options)
    backend = DistributedBackend(plan.mesh)
    with rank_context(plan.mesh, rank, backend):
        local = plan.build(rank)
        opt = plan.optimizer(local, torch.optim.AdamW, lr=LR)

    def step():
        with rank_context(plan.mesh, rank, backend):
            local(tokens, labels).backward()
            opt.step()
            opt.zero_grad()
    step.backend = backend
    return step


class _Done:
    """A transfer that is already complete (the wire-free floor's work handle)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


class _NoWire:
    """The transport of autoshard's backend (``DistributedBackend._wire``) with every transfer
    replaced by a local copy into the output: the program computes, allocates and copies as it
    does over gloo, only nothing crosses a process (its values are wrong). Used by ``--floor``."""

    @staticmethod
    def all_reduce(t, *args, async_op=False, **kwargs):
        return _Done() if async_op else None

    @staticmethod
    def all_gather_single(out, t, *args, async_op=False, **kwargs):
        out.view(-1, t.numel()).copy_(t.reshape(1, -1))
        return _Done() if async_op else None

    @staticmethod
    def all_to_all_single(out, t, *args, async_op=False, **kwargs):
        out.copy_(t)
        return _Done() if async_op else None


def wire_free(step):
    """``step`` (an autoshard runtime's) run with its collectives' transfers removed."""
    def floor_step():
        step.backend._wire = lambda axis, payload: _NoWire  # every collective's transport
        try:
            step()
        finally:
            del step.backend._wire
    return floor_step


def runtimes_for(pair, model, tokens, labels, rank, world, meshes):
    """(autoshard step, PyTorch step) of one pair."""
    import autoshard
    dp = autoshard.Mesh(meshes["dp"])
    if pair == "zero0/ddp":
        return (autoshard_step(model, tokens, labels, rank, dp, {"batch": "dp"}, zero_stage=0),
                ddp_step(model, tokens, labels, rank, world))
    if pair in ("zero3/fsdp2", "zero3-keep/fsdp2-keep"):
        reshard = pair == "zero3/fsdp2"
        return (autoshard_step(model, tokens, labels, rank, dp, {"batch": "dp"}, zero_stage=3,
                               reshard_after_forward=reshard),
                fsdp2_step(model, tokens, labels, rank, world, reshard, meshes["dp"]))
    if pair in ("tp/dtensor", "tp-sp/dtensor-sp"):
        sp = pair == "tp-sp/dtensor-sp"
        layout = {"heads": "tp", "ffn": "tp", "vocab": "tp", **({"seq": "tp?"} if sp else {})}
        return (autoshard_step(model, tokens, labels, rank, autoshard.Mesh(meshes["tp"]), layout),
                dtensor_tp_step(model, tokens, labels, meshes["tp"], seq_parallel=sp))
    raise ValueError(pair)


def timed(step, steps):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def compare(a, b, rounds, steps, warmup, min_round_s=0.0):
    for _ in range(warmup):
        a()
        b()
    # Short steps (50 ms) make short rounds whose medians move by 10% or more: take enough
    # steps per round that a round lasts ``min_round_s``, measured on the slower runtime; every
    # rank must run the same number of steps, so rank 0's count is the one used.
    slowest = max(timed(a, 1), timed(b, 1))
    want = torch.tensor([max(steps, math.ceil(min_round_s / slowest))])
    dist.broadcast(want, 0)
    steps = int(want)
    ta, tb = [], []
    for r in range(rounds):
        # alternate which runs first, so neither always follows the other
        if r % 2 == 0:
            ta.append(timed(a, steps))
            tb.append(timed(b, steps))
        else:
            tb.append(timed(b, steps))
            ta.append(timed(a, steps))
    paired = sorted(x / y for x, y in zip(ta, tb))
    return statistics.median(ta), statistics.median(tb), steps, (paired[0], paired[-1])


def op_times(step, steps):
    """{op: (self CPU ms per step, calls per step)} over ``steps`` profiled steps (after one
    unprofiled step, so lazily built programs are not counted)."""
    step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        dist.barrier()
    return {e.key: (e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()}


def print_op_times(ours, peer, top=25):
    print(f"  {'op (self CPU time per step)':56s} {'autoshard ms':>12s} {'calls':>6s} {'peer ms':>9s} {'calls':>6s}")
    for key in sorted(set(ours) | set(peer), key=lambda k: -max(ours.get(k, (0,))[0], peer.get(k, (0,))[0]))[:top]:
        (a, na), (b, nb) = ours.get(key, (0.0, 0)), peer.get(key, (0.0, 0))
        print(f"  {key[:56]:56s} {a:12.1f} {na:6d} {b:9.1f} {nb:6d}")
    print(f"  {'all ops':56s} {sum(v[0] for v in ours.values()):12.1f} {'':6s} "
          f"{sum(v[0] for v in peer.values()):9.1f}", flush=True)


def worker(opts):
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {"dp": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
              "tp": init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))}
    rows, floors = [], []
    for key in opts.configs:
        (layers, dim, seq, gb), pairs = CONFIGS[key]
        model, _ = build_model(layers, dim, seq)
        tokens, labels = batch(seq, gb)
        for pair in pairs:
            if opts.pairs and pair not in opts.pairs:
                continue
            a, b = runtimes_for(pair, model, tokens, labels, rank, world, meshes)
            ta, tb, steps, spread = compare(a, b, opts.rounds, opts.steps, opts.warmup, opts.min_round)
            rows.append((key, (layers, dim, seq, gb), pair, ta, tb, spread))
            if rank == 0:
                print(f"[{world} procs] {key} {pair}: autoshard {ta * 1e3:.1f} ms, peer {tb * 1e3:.1f} ms, "
                      f"ratio {ta / tb:.2f}, {spread[0]:.2f}-{spread[1]:.2f} by round "
                      f"({opts.rounds} rounds of {steps} steps)", flush=True)
            if opts.floor:
                fa, fb, fsteps, fspread = compare(wire_free(a), b, opts.rounds, opts.steps, opts.warmup,
                                                  opts.min_round)
                floors.append((key, (layers, dim, seq, gb), pair, fa, fb, fspread))
                if rank == 0:
                    print(f"[{world} procs] {key} {pair}: autoshard without transfers {fa * 1e3:.1f} ms, "
                          f"peer {fb * 1e3:.1f} ms, floor ratio {fa / fb:.2f}, {fspread[0]:.2f}-"
                          f"{fspread[1]:.2f} by round ({opts.rounds} rounds of {fsteps} steps)", flush=True)
            if opts.profile:
                ours, peer = op_times(a, opts.profile), op_times(b, opts.profile)
                if rank == 0:
                    print_op_times(ours, peer)
            del a, b
    if rank == 0:
        print_table(rows, world)
        if floors:
            print_table(floors, world, what="autoshard step time with every collective's transfer removed")
    dist.destroy_process_group()


def print_table(rows, world, what="autoshard step time"):
    pairs = ["tp/dtensor", "tp-sp/dtensor-sp", "zero0/ddp", "zero3/fsdp2", "zero3-keep/fsdp2-keep"]
    print(f"\n{world} gloo processes, 1 thread each: {what} / PyTorch step time (median of rounds, "
          f"[lowest-highest ratio of one round each])")
    print("| config (layers, dim, seq, batch) | " + " | ".join(pairs) + " |")
    print("|---" * (len(pairs) + 1) + "|")
    by = {}
    for key, shape, pair, ta, tb, (low, high) in rows:
        by.setdefault(shape, {})[pair] = f"{ta / tb:.2f} [{low:.2f}-{high:.2f}] ({ta * 1e3:.0f}/{tb * 1e3:.0f} ms)"
    for shape, cells in by.items():
        print(f"| {', '.join(map(str, shape))} | " + " | ".join(cells.get(p, "–") for p in pairs) + " |")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes, one torchrun job each")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--pairs", nargs="+", default=None, help="only these pairs (e.g. zero3/fsdp2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed round (at least)")
    ap.add_argument("--min-round", type=float, default=0.5,
                    help="seconds a round lasts at least: more steps per round for short steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing a pair, profile N steps of each runtime and print CPU time per op")
    ap.add_argument("--floor", action="store_true",
                    help="also time autoshard's program with every collective's transfer removed (a local "
                         "copy instead; wrong values, the same compute) against the peer: the lowest ratio "
                         "any communication scheme could reach")
    opts = ap.parse_args()
    if "RANK" in os.environ:
        return worker(opts)
    try:
        import expecttest  # noqa: F401
    except ImportError:
        sys.exit("vs_pytorch.py: error: torch's test Transformer needs the expecttest package "
                 "(hint: .venv/bin/pip install expecttest)")
    for n in opts.world:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               __file__, *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        rc = subprocess.call(cmd, env=env)
        if rc:
            sys.exit(rc)


if __name__ == "__main__":
    main()
