"""Marking a collective node with a runtime option, its reason saying why.

The passes after the rewrite (``output_sums``, ``inplace_sums``, ``param_sums``) each turn on an
option of a collective call (``lazy``, ``consume``, ``later``) and add a clause to the reason
the node carries, which the export prints above the call.

Example::

    tag = mark(node, "lazy", LAZY)   # all_reduce(..., tag=7, lazy=True); its reason ends with LAZY
"""
from __future__ import annotations

from torch import fx


def mark(node: fx.Node, option: str, reason: str) -> int:
    """Set ``option=True`` on the collective call ``node``, append ``reason`` to its reason
    (where the rewrite gave it one); returns its tag."""
    node.kwargs = {**node.kwargs, option: True}
    if "autoshard" in node.meta:
        node.meta["autoshard"]["why"] += reason
    return node.kwargs["tag"]
