"""The options of ``autoshard.autoshard`` as small typed objects, one per concern.

Every keyword of :func:`autoshard.autoshard` beyond the model, its inputs, ``mesh``, ``dims`` and
``layout`` is a field of one of these frozen dataclasses. Pass them with ``options=`` (one object
or several), or the dict keywords' objects in their place (``pipeline=PipelineOptions(...)``);
the keywords of earlier releases keep working. A keyword and an option object that set the same
field to different values are refused (``ValueError`` naming both). The command line's flags are
made from the same fields (``autoshard plan --help``), each field's doc is its flag's help.

Example::

    >>> from autoshard.options import TrainingOptions, SearchOptions, collect
    >>> opts = collect([TrainingOptions(train=True, zero_stage=3), SearchOptions(hardware="h100")])
    >>> opts.training.zero_stage, opts.search.hardware, opts.training.bucket_mb
    (3, 'h100', 25.0)
    >>> collect([TrainingOptions(train=True)], {"train": False, "bucket_mb": 0}).training.bucket_mb
    0
    >>> collect([TrainingOptions(bucket_mb=0)], {"bucket_mb": 10})
    Traceback (most recent call last):
    ...
    ValueError: bucket_mb=10 and TrainingOptions(bucket_mb=0) disagree: give it once

This module imports nothing heavy (the command line builds its flags from it before torch loads).
"""
from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Iterable, Mapping, Optional, Union

__all__ = ["TrainingOptions", "SearchOptions", "RewriteOptions", "PipelineOptions", "PrecisionOptions",
           "RecomputeOptions", "ContextOptions", "ExpertOptions", "Options", "OPTION_TYPES", "collect",
           "parse_bytes", "parse_dtype", "parse_units", "parse_switch", "CHECKPOINT_CHOICES", "option_flag"]


def _opt(default, doc: str, *, flag: Optional[str] = None, parse=None, choices=None, metavar=None):
    """A field with its documentation and how the command line reads it: ``flag`` (default
    ``--field-name``), ``parse`` (text -> value; None: a plain string, ``bool`` for an on/off
    switch), ``choices`` (the words the flag accepts)."""
    return field(default=default, metadata={"doc": doc, "flag": flag, "parse": parse, "choices": choices,
                                            "metavar": metavar})


# ----------------------------------------------------------------------------- reading text values

_BYTE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40}


def parse_bytes(v) -> Optional[float]:
    """``80e9``, ``"80GB"``, ``"80 GiB"`` -> bytes (None stays None).

    >>> parse_bytes("80GB"), parse_bytes("1 GiB"), parse_bytes(None)
    (80000000000.0, 1073741824.0, None)
    """
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v <= 0:
            raise ValueError(f"memory_limit must be positive, got {v!r}")
        return float(v)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2).upper() not in _BYTE_UNITS:
        raise ValueError(f"memory_limit {v!r}: give bytes or a string such as '80GB' or '64GiB'")
    try:
        return parse_bytes(float(m.group(1)) * _BYTE_UNITS[m.group(2).upper()])
    except ValueError:
        raise ValueError(f"memory_limit {v!r}: give bytes or a string such as '80GB' or '64GiB'") from None


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "fp32": "float32", "float32": "float32", "float": "float32", "fp64": "float64", "float64": "float64",
           "double": "float64"}


def parse_dtype(text: str):
    """``"bf16"``, ``"float32"``, ... -> the torch dtype.

    >>> parse_dtype("bf16")
    torch.bfloat16
    """
    name = _DTYPES.get(str(text).strip().lower())
    if name is None:
        raise ValueError(f"unknown floating dtype {text!r}; one of {', '.join(sorted(_DTYPES))}")
    import torch  # deferred: --help and the flags' parsing need no torch

    return getattr(torch, name)


def parse_units(text: str):
    """``"block"`` stays a word; ``"layers.0,layers.1*"`` -> a tuple of module prefixes / globs.

    >>> parse_units("block"), parse_units("embed,layers.*")
    ('block', ('embed', 'layers.*'))
    """
    parts = tuple(p.strip() for p in str(text).split(",") if p.strip())
    return parts[0] if len(parts) == 1 and parts[0] in ("block", "model", "param") else parts


def _parse_list(text: str) -> tuple:
    return tuple(p.strip() for p in str(text).split(",") if p.strip())


_SWITCH = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False, "auto": None}


def parse_switch(text: str):
    """``on`` / ``off`` / ``auto`` -> True / False / None (``auto``: the planner decides).

    >>> parse_switch("on"), parse_switch("off"), parse_switch("auto")
    (True, False, None)
    """
    key = str(text).strip().lower()
    if key not in _SWITCH:
        raise ValueError(f"{text!r}: give on, off or auto")
    return _SWITCH[key]


# what ``--recompute WORD`` means: a word -> the value of RecomputeOptions.checkpoint
CHECKPOINT_CHOICES = {"on": True, "off": False, "auto": None, "block": "block", "selective": "selective"}


def _parse_checkpoint(text: str):
    key = str(text).strip().lower()
    if key not in CHECKPOINT_CHOICES:
        raise ValueError(f"--recompute {text!r}: give one of {', '.join(CHECKPOINT_CHOICES)}")
    return CHECKPOINT_CHOICES[key]


# ----------------------------------------------------------------------------- the option objects

@dataclass(frozen=True)
class TrainingOptions:
    """What a training plan shards and how its gradients are summed (``docs/training.md``).

    Example::

        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"},
                            options=TrainingOptions(train=True, zero_stage=3, units="block"))
    """

    train: bool = _opt(False, "plan for training (forward, backward, optimizer)", parse=bool)
    zero_stage: Optional[int] = _opt(None, "state sharding on the data axes: 0 (replicated), 1 (optimizer state), "
                                           "2 (+ gradients), 3 (+ parameters, FSDP); default: chosen by the search "
                                           "when it runs, else 0", parse=int, choices=(0, 1, 2, 3))
    reshard_after_forward: Optional[bool] = _opt(
        None, "ZeRO-3: free gathered parameters after forward and gather them again in backward "
              "(off: keep them); default: chosen by the search, else on", parse=parse_switch,
        choices=("on", "off", "auto"))
    bucket_mb: float = _opt(25.0, "MiB per data-parallel gradient all-reduce bucket (0: one all-reduce per "
                                  "parameter, inside backward)", parse=float, metavar="MIB")
    units: Union[str, tuple, list, None] = _opt(
        None, "ZeRO-3 gather units: block (one per repeated block), model, param, or module prefixes / globs "
              "separated by commas; default: chosen by cost when the search runs, else block",
        parse=parse_units, metavar="block|model|param|PREFIX,...")


@dataclass(frozen=True)
class SearchOptions:
    """Whether the layout search runs, and what it prices plans with (``docs/search.md``,
    ``docs/cost-model.md``).

    Example::

        autoshard.autoshard(model, args, mesh=autoshard.Mesh.auto(8, ("dp", "tp")), dims=dims,
                            options=SearchOptions(hardware="h100", memory_limit="80GB"))
    """

    search: Optional[bool] = _opt(None, "search the layout (on: layout entries are constraints; off: never); "
                                        "default: when no layout shards, with Mesh.auto or a memory limit",
                                  parse=parse_switch, choices=("on", "off", "auto"))
    hardware: Any = _opt(None, "cost model: a preset (h100, cpu-gloo, ...), a hardware JSON file written by "
                               "calibrate, or a cost.Hardware / CostModel; default $AUTOSHARD_HARDWARE or cpu-gloo",
                         metavar="PRESET|FILE.json")
    memory_limit: Union[float, str, None] = _opt(None, "bytes per device the plan must fit in, e.g. 80GB "
                                                       "(runs the search)", parse=parse_bytes, metavar="BYTES")


@dataclass(frozen=True)
class RewriteOptions:
    """How strictly the layout is carried out, and which program passes run (``docs/passes.md``).

    Example::

        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"heads": "tp"},
                            options=RewriteOptions(strict=True, disable_passes=("early_sums",)))
    """

    strict: bool = _opt(False, "refuse a plan that gathers in forward a value the layout shards "
                               "(plan.unsharded lists them)", parse=bool)
    disable_passes: tuple = _opt((), "program passes not to run, separated by commas (early_sums, "
                                     "overlap_linear, ...)", parse=_parse_list, metavar="PASS,...")


@dataclass(frozen=True)
class PipelineOptions:
    """``pipeline=``: split the layer sequence over a mesh axis (``docs/pipeline.md``); None
    fields are chosen by the planner. A mesh axis named ``pp`` pipelines without it.

    Example::

        autoshard.autoshard(model, args, mesh=autoshard.Mesh({"pp": 2, "dp": 2}), dims=dims,
                            layout={"batch": "dp"}, train=True,
                            pipeline=PipelineOptions(axis="pp", microbatches=8, schedule="1f1b"))
    """

    axis: Optional[str] = _opt(None, "mesh axis that splits the layer sequence (default pp)", flag="--pipeline",
                               metavar="AXIS")
    microbatches: Optional[int] = _opt(None, "pipeline: microbatches per step (args are one step's batch)",
                                       parse=int, metavar="N")
    schedule: Optional[str] = _opt(None, "pipeline schedule: gpipe, 1f1b, interleaved or zero_bubble",
                                   metavar="NAME")
    virtual: Optional[int] = _opt(None, "pipeline: stages per pipeline rank (interleaved schedules)", parse=int,
                                  flag="--virtual-stages", metavar="N")
    cuts: Optional[tuple] = _opt(None, "pipeline: module names where stages 1.. begin, separated by commas "
                                       "(default: balanced by cost)", parse=_parse_list, metavar="MODULE,...")


@dataclass(frozen=True)
class PrecisionOptions:
    """``precision=``: mixed precision (``docs/training.md``). Parameters, activations and
    gathers in ``param``; gradient sums in ``reduce``; 16-bit parameters are stepped through
    fp32 master copies by ``plan.optimizer``.

    Example::

        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, train=True,
                            precision=PrecisionOptions(param=torch.bfloat16, reduce=torch.float32))
    """

    param: Any = _opt(None, "dtype of parameters, activations and gathers (bf16, fp16, fp32)", flag="--precision",
                      parse=parse_dtype, metavar="DTYPE")
    reduce: Any = _opt(None, "dtype gradient sums run in (e.g. fp32 with --precision bf16)",
                       flag="--reduce-precision", parse=parse_dtype, metavar="DTYPE")


@dataclass(frozen=True)
class RecomputeOptions:
    """Activation checkpointing of repeated blocks in training (``docs/training.md``).

    Example::

        autoshard.autoshard(model, args, mesh=mesh, dims=dims, layout={"batch": "dp"}, train=True,
                            options=RecomputeOptions(checkpoint=True))
    """

    checkpoint: Union[bool, str, None] = _opt(None, "recompute each repeated block's activations in backward: on "
                                            "(whole blocks, as block), selective (keep matmul and attention "
                                            "outputs), off, or auto (the search turns it on when only then the "
                                            "plan fits the memory limit)", flag="--recompute", parse=_parse_checkpoint,
                                      choices=tuple(CHECKPOINT_CHOICES))


@dataclass(frozen=True)
class ContextOptions:
    """``context=``: context-parallel attention when a layout splits the query sequence
    (``docs/context.md``); None fields are chosen by the planner.

    Example::

        autoshard.autoshard(model, args, mesh=autoshard.Mesh({"cp": 2}), dims=dims, layout={"seq": "cp"},
                            context=ContextOptions(variant="ring", order="zigzag"))
    """

    order: Optional[str] = _opt(None, "sequence order of context parallelism (default zigzag for causal or masked "
                                      "attention)", flag="--context-order", choices=("zigzag", "contiguous"))
    variant: Optional[str] = _opt(None, "context-parallel attention (default: chosen by cost)",
                                  flag="--context-variant", choices=("ring", "allgather"))


@dataclass(frozen=True)
class ExpertOptions:
    """``moe=``: Mixture-of-Experts dispatch (``docs/experts.md``).

    Example::

        autoshard.autoshard(model, args, mesh=autoshard.Mesh({"ep": 2}), dims=dims,
                            layout={"experts": "ep"}, moe=ExpertOptions(capacity_factor=1.25))
    """

    capacity_factor: Optional[float] = _opt(None, "MoE: rows per expert capped at this factor of an even share "
                                                  "(default: dropless)", parse=float, metavar="F")


# the option objects, in the order the command line lists their flags
OPTION_TYPES = (TrainingOptions, SearchOptions, RewriteOptions, PipelineOptions, PrecisionOptions,
                RecomputeOptions, ContextOptions, ExpertOptions)

# option objects given as one dict keyword of autoshard(): keyword -> type (None: no such object)
_DICT_KEYWORDS = {"pipeline": PipelineOptions, "precision": PrecisionOptions, "context": ContextOptions,
                  "moe": ExpertOptions}


@dataclass(frozen=True)
class Options:
    """Every option of one ``autoshard()`` call, gathered from its keywords and option objects
    (:func:`collect`); ``pipeline`` and ``precision`` are None when not asked for. A plan keeps
    them as ``plan.options``."""

    training: TrainingOptions = field(default_factory=TrainingOptions)
    search: SearchOptions = field(default_factory=SearchOptions)
    rewrite: RewriteOptions = field(default_factory=RewriteOptions)
    pipeline: Optional[PipelineOptions] = None
    precision: Optional[PrecisionOptions] = None
    recompute: RecomputeOptions = field(default_factory=RecomputeOptions)
    context: ContextOptions = field(default_factory=ContextOptions)
    experts: ExpertOptions = field(default_factory=ExpertOptions)

    def objects(self) -> tuple:
        """The option objects set, for ``options=`` of another call."""
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)


_SLOT = {TrainingOptions: "training", SearchOptions: "search", RewriteOptions: "rewrite",
         PipelineOptions: "pipeline", PrecisionOptions: "precision", RecomputeOptions: "recompute",
         ContextOptions: "context", ExpertOptions: "experts"}
# flat keyword of autoshard() -> the option type holding the field of that name
FLAT_KEYWORDS = {f.name: t for t in (TrainingOptions, SearchOptions, RewriteOptions, RecomputeOptions)
                 for f in fields(t)}


def option_flag(f) -> str:
    """The command-line flag of an option field: its own, or ``--field-name``.

    >>> [option_flag(f) for f in fields(PrecisionOptions)]
    ['--precision', '--reduce-precision']
    """
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()


def _from_dict(keyword: str, cls, value):
    """The option object for a dict keyword (``pipeline={"axis": "pp"}``), or the object itself."""
    if value is None or isinstance(value, cls):
        return value
    names = [f.name for f in fields(cls)]
    if not isinstance(value, Mapping):
        raise ValueError(f"{keyword}= takes a dict with keys {tuple(names)} or a {cls.__name__}, got {value!r}")
    unknown = set(value) - set(names)
    if unknown:
        raise ValueError(f"{keyword}= takes {', '.join(map(repr, names))}, not {sorted(unknown)}: unknown keys")
    return cls(**value)


def _merge(obj, given: dict, *, what=lambda k, v: f"{k}={v!r}"):
    """``obj`` with the ``given`` fields set; a field that both set to different values (neither
    the default) is refused."""
    out = {}
    for f in fields(type(obj)):
        if f.name not in given:
            continue
        mine, theirs, default = getattr(obj, f.name), given[f.name], _default(f)
        if _same(theirs, default) or _same(theirs, mine):
            continue
        if not _same(mine, default):
            raise ValueError(f"{what(f.name, theirs)} and {type(obj).__name__}({f.name}={mine!r}) disagree: "
                             f"give it once")
        out[f.name] = theirs
    return replace(obj, **out) if out else obj


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a bool (tensors): the same object only
        return a is b


def collect(options: Union[None, object, Iterable] = (), keywords: Optional[Mapping] = None) -> Options:
    """:class:`Options` from ``options`` (option objects, one or an iterable, or an
    :class:`Options`) and ``keywords`` (``autoshard()``'s keywords: flat ones such as
    ``train=True`` and dict ones such as ``pipeline={...}``; values equal to the default count as
    not given). A field set differently on both sides is a ``ValueError``.

    Example::

        >>> collect(PrecisionOptions(param="bf16")).precision.param
        'bf16'
        >>> collect(None, {"pipeline": {"axis": "pp"}}).pipeline
        PipelineOptions(axis='pp', microbatches=None, schedule=None, virtual=None, cuts=None)
    """
    if isinstance(options, Options):
        options = options.objects()
    elif options is None:
        options = ()
    elif isinstance(options, OPTION_TYPES):
        options = (options,)
    slots: dict = {}
    for obj in options:
        if not isinstance(obj, OPTION_TYPES):
            raise TypeError(f"options= takes option objects ({', '.join(t.__name__ for t in OPTION_TYPES)}), "
                            f"not {obj!r}")
        if type(obj) in slots:
            raise ValueError(f"options= has two {type(obj).__name__}: give one")
        slots[type(obj)] = obj
    keywords = dict(keywords or {})
    for keyword, cls in _DICT_KEYWORDS.items():
        value = _from_dict(keyword, cls, keywords.pop(keyword, None))
        if value is None:
            continue
        if cls not in slots:
            slots[cls] = value
            continue
        given = {f.name: getattr(value, f.name) for f in fields(cls)}
        slots[cls] = _merge(slots[cls], given, what=lambda k, v, kw=keyword: f"{kw}[{k!r}]={v!r}")
    by_type: dict = {}
    for name, value in keywords.items():
        if name not in FLAT_KEYWORDS:
            raise TypeError(f"autoshard() got an unexpected option {name!r}")
        by_type.setdefault(FLAT_KEYWORDS[name], {})[name] = value
    for cls, given in by_type.items():
        slots[cls] = _merge(slots.get(cls, cls()), given)
    return Options(**{_SLOT[cls]: obj for cls, obj in slots.items()})
