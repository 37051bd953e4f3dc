"""The property tests' random programs: a seeded generator of small ``nn.Module`` programs
(matmuls / linears / bmm, broadcasting elementwise ops, reductions, split/merge reshapes,
transposes, softmax and embeddings) with every input and parameter dim named, random layouts
for them, and the oracle that predicts, independently of the library, whether a layout is valid.
Used by ``tests/test_property.py`` and ``tests/test_fuzz_exact.py``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_NUMEL = 2048
MESHES = [{"x": 2}, {"x": 4}, {"a": 2, "b": 2}]

COMMON_SIZES = [4, 8, 12, 16]  # divisible by 2 and 4
ODD_SIZES = [2, 6]  # divisible by 2, not by 4
RARE_SIZES = [3]  # divisible by neither

# =========================================================================== the generator
# A symbolic tensor: per tensor dim, the tuple of atoms (logical dims, major first) it holds.
# () is a size-1 dim (keepdim), a tuple of several atoms a merged dim.


@dataclass
class Sym:
    dims: list
    bounded: bool = False  # values in [-1, 1] or so (exp is safe on them)


@dataclass
class Program:
    seed: int
    sizes: dict = field(default_factory=dict)  # atom name -> size
    children: dict = field(default_factory=dict)  # atom split by a reshape -> (major, minor) atoms
    steps: list = field(default_factory=list)  # (op, *args); result index = position in env
    syms: list = field(default_factory=list)  # Sym of each env value
    params: dict = field(default_factory=dict)  # FQN -> dims (list of atom tuples)
    embeddings: dict = field(default_factory=dict)  # module name -> (vocab atom, hidden atom)
    inputs: dict = field(default_factory=dict)  # arg name -> dims
    # Dims of every tensor whose placement the pass derives from the layout: inputs, parameters
    # and the result of every op except reshapes (a reshape's result takes its input's shards
    # that survive the regrouping, so it never holds a conflict of its own).
    checked: list = field(default_factory=list)
    consumed: set = field(default_factory=set)
    outputs: list = field(default_factory=list)
    loss_kinds: list = field(default_factory=list)
    source: list = field(default_factory=list)

    # ---------------------------------------------------------------- shapes
    def size_of(self, d: tuple) -> int:
        return math.prod(self.sizes[a] for a in d)

    def shape(self, dims) -> list:
        return [self.size_of(d) for d in dims]

    def numel(self, dims) -> int:
        return math.prod(self.shape(dims))

    def leaves(self, d: tuple) -> tuple:
        """The finest atoms of a dim (a reshape may have split one of its atoms)."""
        out = ()
        for a in d:
            out += self.leaves(self.children[a]) if a in self.children else (a,)
        return out

    def names(self) -> list:
        """Atoms the user names: those that are a whole dim of an input or a parameter."""
        named = {d[0] for dims in list(self.inputs.values()) + list(self.params.values()) for d in dims if len(d) == 1}
        return [a for a in self.sizes if a in named]

    def dims_spec(self, dims) -> str:
        """Names for ``dims``: a single atom is named, a size-1 or merged dim is left to dataflow."""
        return " ".join(d[0] if len(d) == 1 else "-" for d in dims)

    def dims_arg(self) -> dict:
        spec = {name: self.dims_spec(d) for name, d in self.inputs.items()}
        spec.update({fqn: self.dims_spec(d) for fqn, d in self.params.items()})
        return spec


class Gen:
    """Builds a random :class:`Program` from ``random.Random(seed)``."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.p = Program(seed)

    # ---------------------------------------------------------------- helpers
    def new_atom(self, limit: int = MAX_NUMEL) -> str | None:
        r = self.r
        roll = r.random()
        pool = COMMON_SIZES if roll < 0.8 else ODD_SIZES if roll < 0.95 else RARE_SIZES
        used = set(self.p.sizes.values())
        fits = [s for s in pool if s <= limit]
        if not fits:
            fits = [s for s in COMMON_SIZES + ODD_SIZES + RARE_SIZES if s <= limit]
        if not fits:
            return None
        fresh = [s for s in fits if s not in used]
        size = r.choice(fresh if fresh and r.random() < 0.7 else fits)
        name = f"d{len(self.p.sizes)}"
        self.p.sizes[name] = size
        return name

    def add(self, sym: Sym, step: tuple, src: str, *, view: bool = False, consumed=()) -> int:
        p = self.p
        p.steps.append(step)
        p.syms.append(sym)
        if not view:
            p.checked.append(list(sym.dims))
        p.consumed.update(consumed)
        k = len(p.syms) - 1
        p.source.append(f"v{k} = {src}")
        return k

    def param(self, dims, prefix="w") -> str:
        name = f"{prefix}{len(self.p.params)}"
        self.p.params[name] = list(dims)
        self.p.checked.append(list(dims))
        return name

    def pick(self, pred=lambda s: True) -> int | None:
        """A value satisfying ``pred``, preferring the newest and unconsumed ones."""
        cands = [k for k, s in enumerate(self.p.syms) if pred(s)]
        if not cands:
            return None
        fresh = [k for k in cands if k not in self.p.consumed]
        if fresh and self.r.random() < 0.8:
            return max(fresh) if self.r.random() < 0.6 else self.r.choice(fresh)
        return self.r.choice(cands)

    # ---------------------------------------------------------------- program
    def build(self) -> Program:
        r, p = self.r, self.p
        # Sources: a float input x, and sometimes an embedding of an int input.
        nd = r.choice([2, 2, 3])
        xdims = []
        for _ in range(nd):
            a = self.new_atom(limit=max(2, 512 // max(1, p.numel(xdims))))
            xdims.append((a,))
        p.inputs["x"] = xdims
        p.checked.append(list(xdims))
        p.syms.append(Sym(xdims))
        p.steps.append(("input", "x"))
        p.source.append("v0 = x")
        if r.random() < 0.5:
            idims = [(self.new_atom(limit=16),) for _ in range(r.choice([1, 2]))]
            v, h = self.new_atom(limit=16), self.new_atom(limit=max(2, 256 // p.numel(idims)))
            p.inputs["idx"] = idims
            p.checked.append(list(idims))
            p.embeddings["emb"] = (v, h)
            p.params["emb.weight"] = [(v,), (h,)]
            p.checked.append([(v,), (h,)])
            self.add(Sym(idims + [(h,)]), ("embedding", "emb"), "self.emb(idx)")
        n_ops = r.randint(3, 7)
        ops = [self.op_linear, self.op_bmm, self.op_attention, self.op_binary_param, self.op_binary_act,
               self.op_scalar, self.op_unary, self.op_reduce, self.op_merge, self.op_split, self.op_split_atom,
               self.op_transpose, self.op_softmax]
        weights = [5, 2, 1.5, 3, 1.5, 1.5, 3, 2, 2, 2, 1.5, 2, 2]
        done = tries = 0
        while done < n_ops and tries < 100:
            tries += 1
            if r.choices(ops, weights)[0]():
                done += 1
        for _ in range(20):  # every program has a gradient to check
            if p.params:
                break
            self.op_linear() or self.op_binary_param()
        assert p.params, f"program {p.seed} has no parameter"
        self.finish()
        return p

    def finish(self):
        """Outputs: tanh of every value nobody consumed; loss: sum of their means (or sums)."""
        p = self.p
        leaves = [k for k in range(len(p.syms)) if k not in p.consumed and p.steps[k][0] != "input"]
        if not leaves:
            leaves = [len(p.syms) - 1]
        for k in leaves:
            dims = p.syms[k].dims
            p.checked.append(list(dims))  # tanh(v)
            p.outputs.append(k)
            p.loss_kinds.append(self.r.choice(["mean", "mean", "sum"]))
        p.checked.append([])

    # ---------------------------------------------------------------- ops
    def op_linear(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: s.dims and s.dims[-1])
        if k is None:
            return False
        dims = p.syms[k].dims
        rest = p.numel(dims[:-1])
        kdim = dims[-1]
        # Sometimes reuse a parameter (a second use, e.g. a tied embedding as the output
        # projection): its gradient sums two uses that may need different conversions.
        reuse = [(f, "linear") for f, d in p.params.items() if len(d) == 2 and d[1] == kdim and len(d[0]) == 1] + \
                [(f, "matmul") for f, d in p.params.items() if len(d) == 2 and d[0] == kdim and len(d[1]) == 1]
        reuse = [(f, v) for f, v in reuse if rest * p.numel([p.params[f][0 if v == "linear" else 1]]) <= MAX_NUMEL]
        if reuse and r.random() < 0.4:
            w, how = r.choice(reuse)
            if how == "linear":
                out = dims[:-1] + [p.params[w][0]]
                return self.add(Sym(out), ("linear", k, w, None), f"F.linear(v{k}, self.{w})", consumed=[k]) is not None
            out = dims[:-1] + [p.params[w][1]]
            return self.add(Sym(out), ("matmul", k, w, False), f"torch.matmul(v{k}, self.{w})",
                            consumed=[k]) is not None
        n = self.new_atom(limit=MAX_NUMEL // max(rest, p.numel([kdim])))
        if n is None:
            return False
        out = dims[:-1] + [(n,)]
        variant = r.choice(["matmul", "at", "linear", "linear_bias", "mm", "tanh_w", "vec"])
        if variant == "mm" and len(dims) != 2:
            variant = "matmul"
        if variant == "vec" and len(dims) >= 2:  # value @ 1-D weight: contracts the last dim away
            w = self.param([kdim])
            return self.add(Sym(dims[:-1]), ("matmul", k, w, False), f"torch.matmul(v{k}, self.{w})",
                            consumed=[k]) is not None
        if variant == "vec":
            variant = "at"
        if variant in ("linear", "linear_bias"):
            w = self.param([(n,), kdim])
            b = self.param([(n,)], "b") if variant == "linear_bias" else None
            src = f"F.linear(v{k}, self.{w}" + (f", self.{b})" if b else ")")
            return self.add(Sym(out), ("linear", k, w, b), src, consumed=[k]) is not None
        w = self.param([kdim, (n,)])
        if variant == "tanh_w":  # a parameter-derived activation as the right operand
            p.checked.append([kdim, (n,)])
            return self.add(Sym(out), ("matmul", k, w, True), f"v{k} @ torch.tanh(self.{w})", consumed=[k]) is not None
        op = {"matmul": "torch.matmul({}, {})", "at": "{} @ {}", "mm": "torch.mm({}, {})"}[variant]
        return self.add(Sym(out), (variant, k, w, False), op.format(f"v{k}", f"self.{w}"), consumed=[k]) is not None

    def op_bmm(self) -> bool:
        """A batched matmul with a 3-D weight: torch.bmm on a 3-D value, or torch.matmul
        broadcasting a 2-D value over the weight's batch dim."""
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) in (2, 3) and all(s.dims))
        if k is None:
            return False
        dims = p.syms[k].dims
        if len(dims) == 3:
            b, s, kd = dims
            n = self.new_atom(limit=MAX_NUMEL // max(p.numel([b, s]), p.numel([b, kd])))
            if n is None:
                return False
            w = self.param([b, kd, (n,)])
            return self.add(Sym([b, s, (n,)]), ("bmm", k, w), f"torch.bmm(v{k}, self.{w})", consumed=[k]) is not None
        s, kd = dims
        b = self.new_atom(limit=MAX_NUMEL // max(p.numel([s]), p.numel([kd])) // 2)
        if b is None:
            return False
        n = self.new_atom(limit=MAX_NUMEL // max(p.numel([s, (b,)]), p.numel([(b,), kd])))
        if n is None:
            return False
        w = self.param([(b,), kd, (n,)])
        return self.add(Sym([(b,), s, (n,)]), ("matmul", k, w, False), f"torch.matmul(v{k}, self.{w})",
                        consumed=[k]) is not None

    def op_attention(self) -> bool:
        """q, k, v projections of one value; scores = q @ k^T (one logical dim twice in one
        tensor), softmax, @ v."""
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) in (2, 3) and all(s.dims))
        if k is None:
            return False
        dims = p.syms[k].dims
        lead, sd, hd = dims[:-2], dims[-2], dims[-1]
        if p.numel(lead + [sd, sd]) > MAX_NUMEL:
            return False
        e = self.new_atom(limit=MAX_NUMEL // max(p.numel(lead + [sd]), p.numel([hd])))
        if e is None:
            return False
        wq, wk, wv = (self.param([hd, (e,)]) for _ in range(3))
        q = self.add(Sym(lead + [sd, (e,)]), ("matmul", k, wq, False), f"v{k} @ self.{wq}", consumed=[k])
        kk = self.add(Sym(lead + [sd, (e,)]), ("matmul", k, wk, False), f"v{k} @ self.{wk}")
        v = self.add(Sym(lead + [sd, (e,)]), ("matmul", k, wv, False), f"v{k} @ self.{wv}")
        p.checked.append(lead + [(e,), sd])  # k^T
        if len(lead) == 1 and r.random() < 0.5:  # torch.bmm on two activations
            sc = self.add(Sym(lead + [sd, sd]), ("bscores", q, kk), f"torch.bmm(v{q}, v{kk}.transpose(1, 2))",
                          consumed=[q, kk])
        else:
            sc = self.add(Sym(lead + [sd, sd]), ("scores", q, kk), f"v{q} @ v{kk}.transpose(-2, -1)",
                          consumed=[q, kk])
        sm = self.add(Sym(lead + [sd, sd], True), ("softmax", sc, -1), f"torch.softmax(v{sc}, -1)", consumed=[sc])
        self.add(Sym(lead + [sd, (e,)]), ("amatmul", sm, v), f"v{sm} @ v{v}", consumed=[sm, v])
        return True

    def op_binary_param(self) -> bool:
        """value (op) parameter, the parameter broadcasting: fewer dims and/or size-1 dims."""
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 1)
        if k is None:
            return False
        dims = p.syms[k].dims
        nsuf = r.randint(1, len(dims))
        pd = [d if (d and r.random() < 0.75) else () for d in dims[len(dims) - nsuf:]]
        if not any(pd) and r.random() < 0.7:
            return False
        if r.random() < 0.2 and nsuf < len(dims):  # a leading size-1 dim too
            pd = [()] + pd
        w = self.param(pd, "c")
        op = r.choice(["add", "sub", "mul", "div"])
        swap = r.random() < 0.3 and op != "div"
        if op == "div":  # by a positive parameter-derived tensor
            p.checked.append(pd)
            return self.add(Sym(list(dims)), ("binp", op, k, w, False), f"v{k} / torch.exp(self.{w})",
                            consumed=[k]) is not None
        sym = {"add": "+", "sub": "-", "mul": "*"}[op]
        a, b = (f"self.{w}", f"v{k}") if swap else (f"v{k}", f"self.{w}")
        return self.add(Sym(list(dims), p.syms[k].bounded and op == "mul"), ("binp", op, k, w, swap),
                        f"{a} {sym} {b}", consumed=[k]) is not None

    def op_binary_act(self) -> bool:
        """Two activations with the same dims (or one a broadcastable suffix of the other)."""
        r, p = self.r, self.p
        pairs = []
        for i, si in enumerate(p.syms):
            for j, sj in enumerate(p.syms):
                if i != j and len(sj.dims) <= len(si.dims) and sj.dims == si.dims[len(si.dims) - len(sj.dims):] \
                        and sj.dims:
                    pairs.append((i, j))
        if not pairs:
            return False
        fresh = [(i, j) for i, j in pairs if i not in p.consumed or j not in p.consumed]
        i, j = r.choice(fresh or pairs)
        op = r.choice(["add", "sub", "mul"])
        sym = {"add": "+", "sub": "-", "mul": "*"}[op]
        return self.add(Sym(list(p.syms[i].dims)), ("bina", op, i, j), f"v{i} {sym} v{j}", consumed=[i, j]) is not None

    def op_scalar(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 1)
        if k is None:
            return False
        op = r.choice(["add", "sub", "mul", "rsub", "div"])
        c = r.choice([0.5, 1.5, 2.0])
        src = {"add": f"v{k} + {c}", "sub": f"v{k} - {c}", "mul": f"v{k} * {c}", "rsub": f"{c} - v{k}",
               "div": f"v{k} / {c}"}[op]
        return self.add(Sym(list(p.syms[k].dims)), ("scalar", op, k, c), src, consumed=[k]) is not None

    def op_unary(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 1)
        if k is None:
            return False
        fn = r.choice(["tanh", "relu", "silu", "sigmoid", "exp"])
        if fn == "exp" and not p.syms[k].bounded:
            fn = "tanh"
        return self.add(Sym(list(p.syms[k].dims), fn in ("tanh", "sigmoid")), ("unary", fn, k),
                        f"{'F' if fn == 'silu' else 'torch'}.{fn}(v{k})", consumed=[k]) is not None

    def op_reduce(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 2)
        if k is None:
            return False
        dims = p.syms[k].dims
        keep = r.random() < 0.4
        fn = r.choice(["sum", "mean"])
        if len(dims) >= 3 and r.random() < 0.25:  # over two dims at once
            red = sorted(r.sample(range(len(dims)), 2))
            out = [() if j in red else d for j, d in enumerate(dims)] if keep else \
                [d for j, d in enumerate(dims) if j not in red]
            dd = tuple(red)
            return self.add(Sym(out), ("reduce", fn, k, dd, keep), f"v{k}.{fn}({dd}, keepdim={keep})",
                            consumed=[k]) is not None
        d = r.randrange(len(dims))
        out = dims[:d] + [()] + dims[d + 1:] if keep else dims[:d] + dims[d + 1:]
        dd = d - len(dims) if r.random() < 0.3 else d
        return self.add(Sym(out), ("reduce", fn, k, dd, keep), f"v{k}.{fn}({dd}, keepdim={keep})",
                        consumed=[k]) is not None

    def op_merge(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 2)
        if k is None:
            return False
        dims = p.syms[k].dims
        i = r.randrange(len(dims) - 1)
        out = dims[:i] + [dims[i] + dims[i + 1]] + dims[i + 2:]
        shape = p.shape(out)
        return self.add(Sym(out, p.syms[k].bounded), ("reshape", k, shape), f"v{k}.reshape({shape})", view=True,
                        consumed=[k]) is not None

    def op_split(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: any(len(d) >= 2 for d in s.dims))
        if k is None:
            return False
        dims = p.syms[k].dims
        i = r.choice([j for j, d in enumerate(dims) if len(d) >= 2])
        cut = r.randint(1, len(dims[i]) - 1)
        out = dims[:i] + [dims[i][:cut], dims[i][cut:]] + dims[i + 1:]
        shape = p.shape(out)
        return self.add(Sym(out, p.syms[k].bounded), ("reshape", k, shape), f"v{k}.reshape({shape})", view=True,
                        consumed=[k]) is not None

    def op_split_atom(self) -> bool:
        """[.., n, ..] -> [.., n0, n1, ..]: a named dim split into two atoms nobody named
        (sharding n then shards n0 if n0 alone divides by the axis, else neither)."""
        r, p = self.r, self.p
        ok = lambda d: len(d) == 1 and (d[0] in p.children or p.sizes[d[0]] in (4, 6, 8, 12, 16))
        k = self.pick(lambda s: any(ok(d) for d in s.dims))
        if k is None:
            return False
        dims = p.syms[k].dims
        i = r.choice([j for j, d in enumerate(dims) if ok(d)])
        a = dims[i][0]
        if a not in p.children:
            n = p.sizes[a]
            f = r.choice([f for f in range(2, n) if n % f == 0])
            kids = (f"d{len(p.sizes)}", f"d{len(p.sizes) + 1}")
            p.sizes[kids[0]], p.sizes[kids[1]] = f, n // f
            p.children[a] = kids
        c0, c1 = p.children[a]
        out = dims[:i] + [(c0,), (c1,)] + dims[i + 1:]
        shape = p.shape(out)
        return self.add(Sym(out, p.syms[k].bounded), ("reshape", k, shape), f"v{k}.reshape({shape})", view=True,
                        consumed=[k]) is not None

    def op_transpose(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 2)
        if k is None:
            return False
        dims = p.syms[k].dims
        if len(dims) >= 3 and r.random() < 0.5:
            perm = list(range(len(dims)))
            while perm == sorted(perm):
                r.shuffle(perm)
            return self.add(Sym([dims[j] for j in perm], p.syms[k].bounded), ("permute", k, perm),
                            f"v{k}.permute({perm})", consumed=[k]) is not None
        a, b = r.sample(range(len(dims)), 2)
        out = list(dims)
        out[a], out[b] = out[b], out[a]
        return self.add(Sym(out, p.syms[k].bounded), ("transpose", k, a, b), f"v{k}.transpose({a}, {b})",
                        consumed=[k]) is not None

    def op_softmax(self) -> bool:
        r, p = self.r, self.p
        k = self.pick(lambda s: len(s.dims) >= 1)
        if k is None:
            return False
        d = r.randrange(len(p.syms[k].dims))
        return self.add(Sym(list(p.syms[k].dims), True), ("softmax", k, d), f"torch.softmax(v{k}, {d})",
                        consumed=[k]) is not None


# =========================================================================== the module


def run_steps(mod, p: Program, x, idx=None):
    """The program's forward: its steps on ``x`` (and ``idx``); returns (loss, *outputs)."""
    env = []
    binop = {"add": torch.add, "sub": torch.sub, "mul": torch.mul}
    for step in p.steps:
        op = step[0]
        if op == "input":
            v = x
        elif op == "embedding":
            v = getattr(mod, step[1])(idx)
        elif op in ("matmul", "at", "mm"):
            _, k, w, pre = step
            wt = mod.get_parameter(w)
            if pre:
                wt = torch.tanh(wt)
            v = torch.matmul(env[k], wt) if op == "matmul" else env[k] @ wt if op == "at" else torch.mm(env[k], wt)
        elif op == "linear":
            _, k, w, b = step
            v = F.linear(env[k], mod.get_parameter(w), mod.get_parameter(b) if b else None)
        elif op == "bmm":
            v = torch.bmm(env[step[1]], mod.get_parameter(step[2]))
        elif op == "scores":
            v = env[step[1]] @ env[step[2]].transpose(-2, -1)
        elif op == "bscores":
            v = torch.bmm(env[step[1]], env[step[2]].transpose(1, 2))
        elif op == "amatmul":
            v = env[step[1]] @ env[step[2]]
        elif op == "binp":
            _, o, k, w, swap = step
            a, b = env[k], mod.get_parameter(w)
            v = a / torch.exp(b) if o == "div" else binop[o](b, a) if swap else binop[o](a, b)
        elif op == "bina":
            v = binop[step[1]](env[step[2]], env[step[3]])
        elif op == "scalar":
            _, o, k, c = step
            t = env[k]
            v = {"add": lambda: t + c, "sub": lambda: t - c, "mul": lambda: t * c, "rsub": lambda: c - t,
                 "div": lambda: t / c}[o]()
        elif op == "unary":
            v = {"tanh": torch.tanh, "relu": torch.relu, "silu": F.silu, "sigmoid": torch.sigmoid,
                 "exp": torch.exp}[step[1]](env[step[2]])
        elif op == "reduce":
            _, fn, k, d, keep = step
            v = getattr(env[k], fn)(d, keepdim=keep)
        elif op == "reshape":
            v = env[step[1]].reshape(step[2])
        elif op == "permute":
            v = env[step[1]].permute(step[2])
        elif op == "transpose":
            v = env[step[1]].transpose(step[2], step[3])
        elif op == "softmax":
            v = torch.softmax(env[step[1]], step[2])
        else:
            raise AssertionError(op)
        env.append(v)
    outs = [torch.tanh(env[k]) for k in p.outputs]
    loss = sum(o.mean() if kind == "mean" else o.sum() for o, kind in zip(outs, p.loss_kinds))
    return (loss, *outs)


class _Base(nn.Module):
    def __init__(self, p: Program):
        super().__init__()
        self.prog = p
        g = torch.Generator().manual_seed(p.seed)
        for fqn, dims in p.params.items():
            if "." in fqn:
                continue
            setattr(self, fqn, nn.Parameter(torch.randn(p.shape(dims), generator=g) * 0.5))
        for name, (v, h) in p.embeddings.items():
            emb = nn.Embedding(p.sizes[v], p.sizes[h])
            with torch.no_grad():
                emb.weight.copy_(torch.randn(emb.weight.shape, generator=g) * 0.5)
            setattr(self, name, emb)


class ProgX(_Base):
    def forward(self, x):
        return run_steps(self, self.prog, x)


class ProgXIdx(_Base):
    def forward(self, x, idx):
        return run_steps(self, self.prog, x, idx)


def make_args(p: Program, seed: int) -> tuple:
    """Seeded example inputs of the program's shapes."""
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(p.shape(p.inputs["x"]), generator=g) * 0.5]
    if "idx" in p.inputs:
        v = p.embeddings["emb"][0]
        args.append(torch.randint(0, p.sizes[v], p.shape(p.inputs["idx"]), generator=g))
    return tuple(args)


def make(seed: int):
    """(program, model, args). Plans are captured with other inputs of the same shapes
    (``make_args(p, seed + 20_000)``): nothing of the example inputs may leak into a plan."""
    p = Gen(seed).build()
    model = ProgXIdx(p) if "idx" in p.inputs else ProgX(p)
    return p, model, make_args(p, 10_000 + seed)


def program_source(p: Program) -> str:
    """The program written out as Python, for failure messages."""
    lines = [f"# program seed {p.seed}; sizes {p.sizes}",
             "# params: " + ", ".join(f"{f}{p.shape(d)} '{p.dims_spec(d)}'" for f, d in p.params.items()),
             "# inputs: " + ", ".join(f"{n}{p.shape(d)} '{p.dims_spec(d)}'" for n, d in p.inputs.items())]
    lines += p.source
    outs = [f"torch.tanh(v{k})" for k in p.outputs]
    lines.append("outs = [" + ", ".join(outs) + "]")
    lines.append("loss = " + " + ".join(f"outs[{i}].{kind}()" for i, kind in enumerate(p.loss_kinds)))
    lines.append("return (loss, *outs)")
    return "\n".join(lines)


# =========================================================================== layouts and the oracle


def random_layout(r: random.Random, p: Program):
    """(mesh, layout): a random mesh and a layout of 1-3 named dims, now and then an invalid one."""
    mesh = r.choice(MESHES)
    names = p.names()
    k = r.choices([1, 2, 3], [0.45, 0.4, 0.15])[0]
    chosen = r.sample(names, min(k, len(names)))
    layout = {}
    axes = list(mesh)
    for name in chosen:
        roll = r.random()
        if roll < 0.08:
            layout[name] = None
        elif len(axes) == 2 and roll < 0.25:
            layout[name] = ("a", "b") if r.random() < 0.8 else ("b", "a")
        else:
            a = r.choice(axes)
            layout[name] = a if r.random() < 0.7 else (a,)
    roll = r.random()
    if roll < 0.03:
        layout["nosuchdim"] = axes[0]
    elif roll < 0.06:
        layout[r.choice(names)] = "y"
    return mesh, layout


def axes_of(v) -> tuple:
    """A layout entry's axes as a tuple (None: none; a name: that one)."""
    return () if v is None else (v,) if isinstance(v, str) else tuple(v)


def predict_units(p: Program, mesh: dict, layout: dict) -> dict:
    """Sharding a dim on an axis splits its leading atoms: the unit of a name on an axis is the
    shortest prefix of its atoms whose size the axes so far (in the layout's order) divide. A
    tensor dim is sharded on the axis when its atoms start with a unit of the axis."""
    units = {a: [] for a in mesh}
    for key, v in layout.items():
        atoms, degree = p.leaves((key,)), 1
        for a in axes_of(v):
            degree *= mesh[a]
            k = 1
            while math.prod(p.sizes[x] for x in atoms[:k]) % degree:
                k += 1
            units[a].append(atoms[:k])
    return units


def predict(p: Program, mesh: dict, layout: dict):
    """(kind, details) the library must raise, or (None, None) for a valid layout."""
    names = set(p.names())
    for key, v in layout.items():
        axes = axes_of(v)
        if any(a not in mesh for a in axes):
            return "unknown_axis", key
        if len(set(axes)) != len(axes):
            return "repeat_axis", key
        if key not in names:
            return "unknown_dim", key
        degree = 1
        for a in axes:
            degree *= mesh[a]
            if p.sizes[key] % degree:
                return "divisibility", key
    units = predict_units(p, mesh, layout)
    conflicts = []
    for dims in p.checked:
        for a, us in units.items():
            hits = [d for d in dims if any(p.leaves(d)[:len(u)] == u for u in us)]
            if len(set(hits)) > 1:  # one name twice ([batch, batch]) splits its first dim only
                conflicts.append((a, hits))
    if conflicts:
        return "two_dims", conflicts
    return None, None


def sharded_anything(layout: dict) -> bool:
    """Whether the layout splits any dim at all."""
    return any(axes_of(v) for v in layout.values())
