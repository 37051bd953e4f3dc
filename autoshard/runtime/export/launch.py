"""One process of run.py under torchrun: check everything, join the group, run this rank.

``prepare`` checks all that can fail without talking to other ranks (world size against the
mesh, files, shapes, options), so a usage problem is one line and exit code 2, never a hang;
``run`` then initializes torch.distributed (nccl on CUDA, else gloo), builds the mesh backend,
runs this rank's program or training loop and, with ``--check``, agrees on one verdict.

Example::

    rc = run(Path("out"), _parser().parse_args(["--check"]))   # _parser: cli.py's
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.mesh import Mesh
from autoshard.runtime import DistributedBackend, rank_context
from autoshard.runtime.execution import shared_paths
from autoshard.runtime.execution import step_memory
from autoshard.runtime.execution.malloc import fixed_mmap_threshold
from autoshard.runtime.transport.watchdog import Heartbeat

from .block_check import block_args, group_report
from .checks import summarize_check
from .errors import EXIT_NONFINITE, EXIT_PEER, EXIT_USAGE, NonFiniteError, RunError, _env_int, _report_lost_peer
from .memory import process_bytes, report as memory_report, trace
from .accumulation import load_step_inputs
from .plan_file import _pipeline, _this, load_programs, loss_shape, read_plan
from .program import rank_loop, rank_program
from .training import Stopped, prepare_training, train_loop
from .weights import _load, open_weights


def _say(msg: str) -> None:
    print(msg, flush=True)


def prepare(root: Path, args) -> dict:
    """Everything that can fail without talking to other ranks; raises RunError."""
    doc = read_plan(root)
    if args.check and not doc.get("reference") and doc.get("block_check"):
        # over the check budget: the checked model (one block of each kind) is checked instead
        sub_root = root / doc["block_check"]["dir"]
        sub_doc = read_plan(sub_root)
        sub_args = block_args(args, (sub_doc.get("reference") or {}).get("steps", 0))
        sub = prepare(sub_root, sub_args)
        ctx = prepare(root, argparse.Namespace(**{**vars(args), "check": False}))
        ctx["blocks"] = (sub_root, sub_args, sub)
        return ctx
    mesh = Mesh(doc["mesh"])
    world = _env_int("WORLD_SIZE", 1)
    if world != mesh.size:
        launched = "torchrun started" if "WORLD_SIZE" in os.environ else "run without torchrun, that is"
        raise RunError(f"this program is planned for {mesh}, {mesh.size} ranks, but {launched} {world} "
                       f"process{'es' if world != 1 else ''} (hint: torchrun --nproc-per-node={mesh.size} "
                       f"{root / 'run.py'}, or with --nnodes, nodes x procs = {mesh.size})")
    if args.steps < 0:
        raise RunError("--steps must be >= 0")
    if args.steps and not any(m["kind"] == "parameter" and m.get("trainable") for m in doc["inputs"]):
        raise RunError("--steps trains parameters, but this program has no trainable ones")
    if args.steps and doc.get("pipeline") is None:
        shape = loss_shape(doc, mesh)
        if shape is None or math.prod(shape) != 1:
            raise RunError(f"--steps trains on output {doc['loss_output']} (the loss), of shape {shape}: grad can be "
                           f"implicitly created only for scalar outputs, as torch's loss.backward() says (hint: "
                           f"reduce the loss to a scalar in the model's forward and export again)")
    if args.synthetic and args.inputs:
        raise RunError("--synthetic and --inputs exclude each other")
    if args.timeline and not doc.get("pipeline"):
        raise RunError("--timeline records the actions of a pipeline schedule; this export is not pipelined")
    program = load_programs(root, doc)
    if args.allow_partial and not (args.weights or doc["weights"].get("checkpoint")):
        raise RunError("--allow-partial applies to a --weights checkpoint")
    if args.check and not doc.get("reference"):  # before the weights: a meta export has neither
        missing = doc.get("missing") or {}
        why = "; ".join(w for w in (missing.get("reference"), missing.get("block_check")) if w)
        raise RunError("this export has no references to check against" + (f": {why}" if why else "")
                       + " (hint: export a model with real weights and example inputs, reference=True; "
                       "over the check budget, a model whose blocks repeat is checked one block of each kind)")
    weights = open_weights(root, doc, args.weights, args.allow_partial, args.weights_prefix)
    loop = prepare_training(root, doc, args)  # the training loop's options (--data, --resume, ...)
    user = None if loop.get("data") else load_step_inputs(root, doc, args)
    ref = None
    if args.check:
        if args.synthetic or args.inputs:
            raise RunError("--check compares with references made from the saved example inputs "
                           "(hint: drop --synthetic / --inputs)")
        if args.weights:
            raise RunError("--check compares with references made from the exported weights (hint: drop --weights)")
        r = doc["reference"]
        ref = _load(root / r["file"], "reference file")
        if not isinstance(ref, dict) or "outputs" not in ref:
            raise RunError(f"reference file {root / r['file']} is corrupted (hint: export the plan again)")
    return dict(doc=doc, mesh=mesh, program=program, weights=weights, user=user, ref=ref, loop=loop)


def run(root: Path, args) -> int:
    fixed_mmap_threshold()  # freed tensors leave the process: the peak is what is alive (malloc.py)
    baseline = process_bytes().get("VmRSS", 0)  # the process before any of the program (memory.py)
    local_rank = _env_int("LOCAL_RANK", 0)
    try:
        ctx = prepare(root, args)
    except RunError as e:
        if local_rank == 0:  # one message per node, not one per process
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops the node's other processes at the first exit: give local rank 0,
            # which found the same problem, the moment it needs to print it
            time.sleep(2.0)
        return EXIT_USAGE
    doc, mesh = ctx["doc"], ctx["mesh"]
    if ctx["weights"].partial_note and local_rank == 0:
        print(f"run.py: note: {ctx['weights'].partial_note}", file=sys.stderr, flush=True)
    for warning in ctx["weights"].warnings if _env_int("RANK", 0) == 0 else ():  # as --resume says them
        _say(f"warning: {warning}")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    ctx["program"].DEVICE = device
    if (ctx["loop"].get("accum") or {}).get("module") is not None:
        ctx["loop"]["accum"]["module"].DEVICE = device
    if "WORLD_SIZE" not in os.environ:  # `python run.py` on a one-rank mesh: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    trace("prepared+group")
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    beat = Heartbeat(store, rank)
    try:
        check_shared_paths(args, ctx["loop"], rank)
        rc = 0
        if ctx.get("blocks"):
            sub_root, sub_args, sub = ctx["blocks"]
            reported = []
            rc = _run_ranks(sub_root, sub_args, sub, sub["doc"], mesh, rank, device, use_cuda, on_result=reported.append)
            ok, lines = group_report(doc["block_check"], sub["doc"], mesh, rank, reported[0], sub["ref"], sub_args,
                                     device)
            for line in lines if rank == 0 else ():
                print(line, flush=True)
            rc = rc or (0 if ok else 1)
            del sub, reported, ctx["blocks"]  # its references and weights: the whole model runs next
            gc.collect()
        rc = _run_ranks(root, args, ctx, doc, mesh, rank, device, use_cuda, baseline=baseline) or rc
    except RunError as e:  # found by every rank at the same point (a bad token in --data)
        if rank == 0:
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        rc = EXIT_USAGE
    except NonFiniteError as e:  # on every rank at the same step (--nan-policy stop)
        if rank == 0:
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        rc = EXIT_NONFINITE
    except Stopped as e:  # SIGTERM / SIGINT agreed at a step's end; the checkpoint is saved
        rc = 128 + e.signum
    except Exception as e:  # noqa: BLE001 - a peer that stopped answering: one line, not a hang
        if _report_lost_peer(e, store, rank, mesh.size, args.timeout):
            # peers are stopped or gone: tearing the group down could block or abort
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEER)
        beat.stop()
        dist.destroy_process_group()
        raise
    # Leave together: a rank that destroys its groups while a peer still talks to it makes the
    # peer's gloo threads abort ("terminate called without an active exception").
    dist.barrier()
    beat.stop()
    dist.destroy_process_group()
    if ctx["loop"].get("lock"):
        ctx["loop"]["lock"].release()
    return rc


def check_shared_paths(args, loop: dict, rank: int) -> None:
    """RunError on every rank unless every rank sees rank 0's ``--ckpt`` directory, ``--data``
    file and ``--resume`` checkpoint (a job on several nodes needs them on a shared file system:
    :mod:`autoshard.runtime.execution.shared_paths`); collectives, after the process group starts."""
    if dist.get_world_size() == 1 or not (args.ckpt or loop.get("data") or loop.get("resume")):
        return
    problems = shared_paths.check_shared_paths(rank, ckpt=args.ckpt, data=args.data if loop.get("data") else None,
                                               resume=loop.get("resume"))
    if problems:
        raise RunError("; ".join(problems))


def _run_ranks(root, args, ctx, doc, mesh, rank, device, use_cuda, on_result=None, baseline=None) -> int:
    say = _say if rank == 0 else (lambda msg: None)
    backend = DistributedBackend(mesh, device_type="cuda" if use_cuda else "cpu", timeout=args.timeout)
    train = args.steps > 0
    zero = f", ZeRO-{doc['zero_stage']}" if doc.get("zero_stage") else ""
    transports = backend.connect()  # every rank: the segments are made now, so the line says what is used
    trace("connected")
    say(f"autoshard export {root.name}: {doc.get('model', 'model')} on {mesh}{zero} "
        f"({mesh.size} {'nccl' if use_cuda else 'gloo'} processes"
        f"{', collectives through shared memory' if 'shared memory' in transports.values() else ''}), "
        + (f"{args.steps} training step{'s' if args.steps != 1 else ''} ({args.optimizer}, lr {args.lr:g})"
           if train else "forward only"))
    if doc.get("pipeline"):
        p = doc["pipeline"]
        say(f"pipeline on {p['axis']}: {len(p['stages'])} stages, {p.get('schedule')}, {p['microbatches']} "
            f"microbatches per step")
    with rank_context(mesh, rank, backend):
        rp = rank_program(doc, mesh, rank, ctx["program"], ctx["weights"], device, train)
        meter = step_memory.watch(rp) if getattr(args, "memory", False) and train else None
        trace("loaded")
        ctx["weights"] = None  # every rank has its blocks: the weights file's mapping goes
        trace("weights dropped")
        if ctx["loop"]:
            res = train_loop(rp, ctx["user"], ctx["loop"], args, say=say)
        elif doc.get("pipeline"):
            res = _pipeline().rank_loop(rp, ctx["user"], steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                                        ref=ctx["ref"], rtol=args.rtol, atol=args.atol, say=say, R=_this(),
                                        nan_policy=args.nan_policy)
        else:
            res = rank_loop(rp, ctx["user"], steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                            ref=ctx["ref"], rtol=args.rtol, atol=args.atol, say=say, nan_policy=args.nan_policy)
        if args.timeline:
            _pipeline().write_timeline(rp, args.timeline, say)
        if meter is not None:
            say(step_memory.report(meter, doc, mesh.coords(rank), lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)))
    if on_result is not None:
        on_result(res)
    if baseline is not None:  # the whole export's run (not the block check's): each rank's peak
        memory_report(rank, mesh, doc, train=train, device=device, baseline=baseline, metrics=args.metrics,
                      shm_axes=[a for a, t in transports.items() if t == "shared memory" and mesh.axes[a] > 1],
                      say=say, optimizer=args.optimizer,
                      grad_norm=args.nan_policy != "ignore" or getattr(args, "clip_grad_norm", None) is not None)
    if ctx["ref"] is None:
        return 0
    flags = torch.tensor([1.0 if res["ok"] else 0.0], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    worst = torch.tensor([res["worst_out"], res["worst_grad"]], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    for msg in res["problems"][:5]:
        print(f"run.py: rank {rank}: {msg}", file=sys.stderr, flush=True)
    ok, text = summarize_check(doc, ctx["ref"], args, flags.item() == 1.0, worst.tolist(), res["losses"],
                               mesh.size)
    if ok and res.get("params_checked"):  # a pipelined export also checks the trained parameters
        text += f"; parameters after {args.steps} steps match"
    say(text)
    return 0 if ok else 1
