"""Non-persistent buffers of a model built on the meta device, recomputed on the CPU.

A model built under ``torch.device("meta")`` holds no data, and its non-persistent buffers
(RoPE's ``inv_freq`` and ``original_inv_freq``) are in no state dict, so no checkpoint can
supply them. Their values come from the owning module's constructor. :func:`recompute_buffers`
therefore builds each owning module again, on the CPU, with the constructor arguments it keeps
as attributes of the same names (``config`` for Hugging Face modules and this project's example
models; ``dim``, ``base``, ... for modules that store theirs) and takes the buffer from that
fresh copy: the model's own code on the same inputs, so the same bits as in the model built
with real weights. The fresh module is built and dropped one owner at a time; an owner with
parameters allocates them for that moment (a rotary embedding has none).

Floating buffers are cast to the meta buffer's dtype, as ``model.to(dtype)`` after
construction casts them. A buffer whose owner cannot be rebuilt this way (a constructor argument
it does not keep, a constructor that fails, a value of another shape) is a
:class:`RecomputeError` naming the buffer and its module.

Example::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    bufs = recompute_buffers(model, ["model.rotary_emb.inv_freq"])   # {name: CPU tensor}
"""
from __future__ import annotations

import inspect

import torch
from torch import nn


class RecomputeError(ValueError):
    """A buffer of a meta model that cannot be recomputed: one line naming it and its module
    (``fqn``: the buffer), without a hint; the caller knows what else can supply it."""

    def __init__(self, msg: str, fqn: str):
        super().__init__(msg)
        self.fqn = fqn


def non_persistent_buffers(model: nn.Module) -> set:
    """FQNs of ``model``'s buffers that its state dict leaves out (``persistent=False``)."""
    names = set()
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{b}" if prefix else b)
    return names


def _owner_name(fqn: str) -> tuple:
    prefix, _, attr = fqn.rpartition(".")
    return prefix, attr


# constructor arguments that choose where the values are made, not what they are
_PLACEMENT_ARGS = ("device", "dtype")


def _constructor_args(owner: nn.Module, what: str, fqn: str) -> dict:
    """The arguments ``type(owner)`` was built with, read back from the attributes of the same
    names that the module keeps (``config`` for Hugging Face modules; ``dim``, ``base``, ... for
    modules that store their arguments). A parameter it does not keep is refused unless it only
    places the result (``device``, ``dtype``: left at their defaults, the CPU and torch's default)."""
    cls = type(owner)
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    args, lost = {}, []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in owner.__dict__:  # a plain attribute: what the constructor stored
            args[p.name] = getattr(owner, p.name)
        elif p.default is p.empty or p.name not in _PLACEMENT_ARGS:
            lost.append(p.name)
    if lost:
        raise RecomputeError(f"{what} is on the meta device and in no state dict, and {cls.__name__} keeps no "
                             f"attribute for its constructor argument(s) {', '.join(lost)} to rebuild it from "
                             f"(a module that keeps them, as self.config = config in Hugging Face modules, is "
                             f"rebuilt from them)", fqn)
    return args


def _rebuild(owner: nn.Module, where: str, fqn: str) -> nn.Module:
    """A fresh copy of ``owner``, built on the CPU by its own constructor from the arguments it keeps."""
    cls = type(owner)
    what = f"buffer {fqn} of {where} ({cls.__name__})"
    args = _constructor_args(owner, what, fqn)
    try:
        with torch.device("cpu"):  # overrides a caller's torch.device("meta") context
            return cls(**args)
    except Exception as e:  # noqa: BLE001 - the constructor's own error, on one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise RecomputeError(f"{what} is on the meta device and in no state dict, and rebuilding "
                             f"{cls.__name__}({', '.join(args)}) on the CPU failed: {type(e).__name__}: "
                             f"{first}", fqn) from None


def recompute_buffers(model: nn.Module, names) -> dict:
    """``{fqn: CPU tensor}`` for the (meta) buffers ``names`` of ``model``, each taken from a
    fresh copy of its owning module built on the CPU from the owner's ``config``; raises
    :class:`RecomputeError` naming the buffer and module when that is not possible.

    Example::

        recompute_buffers(meta_llama, ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"])
    """
    by_owner: dict = {}
    for fqn in names:
        by_owner.setdefault(_owner_name(fqn)[0], []).append(fqn)
    out = {}
    for prefix, fqns in by_owner.items():
        owner = model.get_submodule(prefix)
        where = prefix or "the model"
        fresh = _rebuild(owner, where, fqns[0])
        for fqn in fqns:
            attr = _owner_name(fqn)[1]
            want = owner.get_buffer(attr)
            got = fresh._buffers.get(attr)
            if not isinstance(got, torch.Tensor) or got.is_meta:
                raise RecomputeError(f"buffer {fqn} of {where} ({type(owner).__name__}): a fresh "
                                     f"{type(owner).__name__} built on the CPU has no tensor {attr!r}", fqn)
            if got.shape != want.shape:
                raise RecomputeError(f"buffer {fqn} of {where} ({type(owner).__name__}): a fresh "
                                     f"{type(owner).__name__} has it as {list(got.shape)}, the model as "
                                     f"{list(want.shape)} (the module was changed after it was built)", fqn)
            if got.dtype != want.dtype:
                if not (got.is_floating_point() and want.is_floating_point()):
                    raise RecomputeError(f"buffer {fqn} of {where} ({type(owner).__name__}): a fresh copy has "
                                         f"it as {got.dtype}, the model as {want.dtype}", fqn)
                got = got.to(want.dtype)  # what model.to(dtype) did to the model's own copy
            out[fqn] = got.detach().contiguous()
        del fresh
    return out
