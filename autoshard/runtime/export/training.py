"""The training loop of run.py: ``--data``, lr schedule, clipping, checkpoints, ``--resume``, preemption.

``prepare_training`` checks the loop's options before any rank starts (the checkpoint
directory's lock and free space, a resumed checkpoint's match with this run); ``train_loop``
runs the steps of a ``RankProgram`` or ``PipelineProgram``, saving every ``--save-every``
steps and stopping cleanly (checkpoint saved, exit 128 + signal) on an agreed SIGTERM/SIGINT.

Example::

    loop = prepare_training(root, doc, args)        # {} when no loop option is given
    res = train_loop(rp, user, loop, args, say=print)
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from autoshard.runtime.execution import checkpoint as ckpt

from .accumulation import grad_accum_mismatch, grad_accum_setup
from .data import TokenData
from .errors import RunError, _env_int
from .program import agreed, check_finite_state, nonfinite_step


def add_training_args(p) -> None:
    g = p.add_argument_group("training loop (with --steps N)")
    g.add_argument("--data", help="token file: a 1-D integer tensor saved with torch.save, or a .npy / .bin of "
                                  "uint16/uint32 token ids; each step reads the next global batch, each rank its block")
    g.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16",
                   help="element type of a raw .bin token file")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="cosine: linear warmup over --warmup steps, then cosine decay to --min-lr at --total-steps")
    g.add_argument("--warmup", type=int, default=0, help="warmup steps of the schedule")
    g.add_argument("--total-steps", type=int, default=None,
                   help="the schedule's length (default: --steps, counted from the resumed step)")
    g.add_argument("--min-lr", type=float, default=0.0, help="the cosine schedule's final learning rate")
    g.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip gradients to this global 2-norm (over every shard and mesh axis)")
    g.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="K planned batches per optimizer step (K x the tokens of --data; --inputs with K x the "
                        "planned rows): gradients accumulate, data-axis sums run once per step, and the loss is "
                        "that of the K batches together (a masked mean over all their valid tokens)")
    g.add_argument("--ckpt", help="directory for checkpoints: step-NNNNNN/ written at --save-every and at the end")
    g.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (needs --ckpt)")
    g.add_argument("--resume", help="a checkpoint, or a --ckpt directory (its newest complete step-*): restores "
                                    "weights, optimizer, schedule and data position")
    g.add_argument("--metrics", help="rank 0 writes one JSON line per step here (step, loss, lr, grad_norm, "
                                     "tokens_per_s, seconds)")
    g.add_argument("--term-timeout", type=float, default=20.0,
                   help="with --ckpt: on SIGTERM/SIGINT, every process finishes its step, saves a checkpoint and "
                        "exits 143/130 within this many seconds (keep it below the launcher's grace period before "
                        "SIGKILL: torchrun's is 30 s)")


class Stopped(Exception):
    """Every rank received SIGTERM or SIGINT (one of them did, and they agreed at a step's end):
    the job saved its checkpoint and ends with exit code 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Preemption:
    """SIGTERM / SIGINT during a training loop with ``--ckpt``: the handler only notes the signal
    (and arms a timer that ends the process after ``--term-timeout`` seconds, whatever it is
    doing); at the end of each step the ranks agree whether any of them was signalled, and if so
    all save a checkpoint of that step and stop (:class:`Stopped`). Installed in the main thread
    only (simulated ranks are threads: they never see a signal).

    Example::

        with Preemption(timeout=20) as pre:
            for step in ...:
                ...
                if pre.agreed(rp):       # every rank, each step
                    save(); raise Stopped(pre.signum)
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, timeout: float):
        self.timeout, self.signum, self.old, self.timer = timeout, None, {}, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.old[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        # once signalled the deadline stays: leaving the process group must end within it too
        return False

    def _note(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            self.timer = threading.Timer(self.timeout, lambda: os._exit(128 + signum))
            self.timer.daemon = True
            self.timer.start()

    def agreed(self, rp) -> bool:
        """Whether any rank was signalled (the same answer on every rank; a collective); the
        signal of the job is then SIGTERM if any rank got it, else SIGINT."""
        if not self.old:
            return False
        term, intr = agreed(rp, [self.signum == signal.SIGTERM, self.signum == signal.SIGINT])
        if term or intr:
            self.signum = signal.SIGTERM if term else signal.SIGINT
            if self.timer is None:  # a peer was signalled first: this rank's deadline starts now
                self._note(self.signum, None)
            return True
        return False


def uses_training_loop(args) -> bool:
    return bool(args.data or args.ckpt or args.resume or args.save_every or args.metrics or args.grad_accum != 1
                or args.clip_grad_norm is not None or args.lr_schedule != "constant" or args.total_steps)


def prepare_training(root: Path, doc: dict, args) -> dict:
    """The training loop's inputs, checked before any process group exists: {} when no loop
    option is given; else the token source, the checkpoint to resume and the schedule."""
    if not uses_training_loop(args):
        return {}
    if args.steps <= 0:
        raise RunError("the training loop options (--data, --ckpt, --resume, --lr-schedule, ...) need --steps N > 0")
    if args.check:
        raise RunError("--check compares with references of the saved batch; it excludes the training loop options")
    if args.save_every < 0 or args.warmup < 0 or (args.total_steps is not None and args.total_steps <= 0):
        raise RunError("--save-every and --warmup must be >= 0 and --total-steps > 0")
    if args.save_every and not args.ckpt:
        raise RunError("--save-every needs --ckpt DIR")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise RunError("--clip-grad-norm must be > 0")
    accum = grad_accum_setup(root, doc, args)
    loop = {"schedule": {"kind": args.lr_schedule, "warmup": args.warmup, "total": args.total_steps,
                         "min_lr": args.min_lr, "lr": args.lr}, "accum": accum}
    if args.data:
        if args.synthetic or args.inputs:
            raise RunError("--data excludes --synthetic and --inputs")
        loop["data"] = TokenData(Path(args.data), args.data_dtype, doc)
    loop["warnings"] = []
    if args.resume:
        skipped = []
        try:
            loop["resume"] = ckpt.resolve(args.resume, skipped)
            manifest = ckpt.read_manifest(loop["resume"])
        except ckpt.CheckpointError as e:
            raise RunError(f"--resume: {e}") from None
        loop["warnings"] += ckpt.skipped_warnings(skipped, "--resume")
        loop["warnings"] += resume_mismatches(loop["resume"], manifest, args)
        loop["warnings"] += grad_accum_mismatch(loop["resume"], manifest, args)
    if args.ckpt:
        check_ckpt_dir(Path(args.ckpt), checkpoint_bytes(doc, args.optimizer))
        if _env_int("RANK", 0) == 0:  # the job's first process holds the directory for the job
            try:
                loop["lock"], dead = ckpt.DirectoryLock.take(args.ckpt)
            except ckpt.DirectoryHeld as e:
                raise RunError(f"--ckpt {e}") from None
            if dead is not None:
                loop["warnings"].append(f"--ckpt {args.ckpt} was held by a job that ended without releasing it "
                                        f"({ckpt.describe_holder(dead)}); this job takes it over")
    return loop


def resume_mismatches(path: Path, manifest: dict, args) -> list:
    """Warnings where the resumed run differs from the checkpoint's run in its data (another
    token file, or none); RunError where the checkpoint's state cannot apply (another optimizer)."""
    extra = manifest.get("extra") or {}
    saved_opt, saved_data = extra.get("optimizer"), extra.get("data")
    if saved_opt is not None and saved_opt != args.optimizer:
        raise RunError(f"--resume: {path} was trained with --optimizer {saved_opt}; its optimizer state does not "
                       f"apply to --optimizer {args.optimizer} (hint: --optimizer {saved_opt})")
    if saved_data is None:
        return [f"--resume: {path}'s run had no --data; this one reads {args.data}"] if args.data else []
    if not args.data:
        return [f"--resume: {path}'s run read --data {saved_data['file']} (to token {extra.get('data_position', 0)}); "
                f"this one has no --data and trains on its saved inputs"]
    now = ckpt.data_identity(args.data)
    if (now["bytes"], now["sha256_first_mib"]) != (saved_data["bytes"], saved_data["sha256_first_mib"]):
        return [f"--resume: --data {args.data} ({now['bytes']} bytes) is not the file {path}'s run read "
                f"({saved_data['file']}, {saved_data['bytes']} bytes): training goes on from token "
                f"{extra.get('data_position', 0)} of another file"]
    return []


def checkpoint_bytes(doc: dict, optimizer: str) -> int:
    """Bytes of one whole checkpoint of this program (all ranks' pieces together): parameters
    and buffers in their dtypes, and per trainable parameter the optimizer's per-element state
    (AdamW 2, plain SGD none), in fp32 with an fp32 master copy for 16-bit parameters."""
    states = {"adamw": 2, "sgd": 0}.get(optimizer, 2)
    total = 0
    for m in doc["inputs"]:
        if m["kind"] not in ("parameter", "buffer") or m.get("shape") is None or m.get("role") == "full":
            continue
        n = math.prod(m["shape"])
        size = torch.empty((), dtype=m["_dtype"]).element_size()
        total += n * size
        if m["kind"] == "parameter" and m.get("trainable"):
            low = m["_dtype"] in (torch.bfloat16, torch.float16)
            total += 4 * n * (states + (1 if low else 0)) if low else size * n * states
    return total


def check_ckpt_dir(path: Path, need: int) -> None:
    """RunError unless ``--ckpt`` can take a checkpoint: the directory exists or can be made,
    a file can be written in it, and its file system has ``need`` bytes free (one checkpoint's
    size), so a run does not spend its training time before the first save fails."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise RunError(f"--ckpt {path} is not writable: {e.strerror or e}") from None
    free = shutil.disk_usage(path).free
    if free < need:
        raise RunError(f"--ckpt {path} has {free / 2**20:,.1f} MiB free; one checkpoint of this program takes "
                       f"{need / 2**20:,.1f} MiB (hint: free space or choose another --ckpt)")


def lr_factor(schedule: dict, total: int):
    """The multiplier of the base lr at step index s (0-based): linear warmup to 1 over
    ``warmup`` steps, then constant, or cosine down to ``min_lr / lr`` at ``total``."""
    warmup, kind = schedule["warmup"], schedule["kind"]
    floor = schedule["min_lr"] / schedule["lr"] if schedule["lr"] else 0.0

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min((s - warmup) / max(1, total - warmup), 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def train_loop(rp, user, loop: dict, args, say=lambda msg: None) -> dict:
    """``args.steps`` training steps of one rank inside its rank context, with the loop's data,
    schedule, clipping and checkpoints; returns ``losses`` (and ``grad_norms``, ``lrs``, and
    ``skipped``: the steps ``--nan-policy skip-step`` skipped).
    ``rp``: a :class:`RankProgram`, or a pipelined export's ``PipelineProgram`` (each step its
    schedule over the step's microbatches); both give ``train_step``, ``step_loss``,
    ``clip_grad_norm_``, ``step`` and ``local``."""
    doc, mesh = rp.doc, rp.mesh
    for warning in loop.get("warnings", ()):
        say(f"warning: {warning}")
    rp.make_optimizer(args.optimizer, args.lr)
    opt, start, pos, schedule, manifest = rp.opt, 0, 0, dict(loop["schedule"]), None
    if loop.get("resume"):
        manifest = ckpt.read_manifest(loop["resume"])
        start = int(manifest.get("step") or 0)
        schedule = (manifest.get("extra") or {}).get("schedule") or schedule  # the run's own schedule continues
    if schedule.get("total") is None:
        schedule["total"] = start + args.steps
    # the scheduler first: creating it sets the lr to the schedule's start, which the checkpoint's
    # param groups (its current lr) and the scheduler's saved state then overwrite
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt.inner, lr_factor(schedule, schedule["total"]))
    if manifest is not None:
        ckpt.load(rp.local, opt, loop["resume"])
        extra = manifest.get("extra") or {}
        pos = int(extra.get("data_position", 0))
        if extra.get("scheduler"):
            scheduler.load_state_dict(extra["scheduler"])
        say(f"resumed from {loop['resume']} at step {start}" + (f", token {pos}" if loop.get("data") else ""))
    data, end, accum = loop.get("data"), start + args.steps, loop.get("accum")
    data_id = ckpt.data_identity(data.path) if data else None
    tokens = data.per_batch * (accum["k"] if accum else 1) if data else None
    if accum:
        say(f"gradient accumulation: {accum['k']} microbatches per optimizer step ({accum['source']})")
    info = {"model": doc.get("model"), "aliases": doc.get("aliases") or {},
            "state_dict_keys": doc.get("state_dict_keys")}
    metrics = open(args.metrics, "a") if args.metrics and rp.rank == 0 else None
    res = dict(ok=True, losses=[], grad_norms=[], lrs=[], skipped=[], worst_out=0.0, worst_grad=0.0, problems=[])
    sync = torch.cuda.synchronize if rp.device.type == "cuda" else (lambda: None)
    t_start = time.perf_counter()
    preemption = Preemption(args.term_timeout) if args.ckpt else None
    try:
        if preemption is not None:
            preemption.__enter__()
        for step in range(start + 1, end + 1):
            t0 = time.perf_counter()
            if accum:  # --grad-accum K: K planned batches, data-axis sums with the last
                microbatches = user
                if data:
                    microbatches = []
                    for _ in range(accum["k"]):
                        mb, pos = data.batch(pos, mesh, rp.rank)
                        microbatches.append(mb)
                value = rp.train_accumulated(microbatches, accum)
            else:
                if data:
                    user, pos = data.batch(pos, mesh, rp.rank)
                value = rp.step_loss(rp.train_step(user))
            norm = rp.clip_grad_norm_(args.clip_grad_norm) if args.clip_grad_norm is not None else None
            lr = opt.inner.param_groups[0]["lr"]
            skipped = nonfinite_step(rp, step, value, norm, args.nan_policy)
            if skipped:
                opt.zero_grad(set_to_none=True)
                res["skipped"].append(step)
                with warnings.catch_warnings():  # the schedule follows the step count, stepped or not
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before")
                    scheduler.step()
            else:
                rp.step()
                scheduler.step()
            sync()
            dt = time.perf_counter() - t0
            res["losses"].append(value)
            res["grad_norms"].append(norm)
            res["lrs"].append(lr)
            line = f"step {step}/{end}  loss {value:.6f}  time {dt * 1e3:.1f} ms  lr {lr:.3e}"
            if norm is not None:
                line += f"  grad-norm {norm:.4f}"
            if tokens:
                line += f"  tokens/s {tokens / dt:,.0f}"
            say(line + (f"  {skipped}" if skipped else ""))
            if metrics:
                metrics.write(json.dumps({"step": step, "loss": value, "lr": lr, "grad_norm": norm,
                                          "tokens_per_s": tokens / dt if tokens else None, "seconds": dt}) + "\n")
                metrics.flush()
            stop = preemption is not None and preemption.agreed(rp)
            if args.ckpt and ((args.save_every and step % args.save_every == 0) or step == end or stop):
                path = Path(args.ckpt) / f"step-{step:06d}"
                if args.nan_policy != "ignore":
                    check_finite_state(rp, step, path)
                ckpt.save(rp.local, opt, path, step=step, info=info,
                          extra={"data_position": pos, "schedule": schedule, "scheduler": scheduler.state_dict(),
                                 "optimizer": args.optimizer, "data": data_id,
                                 "grad_accum": accum["k"] if accum else 1})
                say(f"saved checkpoint {path}")
            if stop:
                say(f"stopping on {signal.Signals(preemption.signum).name} after step {step}: its checkpoint is "
                    f"saved; --resume {args.ckpt} continues")
                raise Stopped(preemption.signum)
    finally:
        if metrics:
            metrics.close()
        if preemption is not None:
            preemption.__exit__(None, None, None)
    took = time.perf_counter() - t_start
    if res["losses"]:
        say(f"done: {args.steps} step{'s' if args.steps != 1 else ''} in {took:.1f} s"
            + (f", {tokens * args.steps / took:,.0f} tokens/s" if tokens else "")
            + f", final loss {res['losses'][-1]:.6f}")
    return res
