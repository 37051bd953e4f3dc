"""run.py's command line: the options of a run and ``main``, which the exported run.py calls.

Example::

    main(["--steps", "2", "--check"], root="out")    # as `torchrun ... out/run.py --steps 2 --check`
"""
from __future__ import annotations

import argparse
from pathlib import Path

from autoshard.runtime.execution.local import OPTIMIZERS

from .launch import run
from .program import NAN_POLICIES
from .training import add_training_args


def _parser():
    p = argparse.ArgumentParser(
        prog="run.py", description="Run an exported autoshard plan: torchrun --nproc-per-node=N run.py [options]")
    p.add_argument("--check", action="store_true",
                   help="compare outputs (and gradients and losses with --steps) with the unsharded model")
    p.add_argument("--steps", type=int, default=0, help="training steps (forward, backward, optimizer); "
                                                        "default: one forward only")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nan-policy", choices=NAN_POLICIES, default="stop",
                   help="a training step whose global loss or gradient norm is not finite: stop (every process "
                        "exits 4, naming the step, before its optimizer step), skip-step (no optimizer step, "
                        "said on its line), ignore (train on; no check)")
    p.add_argument("--synthetic", action="store_true", help="random inputs of the planned shapes")
    p.add_argument("--inputs", help="a torch.save'd list of the (global) inputs, in the planned order")
    p.add_argument("--weights", help="where the parameters come from: a torch.save state dict by parameter name, a "
                                     ".safetensors file, a Hugging Face save_pretrained directory (sharded or not), "
                                     "or a DCP checkpoint (autoshard's, a --ckpt directory: its newest complete one, "
                                     "or a plain torch.distributed.checkpoint.save directory)")
    p.add_argument("--weights-prefix", metavar="PREFIX",
                   help="with --weights: the FQN in the planned module under which the checkpoint's keys live "
                        "(prepended to them: 'model' when the planned module holds the HF model as self.model)")
    p.add_argument("--allow-partial", action="store_true",
                   help="with --weights: parameters the checkpoint lacks come from the export (default: an error)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic inputs")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda (nccl) when available, else cpu (gloo)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    p.add_argument("--memory", action="store_true",
                   help="with --steps: measure each rank's peak of saved activations + parameters + gradients + "
                        "optimizer state and print it next to the plan's prediction")
    p.add_argument("--timeline", help="a pipelined export: rank 0 writes the last step's measured actions of every "
                                      "rank here (Chrome / Perfetto trace JSON, one row per rank)")
    add_training_args(p)
    return p


def main(argv=None, root=None) -> int:
    """Run the export in ``root`` (the directory of its run.py) with run.py's options ``argv``;
    returns the exit code. The exported run.py calls it as ``main(root=Path(__file__).parent)``."""
    if root is None:
        raise TypeError("main() needs root=, the export directory")
    args = _parser().parse_args(argv)
    return run(Path(root), args)
