"""Op rules as data: how the dims of each aten op's operands relate.

Every rule turns one FX node into an :class:`Indexing`: a letter for each dim of each tensor
operand and result, like an einsum. The same letter on two dims means "the same logical dim";
letters that appear only in inputs are contracted. The roles of letters then say what sharding
is allowed, and one engine (``passes.dims`` for inference, ``passes.spmd`` for ownership and
collectives) interprets them:

- loop letters (present in a result) may be sharded: each rank computes its block;
- ``summed`` letters are contracted by a sum: sharding them leaves a Partial result;
- ``local`` letters must be whole on every rank (softmax/norm dims, gather targets, causal
  positions): an operand sharded there is gathered first;
- ``linear``: input positions in which the op is linear, so a Partial value may pass through
  (``joint`` when all of them must be Partial together, as for ``add``);
- ``additive``: inputs added to a contraction's sum (a bias): they become Partial when the
  contraction is split, so they are added once.

The table at the bottom is the whole registry: one line per op where the op fits a helper.
Example::

    >>> from torch.ops import aten
    >>> RULES[aten.linear.default].__doc__.splitlines()[0]
    'einsum rule: ... i, o i, o -> ... o'
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import fx

aten = torch.ops.aten

Letter = Optional[str]  # None: a broadcast size-1 dim, never sharded


@dataclass
class Indexing:
    """Letters for one node. ``inputs`` holds (path to the tensor in node.args, letters)."""

    inputs: list[tuple[tuple, list[Letter]]]
    outputs: list[list[Letter]]
    summed: frozenset = frozenset()
    local: frozenset = frozenset()
    linear: tuple = ()
    joint: bool = False
    additive: frozenset = frozenset()
    kind: str = "einsum"  # "einsum" | "view" | "creation"
    mean_dims: tuple = ()  # letters averaged (not summed): a sharded one rescales the result

    @property
    def loop(self) -> set:
        return {l for out in self.outputs for l in out if l is not None}


def shape_of(x) -> tuple:
    # (a node of the captured graph or of a per-rank program: a rewrite building no graph makes
    # stand-ins with the same ``meta``)
    v = x.meta.get("val") if isinstance(getattr(x, "meta", None), dict) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()


def is_tensor_node(x) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# --------------------------------------------------------------------------- helpers


def _broadcast_letters(shapes: list[tuple], out_shape: tuple, prefix: str = "e") -> tuple[list, list]:
    """Right-aligned broadcasting: equal-position dims share a letter; size-1 dims that
    broadcast against a larger size get None."""
    out = [f"{prefix}{len(out_shape) - k}" for k in range(len(out_shape))]
    ins = []
    for shp in shapes:
        off = len(out_shape) - len(shp)
        ins.append([None if (s == 1 and out_shape[off + k] != 1) else out[off + k] for k, s in enumerate(shp)])
    return ins, [None if s == 1 else l for l, s in zip(out, out_shape)]


def tensor_args(node: fx.Node) -> list[tuple]:
    """Paths of the tensor operands of a node: (i,) for args[i], (i, j) for args[i][j],
    ("kw", name) for kwargs."""
    paths = []
    for i, a in enumerate(node.args):
        if is_tensor_node(a):
            paths.append((i,))
        elif isinstance(a, (list, tuple)):
            paths += [(i, j) for j, b in enumerate(a) if is_tensor_node(b)]
    for k, a in node.kwargs.items():
        if is_tensor_node(a):
            paths.append(("kw", k))
    return paths


def get_path(node: fx.Node, path: tuple):
    if path[0] == "kw":
        return node.kwargs[path[1]]
    a = node.args[path[0]]
    return a if len(path) == 1 else a[path[1]]


def elementwise(linear: tuple = (), joint: bool = False, local_dim_arg: Optional[tuple] = None):
    """All tensor operands broadcast against the result. ``local_dim_arg`` = (arg index,
    kwarg name) of a dim that must stay whole (softmax, cumsum)."""

    def rule(node: fx.Node) -> Indexing:
        paths = tensor_args(node)
        out_shape = shape_of(node)
        ins, out = _broadcast_letters([shape_of(get_path(node, p)) for p in paths], out_shape)
        local = frozenset()
        if local_dim_arg is not None:
            d = arg(node, *local_dim_arg)
            if out_shape:
                local = frozenset({f"e{len(out_shape) - norm_dim(d, len(out_shape))}"})
        lin = tuple(k for k, p in enumerate(paths) if p[0] in linear)
        if joint and any(not is_tensor_node(a) for a in node.args[:2]):
            lin = ()  # x + 1.0: the constant would be added once per rank to a pending sum
        return Indexing(list(zip(paths, ins)), [out], local=local, linear=lin, joint=joint)

    rule.__doc__ = "elementwise rule (broadcasting)"
    return rule


def einsum(spec: str, summed: str = "", local: str = "", linear: tuple = (), additive: tuple = ()):
    """Rule from an einsum-like signature over the tensor args in order, e.g. linear is
    ``"... i, o i, o -> ... o"``. ``...`` covers leading dims (broadcast right-aligned)."""
    lhs, rhs = spec.split("->")
    in_specs = [s.split() for s in lhs.split(",")]
    out_spec = rhs.split()

    def rule(node: fx.Node) -> Indexing:
        paths = tensor_args(node)
        shapes = [shape_of(get_path(node, p)) for p in paths]
        specs = in_specs[: len(paths)]
        # Optional operands (a missing bias) are skipped: match specs by position in args.
        if len(paths) < len(in_specs):
            arg_pos = [p[0] for p in paths]
            specs = [in_specs[i] for i in arg_pos]
        ell_shapes = [shp[: len(shp) - (len(s) - ("..." in s))] if "..." in s else () for s, shp in zip(specs, shapes)]
        out_shape = shape_of(node)
        n_ell_out = len(out_shape) - (len(out_spec) - ("..." in out_spec))
        ell_in, ell_out = _broadcast_letters(ell_shapes, out_shape[:n_ell_out] if "..." in out_spec else ())
        ins = []
        for s, shp, ell in zip(specs, shapes, ell_in):
            letters = []
            for tok in s:
                letters += ell if tok == "..." else [tok]
            letters = letters[len(letters) - len(shp):] if len(shp) else []  # a 1-D bias aligns right
            # A named dim of size 1 that broadcasts (e.g. a [1, n] bias) carries no letter.
            ins.append([None if (n == 1 and l is not None and not l.startswith("e")) else l for l, n in zip(letters, shp)])
        out = []
        for tok in out_spec:
            out += ell_out if tok == "..." else [tok]
        out = [None if n == 1 else l for l, n in zip(out, out_shape)]
        lin = tuple(k for k, p in enumerate(paths) if p[0] in linear)
        add = frozenset(k for k, p in enumerate(paths) if p[0] in additive)
        return Indexing(list(zip(paths, ins)), [out], summed=frozenset(summed.split()),
                        local=frozenset(local.split()), linear=lin, additive=add)

    rule.__doc__ = f"einsum rule: {spec}"
    # a product of two factors with a summed letter (a matrix product, 2mnk FLOPs): the
    # positions of its factors, read by the op classes below
    rule.factors = tuple(linear) if summed.split() and len(linear) == 2 else None
    return rule


def einsum_equation_rule(node: fx.Node) -> Optional[Indexing]:
    """torch.einsum(equation, operands): the equation's letters are the rule's; letters absent
    from the result are summed, and the op is linear in each operand (a product). A letter
    repeated within one operand (a diagonal) has no rule: the op runs whole."""
    eq = node.args[0].replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    specs = lhs.split(",")
    if not rhs and "->" not in eq:  # implicit output: the letters used once, sorted
        used = [c for c in lhs if c.isalpha()]
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(used) if used.count(c) == 1))
    tokens = lambda spec: ["..." if t == "." else t for t in spec.replace("...", ".")]  # noqa: E731
    if any(len(set(t for t in tokens(sp) if t != "...")) != len([t for t in tokens(sp) if t != "..."]) for sp in specs):
        return None
    out = tokens(rhs)
    summed = {t for sp in specs for t in tokens(sp) if t != "..." and t not in out}
    spec = ", ".join(" ".join(tokens(sp)) for sp in specs) + " -> " + " ".join(out)
    return einsum(spec, summed=" ".join(sorted(summed)), linear=(1,))(node)


def matmul_rule(node: fx.Node) -> Indexing:
    """torch.matmul: 1-D operands are vectors; leading dims broadcast."""
    a, b = node.args[:2]
    sa, sb = shape_of(a), shape_of(b)
    if len(sa) == 1 and len(sb) == 1:
        return einsum("i, i -> ", summed="i", linear=(0, 1))(node)
    if len(sb) == 1:
        return einsum("... n i, i -> ... n", summed="i", linear=(0, 1))(node)
    if len(sa) == 1:
        return einsum("i, ... i o -> ... o", summed="i", linear=(0, 1))(node)
    out_shape = shape_of(node)
    batch_out = out_shape[:-2]
    ins, bl = _broadcast_letters([sa[:-2], sb[:-2]], batch_out)
    la = ins[0] + ["n", "i"]
    lb = ins[1] + ["i", "o"]
    fix = lambda ls, shp: [None if n == 1 else l for l, n in zip(ls, shp)]
    return Indexing([((0,), fix(la, sa)), ((1,), fix(lb, sb))], [fix(bl + ["n", "o"], out_shape)],
                    summed=frozenset({"i"}), linear=(0, 1))


matmul_rule.factors = (0, 1)


def reduction(summed: bool, mean: bool = False, dim_arg: tuple = (1, "dim"), keepdim_arg: tuple = (2, "keepdim")):
    """Reduce over ``dim`` (all dims when absent). Summed reductions leave Partial results."""

    def rule(node: fx.Node) -> Indexing:
        x = node.args[0]
        shp = shape_of(x)
        dims = arg(node, *dim_arg) if dim_arg else None
        if dims is None or dims == []:
            dims = list(range(len(shp)))
        dims = {norm_dim(d, len(shp)) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
        keep = bool(arg(node, *keepdim_arg, default=False)) if keepdim_arg else False
        letters = [f"d{k}" for k in range(len(shp))]
        ins = [None if n == 1 else l for l, n in zip(letters, shp)]
        out = [None if k in dims else l for k, l in enumerate(ins)] if keep else [l for k, l in enumerate(ins) if k not in dims]
        red = frozenset(letters[k] for k in dims)
        outs = [out] * (2 if isinstance(node.meta.get("val"), (tuple, list)) else 1)
        return Indexing([((0,), ins)], outs, summed=red if summed else frozenset(),
                        local=frozenset() if summed else red, linear=(0,) if summed else (),
                        mean_dims=tuple(sorted(red)) if mean else ())

    rule.__doc__ = f"reduction rule ({'sum' if summed else 'local'})"
    return rule


def view_rule(node: fx.Node) -> Indexing:
    """Reshape: dims regroup; the dims engine aligns their atoms."""
    return Indexing([((0,), [f"i{k}" for k in range(len(shape_of(node.args[0])))])],
                    [[f"o{k}" for k in range(len(shape_of(node)))]], linear=(0,), kind="view")


view_rule.__doc__ = "view rule: dims split and merge"


def permute_rule(node: fx.Node) -> Indexing:
    """transpose / permute / t / .T / .mT: letters move with their dims."""
    shp = shape_of(node.args[0])
    n = len(shp)
    letters = [f"d{k}" for k in range(n)]
    if node.target in (aten.transpose.int,):
        a, b = norm_dim(node.args[1], n), norm_dim(node.args[2], n)
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    elif node.target in (aten.t.default, aten.numpy_T.default):  # x.T reverses every dim
        order = list(reversed(range(n)))
    elif node.target in MATRIX_TRANSPOSE:  # x.mT, x.mH, adjoint: the last two dims swap
        order = list(range(n - 2)) + [n - 1, n - 2]
    else:
        order = [norm_dim(d, n) for d in node.args[1]]
    ins = [None if s == 1 else l for l, s in zip(letters, shp)]
    return Indexing([((0,), ins)], [[ins[k] for k in order]], linear=(0,))


def unsqueeze_rule(node: fx.Node) -> Indexing:
    shp = shape_of(node.args[0])
    ins = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    out_shape = shape_of(node)
    if node.target == aten.unsqueeze.default:
        d = norm_dim(node.args[1], len(out_shape))
        out = ins[:d] + [None] + ins[d:]
    else:  # squeeze: drop size-1 dims, which carry no letter anyway
        out = [l for l, s in zip(ins, shp) if s != 1] if len(out_shape) < len(shp) else ins
        if len(out) != len(out_shape):
            out = [l for l in ins if l is not None]
    return Indexing([((0,), ins)], [out], linear=(0,))


def expand_rule(node: fx.Node) -> Indexing:
    """expand: size-1 dims grow into new letters (each rank may hold a block of them)."""
    shp, out_shape = shape_of(node.args[0]), shape_of(node)
    off = len(out_shape) - len(shp)
    out = []
    for k, n in enumerate(out_shape):
        src = k - off
        if src >= 0 and shp[src] == n:
            out.append(None if n == 1 else f"d{src}")
        else:
            out.append(None if n == 1 else f"new{k}")
    ins = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    return Indexing([((0,), ins)], [out], linear=(0,))


def slice_rule(node: fx.Node) -> Indexing:
    """slice: a full-range slice is the identity; otherwise the sliced dim stays whole."""
    shp = shape_of(node.args[0])
    d = norm_dim(arg(node, 1, "dim", 0), len(shp))
    start, end, step = arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1)
    full = (start in (None, 0)) and (end is None or end >= shp[d]) and step in (None, 1)
    ins = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    out = list(ins)
    local = frozenset()
    if not full:
        out[d] = None if shape_of(node)[d] == 1 else "sliced"
        local = frozenset({l for l in (ins[d], out[d]) if l})
    return Indexing([((0,), ins)], [out], local=local, linear=(0,))


def select_rule(node: fx.Node) -> Indexing:
    shp = shape_of(node.args[0])
    d = norm_dim(node.args[1], len(shp))
    ins = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    return Indexing([((0,), ins)], [ins[:d] + ins[d + 1:]], local=frozenset({ins[d]} - {None}), linear=(0,))


def cat_rule(node: fx.Node) -> Indexing:
    """cat: the concatenated dim stays whole; the others are shared."""
    out_shape = shape_of(node)
    d = norm_dim(arg(node, 1, "dim", 0), len(out_shape))
    ins, local = [], set()
    for j, t in enumerate(node.args[0]):
        shp = shape_of(t)
        if len(shp) != len(out_shape):  # legacy empty tensors
            continue
        letters = [None if s == 1 and out_shape[k] != 1 else f"d{k}" for k, s in enumerate(shp)]
        letters[d] = f"cat{j}"
        local.add(f"cat{j}")
        ins.append(((0, j), letters))
    out = [None if s == 1 else f"d{k}" for k, s in enumerate(out_shape)]
    out[d] = "catout"
    return Indexing(ins, [out], local=frozenset(local | {"catout"}), linear=tuple(range(len(ins))), joint=True)


def stack_rule(node: fx.Node) -> Indexing:
    """stack(tensors, dim): a new dim (one position per input) inserted at ``dim``; the inputs'
    dims (equal shapes) carry through. The new dim stays whole: each rank holds every input."""
    out_shape = shape_of(node)
    d = norm_dim(arg(node, 1, "dim", 0), len(out_shape))
    ins = [((0, j), _letters(shape_of(t))) for j, t in enumerate(node.args[0])]
    letters = _letters(shape_of(node.args[0][0]))
    out = letters[:d] + [None if out_shape[d] == 1 else "stacked"] + letters[d:]
    return Indexing(ins, [out], local=frozenset({"stacked"}), linear=tuple(range(len(ins))), joint=True)


def complex_view_rule(node: fx.Node) -> Indexing:
    """view_as_complex ([..., 2] real -> [...] complex) / view_as_real (the reverse): the real and
    imaginary parts are the trailing size-2 dim, which stays whole; the other dims carry through."""
    to_complex = node.target == aten.view_as_complex.default
    shp = shape_of(node.args[0])
    ins = _letters(shp)
    if to_complex:
        ins[-1] = "parts"
        out = ins[:-1]
    else:
        out = ins + ["parts"]
    return Indexing([((0,), ins)], [out], local=frozenset({"parts"}), linear=(0,))


def repeat_rule(node: fx.Node) -> Indexing:
    """repeat / tile(x, sizes): tiles x; sizes may add leading dims. A dim repeated once carries its
    letter; a tiled dim (and a new leading one) holds every copy of the input's dim, so the input
    dim and the result's stay whole."""
    shp, reps = shape_of(node.args[0]), list(node.args[1])
    reps = [1] * (len(shp) - len(reps)) + reps  # tile: fewer sizes than dims repeat the trailing ones
    off = len(reps) - len(shp)
    ins = _letters(shp)
    out, local = [], set()
    for k, (r, n) in enumerate(zip(reps, shape_of(node))):
        src = k - off
        if src >= 0 and r == 1:
            out.append(ins[src])
            continue
        out.append(None if n == 1 else f"tiled{k}")
        local |= {f"tiled{k}", ins[src] if src >= 0 else None}
    return Indexing([((0,), ins)], [out], local=frozenset(local - {None}), linear=(0,))


def pool_rule(node: fx.Node) -> Indexing:
    """adaptive_avg_pool1d/2d(x [N, C, *S], output_size) and group_norm(x [N, C, *S], groups,
    weight [C], bias [C]): batch a loop letter; positions whole (pooled, or normalized over);
    channels a loop letter of a pool, whole for a group norm (its groups span channels)."""
    shp = shape_of(node.args[0])
    ins = _letters(shp)
    local = set(ins[2:])
    if node.target == aten.group_norm.default:
        local.add(ins[1])
        out = list(ins)
        operands = [((0,), ins)] + [(p, [ins[1]]) for p in tensor_args(node)[1:]]
    else:
        out = ins[:2] + [None if n == 1 else f"y{k}" for k, n in enumerate(shape_of(node)[2:])]
        local |= set(out[2:])
        operands = [((0,), ins)]
    linear = () if node.target == aten.group_norm.default else (0,)  # an average is linear; a norm is not
    return Indexing(operands, [out], local=frozenset(local - {None}), linear=linear)


def split_rule(node: fx.Node) -> Indexing:
    """split / split_with_sizes / chunk / unbind: the split dim stays whole."""
    shp = shape_of(node.args[0])
    d = norm_dim(arg(node, 2, "dim", 0) if node.target != aten.unbind.int else arg(node, 1, "dim", 0), len(shp))
    ins = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    outs = []
    for j, v in enumerate(node.meta["val"]):
        o = list(ins)
        if node.target == aten.unbind.int:
            o = ins[:d] + ins[d + 1:]
        else:
            o[d] = None if v.shape[d] == 1 else f"part{j}"
        outs.append(o)
    local = {ins[d]} | {o[d] for o in outs if node.target != aten.unbind.int and len(o) > d}
    return Indexing([((0,), ins)], outs, local=frozenset(local - {None}), linear=(0,))


def embedding_rule(node: fx.Node) -> Indexing:
    """embedding(weight [v, h], indices [...]) -> [..., h]: the vocab dim stays whole."""
    idx_shape = shape_of(node.args[1])
    ell = [None if s == 1 else f"e{k}" for k, s in enumerate(idx_shape)]
    return Indexing([((0,), ["v", "h"]), ((1,), ell)], [ell + ["h"]], local=frozenset({"v"}), linear=(0,))


def sdpa_rule(node: fx.Node) -> Indexing:
    """scaled_dot_product_attention(q [.. h s d], k [.. g t d], v [.. g t e], mask) -> [.. h s e].
    Key/value positions and the head dim are consumed inside a softmax: they stay whole. Query
    positions stay whole under is_causal (the mask depends on absolute positions)."""
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    causal = bool(arg(node, 5, "is_causal", False))
    nb = len(shape_of(q)) - 3
    batch = [f"b{i}" for i in range(nb)]
    qs, ks = shape_of(q), shape_of(k)
    gqa = qs[-3] != ks[-3]
    kv_head = "kvh" if gqa else "h"
    ins = [((0,), batch + ["h", "s", "d"]), ((1,), batch + [kv_head, "t", "d"]), ((2,), batch + [kv_head, "t", "e"])]
    out = batch + ["h", "s", "e"]
    if is_tensor_node(mask):
        mshape = shape_of(mask)
        full = batch + ["h", "s", "t"]
        off = len(full) - len(mshape)
        ins.append(((3,), [None if n == 1 else full[off + i] for i, n in enumerate(mshape)]))
    ins = [(p, [None if n == 1 else l for l, n in zip(ls, shape_of(get_path(node, p)))]) for p, ls in ins]
    local = {"t", "d"} | ({"s"} if causal else set()) | ({"h", "kvh"} if gqa else set())
    return Indexing(ins, [[None if n == 1 else l for l, n in zip(out, shape_of(node))]],
                    local=frozenset(local), linear=(2,))


def norm_rule(node: fx.Node) -> Indexing:
    """layer_norm / rms_norm(x, normalized_shape, weight, bias): normalized dims stay whole."""
    shp = shape_of(node.args[0])
    k = len(node.args[1])
    letters = [None if s == 1 else f"d{i}" for i, s in enumerate(shp)]
    ins = [((0,), letters)]
    for p in tensor_args(node)[1:]:
        ins.append((p, letters[len(shp) - k:]))
    return Indexing(ins, [letters], local=frozenset(l for l in letters[len(shp) - k:] if l))


def batch_norm_rule(node: fx.Node) -> Indexing:
    """batch_norm(x [N, C, *S], weight, bias, running_mean, running_var [C], training=False, ...):
    in eval mode every element is normalized with its channel's running statistics, so every
    dim is a loop letter (a block of the batch, of the positions or of the channels computes
    alone). Training mode is decomposed at capture (``batch_norm_with_batch_statistics``)."""
    shp = shape_of(node.args[0])
    letters = _letters(shp)
    channel = letters[1] if len(shp) > 1 else letters[0]
    ins = [((0,), letters)] + [(p, [channel]) for p in tensor_args(node)[1:]]
    return Indexing(ins, [letters])


def cross_entropy_rule(node: fx.Node) -> Indexing:
    """cross_entropy_loss(input [N, C, ...], target [N, ...] or probabilities [N, C, ...],
    reduction='none'): classes whole.
    (Mean reductions are rewritten at capture into sums and a global count.)"""
    shp = shape_of(node.args[0])
    letters = [None if s == 1 else f"d{i}" for i, s in enumerate(shp)]
    tgt = letters[:1] + letters[2:] if len(shp) > 1 else []
    # class-index targets are [N, ...]; probability targets are shaped like the input
    tin = letters if len(shape_of(node.args[1])) == len(shp) else tgt
    return Indexing([((0,), letters), ((1,), tin)], [tgt], local=frozenset({letters[1]} - {None}) if len(shp) > 1 else frozenset())


def creation_rule(node: fx.Node) -> Indexing:
    """Tensors made from sizes (zeros, ones, full, arange, new_*): new letters."""
    # A tensor argument (new_ones' self) only lends dtype and device: it is not an operand.
    out = [None if s == 1 else f"c{k}" for k, s in enumerate(shape_of(node))]
    local = frozenset(out) - {None} if node.target in POSITIONAL_CREATION else frozenset()
    return Indexing([], [out], local=local, kind="creation")


def triangle_rule(node: fx.Node) -> Indexing:
    """triu / tril: the last two dims hold positions, so they stay whole."""
    shp = shape_of(node.args[0])
    letters = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    return Indexing([((0,), letters)], [letters], local=frozenset(l for l in letters[-2:] if l))


def index_rule(node: fx.Node) -> Indexing:
    """x[idx0, idx1, ...] with tensor indices: the indexed dims stay whole; index tensors
    broadcast together into the result's leading (or in-place) block."""
    x = node.args[0]
    shp = shape_of(x)
    idx = node.args[1]
    letters = [None if s == 1 else f"d{k}" for k, s in enumerate(shp)]
    out_shape = shape_of(node)
    tensor_pos = [k for k, t in enumerate(idx) if t is not None]
    idx_shapes = [shape_of(idx[k]) for k in tensor_pos]
    nb = max(len(s) for s in idx_shapes)
    # Advanced indices that are adjacent land in place; otherwise at the front.
    adjacent = tensor_pos == list(range(tensor_pos[0], tensor_pos[0] + len(tensor_pos)))
    front = tensor_pos[0] if adjacent else 0
    bshape = out_shape[front: front + nb]
    idx_letters, _ = _broadcast_letters(idx_shapes, bshape, prefix="ix")
    bl = [None if n == 1 else f"ix{nb - k}" for k, n in enumerate(bshape)]
    rest = [letters[k] for k in range(len(shp)) if k not in tensor_pos]
    out = (rest[:front] + bl + rest[front:]) if adjacent else (bl + rest)
    ins = [((0,), letters)] + [((1, k), ls) for k, ls in zip(tensor_pos, idx_letters)]
    return Indexing(ins, [out], local=frozenset(letters[k] for k in tensor_pos if letters[k]), linear=(0,))


def _letters(shape, prefix="d") -> list:
    return [None if s == 1 else f"{prefix}{k}" for k, s in enumerate(shape)]


def conv_rule(node: fx.Node) -> Indexing:
    """conv1d/2d/3d and convolution(input [N, Cin, *S], weight [Cout, Cin/g, *K], bias [Cout]):
    batch and output channels are loop letters, input channels are contracted (summed);
    spatial positions and the kernel stay whole (a sharded image would need halos). Depthwise
    convolutions (groups = Cin = Cout) keep the channel as one loop letter; other grouped ones
    keep channels whole."""
    x, w = node.args[0], node.args[1]
    xs, ws = shape_of(x), shape_of(w)
    nsp = len(ws) - 2
    conv = node.target in CONVOLUTION
    transposed = bool(arg(node, 6, "transposed", False)) if conv else False
    groups = arg(node, 8 if conv else 6, "groups", 1)
    batch = ["n"] if len(xs) == nsp + 2 else []
    space = [f"x{k}" for k in range(nsp)]
    kernel = [f"k{k}" for k in range(nsp)]
    out_space = [f"y{k}" for k in range(nsp)]
    local = set(space + kernel + out_space)
    if groups == 1:
        cin, wl, cout, summed = "i", (["i", "o"] if transposed else ["o", "i"]), "o", "i"
    elif not transposed and groups == xs[len(batch)] == ws[0]:  # depthwise: channel c -> c
        cin, wl, cout, summed = "c", ["c", "cw"], "c", ""
    else:
        cin, wl, cout, summed = "ci", ["w0", "w1"], "co", ""
        local |= {"ci", "co", "w0", "w1"}
    ins = [((0,), batch + [cin] + space), ((1,), wl + kernel)]
    if is_tensor_node(arg(node, 2, "bias")):
        ins.append(((2,), [cout]))
    ins = [(p, [None if n == 1 else l for l, n in zip(ls, shape_of(get_path(node, p)))]) for p, ls in ins]
    out = [None if n == 1 else l for l, n in zip(batch + [cout] + out_space, shape_of(node))]
    return Indexing(ins, [out], summed=frozenset({summed} - {""}), local=frozenset(local), linear=(0, 1),
                    additive=frozenset({2} if len(ins) == 3 else ()))


def along_dim_rule(dim_arg: tuple, new_size: bool = True):
    """topk / sort / argsort: each slice along ``dim`` is processed whole (the dim is local);
    every other dim is a loop letter. Results along ``dim`` are new positions (ranks, order)."""

    def rule(node: fx.Node) -> Indexing:
        shp = shape_of(node.args[0])
        i, name = dim_arg
        d = arg(node, i, name, -1) if i is not None else node.kwargs.get(name, -1)
        d = norm_dim(d, len(shp)) if shp else 0
        ins = _letters(shp)
        out = list(ins)
        val = node.meta.get("val")
        several = isinstance(val, (tuple, list))
        if shp:
            out[d] = None if (val[0] if several else val).shape[d] == 1 else "along"
        outs = [out] * (len(val) if several else 1)
        return Indexing([((0,), ins)], outs, local=frozenset({ins[d] if shp else None, "along"} - {None}))

    rule.__doc__ = "along-dim rule (the dim stays whole)"
    return rule


def gather_rule(node: fx.Node) -> Indexing:
    """gather(self, dim, index) -> out shaped like index: out[.., j, ..] = self[.., index[.., j, ..], ..].
    Positions of ``index`` (and out) along ``dim`` are loop letters; ``self`` along ``dim`` stays
    whole. Other dims are shared where self and index have equal sizes (else both stay whole)."""
    x, idx = node.args[0], node.args[2]
    xs, js = shape_of(x), shape_of(idx)
    d = norm_dim(node.args[1], len(xs)) if xs else 0
    xl, il, local = [], [], set()
    for k, (a, b) in enumerate(zip(xs, js)):
        if k == d:
            xl.append("src"); il.append("pos"); local.add("src")
        elif a == b:
            xl.append(f"d{k}"); il.append(f"d{k}")
        else:
            xl.append(f"s{k}"); il.append(f"j{k}"); local |= {f"s{k}", f"j{k}"}
    xl = [None if n == 1 else l for l, n in zip(xl, xs)]
    il = [None if n == 1 else l for l, n in zip(il, js)]
    return Indexing([((0,), xl), ((2,), il)], [il], local=frozenset(local), linear=(0,))


def histc_rule(node: fx.Node) -> Indexing:
    """histc(self, bins, min, max): counts per bin over all elements. With a fixed range
    (min < max) counts of a split input add up: every input dim is summed (Partial result).
    With min == max the range comes from the data, so the input stays whole."""
    shp = shape_of(node.args[0])
    lo, hi = arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    ins = _letters(shp)
    letters = frozenset(ins) - {None}
    fixed = lo != hi
    return Indexing([((0,), ins)], [[None if shape_of(node)[0] == 1 else "bins"]],
                    summed=letters if fixed else frozenset(), local=frozenset() if fixed else letters)


def index_put_rule(node: fx.Node) -> Indexing:
    """index_put(self, indices, values, accumulate): self[indices] = values (or +=). The indexed
    dims of self and the index positions stay whole (each rank would write other rows);
    the remaining dims of self are shared with values. Jointly linear in self and values."""
    x = node.args[0]
    shp = shape_of(x)
    idx = node.args[1]
    letters = _letters(shp)
    tensor_pos = [k for k, t in enumerate(idx) if t is not None]
    idx_shapes = [shape_of(idx[k]) for k in tensor_pos]
    nb = max(len(s) for s in idx_shapes)
    bshape = list(torch.broadcast_shapes(*[torch.Size(s) for s in idx_shapes]))
    idx_letters, bl = _broadcast_letters(idx_shapes, tuple(bshape), prefix="ix")
    adjacent = tensor_pos == list(range(tensor_pos[0], tensor_pos[0] + len(tensor_pos)))
    front = tensor_pos[0] if adjacent else 0
    rest = [(letters[k], shp[k]) for k in range(len(shp)) if k not in tensor_pos]
    pairs = (rest[:front] + list(zip(bl, bshape)) + rest[front:]) if adjacent else (list(zip(bl, bshape)) + rest)
    vshape = shape_of(node.args[2])
    off = len(pairs) - len(vshape)
    vl = [None if n == 1 else pairs[off + k][0] for k, n in enumerate(vshape)]
    ins = [((0,), letters)] + [((1, k), ls) for k, ls in zip(tensor_pos, idx_letters)] + [((2,), vl)]
    local = {letters[k] for k in tensor_pos} | {l for ls in idx_letters for l in ls}
    return Indexing(ins, [letters], local=frozenset(local - {None}), linear=(0, len(ins) - 1), joint=True)


def scatter_rule(add: bool):
    """scatter(self, dim, index, src | value) / scatter_add: out = self with, along ``dim``,
    out[.., index[.., j, ..], ..] = src[.., j, ..] (``add``: +=). Positions of self along
    ``dim`` stay whole (an index names any of them); the other dims are shared where self, index
    and src have equal sizes (a rank's block of rows writes its own rows), else whole. For a
    sum (scatter_add) the index positions are summed: a split of them leaves a Partial result,
    self added once (additive). Overwriting scatters keep them whole (the last write wins)."""

    def rule(node: fx.Node) -> Indexing:
        x, idx = node.args[0], node.args[2]
        src = node.args[3] if len(node.args) > 3 and is_tensor_node(node.args[3]) else node.kwargs.get("src")
        xs, js = shape_of(x), shape_of(idx)
        ss = shape_of(src) if is_tensor_node(src) else js
        d = norm_dim(node.args[1], len(xs)) if xs else 0
        xl, il, sl, local = [], [], [], set()
        for k in range(len(js)):
            if k == d:
                xl.append("dst"); local.add("dst")
                shared = ss[k] == js[k]
                il.append("pos"); sl.append("pos" if shared else "spos")
                local |= {"spos"} | (set() if add and shared else {"pos"})
            elif xs[k] == js[k] == ss[k]:
                xl.append(f"d{k}"); il.append(f"d{k}"); sl.append(f"d{k}")
            else:
                xl.append(f"x{k}"); il.append(f"j{k}"); sl.append(f"s{k}"); local |= {f"x{k}", f"j{k}", f"s{k}"}
        fix = lambda ls, shp: [None if n == 1 else l for l, n in zip(ls, shp)]  # noqa: E731
        ins = [((0,), fix(xl, xs)), ((2,), fix(il, js))]
        linear, additive, summed = (), frozenset(), frozenset()
        if is_tensor_node(src):
            ins.append(((3,) if len(node.args) > 3 else ("kw", "src"), fix(sl, ss)))
            linear = (3,) if add else (0, 3)
        if add and "pos" not in local:
            summed, additive = frozenset({"pos"}), frozenset({0})
        lin = tuple(k for k, (p, _) in enumerate(ins) if p[0] in linear)
        return Indexing(ins, [fix(xl, xs)], summed=summed, local=frozenset(local), linear=lin,
                        joint=not add and len(lin) == 2, additive=additive)

    rule.__doc__ = f"scatter rule ({'sum' if add else 'overwrite'})"
    return rule


def index_add_rule(node: fx.Node) -> Indexing:
    """index_add(self, dim, index [j], source, alpha): self[.., index[j], ..] += alpha * source[.., j, ..].
    Self's positions along ``dim`` stay whole; the index positions j are summed (a split of
    them leaves a Partial result, self added once); the other dims are shared with source."""
    xs = shape_of(node.args[0])
    d = norm_dim(node.args[1], len(xs))
    xl = _letters(xs)
    xl[d] = "dst" if xs[d] != 1 else None
    sl = list(xl)
    ss = shape_of(node.args[3])
    sl[d] = None if ss[d] == 1 else "pos"
    ins = [((0,), xl), ((2,), [None if shape_of(node.args[2])[0] == 1 else "pos"] if shape_of(node.args[2]) else []),
           ((3,), sl)]
    return Indexing(ins, [xl], summed=frozenset({"pos"}), local=frozenset({"dst"}), linear=(2,),
                    additive=frozenset({0}))


def pad_rule(node: fx.Node) -> Indexing:
    """pad / constant_pad_nd: padded dims stay whole (positions shift); the others are shared.
    Zero constant padding is linear (a pending sum may pass through)."""
    shp = shape_of(node.args[0])
    pads = list(node.args[1])
    mode = arg(node, 2, "mode", "constant") if node.target == aten.pad.default else "constant"
    value = arg(node, 3, "value", None) if node.target == aten.pad.default else arg(node, 2, "value", 0)
    padded = {len(shp) - 1 - k // 2 for k, p in enumerate(pads) if p}
    ins = _letters(shp)
    out = [None if n == 1 else (f"p{k}" if k in padded else l) for k, (l, n) in enumerate(zip(ins, shape_of(node)))]
    local = {ins[k] for k in padded} | {out[k] for k in padded}
    linear = (0,) if mode != "constant" or value in (None, 0, 0.0) else ()
    return Indexing([((0,), ins)], [out], local=frozenset(local - {None}), linear=linear)


def diff_rule(node: fx.Node) -> Indexing:
    """diff(self, n, dim, prepend, append): differences along ``dim`` (whole); the other dims
    are shared with prepend/append (which broadcast)."""
    shp = shape_of(node.args[0])
    d = norm_dim(arg(node, 2, "dim", -1), len(shp))
    ins = _letters(shp)
    ins[d] = "along"
    operands = [((0,), ins)]
    for i, name in ((3, "prepend"), (4, "append")):
        t = arg(node, i, name)
        if is_tensor_node(t):
            ps = shape_of(t)
            operands.append(((i,) if len(node.args) > i else ("kw", name),
                             [None if n == 1 and k != d else (f"{name}" if k == d else ins[k])
                              for k, n in enumerate(ps)]))
    out = [None if n == 1 else ("diff" if k == d else l) for k, (l, n) in enumerate(zip(ins, shape_of(node)))]
    return Indexing(operands, [out], local=frozenset({"along", "diff", "prepend", "append"}))


def dropout_rule(node: fx.Node) -> Indexing:
    """dropout(x, p, train): the identity in eval mode (or p = 0), so linear then; in training
    mode it draws a mask per element (per rank: see the README's known limits)."""
    identity = not arg(node, 2, "train", True) or arg(node, 1, "p", 0.5) == 0
    return elementwise(linear=(0,) if identity else ())(node)


def local_groups(node: fx.Node, args: tuple) -> tuple:
    """A depthwise convolution on a block of the channels has as many groups as local channels."""
    conv = node.target in CONVOLUTION
    pos = 8 if conv else 6
    groups = arg(node, pos, "groups", 1)
    if groups == 1:
        return args
    x, w = shape_of(node.args[0]), shape_of(node.args[1])
    channel = len(x) - len(w) + 1  # 1 with a batch dim, 0 without
    local_cin = args[0].meta["val"].shape[channel]
    args = list(args) + [None] * max(0, pos + 1 - len(args))
    defaults = {3: [1] * (len(w) - 2), 4: [0] * (len(w) - 2), 5: [1] * (len(w) - 2)}
    for i in range(len(args)):
        if args[i] is None and i in defaults and not conv:
            args[i] = defaults[i]
    args[pos] = local_cin // w[1]
    return tuple(args)


def grouped_matmul_rule(node: fx.Node) -> Indexing:
    """grouped matmul(x [rows, i], w [experts, i, o], offs [experts]): each expert's block of
    rows (ending at offs[e]) times its matrix. Rows and experts stay whole (offs counts rows);
    the contracted i may be split (a pending sum), o too (column blocks)."""
    return einsum("s i, e i o, e -> s o", summed="i", local="s e", linear=(0, 1))(node)


MATRIX_TRANSPOSE = {aten.mT.default, aten.mH.default, aten.adjoint.default}
POSITIONAL_CREATION = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.eye.default}
CONVOLUTION = {aten.convolution.default}

UNARY = [
    aten.neg.default, aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default,
    aten.tanh.default, aten.sigmoid.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.sin.default, aten.cos.default, aten.abs.default, aten.reciprocal.default, aten.erf.default,
    aten.pow.Tensor_Scalar, aten.logical_not.default, aten.bitwise_not.default, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.zeros_like.default,
    aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.isnan.default,
    aten.log1p.default, aten.expm1.default, aten.square.default, aten.sign.default, aten.floor.default,
    aten.ceil.default, aten.round.default, aten.exp2.default, aten.softplus.default, aten.log_sigmoid.default,
    aten.hardtanh.default, aten.hardswish.default, aten.hardsigmoid.default, aten.leaky_relu.default,
    aten.elu.default, aten.mish.default, aten.relu6.default, aten.acos.default,
]
LINEAR_UNARY = [
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
    aten.lift_fresh_copy.default, aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.real.default,
]
BINARY = [
    aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default, aten.eq.Tensor, aten.ne.Tensor,
    aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.eq.Scalar, aten.ne.Scalar,
    aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.logical_and.default,
    aten.logical_or.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.rsub.Scalar, aten.floor_divide.default, aten.remainder.Scalar, aten.fmod.Scalar,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.bitwise_xor.Tensor,
    aten.logical_xor.default, aten.where.ScalarOther, aten.where.ScalarSelf, aten.min.other, aten.max.other,
    aten.fill.Tensor, aten.fill.Scalar, aten.zero.default, aten.clamp.Tensor, aten.polar.default,
    aten.where.Scalar, aten.pow.Scalar, aten.div.Tensor_mode,
]
CREATION = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
    aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.eye.default,
    aten.tensor.default if hasattr(aten, "tensor") else aten.zeros.default,
]

RULES: dict[object, Callable[[fx.Node], Indexing]] = {
    # contractions: the algebra of C = A B with the contracted letter summed
    aten.linear.default: einsum("... i, o i, o -> ... o", summed="i", linear=(0, 1), additive=(2,)),
    aten.addmm.default: einsum("n o, n i, i o -> n o", summed="i", linear=(1, 2), additive=(0,)),
    aten.matmul.default: matmul_rule,
    aten.einsum.default: einsum_equation_rule,
    aten.mm.default: einsum("n i, i o -> n o", summed="i", linear=(0, 1)),
    aten.outer.default: einsum("i, o -> i o", linear=(0, 1)),
    aten.bmm.default: einsum("b n i, b i o -> b n o", summed="i", linear=(0, 1)),
    aten.baddbmm.default: einsum("b n o, b n i, b i o -> b n o", summed="i", linear=(1, 2), additive=(0,)),
    aten.embedding.default: embedding_rule,
    aten.scaled_dot_product_attention.default: sdpa_rule,
    # elementwise: linear ones let a Partial through
    aten.add.Tensor: elementwise(linear=(0, 1), joint=True),
    aten.sub.Tensor: elementwise(linear=(0, 1), joint=True),
    aten.mul.Tensor: elementwise(linear=(0, 1)),
    aten.multiply.Tensor: elementwise(linear=(0, 1)),
    aten.div.Tensor: elementwise(linear=(0,)),
    **{op: elementwise(linear=(0,)) for op in LINEAR_UNARY},
    **{op: elementwise() for op in UNARY + BINARY},
    aten.softmax.int: elementwise(local_dim_arg=(1, "dim")),
    aten._softmax.default: elementwise(local_dim_arg=(1, "dim")),
    aten.log_softmax.int: elementwise(local_dim_arg=(1, "dim")),
    aten._log_softmax.default: elementwise(local_dim_arg=(1, "dim")),
    aten.cumsum.default: elementwise(local_dim_arg=(1, "dim")),
    aten.cumprod.default: elementwise(local_dim_arg=(1, "dim")),
    aten.triu.default: triangle_rule,
    aten.tril.default: triangle_rule,
    aten.layer_norm.default: norm_rule,
    aten.rms_norm.default: norm_rule,
    aten.cross_entropy_loss.default: cross_entropy_rule,
    aten.batch_norm.default: batch_norm_rule,
    # reductions
    aten.sum.dim_IntList: reduction(summed=True),
    aten.sum.default: reduction(summed=True, dim_arg=None, keepdim_arg=None),
    aten.mean.dim: reduction(summed=True, mean=True),
    aten.mean.default: reduction(summed=True, mean=True, dim_arg=None, keepdim_arg=None),
    aten.amax.default: reduction(summed=False),
    aten.logsumexp.default: reduction(summed=False),
    aten.linalg_vector_norm.default: reduction(summed=False, dim_arg=(2, "dim"), keepdim_arg=(3, "keepdim")),
    aten.amin.default: reduction(summed=False),
    aten.max.dim: reduction(summed=False),
    aten.min.dim: reduction(summed=False),
    aten.argmax.default: reduction(summed=False),
    aten.any.dim: reduction(summed=False),
    aten.all.dim: reduction(summed=False),
    # layout: views regroup dims, the rest move them
    aten.view.default: view_rule,
    aten.view_as.default: view_rule,
    aten.reshape_as.default: view_rule,
    aten.reshape.default: view_rule,
    aten._unsafe_view.default: view_rule,
    aten.flatten.using_ints: view_rule,
    aten.unflatten.int: view_rule,
    aten.transpose.int: permute_rule,
    aten.permute.default: permute_rule,
    aten.t.default: permute_rule,
    aten.numpy_T.default: permute_rule,
    **{op: permute_rule for op in MATRIX_TRANSPOSE},
    aten.unsqueeze.default: unsqueeze_rule,
    aten.squeeze.dim: unsqueeze_rule,
    aten.squeeze.dims: unsqueeze_rule,
    aten.squeeze.default: unsqueeze_rule,
    aten.expand.default: expand_rule,
    aten.slice.Tensor: slice_rule,
    aten.select.int: select_rule,
    aten.cat.default: cat_rule,
    aten.concat.default: cat_rule,  # torch.concat, an alias of cat
    aten.stack.default: stack_rule,
    aten.view_as_complex.default: complex_view_rule,
    aten.view_as_real.default: complex_view_rule,
    aten.repeat.default: repeat_rule,
    aten.tile.default: repeat_rule,
    aten.adaptive_avg_pool1d.default: pool_rule,
    aten.adaptive_avg_pool2d.default: pool_rule,
    aten.group_norm.default: pool_rule,
    aten.split.Tensor: split_rule,
    aten.split_with_sizes.default: split_rule,
    aten.chunk.default: split_rule,
    aten.unbind.int: split_rule,
    aten.index.Tensor: index_rule,
    aten.index_put.default: index_put_rule,
    aten.gather.default: gather_rule,
    aten.scatter.src: scatter_rule(add=False),
    aten.scatter.value: scatter_rule(add=False),
    aten.scatter_add.default: scatter_rule(add=True),
    aten.index_add.default: index_add_rule,
    aten.pad.default: pad_rule,
    aten.constant_pad_nd.default: pad_rule,
    aten.diff.default: diff_rule,
    aten.copy.default: elementwise(linear=(1,)),
    aten.dropout.default: dropout_rule,
    # convolutions: batch and output channels shard, input channels are contracted
    aten.conv1d.default: conv_rule,
    aten.conv2d.default: conv_rule,
    aten.conv3d.default: conv_rule,
    aten.conv1d.padding: conv_rule,
    aten.conv2d.padding: conv_rule,
    aten.conv3d.padding: conv_rule,
    aten.convolution.default: conv_rule,
    # routing (mixtures of experts): per-slice selection and counting
    aten.topk.default: along_dim_rule((2, "dim")),
    aten.sort.default: along_dim_rule((1, "dim")),
    aten.sort.stable: along_dim_rule((None, "dim")),
    aten.argsort.default: along_dim_rule((1, "dim")),
    aten.argsort.stable: along_dim_rule((None, "dim")),
    aten.histc.default: histc_rule,
    aten._grouped_mm.default: grouped_matmul_rule,
    **{op: creation_rule for op in CREATION},
}
# Op classes, derived from the table (the cost model reads them, cost/model.py):
# - views: ops whose rule regroups, moves, slices or broadcasts dims of one operand (its memory
#   re-described: no FLOPs, no traffic), and the elementwise ops that only rename a tensor;
# - matrix products: contractions of two factors over a summed letter, {op: index of the first
#   factor among the op's arguments} (2mnk FLOPs; ``einsum`` and ``outer`` are not: an equation's
#   FLOPs are not the product of its first factor's last dim).
VIEW_RULES = (view_rule, permute_rule, unsqueeze_rule, expand_rule, slice_rule, select_rule, split_rule)
ALIAS_OPS = (aten.alias.default, aten.detach.default)
VIEW_OPS = frozenset(op for op, rule in RULES.items() if rule in VIEW_RULES) | frozenset(ALIAS_OPS)
MATMUL_OPS = {op: rule.factors[0] for op, rule in RULES.items() if getattr(rule, "factors", None)}

# Rules for ops of optional libraries, by qualified name (the op exists once the library loads).
NAMED_RULES: dict[str, Callable[[fx.Node], Indexing]] = {
    "autoshard::grouped_mm": grouped_matmul_rule,
    "transformers::grouped_mm_fallback": grouped_matmul_rule,
}


def rule_for(target) -> Optional[Callable[[fx.Node], Indexing]]:
    """The rule of an FX call target: the op table, else the named table (custom ops).

    >>> rule_for(torch.ops.aten.sort.default).__doc__
    'along-dim rule (the dim stays whole)'
    """
    rule = RULES.get(target)
    if rule is None and hasattr(target, "name") and callable(target.name):
        rule = NAMED_RULES.get(target.name().split(".")[0])
    return rule


# Non-tensor arguments that depend on local sizes: (node, local args) -> local args.
LOCAL_ARGS = {op: local_groups for op in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
                                          aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
                                          aten.convolution.default)}


def repeat_interleave_as_expand(b, x, repeats: int, dim=None, output_size=None):
    """x.repeat_interleave(r, dim=d) == x.unsqueeze(d + 1).expand(..., r, ...).reshape(..., n * r, ...):
    each element repeated r times in a row, so the result's dim d is [n, r] (n major) and a
    split of n (the token dim of a mixture of experts) carries over."""
    shape = b.shape(x)
    if dim is None:
        x, shape, dim = b(aten.reshape.default, x, [math.prod(shape)]), [math.prod(shape)], 0
    d = norm_dim(dim, len(shape))
    wide = b(aten.expand.default, b(aten.unsqueeze.default, x, d + 1), shape[:d + 1] + [repeats] + shape[d + 1:])
    return b(aten.reshape.default, wide, shape[:d] + [shape[d] * repeats] + shape[d + 1:])


def batch_norm_with_batch_statistics(b, x, weight, bias, running_mean, running_var, training, momentum, eps,
                                     cudnn_enabled=False):
    """batch_norm in training mode as sums: mean and biased variance over every dim but the
    channel (dim 1), each a sum divided by the global count, so a batch split across ranks sums
    its statistics (a synchronized BatchNorm: Partial sums and one all-reduce each); the running
    statistics are updated as torch does (``momentum * mean + (1 - momentum) * running_mean``,
    the variance unbiased by ``n / (n - 1)``) and written into the buffers in place. Statistics
    of 16-bit inputs are computed in float32, as torch's kernels do. Eval mode keeps the op
    (None: its own rule)."""
    if not training:
        return None
    momentum = 0.1 if momentum is None else momentum  # F.batch_norm's default
    shape = b.shape(x)
    channels, n = shape[1], math.prod(shape) // shape[1]
    over = [0] + list(range(2, len(shape)))
    per_channel = [1, channels] + [1] * (len(shape) - 2)
    low = x.meta["val"].dtype in (torch.float16, torch.bfloat16)
    xs = b(aten._to_copy.default, x, dtype=torch.float32) if low else x
    mean = b(aten.div.Tensor, b(aten.sum.dim_IntList, xs, over, True), n)
    centered = b(aten.sub.Tensor, xs, mean)
    var = b(aten.div.Tensor, b(aten.sum.dim_IntList, b(aten.mul.Tensor, centered, centered), over, True), n)
    y = b(aten.mul.Tensor, centered, b(aten.rsqrt.default, b(aten.add.Tensor, var, eps)))
    if low:
        y = b(aten._to_copy.default, y, dtype=x.meta["val"].dtype)
    if weight is not None:
        y = b(aten.mul.Tensor, y, b(aten.reshape.default, weight, per_channel))
    if bias is not None:
        y = b(aten.add.Tensor, y, b(aten.reshape.default, bias, per_channel))
    for stat, batch, scale in ((running_mean, mean, 1.0), (running_var, var, n / max(n - 1, 1))):
        if stat is None:
            continue
        # the update carries no gradient (torch's kernel writes it outside autograd)
        batch = b(aten.reshape.default, b(aten.detach.default, batch), [channels])
        if scale != 1.0:
            batch = b(aten.mul.Tensor, batch, scale)
        new = b(aten.add.Tensor, b(aten.mul.Tensor, batch, momentum), b(aten.mul.Tensor, stat, 1.0 - momentum))
        if new.meta["val"].dtype != stat.meta["val"].dtype:
            new = b(aten._to_copy.default, new, dtype=stat.meta["val"].dtype)
        b(aten.copy_.default, stat, new)
    return y


def _positions(b, base, dim):
    """arange(n) of ``base``'s dim as a [1, .., n, .., 1] tensor: each element's position there.
    Elementwise ops on it shard with the dim: a rank's block holds its global positions."""
    shape = b.shape(base)
    pos = b(aten.arange.default, shape[dim], dtype=torch.int64, device=b.device(base))
    return b(aten.reshape.default, pos, [n if k == dim else 1 for k, n in enumerate(shape)])


def _in_range(b, pos, start: int, end: int, step: int):
    mask = b(aten.logical_and.default, b(aten.ge.Scalar, pos, start), b(aten.lt.Scalar, pos, end))
    if step != 1:
        offset = b(aten.remainder.Scalar, b(aten.sub.Scalar, pos, start), step)
        mask = b(aten.logical_and.default, mask, b(aten.eq.Scalar, offset, 0))
    return mask


def select_scatter_as_where(b, base, src, dim: int, index: int):
    """select_scatter(base, src, d, i) == where(position == i, src.unsqueeze(d), base): an
    elementwise form, so a split of dim d needs no data moved (the rank owning position i
    writes it; global positions come from the position table's block) and gradients follow
    where's (src gets the gradient at i, base everywhere else)."""
    shape = b.shape(base)
    d = norm_dim(dim, len(shape))
    i = index + shape[d] if index < 0 else index
    mask = b(aten.eq.Scalar, _positions(b, base, d), i)
    return b(aten.where.self, mask, b(aten.unsqueeze.default, src, d), base)


def slice_scatter_as_where(b, base, src, dim: int = 0, start=None, end=None, step: int = 1):
    """slice_scatter(base, src, d, start, end, step) == where(position in the slice, src padded
    to base's length at its positions, base): elementwise in base's dim d (see
    select_scatter_as_where); the padded src is built whole (pad) and each rank reads its block."""
    shape = b.shape(base)
    d = norm_dim(dim, len(shape))
    n, step = shape[d], step or 1
    start, end, _ = slice(start, end, step).indices(n)
    m = b.shape(src)[d]
    if m == 0:
        return base
    wide = src
    if step != 1:  # src[j] at offset j * step: interleave step - 1 zeros, cut at the slice's end
        wide = b(aten.unsqueeze.default, src, d + 1)
        wide = b(aten.constant_pad_nd.default, wide, [0, 0] * (len(shape) - 1 - d) + [0, step - 1])
        wide = b(aten.reshape.default, wide, shape[:d] + [m * step] + b.shape(src)[d + 1:])
        wide = b(aten.slice.Tensor, wide, d, 0, min(m * step, n - start))
    length = b.shape(wide)[d]
    pads = [0, 0] * (len(shape) - 1 - d) + [start, n - start - length]
    if any(pads):
        wide = b(aten.constant_pad_nd.default, wide, pads)
    mask = _in_range(b, _positions(b, base, d), start, end, step)
    return b(aten.where.self, mask, wide, base)


def masked_index_put_as_where(b, base, indices, values, accumulate: bool = False):
    """x[mask] = v with one boolean mask over x's leading dims and a single value: the
    elementwise where(mask, v, x) (shards like a masked_fill); other index_puts keep their rule."""
    idx = [t for t in indices if t is not None]
    if accumulate or len(idx) != 1 or len(indices) != 1 or idx[0].meta["val"].dtype != torch.bool or \
            values.meta["val"].numel() != 1:
        return None
    shape, mshape = b.shape(base), b.shape(idx[0])
    if shape[:len(mshape)] != mshape:
        return None
    mask = idx[0] if len(mshape) == len(shape) else \
        b(aten.reshape.default, idx[0], mshape + [1] * (len(shape) - len(mshape)))
    value = b(aten.reshape.default, values, []) if b.shape(values) else values
    return b(aten.where.self, mask, value, base)


def expand_as_expand(b, x, other):
    """x.expand_as(other) == x.expand(other.shape): the sizes become the op's own (localized
    like expand's), not a tensor operand whose split the result would have to follow."""
    return b(aten.expand.default, x, b.shape(other))


# Ops rewritten at capture into ops with rules (passes/decompose.py): their result's dims are
# not one letter each (a dim that is an input dim followed by a new one), or a position they
# address would be a global index into a split dim (the scatters of passes/functionalize.py), or
# the op is a composite whose parts shard where it cannot (BatchNorm's batch statistics), or its
# sizes come from another tensor (expand_as). A function returning None keeps the node.
DECOMPOSITIONS = {
    aten.repeat_interleave.self_int: repeat_interleave_as_expand,
    aten.select_scatter.default: select_scatter_as_where,
    aten.slice_scatter.default: slice_scatter_as_where,
    aten.index_put.default: masked_index_put_as_where,
    aten.batch_norm.default: batch_norm_with_batch_statistics,
    aten.expand_as.default: expand_as_expand,
}


def is_inplace(op) -> bool:
    """Whether an aten op writes into its first argument (``add_``, ``copy_``, ``index_put_``)."""
    return _per_op(_INPLACE, op, _schema_writes_first)


def _per_op(table: dict, op, read) -> bool:
    """``read(op)``, memoized in ``table``: read from the op's schema once per op, as the rewrite
    asks per node (an unhashable callable is read each time)."""
    try:
        return table[op]
    except KeyError:
        pass
    except TypeError:
        return read(op)
    table[op] = got = read(op)
    return got


def _schema_writes_first(op) -> bool:
    schema = getattr(op, "_schema", None)
    first = schema.arguments[0] if schema is not None and schema.arguments else None
    return bool(first is not None and first.alias_info is not None and first.alias_info.is_write)


_INPLACE: dict = {}  # op -> is_inplace(op)


def _is_view(node: fx.Node) -> bool:
    """Whether a node's result shares storage with its first argument (view, slice, getitem of split)."""
    if node.op != "call_function":
        return False
    if node.target is GETITEM:
        return isinstance(node.args[0], fx.Node) and _is_view(node.args[0])
    return _per_op(_VIEW, node.target, _schema_returns_view)


def _schema_returns_view(op) -> bool:
    schema = getattr(op, "_schema", None)
    returns = schema.returns if schema is not None else []
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


_VIEW: dict = {}  # op -> whether its result is a view of its first argument


def aliases_read_later(node: fx.Node) -> bool:
    """Whether the tensor an in-place node writes is read after it other than through its own
    result: by a later user of the written value, or of a tensor it is a view of, or after the
    program (an input of it: a buffer's running statistics)."""
    order = {n: k for k, n in enumerate(node.graph.nodes)}
    here = order[node]
    todo, seen = [node.args[0]], set()
    while todo:
        v = todo.pop()
        if v in seen or not isinstance(v, fx.Node):
            continue
        seen.add(v)
        if v.op == "placeholder" or any(u is not node and order[u] > here for u in v.users):
            return True
        if _is_view(v):
            todo.append(v.args[0])
    return False


def _inplace_variants(rules: dict) -> dict:
    """``aten.add_.Tensor`` for ``aten.add.Tensor`` and so on: an in-place op computes what its
    functional op computes (the rewrite keeps its result in the place of the written operand)."""
    out = {}
    for op in rules:
        packet = getattr(aten, op.__name__.split(".")[0] + "_", None) if hasattr(op, "__name__") else None
        variant = getattr(packet, op._overloadname, None) if packet is not None else None
        if variant is not None and is_inplace(variant) and variant not in rules and \
                rules[op] not in (permute_rule, unsqueeze_rule):  # t_, squeeze_: they change the shape
            out[variant] = rules[op]
    return out


RULES.update(_inplace_variants(RULES))

# Ops whose local result must be rescaled when a mean runs over a sharded dim.
MEAN_OPS = {aten.mean.dim, aten.mean.default}
# Tuple-returning ops whose elements are picked by operator.getitem.
GETITEM = operator.getitem
