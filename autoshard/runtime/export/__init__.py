"""The runner of an autoshard export: what an exported ``run.py`` calls under torchrun.

An export's run.py is a launcher of a few lines: it checks that plan.json is the format this
runtime reads (:data:`VERSION`) and calls :func:`main` with the export's directory. Usage::

    torchrun --nproc-per-node=4 out/run.py                 # one forward on the saved inputs
    torchrun --nproc-per-node=4 out/run.py --check         # ... compared with the unsharded model
    torchrun --nproc-per-node=4 out/run.py --steps 2 --check   # 2 training steps (AdamW)
    torchrun --nproc-per-node=4 out/run.py --steps 20 --data tokens.bin --ckpt ck/   # the training loop
    torchrun --nproc-per-node=4 out/pp/run.py --steps 2 --timeline t.json   # pipelined: the measured trace
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 out/run.py --synthetic

Each process: reads plan.json and checks everything it can before joining the process group
(world size against the mesh, files, shapes: a clear one-line error and exit code 2, never a
hang); initializes torch.distributed (nccl when CUDA is available, else gloo), builds the
DeviceMesh, loads only its own blocks of the weights (the weights file is memory-mapped, so
slicing reads only those pages), and runs ``program.forward`` inside a rank context. Rank 0
prints per-step loss and time. ``--check`` compares every rank's outputs (and, with
``--steps``, gradients of the first step and the losses of every step) with the references of
the unsharded model saved at export, and prints "check passed" only if every rank passed.
A training step whose loss or gradient norm is not finite stops every process with exit code 4
before its optimizer step (``--nan-policy``; ``skip-step`` skips it, ``ignore`` trains on).

It is part of the core (it imports the mesh, ownership and runtime alone, never the planner),
so an export runs wherever autoshard is installed. One module per job: :mod:`.plan_file`
(plan.json), :mod:`.weights`, :mod:`.inputs`, :mod:`.data` (``--data``), :mod:`.program` (this
rank's program), :mod:`.checks` (``--check``), :mod:`.training` (the training loop),
:mod:`.accumulation` (``--grad-accum``), :mod:`.errors` (one-line errors, the lost-peer
diagnosis), :mod:`.memory` (each rank's measured peak and its prediction), :mod:`.launch` (one
torchrun process), :mod:`.cli` (options, ``main``), :mod:`.pipeline` (pipelined exports) and
:mod:`.launcher` (the run.py an export gets). The names below are this package's API (tests
and ``passes.export``'s ``simulate_export`` use them).
"""
from __future__ import annotations

from .errors import EXIT_NONFINITE, EXIT_PEER, EXIT_USAGE, NonFiniteError, RunError
from .plan_file import FORMAT, VERSION, _pipeline, load_program, load_programs, loss_shape, read_plan
from .weights import Weights, _common_prefix_fix, open_weights, read_checkpoint, read_safetensors
from .inputs import load_inputs
from .accumulation import grad_accum_setup, load_step_inputs
from .checks import _max_diff, check_tolerance, compare, compare_grads, summarize_check
from .program import (NAN_POLICIES, RankProgram, finish_step, nonfinite_step, rank_loop, rank_program, rank_spec,
                      weights_lookup)
from .data import TokenData
from .training import checkpoint_bytes, prepare_training, train_loop
from .launch import prepare, run
from .cli import _parser, main

__all__ = ["EXIT_NONFINITE", "EXIT_PEER", "EXIT_USAGE", "FORMAT", "NAN_POLICIES", "NonFiniteError", "RankProgram",
           "RunError", "TokenData", "VERSION", "Weights", "check_tolerance", "checkpoint_bytes", "compare",
           "compare_grads", "finish_step", "grad_accum_setup", "load_inputs", "load_program", "load_programs",
           "load_step_inputs", "loss_shape", "main",
           "nonfinite_step", "open_weights", "prepare", "prepare_training", "rank_loop", "rank_program",
           "rank_spec", "read_checkpoint", "read_plan", "read_safetensors", "run", "summarize_check",
           "train_loop", "weights_lookup"]
