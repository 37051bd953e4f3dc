"""The ``autoshard`` command line (``python -m autoshard`` or the ``autoshard`` script).

::

    autoshard plan    examples/models.py:llama_tiny --mesh dp=2,tp=2 --layout batch=dp,heads=tp,ffn=tp
    autoshard explain examples/models.py:llama_tiny --mesh tp=4 --layout heads=tp,ffn=tp
    autoshard export  examples/models.py:llama_tiny out/llama --mesh dp=2,tp=2 --layout ...
    autoshard run     examples/models.py:llama_tiny --mesh dp=2,tp=2 --layout ... [--steps 2]
    autoshard calibrate ...

``FILE.py:FACTORY`` names a function (in a file, or ``package.module:FACTORY``) that returns
``(model, args, dims)`` (optionally a 4th item, kwargs), like the factories in
``examples/models.py``; ``--factory-arg NAME=VALUE`` passes keyword arguments to it
(``--factory-arg with_labels=True``). Mistakes in what was typed (a bad target, mesh or layout
string, unknown dim names) print one line ``autoshard: error: ... (hint: ...)`` and exit with 2;
``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .options import OPTION_TYPES, option_flag

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake in what the user typed or pointed at: one line, with a hint."""

    def __init__(self, msg: str, hint: str = ""):
        super().__init__(msg)
        self.hint = hint


# ------------------------------------------------------------------------------------------------
# parsing the arguments
# ------------------------------------------------------------------------------------------------

def parse_mesh(text: str) -> dict:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``."""
    hint = "--mesh dp=2,tp=2 (axis names and sizes, in mesh order)"
    out = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, eq, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not name.isidentifier() or not re.fullmatch(r"\d+", size) or int(size) < 1:
            raise UsageError(f"bad mesh axis {part!r} in --mesh {text!r}", hint)
        if name in out:
            raise UsageError(f"mesh axis {name!r} appears twice in --mesh {text!r}", hint)
        out[name] = int(size)
    if not out:
        raise UsageError(f"empty mesh {text!r}", hint)
    return out


def parse_layout(text: str | None):
    """``"batch=dp,heads=tp,ffn=tp"`` -> ``{"batch": "dp", ...}``; ``dim=dp+tp`` splits one dim
    over two axes (in mesh order), ``dim=`` or ``dim=none`` keeps it whole."""
    if text is None:
        return None
    hint = "--layout batch=dp,heads=tp (dim name = mesh axis; dp+tp for two axes, none for whole)"
    out = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, eq, axes = part.rpartition("=")
        name, axes = name.strip(), axes.strip()
        if not eq or not name:
            raise UsageError(f"bad layout entry {part!r} in --layout {text!r}", hint)
        if axes.lower() in ("", "none", "-"):
            out[name] = None
            continue
        parts = [a.strip() for a in axes.split("+")]
        if not all(a.isidentifier() for a in parts):
            raise UsageError(f"bad mesh axes {axes!r} for dim {name!r} in --layout", hint)
        out[name] = parts[0] if len(parts) == 1 else tuple(parts)
    return out


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        low = text.lower()
        return {"true": True, "false": False, "none": None}.get(low, text)


def parse_factory_args(items) -> dict:
    out = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq or not name.strip().isidentifier():
            raise UsageError(f"bad --factory-arg {item!r}", "--factory-arg NAME=VALUE, e.g. with_labels=True")
        out[name.strip()] = _literal(value.strip())
    return out


def load_factory(target: str):
    """The function named by ``FILE.py:FACTORY`` or ``package.module:FACTORY``."""
    hint = "FILE.py:FACTORY, e.g. examples/models.py:llama_tiny"
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"expected FILE.py:FACTORY, got {target!r}", hint)
    if not name.isidentifier():
        raise UsageError(f"{name!r} in {target!r} is not a function name", hint)
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"no such file: {where}", hint)
        # Files next to the factory and the working directory import as in a script.
        for p in (str(Path.cwd()), str(path.resolve().parent)):
            if p not in sys.path:
                sys.path.insert(0, p)
        mod_name = "_autoshard_factory_" + re.sub(r"\W", "_", str(path.resolve()))
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise UsageError(f"importing {where} failed: {type(e).__name__}: {_first_line(e)}",
                             "run the file with python to see the full error") from e
    else:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise UsageError(f"importing module {where!r} failed: {type(e).__name__}: {_first_line(e)}", hint) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        known = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UsageError(f"{where} has no function {name!r}",
                         f"functions defined there: {', '.join(known[:12]) or 'none'}")
    return fn


def call_factory(fn, target: str, kwargs: dict):
    """``(model, args, kwargs, dims)`` from the factory's return value."""
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    import torch

    try:
        result = fn(**kwargs)
    except TypeError as e:
        raise UsageError(f"calling {target} failed: {_first_line(e)}",
                         "check --factory-arg names against the factory's parameters") from e
    except Exception as e:  # noqa: BLE001 - the user's code failed, not autoshard: say where, briefly
        raise UsageError(f"calling {target} failed: {type(e).__name__}: {_first_line(e)}{_user_line(e)}",
                         "--debug shows the traceback") from e
    if isinstance(result, dict):
        model, args = result.get("model"), result.get("args", ())
        dims, call_kwargs = result.get("dims"), result.get("kwargs")
    elif isinstance(result, (tuple, list)) and 2 <= len(result) <= 4:
        model, args = result[0], result[1]
        dims = result[2] if len(result) > 2 else None
        call_kwargs = result[3] if len(result) > 3 else None
    else:
        raise UsageError(f"{target} returned a {type(result).__name__}; expected (model, args, dims)",
                         "return the model, a tuple of example inputs and the dims names")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{target} returned a {type(model).__name__} as the model; expected a torch.nn.Module",
                         "return (model, args, dims)")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise UsageError(f"{target} returned {type(args).__name__} as the example inputs; expected a tuple",
                         "return (model, (input_ids, ...), dims)")
    return model, tuple(args), call_kwargs, dims


def _user_line(e: BaseException) -> str:
    """`` at FILE:LINE`` of the innermost frame of ``e``'s traceback ('' without one)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ------------------------------------------------------------------------------------------------
# the options of autoshard.autoshard as flags (one per field of autoshard.options' objects)
# ------------------------------------------------------------------------------------------------

def _dest(cls, f) -> str:
    return f"option_{cls.__name__}_{f.name}"


def add_option_flags(parser) -> None:
    """One flag per field of every option object of :mod:`autoshard.options`, grouped by object,
    with the field's doc as help: ``--train``, ``--zero-stage``, ``--hardware``, ``--pipeline``,
    ``--precision``, ``--recompute``, ``--strict``, ...

    Example::

        p = argparse.ArgumentParser(); add_option_flags(p)
        options_from_flags(p.parse_args(["--hardware", "h100", "--precision", "bf16"]))
        # [SearchOptions(search=None, hardware='h100', memory_limit=None), PrecisionOptions(param=torch.bfloat16, ...)]
    """
    for cls in OPTION_TYPES:
        summary = cls.__doc__.split("\n\n")[0].replace("``", "")
        group = parser.add_argument_group(f"{cls.__name__} (autoshard.options)", summary)
        for f in dataclasses.fields(cls):
            m = f.metadata
            if m["parse"] is bool:
                group.add_argument(option_flag(f), dest=_dest(cls, f), action="store_true", default=None,
                                   help=m["doc"])
                continue
            metavar = m["metavar"] or ("{" + ",".join(map(str, m["choices"])) + "}" if m["choices"] else "VALUE")
            group.add_argument(option_flag(f), dest=_dest(cls, f), default=None, metavar=metavar, help=m["doc"])


def _flag_value(f, text: str):
    """The value of one option flag's ``text`` (its field's parser, its choices checked)."""
    m, flag = f.metadata, option_flag(f)
    if m["parse"] is bool:
        return True
    choices = m["choices"]
    hint = f"{flag} {m['metavar'] or '{' + ','.join(map(str, choices)) + '}'}"
    try:
        value = m["parse"](text) if m["parse"] is not None else text
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}", hint) from None
    if choices is not None and m["parse"] in (None, int) and value not in choices:
        raise UsageError(f"{flag} {text!r} is not one of {', '.join(map(str, choices))}", hint)
    return value


def options_from_flags(ns) -> list:
    """The option objects (:mod:`autoshard.options`) the flags in ``ns`` set: one object per
    kind with any of its flags given, the others left out (``autoshard.autoshard``'s
    defaults). A value that does not parse is a :class:`UsageError` naming the flag.

    Example::

        ns = build_parser().parse_args(["plan", "m.py:f", "--mesh", "dp=2", "--recompute", "on"])
        options_from_flags(ns)   # [RecomputeOptions(checkpoint=True)]
    """
    out = []
    for cls in OPTION_TYPES:
        given = {f.name: _flag_value(f, getattr(ns, _dest(cls, f))) for f in dataclasses.fields(cls)
                 if getattr(ns, _dest(cls, f), None) is not None}
        if given:
            out.append(cls(**given))
    return out


# ------------------------------------------------------------------------------------------------
# the commands
# ------------------------------------------------------------------------------------------------

def _make_plan(ns):
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    import autoshard

    options = options_from_flags(ns)
    training = next((o for o in options if isinstance(o, autoshard.TrainingOptions)), autoshard.TrainingOptions())
    if training.zero_stage is not None and not training.train:
        raise UsageError(f"--zero-stage {training.zero_stage} shards training state, but the plan is not for "
                         f"training", "add --train")
    mesh = autoshard.Mesh(parse_mesh(ns.mesh))
    layout = parse_layout(ns.layout)
    fn = load_factory(ns.target)
    model, args, kwargs, dims = call_factory(fn, ns.target, parse_factory_args(ns.factory_arg))
    plan = autoshard.autoshard(model, args, kwargs, mesh=mesh, dims=dims, layout=layout, options=options,
                               verbose=ns.verbose)
    return plan, args, kwargs


def cmd_plan(ns) -> int:
    plan, _, _ = _make_plan(ns)
    print(plan)
    return 0


def explain(plan) -> str:
    """A compact view: layout, what is sharded, every collective with its reason."""
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    from tabulate import tabulate

    from autoshard.ownership import Replicate, describe

    mesh = plan.mesh
    lines = [f"{type(plan.model).__name__} on {mesh} ({mesh.size} ranks)"]
    lay = [f"{k} -> {'+'.join(v)}" for k, v in plan.layout.items() if v]
    lines.append("layout: " + ("; ".join(lay) if lay else "everything replicated"))
    params = [(i, p) for i, p in zip(plan.captured.inputs, plan.program.input_placements) if i.kind == "parameter"]
    sharded = [(i, p) for i, p in params if not all(isinstance(o, Replicate) for o in p)]
    lines.append(f"parameters: {len(params)}, {len(sharded)} sharded"
                 + (": " + ", ".join(f"{i.target} {describe(p, mesh.names)}" for i, p in sharded[:6])
                    + (", ..." if len(sharded) > 6 else "") if sharded else ""))
    users = [(i, p) for i, p in zip(plan.captured.inputs, plan.program.input_placements) if i.kind == "user"]
    if users:
        lines.append("inputs: " + ", ".join(f"{i.target} {describe(p, mesh.names)}" for i, p in users))
    cols = plan.collectives
    by = {}
    for c in cols:
        by[c.phase] = by.get(c.phase, 0) + 1
    lines.append(f"collectives: {len(cols)}" + (" (" + ", ".join(f"{v} {k}" for k, v in by.items()) + ")" if by else ""))
    if cols:
        rows = [[c.tag, c.phase, c.kind, ",".join(c.axes), _size(c.bytes), c.where or "<root>", c.why] for c in cols]
        lines.append(tabulate(rows, headers=["#", "phase", "kind", "axis", "bytes", "module", "why"],
                              tablefmt="simple", maxcolwidths=[None] * 6 + [70]))
    return "\n".join(lines)


def _size(n) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_explain(ns) -> int:
    plan, _, _ = _make_plan(ns)
    print(explain(plan))
    return 0


def _export(plan, args, kwargs, out, ns):
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    from autoshard.passes.export import export_plan

    return export_plan(plan, out, args, kwargs, weights=ns.weights, weights_prefix=ns.weights_prefix,
                       reference=False if ns.no_reference else None, overwrite=ns.force)


def cmd_export(ns) -> int:
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    from autoshard.passes.export import torchrun_command

    plan, args, kwargs = _make_plan(ns)
    path = _export(plan, args, kwargs, ns.out, ns)
    files = ", ".join(sorted(p.name for p in path.iterdir()))
    print(f"exported {type(plan.model).__name__} on {plan.mesh} to {path}/ ({files})")
    cmd = " ".join(torchrun_command(path, plan.mesh.size)[3:])
    print(f"run it: torchrun {cmd} --check")
    return 0


def cmd_run(ns) -> int:
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    from autoshard.passes.export import torchrun_command

    plan, args, kwargs = _make_plan(ns)
    with tempfile.TemporaryDirectory(prefix="autoshard-run-") as tmp:
        out = Path(ns.out) if ns.out else Path(tmp) / ns.target.rpartition(":")[2]
        ns.force = ns.force or ns.out is None
        path = _export(plan, args, kwargs, out, ns)
        run_args = ([] if ns.no_check or ns.no_reference else ["--check"]) + (
            ["--steps", str(ns.steps)] if ns.steps else []) + list(ns.run_args or [])
        nproc = ns.nproc or plan.mesh.size
        cmd = torchrun_command(path, nproc, *run_args)
        print(f"$ torchrun {' '.join(cmd[3:])}", flush=True)
        return _launch(cmd, ns.timeout)


_TORCHRUN_FAILURE = re.compile(r"elastic/multiprocessing/api\.py:\d+\] failed \(exitcode")
_TORCHRUN_LOG = re.compile(r"[WIE]\d{4} [\d:.]+ \d+ \S*torch/distributed/(elastic|run)")


def _launch(cmd, timeout) -> int:
    """Run torchrun, passing its output through, but not its own traceback when a rank failed
    (run.py's message above says what went wrong)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    swallowed = False
    try:
        for line in proc.stderr:
            if _TORCHRUN_FAILURE.search(line):
                swallowed = True
            if swallowed or _TORCHRUN_LOG.match(line):
                continue
            sys.stderr.write(line)
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise UsageError(f"torchrun did not finish within {timeout:g}s", "raise --timeout, or check for a stuck rank")
    if rc != 0:
        print(f"autoshard: error: the exported program failed under torchrun (exit code {rc})", file=sys.stderr)
    return rc


def cmd_calibrate(ns) -> int:
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    from autoshard.cost import calibrate
    from autoshard.cost.calibrate import parse_mesh

    try:
        mesh_axes = parse_mesh(ns.mesh)
    except ValueError as e:
        raise UsageError(str(e), "calibrate dp=2,tp=2 [NPROCS] [OUT.json]") from None
    hw = calibrate(mesh_axes, ns.nprocs, ns.out_path)
    print(f"calibrated {dict(mesh_axes)}" + (f"; written to {ns.out_path} (use it with hardware='{ns.out_path}')"
                                     if ns.out_path else ""))
    return 0


# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoshard", description="Plan, explain, export and run sharded PyTorch programs.",
        epilog="example: autoshard plan examples/models.py:llama_tiny --mesh dp=2,tp=2 "
               "--layout batch=dp,heads=tp,ffn=tp")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def planning(sp):
        sp.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function returning (model, args, dims), e.g. examples/models.py:llama_tiny")
        sp.add_argument("--mesh", required=True, help="named mesh axes in order, e.g. dp=2,tp=2")
        sp.add_argument("--layout", help="dim -> mesh axes, e.g. batch=dp,heads=tp,ffn=tp")
        sp.add_argument("--factory-arg", action="append", metavar="NAME=VALUE",
                        help="keyword argument for the factory (repeatable), e.g. with_labels=True")
        sp.add_argument("--verbose", action="store_true", help="progress of planning on stderr")
        sp.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
        add_option_flags(sp)  # every option of autoshard.autoshard

    sp = sub.add_parser("plan", help="print the plan: named dims, owners, collectives with reasons")
    planning(sp)
    sp.set_defaults(func=cmd_plan)
    sp = sub.add_parser("explain", help="print a compact view: layout and every collective with its reason")
    planning(sp)
    sp.set_defaults(func=cmd_explain)

    def exporting(sp):
        sp.add_argument("--weights", help="checkpoint run.py slices instead of the model's weights: a state dict "
                                          "by parameter name, a .safetensors file or a save_pretrained directory")
        sp.add_argument("--weights-prefix", metavar="PREFIX",
                        help="with --weights: the FQN under which the checkpoint's keys live in the model")
        sp.add_argument("--no-reference", action="store_true", help="do not save references for --check")

    sp = sub.add_parser("export", help="write a directory runnable with torchrun")
    planning(sp)
    sp.add_argument("out", metavar="OUT", help="directory to create")
    sp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    exporting(sp)
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("run", help="export to a temporary directory and run it with torchrun (CPU: gloo)")
    planning(sp)
    exporting(sp)
    sp.add_argument("--nproc", type=int, help="processes (default: the mesh size)")
    sp.add_argument("--steps", type=int, default=0, help="training steps (default: one forward)")
    sp.add_argument("--no-check", action="store_true", help="do not compare with the unsharded model")
    sp.add_argument("--out", help="keep the export in this directory")
    sp.add_argument("--force", action="store_true", help="replace --out if it exists")
    sp.add_argument("--timeout", type=float, default=900.0, help="seconds before torchrun is stopped")
    sp.add_argument("run_args", nargs="*", metavar="-- RUN.PY ARGS", help="more arguments for run.py after --")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("calibrate", help="measure this machine's compute and links for the cost model")
    sp.add_argument("mesh", nargs="?", default="x=2", help="mesh axes to measure, e.g. dp=2,tp=2 (default x=2)")
    sp.add_argument("nprocs", nargs="?", type=int, help="processes to start (the mesh size)")
    sp.add_argument("out_path", nargs="?", help="hardware JSON file to write")
    sp.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    sp.set_defaults(func=cmd_calibrate)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `autoshard run TARGET --mesh ... -- RUN.PY ARGS`: what follows `--` goes to run.py as it is
    # (argparse would give it to no positional once TARGET was read, and fail on it)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return EXIT_USAGE
    if extra:
        if ns.command != "run":
            parser.error(f"arguments after -- ({' '.join(extra)}) are for `autoshard run` only")
        ns.run_args = list(ns.run_args or []) + extra
    debug = ns.debug or os.environ.get("AUTOSHARD_DEBUG", "") not in ("", "0")
    try:
        return ns.func(ns)
    except UsageError as e:
        if debug:
            raise
        return _fail(str(e), e.hint)
    except Exception as e:  # noqa: BLE001 - user mistakes the library reports, one line each
        if debug:
            raise
        hint = _library_hint(e)
        if hint is None:
            raise
        return _fail(_first_line(e), hint)


def _library_hint(e: BaseException):
    """Hint for an error the library raises on bad user input; None for a bug (traceback)."""
    # deferred: torch is heavy; --help and typing mistakes answer without loading it
    from autoshard import LayoutError

    from autoshard.passes.capture import CaptureError
    from autoshard.passes.export import ExportError
    if isinstance(e, LayoutError):
        return "`autoshard plan` without --layout lists the named dims; check names and mesh axes"
    if isinstance(e, NotImplementedError):
        return "this option is not supported yet"
    if isinstance(e, ExportError):
        return "" if "hint:" in str(e) else "export with --force to replace an existing directory"
    if isinstance(e, CaptureError):
        return "" if "hint:" in str(e) else "--debug shows the traceback"
    if isinstance(e, (ValueError, TypeError)):
        # the library's checks of what it was given (memory_limit, zero_stage without train,
        # hardware names, process counts): one line; --debug / AUTOSHARD_DEBUG=1 show the traceback
        return "" if "hint:" in str(e) else "--debug shows the traceback"
    return None


def _fail(msg: str, hint: str = "") -> int:
    msg = " ".join(msg.split())
    print(f"autoshard: error: {msg}" + (f" (hint: {hint})" if hint else ""), file=sys.stderr)
    return EXIT_USAGE
