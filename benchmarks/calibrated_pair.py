"""Two plans of one small Qwen2 on dp=2 x tp=2: measured step time against the calibrated
cost model's prediction, with the ratio.

Run: .venv/bin/python benchmarks/calibrated_pair.py [--hardware hw.json] [--rounds 5] [--steps 12]

The model is Hugging Face's Qwen2 built from its config (random weights): 4 layers, hidden 128,
4 heads / 2 kv heads, ffn 64, vocab 64, batch 8 x seq 64, fp32, trained with AdamW. The two plans
read the batch on both axes (``{"batch": ("dp", "tp")}``: every rank a quarter) and on tp alone
(``{"batch": "tp"}``: the dp pair computes the same half twice, and no gradient sync crosses dp).

1. ``autoshard.cost.calibrate({"dp": 2, "tp": 2}, 4, out)`` (skipped with ``--hardware``).
2. Each plan's predicted step time (``plan.cost``, forward + backward + optimizer, on the
   calibrated hardware), with its terms.
3. Both plans run on 4 gloo processes in the same processes, alternately, ``--rounds`` rounds
   of ``--steps`` steps (forward + backward + AdamW step) each; a step's time is the slowest
   rank's; a round's time is the median of its steps after the first two.
4. Prints predicted, measured (median over rounds, with the lowest and highest round) and
   predicted / measured per plan, each round's times, in how many rounds the first plan was
   faster, and whether the two orders agree.
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

MESH = {"dp": 2, "tp": 2}
PLANS = [("dp: -, tp: batch", {"batch": "tp"}), ("dp: batch, tp: batch", {"batch": ("dp", "tp")})]
BATCH, SEQ = 8, 64
CONFIG = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
DIMS = {"input_ids": "batch seq", "labels": "batch seq"}


def build_model():
    """(Qwen2 causal LM with random weights, example kwargs)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **CONFIG))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    return model, {"input_ids": ids, "labels": ids.clone()}


def make_plan(layout, hardware=None):
    model, kwargs = build_model()
    plan = autoshard.autoshard(model, (), kwargs, mesh=autoshard.Mesh(MESH), dims=DIMS, layout=layout, train=True,
                               search=False, hardware=hardware)
    return plan, kwargs


def _measure(rank, world, rounds, steps):
    import torch.distributed as dist
    from autoshard.runtime import DistributedBackend, rank_context
    torch.set_num_threads(1)
    runs = []
    for name, layout in PLANS:
        plan, kwargs = make_plan(layout)
        backend = DistributedBackend(plan.mesh)
        with rank_context(plan.mesh, rank, backend):
            local = plan.build(rank)
            opt = plan.optimizer(local, torch.optim.AdamW, lr=1e-3)

        def step(plan=plan, backend=backend, local=local, opt=opt, kwargs=kwargs):
            with rank_context(plan.mesh, rank, backend):
                out = local(**kwargs)
                loss = out["loss"] if isinstance(out, dict) else (out.loss if hasattr(out, "loss") else out)
                loss.backward()
                opt.step()
                opt.zero_grad()
        runs.append(step)
    times = [[] for _ in PLANS]  # per plan: per round: per step
    for r in range(rounds):
        order = range(len(PLANS)) if r % 2 == 0 else reversed(range(len(PLANS)))
        for k in order:
            ts = []
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                runs[k]()
                ts.append(time.perf_counter() - t0)
            times[k].append(ts)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", help="a calibrated hardware JSON (skip calibration)")
    ap.add_argument("--out", help="where to write the calibrated hardware JSON")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-measure", action="store_true", help="print the predictions only")
    a = ap.parse_args(argv)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    hw = a.hardware
    if hw is None:
        hw = a.out or os.path.join(tempfile.mkdtemp(), "hw.json")
        autoshard.cost.calibrate(MESH, 4, hw)
    predicted = {}
    for name, layout in PLANS:
        c = make_plan(layout, hardware=hw)[0].cost
        predicted[name] = c["step_time"]
        terms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in c["compute_by_phase"].items())
        comm = ", ".join(f"{ax}/{ph} {v * 1e3:.1f}" for (ax, ph), v in c["comm_exposed"].items() if v > 0)
        print(f"predicted {name:22s} {c['step_time'] * 1e3:7.1f} ms = compute ({terms}) + exposed ({comm or '-'})")
    if a.no_measure:
        return predicted, None
    from autoshard.runtime.transport.launch import spawn
    results = spawn(_measure, 4, a.rounds, a.steps, timeout=900)
    measured, spread, rounds_of = {}, {}, {}
    for k, (name, _) in enumerate(PLANS):
        per_round = []
        for r in range(a.rounds):
            slowest = [max(res[k][r][s] for res in results) for s in range(a.steps)]
            per_round.append(statistics.median(slowest[2:]))
        measured[name], spread[name] = statistics.median(per_round), (min(per_round), max(per_round))
        rounds_of[name] = per_round
    print(f"\n{'plan':22s} {'predicted ms':>12s} {'measured ms':>12s} {'(rounds lo-hi)':>16s} {'pred/meas':>10s}")
    for name, _ in PLANS:
        lo, hi = spread[name]
        print(f"{name:22s} {predicted[name] * 1e3:12.1f} {measured[name] * 1e3:12.1f} "
              f"{f'({lo * 1e3:.0f}-{hi * 1e3:.0f})':>16s} {predicted[name] / measured[name]:10.2f}")
    names = [n for n, _ in PLANS]
    wins = sum(rounds_of[names[0]][r] < rounds_of[names[1]][r] for r in range(a.rounds))
    for name in names:
        print(f"  {name:20s} rounds: " + " ".join(f"{t * 1e3:.0f}" for t in rounds_of[name]) + " ms")
    print(f"{names[0]} faster in {wins} of {a.rounds} rounds")
    order = lambda d: sorted(d, key=d.get)
    agree = order(predicted) == order(measured)
    print(f"fastest measured: {order(measured)[0]}; predicted: {order(predicted)[0]} "
          f"({'same order' if agree else 'orders differ'})")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return predicted, measured


if __name__ == "__main__":
    main()
