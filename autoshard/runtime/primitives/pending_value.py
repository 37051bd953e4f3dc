"""A forward sum returned before it arrives: the value waits for its collective when read.

A data-parallel loss is the sum of every rank's partial loss, all-reduced at the very end of
forward. Nothing in backward reads that sum (an all-reduce's backward is the identity), so
waiting for it there only makes every rank wait for the slowest once more per step (DDP returns
each rank's own loss and has no such wait). The program instead starts the sum and returns a
:class:`PendingValue`: a tensor whose data is the started collective. Autograd runs through it
as usual (the seed gradient of ``loss.backward()`` needs the shape alone), and the first read of
its data (``.item()``, printing, any op that is not pointwise or a view) waits for the sum,
so a value read is always the finished sum. Pointwise ops and views applied to it before that
(a mean's division by the token count, say) are recorded and replayed on the sum once it
arrives, so the whole tail of the loss stays pending.

Like torch's own ``AsyncCollectiveTensor`` (functional collectives), it is a wrapper tensor
subclass; unlike it, ops on it stay lazy, so the returned loss itself can be pending.

Example::

    pending = backend.all_reduce_async(partial_loss, "dp")       # started, not waited for
    loss = PendingValue.of(pending, like=partial_loss)
    mean = loss / count                                          # recorded, still pending
    mean.item()                                                  # waits, divides, reads
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_map

# Ops that only need a tensor's metadata: autograd's seed gradient for ``loss.backward()``.
_METADATA_ONLY = {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
                  torch.ops.aten.empty_like.default}


class PendingValue(torch.Tensor):
    """A tensor whose data is computed on first read (see the module docstring)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, compute, family: list | None = None):
        out = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                  device=like.device, requires_grad=False)
        out._compute, out._value = compute, None
        # Every value derived from one pending sum: an in-place write to one of them first
        # computes the others, so none replays the write it was made before.
        out._family = family if family is not None else []
        out._family.append(weakref.ref(out))
        return out

    @classmethod
    def of(cls, pending, like: torch.Tensor) -> "PendingValue":
        """The result of ``pending`` (a started collective with ``.wait()``) shaped as ``like``."""
        return cls(like, pending.wait)

    def value(self) -> torch.Tensor:
        """The data: waits for the collective (and replays recorded ops) on first call."""
        if self._value is None:
            self._value, self._compute = self._compute(), None
        return self._value

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_ONLY:
            like, *rest = args
            return func(torch.empty(like.shape, dtype=like.dtype, device=like.device), *rest, **kwargs)
        pending = [a for a in args if isinstance(a, PendingValue)]
        if replayable(func) and len(pending) == 1 and pending[0]._value is None and \
                not any(isinstance(v, PendingValue) for v in kwargs.values()):
            return _record(func, args, kwargs, pending[0])
        if func._schema.is_mutable:
            for a in pending:
                a._compute_family()
        read = lambda a: a.value() if isinstance(a, PendingValue) else a  # noqa: E731
        return func(*tree_map(read, args), **tree_map(read, kwargs))

    def _compute_family(self):
        for ref in self._family:
            member = ref()
            if member is not None:
                member.value()

    # Python-level reads that do not go through dispatch: the finished value answers them.
    def __repr__(self, *, tensor_contents=None):
        return repr(self.value())

    def __format__(self, spec):
        return self.value().__format__(spec)

    def tolist(self):
        return self.value().tolist()

    def numpy(self, *args, **kwargs):
        return self.value().numpy(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self.value().detach().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.value().detach().clone()


def replayable(func) -> bool:
    """Pointwise ops and views (no writes) returning one tensor: cheap to replay once the value
    arrives. (``equal`` is tagged pointwise but returns a bool: it reads the data.)"""
    schema = func._schema
    if schema.is_mutable or len(schema.returns) != 1 or not isinstance(schema.returns[0].type, torch.TensorType):
        return False
    return torch.Tag.pointwise in func.tags or schema.returns[0].alias_info is not None


def _record(func, args, kwargs, source: PendingValue) -> PendingValue:
    # The other operands are copied now: a later in-place write to them must not reach the
    # replayed op (tensors beside a pending loss are scalars, so the copies are small).
    frozen = [a.clone() if isinstance(a, torch.Tensor) and a is not source else a for a in args]
    stand_in = [torch.empty(source.shape, dtype=source.dtype, device=source.device) if a is source else a
                for a in frozen]
    like = func(*stand_in, **kwargs)
    return PendingValue(like, lambda: func(*[source.value() if a is source else a for a in frozen], **kwargs),
                        family=source._family)
