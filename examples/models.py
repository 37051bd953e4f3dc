"""Example models for autoshard: a Llama-style and a GPT-2-style decoder, and a Llama-style
Mixture-of-Experts decoder in two shapes (sparse dispatch and looped experts), pure torch.

The modules mirror Hugging Face's submodule names (``layers.0.self_attn.q_proj``,
``h.0.attn.c_attn``, ...) and its forward-code idioms (repeat_kv via expand+reshape, Conv1D via
addmm, masks built from cumsum/arange comparisons), because those idioms are what autoshard must
capture, name and localize in real user code. Nothing here depends on transformers.

Factories return ``(model, example_args, dims)``, ready for ``autoshard.autoshard``::

    from examples.models import llama_tiny
    model, args, dims = llama_tiny(with_labels=True)
    loss = model(*args)                                  # scalar mean cross-entropy
    plan = autoshard.autoshard(model, args, mesh=mesh, dims=dims, train=True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.runtime.primitives.experts import grouped_mm

__all__ = [
    "LlamaConfig", "Llama", "GPT2Config", "GPT2", "Conv1D", "init_weights",
    "llama_tiny", "gpt2_tiny", "llama_8b_meta", "factory", "FACTORIES",
    "MoEConfig", "MoE", "moe_tiny",
]


def _shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token mean cross-entropy; -100 labels are ignored (and not counted in the mean)."""
    # HF upcasts logits before the loss so bf16 runs keep an fp32 softmax.
    logits = logits[:, :-1, :].float()
    labels = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                           ignore_index=-100)


# --------------------------------------------------------------------------------------------
# Llama
# --------------------------------------------------------------------------------------------

@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 64

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like HF, so the graph carries the same `to` casts as real code.
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config  # as HF keeps it: a model built on meta recomputes inv_freq from it at export
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        # Not persistent: it is derived from the config, so state_dicts stay HF-compatible.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        # [b, d/2, 1] @ [b, 1, s] -> [b, d/2, s]: the HF formulation (a matmul, not an outer).
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        freqs = (inv_freq @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)  # broadcast over heads: [b, 1, s, d]
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv, s, d] -> [b, kv * n_rep, s, d], written exactly as HF does (expand + reshape)."""
    b, kv, s, d = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(b, kv, n_rep, s, d)
    return x.reshape(b, kv * n_rep, s, d)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.n_rep = config.num_heads // config.num_kv_heads
        h, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, h, bias=False)

    def forward(self, x, cos, sin, attn_mask=None):
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # -1: the head count, as in HF
        q = self.q_proj(x).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(x).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(x).view(hidden_shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             is_causal=attn_mask is None)
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-style causal decoder (RMSNorm, RoPE, GQA, SwiGLU) with HF submodule names.

    ``forward(input_ids, attention_mask=None, labels=None)`` returns logits ``[b, s, vocab]``,
    or the scalar mean next-token loss when ``labels`` is given. ``attention_mask`` is a
    ``[b, s]`` 0/1 padding mask (left padding: positions restart at the first real token).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _mask_and_positions(attention_mask: torch.Tensor, dtype: torch.dtype):
        """Padding mask -> (position_ids [b, s], boolean SDPA mask [b, 1, s, s]).

        Written the way real-world code does it (cumsum positions, arange comparisons, expand,
        indexing, dtype casts), because autoshard has to shard exactly these index ops.
        """
        b, s = attention_mask.shape
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(attention_mask == 0, 1)
        idx = torch.arange(s, device=attention_mask.device)
        causal = idx[None, :] <= idx[:, None]                       # [s_q, s_k]
        causal = causal[None, None, :, :].expand(b, 1, s, s)
        keep = attention_mask.to(torch.bool)
        key_ok = keep[:, None, None, :]                            # [b, 1, 1, s_k]
        # A padded query would otherwise attend to nothing: SDPA returns NaN for such rows and
        # the NaN then leaks through 0 * NaN in later layers' masked matmuls. HF unmasks those
        # rows too (AttentionMaskConverter._unmask_unattended); here they see their causal past.
        pad_query = ~keep[:, None, :, None]                        # [b, 1, s_q, 1]
        mask = causal & (key_ok | pad_query)
        # Round-trip through the activation dtype like code that builds additive masks does;
        # the bool result is what SDPA gets.
        mask = mask.to(dtype).to(torch.bool)
        return position_ids, mask

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed_tokens(input_ids)
        if attention_mask is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            mask = None
        else:
            position_ids, mask = self._mask_and_positions(attention_mask, x.dtype)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return _shifted_loss(logits, labels)


# --------------------------------------------------------------------------------------------
# GPT-2
# --------------------------------------------------------------------------------------------

@dataclass
class GPT2Config:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    max_seq_len: int = 64
    intermediate_size: int | None = None  # None: 4 * hidden_size
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0  # embedding, attention-probability, residual and MLP dropout

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out], applied with addmm on a flattened input."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.c_attn = Conv1D(3 * config.hidden_size, config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, config.hidden_size)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        # SDPA applies attention-probability dropout itself; the module only carries p (HF too).
        p = self.attn_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(b, s, self.hidden)
        return self.resid_dropout(self.c_proj(out))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(config.ffn_size, config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, config.ffn_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2-style decoder (learned positions, LayerNorm, GELU-tanh, Conv1D) with HF names.

    ``forward(input_ids, labels=None)`` returns logits ``[b, s, vocab]``, or the scalar mean
    next-token loss when ``labels`` is given. The LM head is tied to ``wte``.
    """

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, labels=None):
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return _shifted_loss(logits, labels)


# --------------------------------------------------------------------------------------------
# Initialization and factories
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.1) -> nn.Module:
    """Deterministically fill every parameter with non-trivial values; returns ``model``.

    Matrices and biases get N(0, std); norm weights get 1 + N(0, std) (not exactly 1, so a
    wrongly dropped or double-applied norm weight shows up in gradient checks). Tied parameters
    are visited once. Meta parameters are skipped (they have no storage).
    """
    gen = torch.Generator().manual_seed(seed)
    norm_weights = {
        id(m.weight) for m in model.modules()
        if isinstance(m, (LlamaRMSNorm, nn.LayerNorm)) and m.weight is not None
    }
    for _, p in model.named_parameters():
        if p.is_meta:
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
        if id(p) in norm_weights:
            noise += 1.0
        p.copy_(noise.to(p.dtype))
    return model


def _token_args(vocab: int, batch: int, seq: int, seed: int, device=None):
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids if device is None else ids.to(device)


def _dims_for(args_present: dict, params: dict) -> dict:
    dims = {name: "batch seq" for name, present in args_present.items() if present}
    dims.update(params)
    return dims


LLAMA_PARAM_DIMS = {
    "embed_tokens.weight": "vocab hidden",
    "*.q_proj.weight": "heads hidden",
    "*.k_proj.weight": "kv_heads hidden",
    "*.v_proj.weight": "kv_heads hidden",
    "*.o_proj.weight": "hidden heads",
    "*.gate_proj.weight": "ffn hidden",
    "*.up_proj.weight": "ffn hidden",
    "*.down_proj.weight": "hidden ffn",
    "*norm.weight": "hidden",
    "lm_head.weight": "vocab hidden",
}

# Conv1D weights are [in, out]. c_attn's output is q|k|v concatenated ("qkv" = 3 * hidden):
# it is split into three "heads"-sized pieces, so it is not itself a head dim.
GPT2_PARAM_DIMS = {
    "wte.weight": "vocab hidden",
    "wpe.weight": "positions hidden",
    "*.attn.c_attn.weight": "hidden qkv",
    "*.attn.c_attn.bias": "qkv",
    "*.attn.c_proj.weight": "heads hidden",
    "*.attn.c_proj.bias": "hidden",
    "*.mlp.c_fc.weight": "hidden ffn",
    "*.mlp.c_fc.bias": "ffn",
    "*.mlp.c_proj.weight": "ffn hidden",
    "*.mlp.c_proj.bias": "hidden",
    "*ln_*.weight": "hidden",
    "*ln_*.bias": "hidden",
    "lm_head.weight": "vocab hidden",
}


def _llama_args(cfg, batch, seq, seed, with_mask, with_labels, device=None):
    ids = _token_args(cfg.vocab_size, batch, seq, seed, device)
    args: tuple = (ids,)
    if with_mask or with_labels:
        # Left-pad the first row by 2 tokens so the mask path does real work.
        mask = torch.ones(batch, seq, dtype=torch.int64, device=ids.device)
        if with_mask and seq > 2 and ids.device.type != "meta":
            mask[0, :2] = 0
        args = (ids, mask if with_mask else None)
    if with_labels:
        labels = ids.clone()
        if with_mask and ids.device.type != "meta":
            labels = labels.masked_fill(args[1] == 0, -100)
        args = args + (labels,)
    return args


def llama_tiny(*, batch: int = 4, seq: int = 8, seed: int = 0, with_mask: bool = False,
               with_labels: bool = False, **config):
    """Tiny fp32 Llama (vocab 64, hidden 32, 2 layers, 8 heads / 2 kv heads, ffn 64).

    Returns ``(model, args, dims)``; ``args`` is ``(input_ids,)``, plus ``attention_mask``
    (row 0 left-padded by 2) when ``with_mask``, plus ``labels`` when ``with_labels`` (then
    ``attention_mask`` is ``None`` unless requested; padded labels are -100). ``config``
    overrides LlamaConfig fields. Example::

        model, args, dims = llama_tiny(with_labels=True)
        model(*args).backward()
    """
    cfg = replace(LlamaConfig(), **config)
    model = init_weights(Llama(cfg), seed)
    args = _llama_args(cfg, batch, seq, seed, with_mask, with_labels)
    dims = _dims_for({"input_ids": True, "attention_mask": with_mask,
                      "labels": with_labels}, LLAMA_PARAM_DIMS)
    if cfg.tie_embeddings:
        dims.pop("lm_head.weight")  # tied: named once, as embed_tokens.weight
    return model, args, dims


def gpt2_tiny(*, batch: int = 4, seq: int = 8, seed: int = 0, with_labels: bool = False,
              **config):
    """Tiny fp32 GPT-2 (vocab 64, hidden 32, 2 layers, 4 heads, ffn 128, tied head).

    Returns ``(model, args, dims)``; ``args`` is ``(input_ids,)`` or ``(input_ids, labels)``.
    ``config`` overrides GPT2Config fields (e.g. ``dropout=0.1``). Example::

        model, args, dims = gpt2_tiny(with_labels=True)
        model(*args).backward()
    """
    cfg = replace(GPT2Config(), **config)
    model = init_weights(GPT2(cfg), seed)
    ids = _token_args(cfg.vocab_size, batch, seq, seed)
    args = (ids, ids.clone()) if with_labels else (ids,)
    dims = _dims_for({"input_ids": True, "labels": with_labels}, GPT2_PARAM_DIMS)
    dims.pop("lm_head.weight")  # tied to wte.weight
    return model, args, dims


# --------------------------------------------------------------------------------------------
# Mixture of Experts (Llama blocks whose MLP is a top-k routed MoE layer)
# --------------------------------------------------------------------------------------------

@dataclass
class MoEConfig(LlamaConfig):
    num_experts: int = 4
    experts_per_token: int = 2
    expert_size: int = 16  # each expert's intermediate size
    # "grouped": experts stacked in [experts, ...] tensors, tokens sorted by expert and one grouped
    # matmul per projection (how Hugging Face's Mixtral / Qwen2-MoE / OLMoE experts export);
    # "looped": a ModuleList of expert MLPs, each applied to every token and masked by its weight.
    experts: str = "grouped"


class TopKRouter(nn.Module):
    """softmax over experts, top-k, weights renormalized over the chosen k (Mixtral's router)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k = config.experts_per_token
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, tokens):
        probs = F.softmax(F.linear(tokens, self.weight).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), chosen


class GroupedExperts(nn.Module):
    """Stacked expert weights; forward(hidden [T, h], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        e, h, f = config.num_experts, config.hidden_size, config.expert_size
        self.num_experts = e
        self.gate_proj = nn.Parameter(torch.empty(e, f, h))
        self.up_proj = nn.Parameter(torch.empty(e, f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))

    def forward(self, hidden, top_k_index, top_k_weights):
        num_tokens, k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        rows = hidden[perm // k]                                  # token rows, grouped by expert
        counts = torch.histc(expert_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate = grouped_mm(rows, self.gate_proj.transpose(1, 2), offsets)
        up = grouped_mm(rows, self.up_proj.transpose(1, 2), offsets)
        out = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offsets)
        out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
        return out[inverse].view(num_tokens, k, -1).sum(1)


class ExpertMLP(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        h, f = config.hidden_size, config.expert_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A top-k routed MoE layer over the tokens of ``x [b, s, h]``."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.gate = TopKRouter(config)
        if config.experts == "grouped":
            self.experts = GroupedExperts(config)
        elif config.experts == "looped":
            self.experts = nn.ModuleList(ExpertMLP(config) for _ in range(config.num_experts))
        else:
            raise ValueError(f"MoEConfig.experts is 'grouped' or 'looped', not {config.experts!r}")

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.gate(tokens)
        if isinstance(self.experts, GroupedExperts):
            return self.experts(tokens, chosen, weights).reshape(x.shape)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            weight = (weights * (chosen == e)).sum(-1, keepdim=True)  # zero unless e was chosen
            out = out + expert(tokens) * weight.to(tokens.dtype)
        return out.reshape(x.shape)


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: MoEConfig):
        super().__init__(config)
        self.mlp = MoE(config)


class MoEModel(Llama):
    """The Llama decoder with an MoE layer in place of every MLP (Mixtral's structure)."""

    def __init__(self, config: MoEConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(MoEDecoderLayer(config) for _ in range(config.num_layers))


MOE_PARAM_DIMS = {
    **LLAMA_PARAM_DIMS,
    "*.mlp.gate.weight": "router hidden",
    # grouped: the leading dim of the stacked expert weights is the experts dim
    "*.experts.gate_proj": "experts ffn hidden",
    "*.experts.up_proj": "experts ffn hidden",
    "*.experts.down_proj": "experts hidden ffn",
    # looped: one MLP per expert (the ModuleList index is the experts dim)
    "*.experts.*.gate_proj.weight": "ffn hidden",
    "*.experts.*.up_proj.weight": "ffn hidden",
    "*.experts.*.down_proj.weight": "hidden ffn",
}
for _key in ("*.gate_proj.weight", "*.up_proj.weight", "*.down_proj.weight"):
    MOE_PARAM_DIMS.pop(_key)


def moe_tiny(*, experts: str = "grouped", batch: int = 4, seq: int = 8, seed: int = 0,
             with_labels: bool = False, **config):
    """Tiny fp32 MoE decoder: the tiny Llama with 4 experts of size 16, top-2, in every layer.

    ``experts="grouped"`` stacks the experts (sparse dispatch, one grouped matmul per
    projection); ``experts="looped"`` holds a ``ModuleList`` of expert MLPs. Returns
    ``(model, args, dims)`` like :func:`llama_tiny`. Example::

        model, args, dims = moe_tiny(experts="looped", with_labels=True)
        plan = autoshard.autoshard(model, args, mesh=autoshard.Mesh({"ep": 2}), dims=dims,
                                   layout={"batch": "ep", "experts": "ep"})
    """
    cfg = replace(MoEConfig(experts=experts), **config)
    model = init_weights(MoEModel(cfg), seed)
    args = _llama_args(cfg, batch, seq, seed, False, with_labels)
    looped = experts == "looped"
    params = {k: v for k, v in MOE_PARAM_DIMS.items() if ".experts." not in k or (".experts.*." in k) == looped}
    dims = _dims_for({"input_ids": True, "labels": with_labels}, params)
    return model, args, dims


LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
                       rms_eps=1e-5, tie_embeddings=False, max_seq_len=8192)


def llama_8b_meta(*, batch: int = 8, seq: int = 2048, with_mask: bool = False,
                  with_labels: bool = False, dtype: torch.dtype = torch.bfloat16, **config):
    """Llama-3-8B-shaped model on the ``meta`` device (no storage; for planning and costing).

    Parameters and example args live on ``meta``, so ``torch.export.export(model, args,
    strict=False)`` traces it without allocating. Example::

        model, args, dims = llama_8b_meta(with_labels=True)
        ep = torch.export.export(model, args, strict=False)
    """
    cfg = replace(LLAMA_8B, **config)
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    args = _llama_args(cfg, batch, seq, 0, with_mask, with_labels, device="meta")
    dims = _dims_for({"input_ids": True, "attention_mask": with_mask,
                      "labels": with_labels}, LLAMA_PARAM_DIMS)
    return model, args, dims


FACTORIES = {"llama_tiny": llama_tiny, "gpt2_tiny": gpt2_tiny, "llama_8b_meta": llama_8b_meta, "moe_tiny": moe_tiny}


def factory(name: str):
    """The factory function registered under ``name``: ``factory("llama_tiny")(with_labels=True)``."""
    try:
        return FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown example model {name!r}; known: {sorted(FACTORIES)}") from None
