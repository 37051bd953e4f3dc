"""torch.export failures as one short :class:`CaptureError` naming the cause and the source line.

torch.export's errors are long (a data-dependent branch also logs the whole partial graph,
~240 lines for a small transformer). :func:`export_program` runs the export with those log
records and its stderr held back (replayed if the export succeeds), and turns a failure into one line: what
failed, where (file:line, the module whose ``forward`` holds that line, the code), and a hint.

Example::

    >>> import torch
    >>> class Branchy(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * 2 if x.sum() > 0 else x
    >>> try:
    ...     export_program(Branchy(), (torch.randn(3),), {})
    ... except CaptureError as e:
    ...     print(str(e).split(":")[0])
    torch.export could not capture Branchy
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys

import torch

# loggers that print graphs and guard details while an export fails
_NOISY = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export", "torch._dynamo")

_CALL = re.compile(r'The following call raised this error:\s*\n\s*File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)')
_DATA_DEPENDENT = ("data-dependent", "GuardOnDataDependentSymNode", "Could not guard on data")


class CaptureError(RuntimeError):
    """The model could not be captured by torch.export (one line: the cause and the source line)."""


class _Hold(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def _held_logs():
    """Hold back the export's log records; yields the list to replay on success."""
    hold = _Hold()
    saved = []
    for name in _NOISY:
        log = logging.getLogger(name)
        saved.append((log, log.propagate, list(log.handlers)))
        log.handlers, log.propagate = [hold], False
    try:
        yield hold.records
    finally:
        for log, propagate, handlers in saved:
            log.handlers, log.propagate = handlers, propagate


def _module_at(model, path: str, line: int):
    """FQN of the first submodule whose forward's source holds ``path:line`` (None if none)."""
    for name, mod in model.named_modules():
        fwd = getattr(type(mod), "forward", None)
        code = getattr(fwd, "__code__", None)
        if code is None or code.co_filename != path:
            continue
        try:
            lines, start = inspect.getsourcelines(fwd)
        except (OSError, TypeError):
            continue
        if start <= line < start + len(lines):
            return name or "<root>"
    return None


def describe_failure(model, e: BaseException) -> str:
    """One line for a torch.export failure of ``model``."""
    text = str(e)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    if len(first) > 200:
        first = first[:197] + "..."
    where = ""
    m = _CALL.search(text)
    if m:
        path, line, fn, code = m.group(1), int(m.group(2)), m.group(3), m.group(4).strip()
        module = _module_at(model, path, line)
        where = f" at {path}:{line} in {fn}" + (f" (module {module})" if module else "") + f": `{code}`"
    config = getattr(model, "config", None)
    # transformers keeps the experts kernel on config._experts_implementation ("eager" loops over
    # the experts that received tokens, a data-dependent loop export cannot capture)
    experts = getattr(config, "_experts_implementation", None)
    if experts not in (None, "grouped_mm", "batched_mm") and any(s in text for s in _DATA_DEPENDENT):
        return (f"torch.export could not capture {type(model).__name__}: data-dependent loop over the experts "
                f"that received tokens{where} (hint: build the Mixture-of-Experts model with "
                f"experts_implementation=\"grouped_mm\" or \"batched_mm\" in its config, which export captures)")
    if any(s in text or s in type(e).__name__ for s in _DATA_DEPENDENT):
        return (f"torch.export could not capture {type(model).__name__}: data-dependent control flow (Python "
                f"branches on a tensor's value){where} (hint: compute both branches with torch.where, "
                f"or take the branch outside the model; a plan is one fixed program)")
    return (f"torch.export could not capture {type(model).__name__}{where}: {type(e).__name__}: {first} "
            f"(hint: run torch.export.export(model, args, strict=False) to see the full error)")


def export_program(model: torch.nn.Module, args: tuple, kwargs: dict):
    """``torch.export.export(model, args, kwargs, strict=False)``, quiet on failure: raises
    :class:`CaptureError` with one line, and replays the held log records on success."""
    printed = io.StringIO()  # a failing export prints its partial graph to stderr
    with _held_logs() as records, contextlib.redirect_stderr(printed):
        try:
            ep = torch.export.export(model, tuple(args), kwargs, strict=False)
        except Exception as e:  # noqa: BLE001 - every export failure becomes one line
            err = CaptureError(describe_failure(model, e))
        else:
            err = None
    if err is not None:
        raise err from None
    sys.stderr.write(printed.getvalue())
    for r in records:
        logging.getLogger(r.name).handle(r)
    return ep
