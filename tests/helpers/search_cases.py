"""The search tests' cases: randomly generated residual stacks (attention and MLP blocks, some
repeated so the evaluator cuts the graph) on random meshes and random hardware, the structured
example models, and a program captured with its dims named, ready for the search."""
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard import Mesh
from autoshard.cost import DeviceSpec, Hardware, LinkSpec
from autoshard.cost.model import CostModel
from autoshard.passes.capture import capture
from autoshard.passes.dims import infer_dims
from autoshard.api import apply_dim_names
from autoshard.passes.param_names import name_parameter_dims
from examples.models import gpt2_tiny, llama_tiny
from tests.helpers import plain_models


class Block(nn.Module):
    def __init__(self, kind, hidden, ffn, heads, head_dim):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(hidden)
        if kind in ("mlp", "both"):
            self.up = nn.Linear(hidden, ffn, bias=False)
            self.down = nn.Linear(ffn, hidden, bias=True)
        if kind in ("attn", "both"):
            self.heads, self.head_dim = heads, head_dim
            self.q = nn.Linear(hidden, heads * head_dim, bias=False)
            self.k = nn.Linear(hidden, heads * head_dim, bias=False)
            self.v = nn.Linear(hidden, heads * head_dim, bias=False)
            self.o = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        if self.kind in ("attn", "both"):
            h = self.norm(x)
            q, k, v = (p(h).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        if self.kind in ("mlp", "both"):
            x = x + self.down(F.gelu(self.up(self.norm(x) if self.kind == "mlp" else x)))
        return x


class RandomNet(nn.Module):
    """Embedding (or a linear input layer), identical residual blocks, head, summed loss."""

    def __init__(self, r: random.Random):
        super().__init__()
        self.hidden = r.choice([8, 16, 24])
        self.ffn = r.choice([8, 16, 32, 48])
        self.heads, self.head_dim = r.choice([(2, 4), (4, 2), (2, 2)])
        self.vocab = r.choice([None, 16, 32])
        kind = r.choice(["mlp", "attn", "both"])
        n = r.choice([1, 2, 4, 5])
        self.inp = nn.Embedding(self.vocab, self.hidden) if self.vocab else nn.Linear(6, self.hidden, bias=False)
        self.layers = nn.ModuleList(Block(kind, self.hidden, self.ffn, self.heads, self.head_dim) for _ in range(n))
        self.head = nn.Linear(self.hidden, self.vocab or 6, bias=False)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return (self.head(h) ** 2).sum()

    def dims(self):
        d = {"x": "batch seq" if self.vocab else "batch seq feat", "head.weight": "out hidden"}
        kind = self.layers[0].kind
        if kind in ("mlp", "both"):
            d.update({"*.up.weight": "ffn hidden", "*.down.weight": "hidden ffn"})
        if kind in ("attn", "both"):
            d.update({"*.q.weight": "heads hidden", "*.k.weight": "heads hidden", "*.v.weight": "heads hidden",
                      "*.o.weight": "hidden heads"})
        d["inp.weight"] = "vocab hidden" if self.vocab else "hidden feat"
        return d


def random_hardware(r: random.Random) -> Hardware:
    """A device and two links (a fast one within pairs, a slow one) of random speeds."""
    dev = DeviceSpec("rand", {"fp32": 10 ** r.uniform(7, 11)}, mem_bandwidth=10 ** r.uniform(8, 11),
                     mem_capacity=1e12, op_overhead=r.choice([0.0, 1e-6]))
    fast = LinkSpec(10 ** r.uniform(8, 11), latency=10 ** r.uniform(-7, -4), domain_size=2, name="fast")
    slow = LinkSpec(10 ** r.uniform(7, 10), latency=10 ** r.uniform(-6, -3), name="slow")
    return Hardware("rand", dev, (fast, slow))


def random_case(seed: int):
    """(model, args, dims, mesh, cost model, train, rng) of random program ``seed``."""
    r = random.Random(seed)
    torch.manual_seed(seed)
    model = RandomNet(r)
    batch, seq = r.choice([2, 4, 8]), r.choice([4, 8])
    x = torch.randint(0, model.vocab, (batch, seq)) if model.vocab else torch.randn(batch, seq, 6)
    mesh = Mesh(r.choice([{"x": 2}, {"x": 4}, {"a": 2, "b": 2}]))
    train = r.random() < 0.5
    return model, (x,), model.dims(), mesh, CostModel(random_hardware(r), overlap=r.random() < 0.7), train, r


def inputs_only(model_args_dims):
    """The model with only its inputs named: every parameter dim gets a module-derived name,
    as when the search runs without weight annotations (autoshard.passes.param_names)."""
    model, args, dims = model_args_dims
    return model, args, {k: v for k, v in dims.items() if "." not in k and "*" not in k}, True


STRUCTURED = {
    "llama-dp2tp2": lambda: (llama_tiny(with_labels=True), Mesh({"dp": 2, "tp": 2}), "h100", False),
    "llama-tp4-train": lambda: (llama_tiny(with_labels=True), Mesh({"tp": 4}), "h100", True),
    "llama5-tp2-train": lambda: (llama_tiny(with_labels=True, num_layers=5), Mesh({"tp": 2}), "cpu-gloo", True),
    "gpt2-tp4": lambda: (gpt2_tiny(with_labels=True), Mesh({"tp": 4}), "cpu-gloo", False),
    # only the inputs named, every dim open (the space the search meets on a first try): a CNN
    # with BatchNorm, and a decoder with rotary attention (name classes, stopped one-axis rewrites)
    "cnn-inputs-tp4-train": lambda: (inputs_only(plain_models.cnn(train=True)), Mesh({"tp": 4}), "h100", True),
    "gpt-inputs-tp4-train": lambda: (inputs_only(plain_models.gpt()), Mesh({"tp": 4}), "h100", True),
    # the small CNN on two axes: a product of axis options large enough to be taken lazily
    "cnn-inputs-dp2tp2-train": lambda: (inputs_only(plain_models.cnn(train=True)), Mesh({"dp": 2, "tp": 2}), "h100",
                                        True),
}


def prepared(model, args, dims, name_params=False):
    """(captured program, dims info) with the user's ``dims`` applied: the search's input;
    ``name_params``: parameter dims nobody named get module-derived names, as the search gives them."""
    cap = capture(model, args)
    info = infer_dims(cap.graph, {i.name: i.target for i in cap.inputs})
    apply_dim_names(info, cap, dims)
    if name_params:
        name_parameter_dims(info, cap.graph, cap.inputs)
    return cap, info


def hf_planned(arch, axes):
    """(plan, search space) of the Hugging Face ``arch`` (``tests/helpers/hf_zoo.py``, built from
    its config) with only its inputs named: ``autoshard()`` on ``Mesh(axes)``, training, h100, and
    a fresh ``SearchSpace`` over the program it captured."""
    import warnings

    import autoshard
    from autoshard.cost import load_hardware
    from autoshard.cost.search import SearchSpace
    from tests.helpers import hf_zoo

    spec = hf_zoo.ARCHS.get(arch) or hf_zoo.ZOO[arch]
    model, kwargs = spec.build()
    dims = {k: v for k, v in spec.all_dims.items() if k in kwargs}
    mesh = Mesh(axes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.autoshard(model, (), kwargs, mesh=mesh, dims=dims, train=True, hardware="h100")
    space = SearchSpace(plan.captured.graph, plan.captured.inputs, plan.info, mesh, CostModel(load_hardware("h100")),
                        train=True)
    return plan, space
