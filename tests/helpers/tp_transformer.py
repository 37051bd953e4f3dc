"""A small GPT-style transformer (tied head, learned positions) and its tensor-parallel training
plan on tp=2, with or without the overlap_linear pass: the tests of the passes that rewrite
tensor-parallel programs share it."""
from __future__ import annotations

import torch

import autoshard


class _Block(torch.nn.Module):
    """Pre-norm attention and GELU MLP as in PyTorch's test Transformer (benchmarks/vs_pytorch.py)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.wq(h), self.wk(h), self.wv(h)))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(torch.nn.functional.gelu(self.w1(self.ffn_norm(x))))


class Transformer(torch.nn.Module):
    """Token and position embeddings, pre-norm blocks, a head tied to the embedding; returns the loss."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2, seq=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.layers = torch.nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, tokens, labels):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = torch.nn.functional.linear(self.norm(x), self.tok.weight)  # tied output head
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


TP_DIMS = {"tokens": "batch seq", "labels": "batch seq", "tok.weight": "vocab hidden",
           "*.wq.weight": "heads hidden", "*.wk.weight": "heads hidden", "*.wv.weight": "heads hidden",
           "*.wo.weight": "hidden heads", "*.w1.weight": "ffn hidden", "*.w1.bias": "ffn", "*.w2.weight": "hidden ffn"}


def transformer_plan(fuse=True, layout=None, **options):
    """(plan, args): :class:`Transformer` on tp=2 (Megatron layout unless ``layout``), trained;
    ``fuse=False`` leaves out the overlap_linear pass."""
    torch.manual_seed(0)
    model = Transformer()
    g = torch.Generator().manual_seed(1)
    args = (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
    plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"tp": 2}), dims=TP_DIMS,
                               layout=layout or {"heads": "tp", "ffn": "tp", "vocab": "tp"}, train=True,
                               search=False, **{"disable_passes": () if fuse else ("overlap_linear",), **options})
    return plan, args
