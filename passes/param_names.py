"""Readable names for the dims of parameters nobody named, so the layout search can shard them.

With only the inputs named (``dims={"input_ids": "batch seq"}``) the search would see two
names and could not find tensor parallelism. :func:`name_parameter_dims` names every unnamed
dim of a trainable parameter after its module, with the repeated-block index dropped (so one name
covers the same projection in every block, as a user's ``"*.q_proj.weight": "heads hidden"``
does) and the dim's role in the op that reads the parameter: ``out`` when it survives into that
op's result (a projection's output features), ``in`` when it is contracted or looked up.

====================================  ====================================================
parameter dim                          name
====================================  ====================================================
``layers.0.self_attn.q_proj.weight:0``  ``self_attn.q_proj.out`` (heads x head_dim)
``layers.3.mlp.down_proj.weight:1``     ``mlp.gate_proj.out`` (already named by gate_proj: ffn)
``h.0.attn.c_attn.weight:1``            ``attn.c_attn.out`` (Conv1D: [in, out])
``embed_tokens.weight:1``               ``embed_tokens.out`` (the residual stream's hidden)
====================================  ====================================================

A dim unified with an already named one keeps that name (dataflow makes ``down_proj``'s input
the ``gate_proj`` output). Example::

    >>> info = infer_dims(cap.graph, origins); apply_dim_names(info, cap, {"input_ids": "batch seq"})  # doctest: +SKIP
    >>> sorted(name_parameter_dims(info, cap.graph, cap.inputs))[:2]                  # doctest: +SKIP
    ['embed_tokens.in', 'embed_tokens.out']
"""
from __future__ import annotations

import re

from torch import fx

_BLOCK_INDEX = re.compile(r"^(?:.*?\.)?\d+\.")  # "layers.0." / "model.h.11." up to the first index


def module_label(fqn: str) -> str:
    """A parameter's module path, without the parameter name and the leading block index.

    >>> module_label("layers.0.self_attn.q_proj.weight"), module_label("lm_head.weight")
    ('self_attn.q_proj', 'lm_head')
    """
    mod = fqn.rsplit(".", 1)[0] if "." in fqn else fqn
    return _BLOCK_INDEX.sub("", mod + ".").rstrip(".") or mod


def _role(info, param: fx.Node, dim: int) -> str:
    """``out`` if the dim survives into the result of the first op reading the parameter."""
    lv = info.leaves(info.of(param)[dim])
    for user in param.users:
        if user not in info.indexing or user not in info.dims:
            continue
        outs = info.of(user, 0)
        return "out" if any(info.leaves(a) == lv for a in outs if a) else "in"
    return f"d{dim}"


def name_parameter_dims(info, graph: fx.Graph, inputs) -> list:
    """Name every unnamed dim of a trainable parameter (see the module docstring), in place in
    ``info.names``; returns the names added. Parameters of rank 2 and more go first, so a
    projection, not a norm weight or a bias, names the dims they share."""
    targets = {i.name: i.target for i in inputs if i.kind == "parameter" and getattr(i, "trainable", True)}
    params = [n for n in graph.nodes if n.op == "placeholder" and n.name in targets and n in info.dims]
    params.sort(key=lambda n: len(info.of(n)) < 2)  # stable: matrices first, in program order
    taken = set(info.names.values())
    added = []
    for p in params:
        label = module_label(targets[p.name])
        for d, atoms in enumerate(info.of(p)):
            lv = info.leaves(atoms) if atoms else ()
            if not lv or lv in info.names:
                continue
            name = f"{label}.{_role(info, p, d)}"
            if name in taken and name not in added:
                continue  # a user's name: never reuse it for another dim
            info.names[lv] = name
            if name not in added:
                added.append(name)
            taken.add(name)
    return added
