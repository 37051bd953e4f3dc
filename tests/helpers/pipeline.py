"""Pipeline training cases the pipeline tests share: a Llama-style model whose microbatches hold
different numbers of valid tokens, and its plan on each pipeline mesh."""
import autoshard
from autoshard import Mesh
from examples.models import llama_tiny


def masked_batch(batch=16, layers=8, **config):
    """Llama-style model with 8 layers; labels masked so microbatches have different numbers
    of valid tokens (one row entirely masked)."""
    model, (ids, _, labels), dims = llama_tiny(with_labels=True, batch=batch, num_layers=layers, **config)
    labels = labels.clone()
    for row in range(batch):
        labels[row, : row % 5] = -100
    labels[3] = -100
    return model, (ids, None, labels), dims


MESHES = {
    "pp2": ({"pp": 2}, {"batch": None}),
    "pp4": ({"pp": 4}, {"batch": None}),
    "pp2xdp2": ({"pp": 2, "dp": 2}, {"batch": "dp"}),
    "pp2xtp2": ({"pp": 2, "tp": 2}, {"batch": None, "heads": "tp", "ffn": "tp"}),
    "pp2xdp2xtp2": ({"pp": 2, "dp": 2, "tp": 2}, {"batch": "dp", "heads": "tp", "ffn": "tp"}),
}


def pipeline_plan(model, args, dims, mesh, schedule, m, zero=None, **pipeline):
    """The training plan on ``MESHES[mesh]`` with ``m`` microbatches of ``schedule`` (ZeRO stage ``zero``)."""
    axes, layout = MESHES[mesh]
    return autoshard.autoshard(model, args, mesh=Mesh(axes), dims=dims, layout=layout, train=True, zero_stage=zero,
                               pipeline={"microbatches": m, "schedule": schedule, **pipeline})
