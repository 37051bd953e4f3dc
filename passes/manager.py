"""The ordered list of passes that run on the rewritten per-rank program, in one place.

``passes/spmd.py`` rewrites the captured graph into the per-rank program; these passes then
change how that program's collectives run (never what it computes): each is a named
:class:`ProgramPass` with one signature, ``run(program, context) -> tags`` (the collectives it
changed), and the words it adds to those collectives' reasons. ``build_program`` walks
:data:`PROGRAM_PASSES` in order, skipping the names in ``disable``, and returns one
:class:`PassRecord` per pass (``plan.passes``): whether it ran, how many collectives it marked
and how many nodes of the program it rewrote.

Example::

    >>> [p.name for p in PROGRAM_PASSES]
    ['early_sums', 'output_sums', 'overlap_linear', 'inplace_sums', 'param_sums']
    >>> check_disabled(["overlap_linear"])
    ('overlap_linear',)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .early_sums import EARLY, start_sums_early
from .inplace_sums import IN_PLACE, consume_sum_inputs
from .output_sums import LAZY, defer_output_sums
from .overlap_linear import OVERLAP, overlap_linear_sums
from .param_sums import LATER, sum_param_grads_later

__all__ = ["ProgramPass", "PassRecord", "PassContext", "PROGRAM_PASSES", "check_disabled", "run_program_passes"]

# backward collectives a pass can mark: the gradient sums of replicated values read by per-rank work
GRADIENT_SUMS = ("mark_varying", "all_gather_varying")


@dataclass(frozen=True)
class PassContext:
    """What a program pass may read besides the program."""

    grad_inputs: frozenset  # placeholder names of trainable parameters
    train: bool


@dataclass(frozen=True)
class ProgramPass:
    """One pass over the rewritten program. ``run`` returns the tags of the collectives it
    changed; ``suffix`` is appended to their reasons (forward collectives, or the backward
    gradient sums of ``GRADIENT_SUMS``, as ``phase`` says); ``train_only``: skipped for
    forward-only plans."""

    name: str
    run: Callable
    suffix: str
    phase: str
    train_only: bool = False


@dataclass
class PassRecord:
    """What one pass did to a plan's program: ``ran`` (False: disabled, or not for this plan,
    ``why_not`` says), ``collectives`` it marked and ``nodes`` of the program it added, removed
    or changed (target or arguments)."""

    name: str
    ran: bool
    collectives: int = 0
    nodes: int = 0
    why_not: str = ""


# The order is the data flow: forward sums without a gradient start early first; the lazy loss
# sum reads them; the fusions of backward sums read mark_varyings of activations (never of
# parameters), which the per-parameter late sums take after them.
PROGRAM_PASSES = (
    ProgramPass("early_sums", lambda prog, ctx: start_sums_early(prog.graph_module.graph), EARLY, "forward"),
    ProgramPass("output_sums", lambda prog, ctx: defer_output_sums(prog.graph_module.graph), LAZY, "forward"),
    ProgramPass("overlap_linear", lambda prog, ctx: overlap_linear_sums(prog.graph_module.graph), OVERLAP,
                "backward"),
    ProgramPass("inplace_sums", lambda prog, ctx: consume_sum_inputs(prog.graph_module.graph), IN_PLACE, "forward"),
    ProgramPass("param_sums", lambda prog, ctx: sum_param_grads_later(prog.graph_module.graph, ctx.grad_inputs,
                                                                       skip=prog.bucketed),
                LATER, "backward", train_only=True),
)
NAMES = tuple(p.name for p in PROGRAM_PASSES)


def check_disabled(names) -> tuple:
    """``names`` as a tuple; ValueError naming the passes there are if one is unknown."""
    names = (names,) if isinstance(names, str) else tuple(names or ())
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"disable_passes names {unknown}, which are not passes; the passes are {list(NAMES)}")
    return names


def _node_keys(graph) -> set:
    """A node as a pass may change it: its target and arguments (a pass that marks a sum lazy or
    in place changes its keyword arguments)."""
    return {(n.name, str(n.target), str(n.args), str(sorted(n.kwargs.items()))) for n in graph.nodes}


def run_program_passes(program, context: PassContext, disable=(), why_not: str = "") -> list:
    """Run :data:`PROGRAM_PASSES` in order on ``program`` (skipping ``disable``; none when
    ``why_not`` says why they do not apply, e.g. a pipeline stage), mark the reasons of the
    collectives they changed, and return their :class:`PassRecord` list."""
    records, tags = [], {}
    after = None  # the keys after the last pass run: the next one starts from that graph
    for p in PROGRAM_PASSES:
        skip = why_not or ("disabled" if p.name in disable else "") or (
            "a forward-only plan" if p.train_only and not context.train else "")
        if skip:
            records.append(PassRecord(p.name, False, why_not=skip))
            continue
        before = after if after is not None else _node_keys(program.graph_module.graph)
        tags[p.name] = set(p.run(program, context))
        after = _node_keys(program.graph_module.graph)
        records.append(PassRecord(p.name, True, len(tags[p.name]), len(before ^ after)))
    if any(tags.values()):
        program.graph_module.recompile()
        for c in program.collectives:
            if c.phase == "forward":
                c.why += "".join(p.suffix for p in PROGRAM_PASSES if p.phase == "forward" and c.tag in tags.get(p.name, ()))
            elif c.phase == "backward" and c.op in GRADIENT_SUMS:
                c.why += "".join(p.suffix for p in PROGRAM_PASSES if p.phase == "backward" and c.tag in tags.get(p.name, ()))
    return records
