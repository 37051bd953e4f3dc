"""Quickstart: plan the Llama-style example on a dp=2 x tp=2 mesh, print the plan, check it
against the unsharded model on a simulated mesh (forward outputs and every parameter's gradient),
then export it and run the export for real: 4 gloo processes under torchrun, with --check.

Run: bash scripts/quickstart.sh   (or .venv/bin/python examples/quickstart.py)
"""
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autoshard  # noqa: E402
from examples.models import llama_tiny  # noqa: E402


def main():
    model, args, dims = llama_tiny(with_labels=True)  # (input_ids, None, labels): returns the loss
    mesh = autoshard.Mesh({"dp": 2, "tp": 2})
    # Batch split on dp; attention heads and MLP channels split on tp (Megatron's layout).
    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims,
                               layout={"batch": "dp", "heads": "tp", "ffn": "tp"})
    print(plan)

    loss, grads = plan.simulate_grads(*args)  # 4 ranks as threads of this process
    model.zero_grad()
    ref = model(*args)
    ref.backward()
    out_diff = (loss - ref.detach()).abs().item()
    grad_diff = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    by_phase = {}
    for c in plan.collectives:
        key = f"{c.phase} {c.kind} on {c.axes[0]}"
        by_phase[key] = by_phase.get(key, 0) + 1
    print()
    print(f"loss: sharded {loss.item():.6f}  unsharded {ref.item():.6f}")
    print(f"max abs difference: loss {out_diff:.2e}, gradients {grad_diff:.2e} "
          f"(over {sum(p.numel() for p in model.parameters())} parameters)")
    print("collectives:", ", ".join(f"{v}x {k}" for k, v in sorted(by_phase.items())))
    ok = torch.allclose(loss, ref.detach(), rtol=1e-5, atol=1e-6) and all(
        torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6) for n, p in model.named_parameters())
    print("check passed: sharded plan equals the unsharded model" if ok else "CHECK FAILED")
    if not ok:
        return 1

    # Export for torchrun and run it for real: 4 processes, gloo on CPU. run.py checks every
    # rank's outputs and gradients against references of the unsharded model saved at export,
    # and the losses of 2 AdamW steps against single-device training.
    from autoshard.passes.export import run_torchrun

    with tempfile.TemporaryDirectory(prefix="autoshard-quickstart-") as tmp:
        path = plan.export(Path(tmp) / "llama_dp2_tp2", args)
        print(f"\nexported to $TMP/{path.name}: " + ", ".join(sorted(p.name for p in path.iterdir())))
        program = (path / "program.py").read_text().splitlines()
        first = next(i for i, line in enumerate(program) if re.search(r"= all_reduce\(", line))
        start = max(i for i in range(first) if "# all_reduce on" in program[i])
        print("program.py, the first forward all-reduce:")
        print("\n".join(program[start:first + 1]))
        print(f"$ torchrun --nproc-per-node=4 $TMP/{path.name}/run.py --check --steps 2", flush=True)
        proc = run_torchrun(path, 4, "--check", "--steps", "2")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
