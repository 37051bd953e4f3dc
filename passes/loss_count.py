"""How a program's loss adds up over microbatches: what gradient accumulation needs to know.

``run.py --grad-accum K`` trains on K planned batches per optimizer step, and the step must
equal one step on a batch K times as large. That depends on how the loss reduces its batch,
read from the per-rank program's last ops (as the pipeline split reads them, see
:func:`autoshard.passes.pipeline.microbatch_reduction`):

- ``"sum"``: the loss is a sum over the batch; the step's loss is the sum of the K losses;
- ``"mean"``: a mean over every element; the step's loss is the mean of the K (equal) ones;
- ``"count"``: a masked mean ``sum / count`` whose ``count`` comes from the inputs alone (a mean
  cross-entropy over the labels ``!= ignore_index``, which the capture writes out this way): the
  step divides by the count over *all* K microbatches (and every data rank: the program's
  count is already summed over them), so microbatches with more valid tokens weigh more. The
  count's ops are exported as their own small program (``normalizer.py``), run on each
  microbatch before its forward.

Any other tail (a scale by a constant that may be the batch size, a nonlinearity of the mean) is
``None``: the step's loss does not follow from the microbatches' exactly, and run.py refuses
``--grad-accum`` for it.

Example::

    acc = loss_accumulation(plan.program, plan.captured.inputs, plan.loss_index())
    acc.reduction, acc.normalizer_inputs        # ('count', ['labels'])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from .pipeline import _is_collective, _is_scalar, _normalizer_graph, microbatch_reduction

aten = torch.ops.aten


@dataclass
class LossAccumulation:
    """How the loss output adds up over microbatches (see the module docstring)."""

    reduction: Optional[str]  # "sum" | "mean" | "count" | None (cannot be accumulated exactly)
    normalizer: Optional[fx.GraphModule] = None  # "count": one microbatch's global count
    normalizer_inputs: list = field(default_factory=list)  # its arguments: program placeholder names


def _depends_on_trainable(graph: fx.Graph, trainable: set) -> dict:
    dep: dict = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            dep[n] = n.name in trainable
        else:
            dep[n] = any(dep.get(a, False) for a in n.all_input_nodes)
    return dep


def loss_accumulation(program, inputs, loss_index: Optional[int]) -> LossAccumulation:
    """The :class:`LossAccumulation` of ``program`` (the rewritten per-rank program of an
    unpipelined plan; ``inputs``: the captured inputs its placeholders index) for output
    ``loss_index``. Example::

        loss_accumulation(plan.program, plan.captured.inputs, plan.loss_index()).reduction   # 'count'
    """
    graph = program.graph_module.graph
    out = graph.output_node().args[0]
    if loss_index is None or not 0 <= loss_index < len(out) or not _is_scalar(out[loss_index]):
        return LossAccumulation(None)
    trainable = {name for name, kind, i in program.placeholders
                 if kind == "input" and inputs[i].kind == "parameter" and inputs[i].trainable}
    loss = out[loss_index]
    n = loss
    while isinstance(n, fx.Node) and _is_collective(n):
        n = n.args[0]
    if isinstance(n, fx.Node) and n.target is aten.div.Tensor and isinstance(n.args[1], fx.Node):
        count = n.args[1]
        if not _depends_on_trainable(graph, trainable)[count] and microbatch_reduction(n.args[0], strict=False) == "sum":
            normalizer, names = _normalizer_graph(list(graph.nodes), count, {})
            return LossAccumulation("count", normalizer, names)
    return LossAccumulation(microbatch_reduction(loss, strict=False))



NORMALIZER = "normalizer.py"  # the same file name as a pipelined export's loss count
NORMALIZER_HEADER = ('"""The loss count of one microbatch (its valid tokens over every data rank): run.py --grad-accum K\n'
                     "sums it over the step's K microbatches and weighs each microbatch's loss by its share, so\n"
                     'the K losses add up to the mean over the K microbatches together.\n"""\n')


def accumulation_json(acc: LossAccumulation) -> dict:
    """plan.json's ``"accumulation"`` section of an unpipelined export (the normalizer's program
    is written to :data:`NORMALIZER`). Example::

        accumulation_json(acc)   # {'reduction': 'count', 'normalizer': {'file': 'normalizer.py', 'inputs': ['labels']}}
    """
    norm = {"file": NORMALIZER, "inputs": list(acc.normalizer_inputs)} if acc.normalizer is not None else None
    return {"reduction": acc.reduction, "normalizer": norm}
