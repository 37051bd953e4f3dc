"""``run.py --check`` of a model too big for its unsharded reference: time to a per-block verdict.

Builds a Hugging Face Llama config (default: 8 layers, hidden 2048, ffn 5632, 16 heads / 8 kv,
vocab 32000: 509 M parameters, 2 GiB of fp32 weights, over the default 2 GiB check budget with
its gradients and AdamW state), writes random weights for it as a sharded ``save_pretrained``
directory, plans the model on the meta device (ZeRO-3 over dp=4), exports it (the export
builds the checked model, one decoder layer at the real width, and its references) and runs
``torchrun --nproc-per-node=4 run.py --weights DIR --check --steps 1``, printing each phase's
wall time and the check's lines::

    .venv/bin/python benchmarks/block_check.py --out /scratch/bc          # the full size
    .venv/bin/python benchmarks/block_check.py --out /scratch/bc --small  # a 2-layer, hidden-256 run
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a scratch directory (weights and the export go there)")
    ap.add_argument("--small", action="store_true", help="2 layers, hidden 256: a quick run")
    o = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    import autoshard
    from autoshard import Mesh

    transformers.logging.set_verbosity_error()
    width = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, vocab_size=4000) if o.small else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, vocab_size=32000)
    cfg = AutoConfig.for_model("llama", num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256,
                               use_cache=False, tie_word_embeddings=False, **width)
    out = Path(o.out)
    hf, export = out / "hf", out / "export"
    t = time.perf_counter()
    if not (hf / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(hf, max_shard_size="500MB")
    print(f"weights        {time.perf_counter() - t:7.1f} s  ({hf})", flush=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    t = time.perf_counter()
    plan = autoshard.autoshard(model, (), kwargs={"input_ids": ids, "labels": ids}, mesh=Mesh({"dp": 4}),
                               dims={"input_ids": "batch seq", "labels": "batch seq"}, layout={"batch": "dp"},
                               train=True, zero_stage=3)
    print(f"plan           {time.perf_counter() - t:7.1f} s  ({n / 1e6:.1f} M parameters on the meta device)", flush=True)
    t = time.perf_counter()
    plan.export(export, overwrite=True)
    print(f"export         {time.perf_counter() - t:7.1f} s  (the checked model and its references in checks/)", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(export / "run.py"), "--weights", str(hf), "--check", "--steps", "1"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(f"run.py --check {time.perf_counter() - t:7.1f} s  (the block check, then one step of the whole model)")
    for line in r.stdout.splitlines():
        if line.startswith(("check", "CHECK", "step")):
            print("   ", line)
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
