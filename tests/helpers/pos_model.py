"""A model whose replicated work feeds per-rank work (a position table looked up at arange(seq)),
its batches and its data-parallel training plan: the tests of the gradient sums of replicated
regions share it."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard import Mesh
from tests.helpers.exactness import assert_trains_like_single_device

VOCAB, SEQ, DIM = 16, 8, 12


class PosModel(nn.Module):
    """Token + position embeddings (the position one is looked up at ``arange(seq)``: replicated
    work feeding per-rank work), a scale read both ways, a mean cross-entropy. ``aux``: add a
    replicated term of the position table to the loss (its gradient comes in whole)."""

    def __init__(self, aux=False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.out = nn.Linear(DIM, VOCAB)
        self.aux = aux

    def forward(self, ids, labels):
        p = self.pos(torch.arange(ids.shape[1])) * self.scale
        h = torch.tanh(self.tok(ids) * self.scale + p)
        loss = F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten())
        return loss + 0.1 * (p ** 2).mean() if self.aux else loss


def batch(seed=0):
    """Seeded (ids, labels) of 4 rows; rank 0's rows count fewer tokens than rank 1's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels[0, :5] = -100  # rank 0 counts fewer tokens than rank 1
    return ids, labels


DIMS = {"ids": "batch seq", "labels": "batch seq"}


def plan_for(model, args, zero_stage=0, **options):
    """The dp=2 training plan of ``model`` (the batch split on dp)."""
    torch.manual_seed(0)
    return autoshard.autoshard(model, args, mesh=Mesh({"dp": 2}), dims=DIMS, layout={"batch": "dp"}, train=True,
                               zero_stage=zero_stage, **options)


def train_matches_single_device(plan, model, microbatches=1):
    """3 steps of ``plan`` match single-device training within its spread."""
    steps = [batch(s) for s in range(3)]
    if microbatches > 1:
        steps = [[tuple(t[i::2] for t in b) for i in range(2)] for b in steps]
    assert_trains_like_single_device(plan, model, steps, microbatches=microbatches)


class Embedded(torch.nn.Module):
    """Token and position embeddings, then two blocks and a head, plus a penalty on the position
    table: its gradient comes in whole there, so the table stays out of the units (gathered for
    replicated use by a plain all_gather between them, its rows' gradient summed where they meet
    the tokens', passes/grad_regions.py)."""

    def __init__(self, vocab=16, seq=8, dim=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, labels):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        loss = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return loss + 1e-2 * self.pos.weight.pow(2).mean()
