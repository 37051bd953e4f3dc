"""autoshard's pipeline schedules against torch.distributed.pipelining, side by side, on gloo.

Run (the machine should be quiet; note its load with the figures)::

    .venv/bin/python benchmarks/pipeline.py
    .venv/bin/python benchmarks/pipeline.py --layers 8 --hidden 128 --rounds 3 --steps 2

Four processes (pp=4, gloo, one intra-op thread each) build the same Llama-style model from one
seed. For each schedule, autoshard (``pipeline={"schedule": ..., "cuts": ..., "microbatches":
M}``) and PyTorch (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``) run the same stages (the same cut points: equal layer counts, the
embedding on the first stage, norm, head and loss on the last), the same global batch and
microbatch count, forward + backward + AdamW. The two are timed alternately in the same
processes (``--rounds`` rounds of ``--steps`` steps after a warm-up), so background load hits
both alike; a round is rank 0's wall time between two barriers; the ratio is autoshard's median
round over PyTorch's (below 1: autoshard faster). *CPU* is the processes' CPU seconds per step
(``time.process_time``, all threads, summed over the 4 ranks; median round): with 4 processes
on fewer cores a step's wall time follows the CPU the ranks need, and CPU time is far less
disturbed by other load than wall time, so its ratio is the steadier comparison.

Bubble: *predicted* is ``plan.bubble`` (the ``cpu-gloo`` preset's stage and transfer times run
through the schedule); *measured* is ``1 - busy / (4 * span)`` of autoshard's last step, where ``span``
runs from the first action's start to the last action's end over all ranks (wall clock) and a
rank's busy time is its actions' time minus the time it spent inside point-to-point receives
(waiting for a peer). The tiny model makes transfers and per-op overheads large against compute,
so the measured bubble is expected above the predicted one.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2)}
PP = 4


def build(cfg):
    from dataclasses import replace

    from examples.models import Llama, LlamaConfig, init_weights
    conf = replace(LlamaConfig(), vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_layers=cfg.layers,
                   num_heads=8, num_kv_heads=2, intermediate_size=2 * cfg.hidden, max_seq_len=cfg.seq)
    model = init_weights(Llama(conf), 0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    labels = ids.clone()
    labels[:, : cfg.seq // 4] = -100
    return model, ids, labels


def stage_bounds(layers: int, stages: int) -> list:
    """Layer index where each stage begins (equal counts)."""
    return [layers * k // stages for k in range(stages)]


class Part(nn.Module):
    """Stage ``k`` of ``n`` of the Llama for torch.distributed.pipelining."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.embed_tokens = copy.deepcopy(model.embed_tokens) if first else None
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in range(lo, hi))
        self.rotary_emb = copy.deepcopy(model.rotary_emb)
        self.norm = copy.deepcopy(model.norm) if last else None
        self.lm_head = copy.deepcopy(model.lm_head) if last else None

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        cos, sin = self.rotary_emb(x, pos)
        for layer in self.layers:
            x = layer(x, cos, sin, None)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def worker(rank, world, cfg):
    from examples.models import _shifted_loss
    from torch.distributed import pipelining as P

    import autoshard
    from autoshard import Mesh
    from autoshard.runtime import DistributedBackend, rank_context

    model, ids, labels = build(cfg)
    from examples.models import LLAMA_PARAM_DIMS, _dims_for
    dims = _dims_for({"input_ids": True, "attention_mask": False, "labels": True}, LLAMA_PARAM_DIMS)
    out = {}
    for name in cfg.schedules:
        torch_cls, v = SCHEDULES[name]
        n_stages = PP * v
        bounds = stage_bounds(cfg.layers, n_stages)
        # --- autoshard
        plan = autoshard.autoshard(model, (ids, None, labels), mesh=Mesh({"pp": PP}), dims=dims,
                                   layout={"batch": None}, hardware="cpu-gloo",
                                   train=True, pipeline={"schedule": name, "microbatches": cfg.microbatches,
                                                         "virtual": v,
                                                         "cuts": [f"layers.{b}" for b in bounds[1:]]})
        backend = DistributedBackend(plan.mesh)
        waits = []
        recv = backend.recv

        def timed_recv(*a, **k):
            t = time.time()
            r = recv(*a, **k)
            waits.append((t, time.time()))
            return r

        backend.recv = timed_recv
        with rank_context(plan.mesh, rank, backend):
            pipe = plan.build(rank)
            opt = plan.optimizer(pipe, torch.optim.AdamW, lr=1e-4)

            def ours():
                pipe.step(plan.split((ids, None, labels)))
                opt.step()
                opt.zero_grad()

            # --- torch.distributed.pipelining on the same cuts
            mine = [k for k in range(n_stages) if k % PP == rank]
            stages = []
            for k in mine:
                hi = bounds[k + 1] if k + 1 < n_stages else cfg.layers
                part = Part(model, bounds[k], hi, k == 0, k == n_stages - 1)
                stages.append(P.PipelineStage(part, k, n_stages, torch.device("cpu")))
            kw = dict(n_microbatches=cfg.microbatches, loss_fn=_shifted_loss)
            sched = getattr(P, torch_cls)(stages if v > 1 else stages[0], **kw)
            topt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-4)
            has_first, has_last = 0 in mine, n_stages - 1 in mine

            def theirs():
                args = (ids,) if has_first else ()
                kwargs = {"target": labels, "losses": []} if has_last else {}
                sched.step(*args, **kwargs)
                topt.step()
                topt.zero_grad()

            def timed(fn, steps):
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    fn()
                c = time.process_time() - c
                dist.barrier()
                return time.perf_counter() - t, c

            for fn in (ours, theirs):  # warm-up
                timed(fn, 1)
            mine_t, theirs_t = [], []
            for _ in range(cfg.rounds):
                mine_t.append([x / cfg.steps for x in timed(ours, cfg.steps)])
                theirs_t.append([x / cfg.steps for x in timed(theirs, cfg.steps)])
            waits.clear()
            ours()
            rows = pipe.measured()
            busy = sum(e - s for _, s, e in rows) - sum(e - s for s, e in waits)
        out[name] = dict(autoshard=mine_t, torch=theirs_t, rows=[(a.kind, s, e) for a, s, e in rows], busy=busy,
                         predicted=plan.bubble)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    cfg = ap.parse_args(argv)
    from autoshard.runtime.transport.launch import spawn

    load = os.getloadavg()
    t = time.time()
    results = spawn(worker, PP, cfg, timeout=3000)
    print(f"pp={PP} gloo processes, Llama layers={cfg.layers} hidden={cfg.hidden} vocab={cfg.vocab} seq={cfg.seq} "
          f"batch={cfg.batch} M={cfg.microbatches}; {cfg.rounds} rounds x {cfg.steps} steps; "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.time() - t:.0f} s")
    print(f"{'schedule':<12}{'bubble pred':>12}{'bubble meas':>12}{'autoshard s':>13}{'torch s':>10}{'ratio':>8}"
          f"{'autoshard CPU s':>17}{'torch CPU s':>13}{'CPU ratio':>11}")
    for name in cfg.schedules:
        per = [r[name] for r in results]
        rows = [row for p in per for row in p["rows"]]
        span = max(e for _, _, e in rows) - min(s for _, s, _ in rows)
        measured = 1 - sum(p["busy"] for p in per) / (PP * span)
        ours, theirs = (statistics.median(w for w, _ in per[0][k]) for k in ("autoshard", "torch"))
        # per round, the CPU of all ranks together
        cpu_ours, cpu_theirs = (statistics.median(sum(p[k][i][1] for p in per) for i in range(cfg.rounds))
                                for k in ("autoshard", "torch"))
        print(f"{name:<12}{per[0]['predicted']:>12.3f}{measured:>12.3f}{ours:>13.4f}{theirs:>10.4f}"
              f"{ours / theirs:>8.2f}{cpu_ours:>17.4f}{cpu_theirs:>13.4f}{cpu_ours / cpu_theirs:>11.2f}")


if __name__ == "__main__":
    main()
