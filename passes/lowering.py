"""What a lowering may do to the per-rank program: the interface the SPMD rewrite hands to the
passes that write some nodes themselves (vocab-parallel cross-entropy, context-parallel
attention, Mixture-of-Experts regions).

A lowering is a visitor ``visit(lw, node)`` registered for a node through
``spmd.rewrite(regions={node: visit})``. It reads the placements the rewrite gave the node's
inputs, asks for conversions of them, adds nodes to the per-rank graph, records the collectives
its runtime functions run, and binds the node's per-rank value with its placement. It never
reaches into the rewriter: everything goes through :class:`Lowering`, so the rewriter may keep
its bookkeeping as it likes.

Example (a lowering that runs a node's op on its first operand's blocks, as it arrives, and
records the one all-reduce its runtime function does)::

    def visit(lw, node):
        x = node.args[0]
        place = lw.placement(x)
        local = lw.convert(x, place, varying=(), consumer=node, reason="my op works on blocks")
        tag = lw.new_tags(1)
        new = lw.call(my_runtime_fn, (local, "tp"), {"tag": tag}, like=node, place=place)
        lw.record("all_reduce", "tp", nbytes=lw.nbytes(local), phase="forward", node=node, tag=tag,
                  op=my_runtime_fn.__name__, why="my op sums its rows over tp")
        lw.bind(node, new, place)
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import fx

from autoshard.ownership import R
from autoshard.runtime.primitives import collectives as C

from .collective import Collective
from .dims import module_of, source_line


def decides_locally(visit: Callable) -> Callable:
    """Mark lowering ``visit`` as deciding, like an op's rule, from the placements of its node's
    operands and the layout's units of the dims of the values it reads and writes, and as writing
    its nodes whole, with no collective, where every one of those is whole and unsplit. A rewrite
    building no graph may then record such nodes whole before the layout's first touch
    (``passes/untouched.py``) and share or resume its state across layouts
    (``passes/rewrite_state.py``), as for ordinary ops. Returns ``visit``."""
    visit.decides_locally = True
    return visit


def is_local(visit: Callable) -> bool:
    """Whether lowering ``visit`` is marked :func:`decides_locally`."""
    return getattr(visit, "decides_locally", False)


def all_decide_locally(regions: dict) -> bool:
    """Whether every lowering of ``regions`` ({node: visit}) is marked :func:`decides_locally`."""
    return all(is_local(v) for v in regions.values())


class Lowering:
    """The rewrite as a lowering sees it (one per rewrite; see the module docstring).

    Read: :attr:`axes`, :attr:`mesh`, :attr:`layout`, :attr:`info`, :meth:`placement`,
    :meth:`local`, :meth:`desired`, :meth:`fixed`, :meth:`needs_grad`, :meth:`display`,
    :meth:`dim_label`, :meth:`unit_of`, :meth:`choose_modes`, :attr:`collectives`.
    Write: :meth:`convert`, :meth:`call`, :meth:`copy_node`, :meth:`new_tags` (:attr:`next_tag`), :meth:`record`,
    :meth:`mark_varying`, :meth:`bind`; :meth:`visit_rule` writes the node as its rule would.
    """

    def __init__(self, rewriter):
        self._rw = rewriter

    # ------------------------------------------------------------------ reading
    @property
    def axes(self) -> tuple:
        """The mesh's axis names, in mesh order (placements are tuples in this order)."""
        return self._rw.axes

    @property
    def mesh(self):
        return self._rw.mesh

    @property
    def layout(self):
        """The resolved layout (``spmd.Layout``)."""
        return self._rw.layout

    @property
    def info(self):
        """The named dims (``dims.DimInfo``) of the captured graph."""
        return self._rw.info

    @property
    def collectives(self) -> tuple:
        """The collectives recorded so far, in program order (read-only view)."""
        return tuple(self._rw.collectives)

    def placement(self, node: fx.Node, out: int = 0) -> tuple:
        """The placement the rewrite gave output ``out`` of a captured node already written."""
        return self._rw.place[node][out]

    def local(self, node: fx.Node):
        """The per-rank value of a captured node already written, as the rewrite bound it."""
        return self._rw.local[node]

    def desired(self, node: fx.Node, out: int = 0) -> tuple:
        """The placement the layout asks for output ``out`` of ``node``."""
        return self._rw.desired(node, out)

    def fixed(self, name: str) -> Optional[tuple]:
        """The placement another pass fixed for input ``name``, or None."""
        return self._rw.fixed.get(name)

    def needs_grad(self, node: fx.Node) -> bool:
        """Whether ``node`` carries a gradient (depends on a trainable input through float ops)."""
        return node in self._rw.rg

    def display(self, name: str) -> str:
        """The name to show for a placeholder (parameter FQN or argument name)."""
        return self._rw.display.get(name, name)

    def dim_label(self, node: fx.Node, out: int, dim: int) -> str:
        """The logical name of dim ``dim`` of output ``out`` of ``node``."""
        return self._rw.dim_label(node, out, dim)

    def unit_of(self, atoms, axis: str) -> Optional[tuple]:
        """The layout's unit on ``axis`` that a dim of these atoms starts with, or None."""
        return self._rw.unit_of(atoms, axis)

    def choose_modes(self, node: fx.Node, ix) -> list:
        """Per mesh axis, the mode the node's rule would run in: ``("shard", letter)``,
        ``("contract", letter)`` or ``("replicate", None)``."""
        return self._rw.choose_modes(node, ix)

    @staticmethod
    def nbytes(value) -> int:
        """Bytes of a per-rank value (by its meta value; 0 when it has none)."""
        v = value.meta.get("val") if hasattr(value, "meta") else value
        return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0

    # ------------------------------------------------------------------ writing
    def convert(self, src: fx.Node, target: tuple, varying: Iterable = (), consumer: fx.Node = None,
                reason: Union[str, Callable[[], str]] = "", out: int = 0):
        """The per-rank value of ``src`` in placement ``target``, converted (and cached) as for
        any consumer. ``varying``: axes on which the consumer's work differs per rank (a whole
        value read there has its gradient summed)."""
        return self._rw.convert(src, out, tuple(target), set(varying), consumer, reason)

    def call(self, fn, args: tuple = (), kwargs: Optional[dict] = None, *, like: Optional[fx.Node] = None,
             place: Optional[tuple] = None, val=None):
        """Add ``fn(*args, **kwargs)`` to the per-rank graph. ``like``: a captured node whose
        metadata (module, source line) the new node takes, with its value's local shape under
        ``place``; ``val``: the new node's meta value otherwise."""
        new = self._rw.g.call_function(fn, tuple(args), dict(kwargs or {}))
        if like is not None:
            new.meta = {k: v for k, v in like.meta.items() if k != "val"}
            if place is not None and isinstance(like.meta.get("val"), torch.Tensor):
                new.meta["val"] = self.meta_local(like.meta["val"], place)
        if val is not None:
            new.meta["val"] = val
        return new

    def copy_node(self, node: fx.Node, arg_transform: Callable):
        """Copy a captured node into the per-rank graph, its inputs mapped by ``arg_transform``."""
        return self._rw.g.node_copy(node, arg_transform)

    def meta_local(self, val: torch.Tensor, place: tuple) -> torch.Tensor:
        """A meta tensor of ``val``'s local shape under ``place``."""
        return self._rw.meta_local(val, place)

    def new_tags(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive collective tags (they link runtime trace records to the
        plan's entries); returns the first."""
        return self._rw.new_tags(n)

    @property
    def next_tag(self) -> int:
        """The tag the next collective will get (the tags of conversions emitted from here on
        start there)."""
        return self._rw.tag

    def record(self, kind: str, axes, *, nbytes: int, phase: str, node, tag: int, op: str, why: str,
               where: Optional[str] = None, line: Optional[str] = None, params: tuple = ()) -> Collective:
        """Record a collective a runtime function of the program runs. ``kind``: one of
        ``runtime.collectives.COMM_KINDS``; ``axes``: an axis name or a tuple; ``nbytes``: this
        rank's input payload; ``node``: the captured node it moves (``where`` and ``line``
        default to its module and source line)."""
        if kind not in C.COMM_KINDS:
            raise ValueError(f"collective kind {kind!r} is not one of runtime.collectives.COMM_KINDS {C.COMM_KINDS}")
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        name = node.name if isinstance(node, fx.Node) else str(node)
        if isinstance(node, fx.Node):
            where = module_of(node) if where is None else where
            line = source_line(node) if line is None else line
        c = Collective(kind, axes, nbytes, phase, where or "", why, name, line or "", tag, op, tuple(params))
        self._rw.collectives.append(c)
        return c

    def mark_varying(self, value, axis: str, src: fx.Node, consumer: fx.Node, why: str):
        """``value`` (a per-rank value of ``src``) read by per-rank work on ``axis``: identity
        forward, gradient sum backward; recorded with reason ``why``."""
        new = self._rw.emit(C.mark_varying, value, axis, (), src, consumer, why, R, R)
        tag = new.meta["autoshard"]["tag"]
        new.meta["autoshard"]["why"] = why
        for c in self._rw.collectives:
            if c.tag == tag:
                c.why = why
        return new

    def bind(self, node: fx.Node, value, placement: tuple) -> None:
        """Make ``value`` the per-rank value of captured ``node``, in ``placement`` (one tuple
        per mesh axis; a node of several outputs: a list of them)."""
        self._rw.local[node] = value
        self._rw.place[node] = list(placement) if isinstance(placement, list) else [tuple(placement)]

    def visit_rule(self, node: fx.Node) -> None:
        """Write ``node`` as its sharding rule would (a lowering that declines the node)."""
        self._rw.visit_einsum(node, self._rw.info.indexing[node])
