"""Named dims: every tensor dim of every value becomes a list of *atoms* (logical dims).

A dim that a view splits (``[b, s, h*d] -> [b, s, h, d]``) is the concatenation of finer atoms
(major first), so the same logical dim is recognised on both sides of any reshape. Atoms live in
a union-find; unifying two dims aligns their atom lists, refining a coarse atom into finer ones
where the other side is finer. Sharding a dim on a mesh axis means splitting its leading atoms
into contiguous blocks, which is why sharding "heads" shards the rows of ``q_proj.weight``.

Example::

    >>> t = DimTable()
    >>> hd = t.new(32, "hidden")            # one dim of size 32
    >>> h, d = t.new(8, "heads"), t.new(4, "head_dim")
    >>> t.unify([hd], [h, d])               # a view split it into 8 x 4
    True
    >>> [t.size[a] for a in t.leaves([hd])]
    [8, 4]
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from .rules import GETITEM, Indexing, get_path, rule_for, shape_of


class DimTable:
    """Union-find over atoms, with refinement of an atom into a sequence of finer atoms."""

    def __init__(self):
        self.size: list[int] = []
        self.parent: list[int] = []
        self.origin: list[str] = []
        self.children: dict[int, list[int]] = {}
        # leaf_tuple's answers; cleared when a union or refinement changes them. The rewrite and
        # the search ask for the same dims' leaves millions of times once inference is done.
        self._leaf_memo: dict = {}

    def new(self, size: int, origin: str) -> int:
        self.size.append(int(size))
        self.parent.append(len(self.parent))
        self.origin.append(origin)
        return len(self.size) - 1

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def leaves(self, atoms) -> list[int]:
        """Finest atoms (roots) of a dim, major first; size-1 atoms dropped."""
        out = []
        for a in atoms:
            r = self.find(a)
            if r in self.children:
                out += self.leaves(self.children[r])
            elif self.size[r] != 1:
                out.append(r)
        return out

    def leaf_tuple(self, atoms) -> tuple:
        """``tuple(leaves(atoms))``, memoized."""
        key = tuple(atoms)
        lv = self._leaf_memo.get(key)
        if lv is None:
            lv = self._leaf_memo[key] = tuple(self.leaves(key))
        return lv

    def _refine(self, a: int, first: int) -> list[int]:
        self._leaf_memo.clear()
        kids = [self.new(first, self.origin[a] + "/0"), self.new(self.size[a] // first, self.origin[a] + "/1")]
        self.children[a] = kids
        return kids

    def _union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a == b:
            return
        self._leaf_memo.clear()
        if b < a:  # keep the older atom as the root: its origin names the logical dim
            a, b = b, a
        ka, kb = self.children.get(a), self.children.get(b)
        self.parent[b] = a
        if kb is not None:
            del self.children[b]
            if ka is None:
                self.children[a] = kb
            else:
                self.unify(ka, kb)

    @staticmethod
    def alignable(sa: list[int], sb: list[int]) -> bool:
        """Whether two size sequences of equal product align by splitting (never by
        reshuffling): [6] ~ [2, 3] yes, [2, 3] ~ [3, 2] no."""
        sa, sb = list(sa), list(sb)
        while sa and sb:
            x, y = sa.pop(0), sb.pop(0)
            if x == y:
                continue
            if x > y:
                if x % y:
                    return False
                sa.insert(0, x // y)
            else:
                if y % x:
                    return False
                sb.insert(0, y // x)
        return not sa and not sb

    def unify(self, la, lb) -> bool:
        """Make two dims (atom lists of equal total size) the same logical dim."""
        A, B = self.leaves(la), self.leaves(lb)
        if not self.alignable([self.size[a] for a in A], [self.size[b] for b in B]):
            return False
        while A and B:
            a, b = self.find(A.pop(0)), self.find(B.pop(0))
            if a in self.children:
                A = self.leaves([a]) + A
                B.insert(0, b)
                continue
            if b in self.children:
                B = self.leaves([b]) + B
                A.insert(0, a)
                continue
            if a == b:
                continue
            if self.size[a] == self.size[b]:
                self._union(a, b)
            elif self.size[a] > self.size[b]:
                k = self._refine(a, self.size[b])
                self._union(k[0], b)
                A.insert(0, k[1])
            else:
                k = self._refine(b, self.size[a])
                self._union(a, k[0])
                B.insert(0, k[1])
        return True


@dataclass
class DimInfo:
    """Result of inference: atoms of every value's dims, and the names of logical dims."""

    table: DimTable
    dims: dict  # node -> list (per output) of list (per dim) of atom lists
    indexing: dict  # node -> Indexing (nodes with a rule)
    fallback: list  # nodes without a rule
    names: dict = field(default_factory=dict)  # leaf-atom tuple -> user name
    input_dims: dict = field(default_factory=dict)  # "param.fqn:k" -> atoms of that input dim
    recognised: dict = field(default_factory=dict)  # what later passes found in this graph, by pass (MoE regions)

    def of(self, node: fx.Node, out: int = 0) -> list[list[int]]:
        return self.dims[node][out]

    def leaves(self, atoms) -> tuple:
        return self.table.leaf_tuple(atoms)

    def unify(self, la, lb) -> list:
        """Make two dims one logical dim after inference (a later pass found that they are, e.g.
        the experts dims of stacked expert weights that one expert-id tensor selects from); user
        names move to the unified dim. Returns ``[(name, other name)]`` for two different names
        that now name one dim (the caller reports them).

        >>> info = DimInfo(DimTable(), {}, {}, [])
        >>> a, b = info.table.new(4, "a"), info.table.new(4, "b")
        >>> info.names[(b,)] = "experts"
        >>> info.unify([a], [b]), info.dim_name([a])
        ([], 'experts')
        """
        if not self.table.unify(la, lb):
            raise ValueError(f"dims of sizes {[self.table.size[a] for a in self.leaves(la)]} and "
                             f"{[self.table.size[b] for b in self.leaves(lb)]} do not align")
        names, clashes = {}, []
        for lv, n in self.names.items():
            key = self.leaves(lv)
            if names.get(key, n) != n:
                clashes.append((names[key], n))
            else:
                names[key] = n
        self.names.clear()
        self.names.update(names)
        return clashes

    def atom_name(self, a: int) -> str:
        r = self.table.find(a)
        return self.names.get((r,), self.table.origin[r])

    def dim_name(self, atoms) -> str:
        """Readable name of a tensor dim: a user name, or the atoms' names joined by '*'."""
        lv = self.leaves(atoms)
        if not lv:
            return "1"
        if lv in self.names:
            return self.names[lv]
        return "*".join(self.atom_name(a) for a in lv)

    def all_names(self) -> dict:
        """{name: [leaf tuples]} for every user name and every inferred atom name."""
        out: dict[str, list] = {}
        for lv, n in self.names.items():
            out.setdefault(n, []).append(lv)
        for n, atoms in self.input_dims.items():  # a split input dim keeps its whole name too
            lv = self.leaves(atoms)
            if len(lv) > 1 and lv not in self.names:
                out.setdefault(n, []).append(lv)
        seen = {lv[0] for lv in self.names if len(lv) == 1}
        for a in range(len(self.table.size)):
            r = self.table.find(a)
            if r == a and r not in self.table.children and r not in seen and self.table.size[r] > 1:
                out.setdefault(self.table.origin[r], []).append((r,))
        return out

    def lookup(self, pattern: str) -> dict:
        """Names matching ``pattern`` (exact, else fnmatch glob) -> leaf tuples."""
        names = self.all_names()
        if pattern in names:
            return {pattern: names[pattern]}
        return {n: lv for n, lv in names.items() if fnmatch.fnmatchcase(n, pattern)}


def module_of(node: fx.Node) -> str:
    """FQN of the innermost module a node comes from ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def source_line(node: fx.Node) -> str:
    """Last 'File ..., line N, in f' frame of the node's stack trace, shortened."""
    tr = node.meta.get("stack_trace") or ""
    lines = [l.strip() for l in tr.strip().splitlines() if l.strip().startswith("File ")]
    if not lines:
        return ""
    last = lines[-1]
    try:
        path = last.split('"')[1]
        rest = last.split('"')[2]
        lineno = rest.split("line")[1].split(",")[0].strip()
        return f"{path.rsplit('/', 1)[-1]}:{lineno}"
    except IndexError:
        return last


def infer_dims(graph: fx.Graph, placeholder_origin: dict) -> DimInfo:
    """Run every op rule over the graph, unifying atoms. ``placeholder_origin`` maps a
    placeholder name to the prefix used for its inferred dim names (a parameter FQN or an
    argument name)."""
    t = DimTable()
    dims: dict = {}
    indexing: dict = {}
    fallback: list = []
    input_dims: dict = {}

    def fresh(node, shape, role):
        where = module_of(node) or node.name
        return [[t.new(s, f"{where}.{role}{k}")] if s != 1 else [] for k, s in enumerate(shape)]

    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                prefix = placeholder_origin.get(node.name, node.name)
                dims[node] = [[[t.new(s, f"{prefix}:{k}")] if s != 1 else [] for k, s in enumerate(val.shape)]]
                input_dims.update({f"{prefix}:{k}": a for k, a in enumerate(dims[node][0]) if a})
            continue
        if node.op != "call_function":
            continue
        if node.target is GETITEM:
            src, i = node.args
            if src in dims and isinstance(i, int) and i < len(dims[src]):
                dims[node] = [dims[src][i]]
            continue
        outs = list(val) if isinstance(val, (tuple, list)) else [val]
        rule = rule_for(node.target)
        ix: Optional[Indexing] = rule(node) if rule is not None else None
        if ix is None:
            fallback.append(node)
            dims[node] = [fresh(node, o.shape, f"{node.name}.") if isinstance(o, torch.Tensor) else [] for o in outs]
            continue
        indexing[node] = ix
        if ix.kind == "view":
            dims[node] = [_view_dims(t, dims[node.args[0]][0], shape_of(node.args[0]), shape_of(node), node, fresh)]
            continue
        bound: dict = {}
        for path, letters in ix.inputs:
            src = get_path(node, path)
            if src not in dims:
                continue
            for letter, atoms in zip(letters, dims[src][0]):
                if letter is None or not atoms:
                    continue
                if letter in bound:
                    t.unify(bound[letter], atoms)
                else:
                    bound[letter] = atoms
        per_out = []
        for o, letters in zip(outs, ix.outputs):
            if not isinstance(o, torch.Tensor):
                per_out.append([])
                continue
            dl = []
            for k, (letter, s) in enumerate(zip(letters, o.shape)):
                if s == 1:
                    dl.append([])
                elif letter in bound:
                    dl.append(bound[letter])
                else:
                    mod = module_of(node)
                    bound[letter] = [t.new(s, f"{mod}.{node.name}.{letter}" if mod else f"{node.name}.{letter}")]
                    dl.append(bound[letter])
            per_out.append(dl)
        dims[node] = per_out
    return DimInfo(t, dims, indexing, fallback, input_dims=input_dims)


def _view_dims(t: DimTable, in_dims, in_shape, out_shape, node, fresh):
    """Align a reshape group by group (runs of dims with equal products)."""
    out_dims = fresh(node, out_shape, "view")
    i = j = 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, gj = [], []
        pi = po = 1
        # Size-1 dims carry no atoms; take them into the current group freely.
        while True:
            if pi == po and (gi or gj) and pi != 1:
                break
            if (pi <= po or j >= no) and i < ni:
                pi *= in_shape[i]; gi.append(i); i += 1
            elif j < no:
                po *= out_shape[j]; gj.append(j); j += 1
            else:
                break
        a = [x for k in gi for x in in_dims[k]]
        b = [x for k in gj for x in out_dims[k]]
        if pi == po and a and b:
            t.unify(a, b)  # an unalignable group keeps fresh atoms: sharding there gathers
    return out_dims
