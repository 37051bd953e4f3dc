"""Plain-PyTorch models written the way popular training code writes them (no framework), at test
size, with the dims a user names and their Megatron-style layout. Used by
``tests/test_plain_models.py`` and ``scripts/op_audit.py``.

- :class:`GPT`: a nanoGPT-style decoder: one fused q|k|v projection split after the matmul,
  ``x @ W.T`` linears over bare parameters, complex rotary embeddings as PyTorch-native Llama
  definitions write them (``torch.polar`` table, ``view_as_complex`` of pairs, ``view_as_real``
  back), the output head tied to the token embedding;
- :class:`MHAEncoder`: ``nn.MultiheadAttention`` (its packed ``in_proj_weight``) and an MLP;
- :class:`CNN`: convolutions with BatchNorm, pooled into a classifier.

Example::

    >>> model, args, dims = gpt()
    >>> float(model(*args)) > 0
    True
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 4, 8, 64, 32, 4, 2


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Complex rotations e^{i t f} for positions t < end and dim/2 frequencies f (Llama's way)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]: consecutive pairs of head_dim rotated as complex numbers."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden, bias=False)  # fused q|k|v
        self.w_o = nn.Parameter(torch.randn(hidden, hidden) * hidden ** -0.5)  # used as x @ W.T
        self.w_fc = nn.Parameter(torch.randn(4 * hidden, hidden) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(hidden, 4 * hidden) * (4 * hidden) ** -0.5)

    def forward(self, x, freqs_cis):
        b, s, e = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(e, dim=2)
        q, k, v = (t.view(b, s, self.heads, e // self.heads) for t in (q, k, v))
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + y.transpose(1, 2).reshape(b, s, e) @ self.w_o.T
        return x + F.gelu(self.ln_2(x) @ self.w_fc.T) @ self.w_out.T


class GPT(nn.Module):
    def __init__(self, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=LAYERS, max_seq=64):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.register_buffer("freqs_cis", precompute_freqs_cis(hidden // heads, max_seq), persistent=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        freqs = self.freqs_cis[: idx.shape[1]]
        for block in self.layers:
            x = block(x, freqs)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


GPT_DIMS = {"idx": "batch seq", "targets": "batch seq", "wte.weight": "vocab hidden",
            "*.c_attn.weight": "qkv hidden", "*.w_o": "hidden heads", "*.w_fc": "ffn hidden",
            "*.w_out": "hidden ffn", "*.ln_*": "hidden", "ln_f.*": "hidden"}


class MHAEncoder(nn.Module):
    """Post-norm encoder layers over ``nn.MultiheadAttention`` (packed in_proj_weight [3E, E])."""

    def __init__(self, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, layers=LAYERS):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "attn": nn.MultiheadAttention(hidden, heads, batch_first=True), "norm1": nn.LayerNorm(hidden),
            "fc1": nn.Linear(hidden, 2 * hidden), "fc2": nn.Linear(2 * hidden, hidden), "norm2": nn.LayerNorm(hidden),
        }) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for m in self.layers:
            x = m["norm1"](x + m["attn"](x, x, x, need_weights=False)[0])
            x = m["norm2"](x + m["fc2"](F.relu(m["fc1"](x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


MHA_DIMS = {"idx": "batch seq", "targets": "batch seq", "*.in_proj_weight": "qkv hidden", "*.in_proj_bias": "qkv",
            "*.out_proj.weight": "hidden heads", "*.fc1.weight": "ffn hidden", "*.fc1.bias": "ffn",
            "*.fc2.weight": "hidden ffn", "*norm*": "hidden"}


class CNN(nn.Module):
    """conv-BN-ReLU twice, global average pool, a linear classifier (a ResNet stem's pattern)."""

    def __init__(self, channels=8, classes=10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False), nn.BatchNorm2d(2 * channels)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x, labels):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.cross_entropy(self.fc(x.mean((2, 3))), labels)


CNN_DIMS = {"x": "batch channels height width", "labels": "batch", "conv1.weight": "c1 channels - -",
            "bn1.[wbr]*": "c1", "conv2.weight": "c2 c1 - -", "bn2.[wbr]*": "c2", "fc.weight": "classes c2"}
# (bn*.[wbr]*: weight, bias and the running statistics; num_batches_tracked is a scalar)


def _tokens(seed):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def gpt(seed: int = 0):
    """(model, args, dims) of the GPT."""
    torch.manual_seed(seed)
    return GPT().eval(), _tokens(seed), dict(GPT_DIMS)


def mha_encoder(seed: int = 0):
    torch.manual_seed(seed)
    return MHAEncoder().eval(), _tokens(seed), dict(MHA_DIMS)


def cnn(seed: int = 0, train: bool = False):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = CNN().train(train)
    return model, (torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g)), dict(CNN_DIMS)


# model -> (builder, Megatron-style tp layout, forward tp all-reduces per layer)
PLAIN = {
    "gpt": (gpt, {"heads": "tp", "ffn": "tp"}, 2),
    "mha_encoder": (mha_encoder, {"heads": "tp", "ffn": "tp"}, 2),
}
