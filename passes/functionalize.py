"""Functionalization: in-place writes become functional ops at capture, so no write can land in
a copy.

torch.export keeps ``y[0] = 0`` as ``select(y, 0, 0)`` followed by ``fill_`` on that view, and
later ops read ``y`` itself. The rewrite gives every value its own placement; if the view's
placement differs from ``y``'s (a select along a sharded dim gathers ``y`` first), the write
lands in the gathered copy and ``y`` never sees it. Here every in-place op becomes its
functional op on the current value of what it writes, and the new value is carried back to the
written tensor's base through the views in between (``select`` -> ``select_scatter``, ``slice``
-> ``slice_scatter``, reshapes and transposes -> their inverse); every later reader of the base,
or of an alias of it made before the write, reads the new value (an alias is re-derived from it
by replaying its views). ``passes/decompose.py`` then writes the scatters as ``where`` over a
position table, which shards along the written dim without moving data (``rules.DECOMPOSITIONS``).

A written input (a buffer) gets its last value copied back into it at the end of the program
(``copy_``, the one write left in place). Writes that cannot be made functional here (no functional op, or a view with no inverse below:
``expand``, ``as_strided``, a ``detach``) stay in place; the rewrite refuses them with a
``LayoutError`` if a layout would make them write into a copy whose base is read later.

Example::

    >>> import torch
    >>> from autoshard.passes.capture import capture
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         y = x.clone()
    ...         y[0] = 0
    ...         return y
    >>> g = capture(M(), (torch.ones(2, 3),)).graph
    >>> any(n.target == torch.ops.aten.fill_.Tensor for n in g.nodes)
    False
"""
from __future__ import annotations

import torch
from torch import fx

from .decompose import KEPT_META, Builder
from .rules import GETITEM, _is_view, is_inplace, norm_dim, shape_of

aten = torch.ops.aten


def functional_op(op):
    """The functional op an in-place op computes (``aten.fill_.Tensor`` -> ``aten.fill.Tensor``),
    or None (no such op).

    >>> functional_op(torch.ops.aten.index_put_.default)
    <OpOverload(op='aten.index_put', overload='default')>
    """
    if op in FUNCTIONAL:
        return FUNCTIONAL[op]
    name = getattr(op, "__name__", "").split(".")[0]
    if not is_inplace(op) or not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    f = getattr(packet, op._overloadname, None) if packet is not None else None
    return f if f is not None and not is_inplace(f) else None


def _copy_value(b, dst, src, non_blocking=False):
    """dst.copy_(src) makes dst src, broadcast to dst's shape in dst's dtype (aten.copy, its
    functional op, has no derivative)."""
    v = src
    if v.meta["val"].dtype != dst.meta["val"].dtype:
        v = b(aten._to_copy.default, v, dtype=dst.meta["val"].dtype)
    if b.shape(v) != b.shape(dst):
        v = b(aten.expand.default, v, b.shape(dst))
    return b(aten.clone.default, v) if v is src or v.target == aten.expand.default else v


def _fill_value(b, dst, value):
    """dst.fill_(value) / zero_(): the value broadcast, not an op on dst, so the values of
    the view written into are never read (a view along a split dim is then never gathered)."""
    if not isinstance(value, fx.Node):
        value = b(aten.scalar_tensor.default, value, dtype=dst.meta["val"].dtype, device=b.device(dst))
    return _copy_value(b, dst, value)


# In-place ops whose functional form is not the op named without the underscore (an op, or a
# function of (Builder, *args) emitting it); None: random fills stay in place (dropout-like:
# every rank would draw its own).
FUNCTIONAL = {
    aten.copy_.default: _copy_value,
    aten.fill_.Scalar: _fill_value, aten.fill_.Tensor: _fill_value,
    aten.zero_.default: lambda b, dst: _fill_value(b, dst, 0),
    aten.uniform_.default: None, aten.normal_.default: None, aten.bernoulli_.float: None,
    aten.bernoulli_.Tensor: None, aten.exponential_.default: None, aten.random_.default: None,
}


def _reshape_back(b, base, new, view):
    return b(aten.reshape.default, new, b.shape(base))


def _select_back(b, base, new, view):
    return b(aten.select_scatter.default, base, new, view.args[1], view.args[2])


def _slice_back(b, base, new, view):
    a = list(view.args) + [None] * (5 - len(view.args))
    dim = view.kwargs.get("dim", a[1] if a[1] is not None else 0)
    start, end = view.kwargs.get("start", a[2]), view.kwargs.get("end", a[3])
    step = view.kwargs.get("step", a[4] if a[4] is not None else 1)
    return b(aten.slice_scatter.default, base, new, dim, start, end, step)


def _narrow_back(b, base, new, view):
    dim, start, length = view.args[1:4]
    n = b.shape(base)[norm_dim(dim, len(b.shape(base)))]
    start = start + n if start < 0 else start
    return b(aten.slice_scatter.default, base, new, dim, start, start + length, 1)


def _transpose_back(b, base, new, view):
    return b(aten.transpose.int, new, view.args[1], view.args[2])


def _t_back(b, base, new, view):
    return b(aten.t.default, new)


def _permute_back(b, base, new, view):
    order = [norm_dim(d, len(b.shape(base))) for d in view.args[1]]
    return b(aten.permute.default, new, [order.index(k) for k in range(len(order))])


def _identity_back(b, base, new, view):
    return new


def _diagonal_back(b, base, new, view):
    return b(aten.diagonal_scatter.default, base, new, *view.args[1:], **view.kwargs)


def _split_item_back(b, base, new, item):
    """getitem k of split / split_with_sizes / chunk / unbind: the part is a slice (a select
    for unbind) of the split's input."""
    split, k = item.args
    if split.target == aten.unbind.int:
        return b(aten.select_scatter.default, base, new, split.args[1] if len(split.args) > 1 else 0, k)
    shp = shape_of(split.args[0])
    dim = norm_dim(split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0), len(shp))
    start = sum(v.shape[dim] for v in split.meta["val"][:k])
    return b(aten.slice_scatter.default, base, new, dim, start, start + split.meta["val"][k].shape[dim], 1)


# view op -> (builder, base value, new value of the view, the view node) -> new value of the base
SCATTER_BACK = {
    aten.select.int: _select_back,
    aten.slice.Tensor: _slice_back,
    aten.narrow.default: _narrow_back,
    **{op: _reshape_back for op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                                    aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default,
                                    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                                    aten.view_as.default, aten.reshape_as.default)},
    aten.transpose.int: _transpose_back,
    aten.t.default: _t_back,
    aten.permute.default: _permute_back,
    aten.alias.default: _identity_back,
    aten.diagonal.default: _diagonal_back,
    GETITEM: _split_item_back,
}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}

# ops whose result is its input when the input allows it (schema ``Tensor(a)``), else a copy
MAYBE_VIEWS = {aten.reshape.default, aten.flatten.using_ints, aten.unflatten.int, aten.reshape_as.default,
               aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default}


def _aliases(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of its first argument in eager mode (a reshape of a
    non-contiguous tensor, a ``to`` that converts, ``contiguous`` of a transposed tensor copy)."""
    if not _is_view(node):
        return False
    if node.target not in MAYBE_VIEWS:
        return True
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if node.target in (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default):
        return out.dtype == src.dtype and out.device == src.device and not node.kwargs.get("copy", False)
    if node.target == aten.contiguous.default:
        return src.is_contiguous()
    try:  # a reshape is a view exactly where view() succeeds on the input's strides
        torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="meta").view(out.shape)
        return True
    except RuntimeError:
        return False


class _Versions:
    """What each storage holds now: a root (a value that is not a view) has a current value and
    a version; an alias is (root, chain of view nodes) and is re-derived when its root moved on."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.alias: dict = {}  # node -> (root, tuple of view nodes from the root)
        self.cur: dict = {}  # root -> its current value
        self.ver: dict = {}  # root -> number of writes so far
        self.made: dict = {}  # view node -> (version, its value at that version)

    def of(self, v):
        return self.alias.get(v, (v, ()))

    def fresh(self, v) -> bool:
        root, chain = self.of(v)
        if not chain:
            return self.cur.get(root, root) is v
        return self.made.get(chain[-1]) == (self.ver.get(root, 0), v)

    def value(self, root, chain, anchor):
        """The current value of ``root`` seen through ``chain`` (views replayed before ``anchor``)."""
        if not chain:
            return self.cur.get(root, root)
        view = chain[-1]
        got = self.made.get(view)
        if got is not None and got[0] == self.ver.get(root, 0):
            return got[1]
        base = self.value(root, chain[:-1], anchor)
        if view.target is GETITEM:
            new = Builder(self.graph, anchor)(GETITEM, base, view.args[1])
        else:
            new = Builder(self.graph, anchor)(view.target, base, *view.args[1:], **view.kwargs)
        new.meta.update({k: v for k, v in view.meta.items() if k in KEPT_META})
        self.alias[new] = (root, chain)
        self.made[view] = (self.ver.get(root, 0), new)
        return new


def functionalize(graph: fx.Graph, state=()) -> int:
    """Rewrite every in-place write that has a functional op and invertible views into
    functional ops (see the module docstring); returns how many. ``state``: names of the
    placeholders that outlive the program (buffers), whose last value is copied back."""
    if not any(n.op == "call_function" and is_inplace(n.target) for n in graph.nodes):
        return 0
    s = _Versions(graph)
    done = 0
    for node in list(graph.nodes):
        if node.op not in ("call_function", "output"):
            continue
        for a in list(node.all_input_nodes):  # readers see what their inputs hold now
            if not s.fresh(a):
                node.replace_input_with(a, s.value(*s.of(a), node))
        if node.op == "output":
            continue
        if is_inplace(node.target):
            dst = node.args[0]
            if _write(s, node):
                done += 1
            elif isinstance(dst, fx.Node):  # left in place: its result is the written tensor
                s.alias[node] = s.of(dst)
            continue
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if src is not None and (node.target is GETITEM or _aliases(node)):
            root, chain = s.of(src)
            if node.target is GETITEM and src.target not in SPLITS:
                continue  # an item of some other multi-output op: not an alias
            s.alias[node] = (root, chain + (node,))
            s.made[node] = (s.ver.get(root, 0), node)
    # A written input (a buffer's counter or running statistic) outlives the program: its last
    # value is copied back into it at the end, the one write that stays in place
    out = next(n for n in graph.nodes if n.op == "output")
    for root, new in s.cur.items():
        if root.op == "placeholder" and root.name in state and new is not root:
            Builder(graph, out)(aten.copy_.default, root, new)
    if done:
        graph.eliminate_dead_code()
    return done


def _write(s: _Versions, node: fx.Node) -> bool:
    """``node`` (in place) as its functional op, carried back to its root; False: left in place."""
    fn = functional_op(node.target)
    dst = node.args[0]
    root, chain = s.of(dst)
    invertible = [v for v in chain if v.target in SCATTER_BACK or v.target in SPLITS]
    if fn is None or len(invertible) != len(chain) or not isinstance(dst.meta.get("val"), torch.Tensor):
        # stays in place; it writes into the current storage, so readers after it see it
        return False
    b = Builder(s.graph, node)
    op = isinstance(fn, torch._ops.OpOverload)
    new = b(fn, *node.args, **node.kwargs) if op else fn(b, *node.args, **node.kwargs)
    want = dst.meta["val"]
    if new.meta["val"].dtype != want.dtype:  # an in-place op keeps its operand's dtype
        new = b(aten._to_copy.default, new, dtype=want.dtype)
    if tuple(new.meta["val"].shape) != tuple(want.shape):
        return False  # (torch raises in eager for an in-place op that would broadcast its operand)
    result = new
    bases = [s.value(root, chain[:k], node) for k in range(len(chain))]
    for view, base in zip(reversed(chain), reversed(bases)):
        if view.target in SPLITS:
            continue  # the item carried the part back into the split's input already
        if view.target is GETITEM:
            base = s.value(root, chain[:chain.index(view) - 1], node)
        new = SCATTER_BACK[view.target](b, base, new, view)
    s.ver[root] = s.ver.get(root, 0) + 1
    s.cur[root] = new
    s.alias[new] = (root, ())  # a later write into the new value writes the same storage
    if chain:
        s.alias[result] = (root, chain)
        s.made[chain[-1]] = (s.ver[root], result)
    node.replace_all_uses_with(result)  # the in-place op returns its (now written) operand
    s.graph.erase_node(node)
    return True
