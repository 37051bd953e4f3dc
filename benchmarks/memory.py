"""Per-rank peak memory: autoshard's export under torchrun against PyTorch's FSDP2 / DTensor, side by side.

Run (one side at a time, 4 processes each; the 317M model needs about 4 x 3 GiB)::

    .venv/bin/python benchmarks/memory.py                  # the 317M HF Llama, three layouts
    .venv/bin/python benchmarks/memory.py --small          # a small Llama: a quick run
    .venv/bin/python benchmarks/memory.py --layouts zero3  # one layout

The model is a Hugging Face ``LlamaForCausalLM`` (hidden 1024, ffn 4096, 16 layers, 16 heads /
8 kv heads, vocab 32000, untied head: 317M parameters), fp32, AdamW, batch 4 x seq 64 with the
labels the ids shifted; 3 training steps. Its weights are written once with ``save_pretrained``
(safetensors) and both sides load them from there, each rank only its own part:

- autoshard: the model planned on the meta device, exported without weights, ``run.py
  --weights HF_DIR --steps 3``; its peaks and predictions are run.py's ``rank R: peak ...``
  lines (``--metrics``);
- PyTorch: the model built on the meta device, sharded, ``to_empty`` on the CPU, the
  checkpoint read through ``torch.distributed.checkpoint`` and its ``HuggingFaceStorageReader``,
  RoPE's non-persistent ``inv_freq`` recomputed, the same 3 steps. ``zero3``: ``fully_shard``
  per decoder layer, then the root (FSDP2, ``reshard_after_forward=True``); ``tp``: DTensor
  tensor parallelism (``ColwiseParallel`` q/k/v/gate/up, ``RowwiseParallel`` o/down, the
  embedding and head replicated as autoshard's layout leaves them); ``dp2xtp2``: the same TP
  on a 2 x 2 mesh, then ``fully_shard`` over dp (FSDP2 + TP).

Both sides are measured the same way: each process's whole high-water mark (``VmHWM``: heap,
mapped file pages, shared memory it touched) at the end, the max over ranks, with the C
allocator's mmap threshold fixed on both (``autoshard.runtime.execution.malloc``, as run.py
does). ``AUTOSHARD_MEMORY_TRACE=1`` also prints the autoshard ranks' VmRSS / VmHWM after
loading and after each forward, backward and optimizer step. gloo on both
sides (autoshard's collectives go through its same-host shared memory, counted in its peak).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=8)
SMALL = dict(vocab_size=4000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
COMMON = dict(max_position_embeddings=128, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
BATCH, SEQ, STEPS, LR = 4, 64, 3, 1e-3
DIMS = {"input_ids": "batch seq", "labels": "batch seq",
        "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "kv_heads hidden", "*.v_proj.weight": "kv_heads hidden",
        "*.o_proj.weight": "hidden heads", "*layernorm.weight": "hidden", "*embed_tokens.weight": "vocab hidden",
        "lm_head.weight": "vocab hidden", "*.gate_proj.weight": "ffn hidden", "*.up_proj.weight": "ffn hidden",
        "*.down_proj.weight": "hidden ffn"}
TP = {"heads": "tp", "kv_heads": "tp", "ffn": "tp"}
LAYOUTS = {  # name -> (mesh, autoshard layout, zero stage)
    "zero3": ({"dp": 4}, {"batch": "dp"}, 3),
    "tp": ({"tp": 4}, TP, 0),
    "dp2xtp2": ({"dp": 2, "tp": 2}, {"batch": "dp", **TP}, 3),
}
GIB = 2 ** 30


def config(small: bool):
    from transformers import AutoConfig
    return AutoConfig.for_model("llama", **(SMALL if small else BIG), **COMMON)


def batch(cfg):
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, 1, dims=1)}


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------------------------------- PyTorch side

def pytorch_worker(hf_dir: str, layout: str, small: bool) -> None:
    """One rank of the PyTorch side (under torchrun); rank 0 prints ``PEAKS [...]`` (bytes)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    from autoshard.runtime.execution.malloc import fixed_mmap_threshold

    fixed_mmap_threshold()  # the same C allocator setting as run.py's: both sides free alike
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config(small)
    mesh_shape, _, _ = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", tuple(mesh_shape.values()), mesh_dim_names=tuple(mesh_shape))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if "tp" in mesh_shape:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    if "dp" in mesh_shape:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
    model.to_empty(device="cpu")
    state = model.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(hf_dir))
    # RoPE's non-persistent buffers are in no checkpoint: recomputed by the module's own constructor
    fresh = type(model.model.rotary_emb)(cfg)
    for name, buf in fresh.named_buffers():
        getattr(model.model.rotary_emb, name).copy_(buf)
    model.model.rotary_emb.original_inv_freq = model.model.rotary_emb.inv_freq
    kwargs = batch(cfg)
    if "dp" in mesh_shape:
        n, i = mesh_shape["dp"], mesh["dp"].get_local_rank()
        kwargs = {k: v.chunk(n)[i] for k, v in kwargs.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    for _ in range(STEPS):
        loss = model(**kwargs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, vm_hwm())
    if rank == 0:
        print("PEAKS " + json.dumps(peaks), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def torchrun(n: int, argv: list, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def pytorch_side(hf_dir: Path, layout: str, small: bool) -> list:
    n = 1
    for v in LAYOUTS[layout][0].values():
        n *= v
    proc = torchrun(n, [__file__, "--worker", str(hf_dir), "--layouts", layout] + (["--small"] if small else []))
    for line in proc.stdout.splitlines():
        if line.startswith("PEAKS "):
            return json.loads(line[6:])
    raise RuntimeError(f"PyTorch side of {layout} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


# --------------------------------------------------------------------------------------------- autoshard side

def export(cfg, layout: str, out: Path) -> Path:
    import torch
    import autoshard
    from transformers import LlamaForCausalLM

    mesh, lay, zero = LAYOUTS[layout]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    plan = autoshard.autoshard(model.eval(), (), kwargs=batch(cfg), mesh=autoshard.Mesh(mesh), dims=DIMS,
                               layout=lay, train=True, zero_stage=zero,
                               reshard_after_forward=True if zero == 3 else None, search=False)
    return plan.export(out / layout, kwargs=batch(cfg), overwrite=True)


def autoshard_side(path: Path, hf_dir: Path, n: int, work: Path) -> tuple:
    """([measured bytes per rank], [predicted bytes per rank], rank 0's terms) from run.py's --metrics."""
    metrics = work / f"{path.name}.jsonl"
    metrics.unlink(missing_ok=True)
    proc = torchrun(n, [str(path / "run.py"), "--weights", str(hf_dir), "--steps", str(STEPS), "--lr", str(LR),
                        "--metrics", str(metrics)])
    if proc.returncode != 0:
        raise RuntimeError(f"autoshard side of {path.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    for line in proc.stderr.splitlines():  # AUTOSHARD_MEMORY_TRACE=1: where each rank's peak rises
        if line.startswith("memtrace "):
            print(line, flush=True)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = steps[-1]
    print(f"{path.name}: step seconds " + ", ".join(f"{s['seconds']:.2f}" for s in steps), flush=True)
    return ([r["measured_bytes"] for r in last["memory"]], [r["predicted_bytes"] for r in last["memory"]],
            last["memory_terms"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a small Llama (hidden 256, 4 layers): a quick run")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    p.add_argument("--sides", default="autoshard,pytorch", help="which sides to run")
    p.add_argument("--terms", action="store_true", help="print rank 0's predicted terms")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        pytorch_worker(args.worker, args.layouts, args.small)
        return 0
    import torch
    from transformers import LlamaForCausalLM

    cfg = config(args.small)
    layouts = args.layouts.split(",")
    sides = args.sides.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="autoshard-memory-") as tmp:
        work = Path(tmp)
        hf_dir = work / "hf"
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(hf_dir)
        del model
        print(f"HF Llama {n_params / 1e6:.0f}M parameters, fp32, AdamW, batch {BATCH} x seq {SEQ}, {STEPS} steps; "
              f"{os.cpu_count()} CPUs; torch {torch.__version__}", flush=True)
        for layout in layouts:
            mesh = LAYOUTS[layout][0]
            n = 1
            for v in mesh.values():
                n *= v
            row = {"layout": layout}
            if "autoshard" in sides:
                t0 = time.perf_counter()
                path = export(cfg, layout, work)
                measured, predicted, terms = autoshard_side(path, hf_dir, n, work)
                ratios = [m / p for m, p in zip(measured, predicted)]
                row.update(autoshard=max(measured), predicted=max(predicted), ratio=max(ratios),
                           minratio=min(ratios), secs=time.perf_counter() - t0)
                if args.terms:
                    print(layout, {k: (round(v / GIB, 3) if isinstance(v, float) else v) for k, v in terms.items()})
            if "pytorch" in sides:
                row["pytorch"] = max(pytorch_side(hf_dir, layout, args.small))
            rows.append(row)
            print(_line(row), flush=True)
    return 0


def _line(row: dict) -> str:
    peer = {"zero3": "FSDP2", "tp": "DTensor TP", "dp2xtp2": "FSDP2+TP"}[row["layout"]]
    parts = [f"{row['layout']:8s}"]
    if "autoshard" in row:
        parts.append(f"autoshard {row['autoshard'] / GIB:.2f} GiB (predicted {row['predicted'] / GIB:.2f}, "
                     f"measured/predicted {row['minratio']:.2f}-{row['ratio']:.2f})")
    if "pytorch" in row:
        parts.append(f"{peer} {row['pytorch'] / GIB:.2f} GiB")
    if "autoshard" in row and "pytorch" in row:
        parts.append(f"autoshard/{peer} {row['autoshard'] / row['pytorch']:.2f}")
    return "  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
