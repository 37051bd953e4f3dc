"""Tiny Hugging Face models built from their configs (random weights, no downloads), with the
dims a user names and the layouts an expert would ask for.

Each :class:`Arch` builds one architecture at test size (2 layers, hidden 32, 4 heads) and knows
its example inputs (keyword arguments, labels included so the output has a loss), the ``dims``
annotation a user writes for it, and its Megatron-style tensor-parallel layout. Used by
``tests/test_hf_models.py``; runnable as a script to print every plan's collectives::

    .venv/bin/python tests/helpers/hf_zoo.py llama gemma2
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch

import transformers
from transformers import AutoConfig, AutoModelForCausalLM

transformers.logging.set_verbosity_error()

BATCH, SEQ, LAYERS = 4, 8, 2
# A decoder: hidden 32 = 4 heads x 8, 2 kv heads, ffn 64, vocab 64; token ids within the vocab.
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False)

ATTENTION_DIMS = {
    "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "kv_heads hidden", "*.v_proj.weight": "kv_heads hidden",
    "*.o_proj.weight": "hidden heads", "*layernorm.weight": "hidden", "*embed_tokens.weight": "vocab hidden",
    "lm_head.weight": "vocab hidden",
}
LLAMA_DIMS = {**ATTENTION_DIMS, "*.gate_proj.weight": "ffn hidden", "*.up_proj.weight": "ffn hidden",
              "*.down_proj.weight": "hidden ffn"}
EXPERTS_DIMS = {"*.experts.gate_up_proj": "experts gate_up hidden", "*.experts.down_proj": "experts hidden moe_ffn",
                "*.mlp.gate.weight": "experts hidden"}
MEGATRON = {"heads": "tp", "kv_heads": "tp", "ffn": "tp"}
TOKENS = {"input_ids": "batch seq", "labels": "batch seq"}


@dataclass
class Arch:
    name: str
    model_type: str
    config: dict
    dims: dict
    tp_layout: dict = field(default_factory=lambda: dict(MEGATRON))
    # forward all-reduces on tp per block in the Megatron plan, by block prefix: 2 per layer (after
    # attention and after the MLP); 1 where both read one input and are summed (parallel blocks,
    # or experts left whole on tp); 3 in a T5 decoder layer (cross-attention); OLMoE adds one
    # all-reduce of a [batch, seq, 1] variance each for its q/k norms, which span all heads
    tp_reduces: dict = field(default_factory=lambda: {"model.layers": 2})
    # a parallel block written ``residual + attn + mlp`` keeps its output a pending sum (the
    # residual kept on rank 0): it is summed once, where the next block's norm or the final norm
    # reads it, so the all-reduces sit at those readers, one per block (tp_reduces is then empty)
    tp_block_outputs: bool = False
    kind: str = "causal"  # causal | masked | seq2seq | image | speech
    note: str = ""
    cls: str = ""  # the transformers class, where the task's auto class has several for this config
    # why strict=True refuses this architecture's Megatron plan: the op whose input is gathered
    # whole in forward (the tests check the plan names it, and is exact regardless)
    not_strict: str = ""


    def build(self, seed: int = 0):
        """(model in eval mode, example kwargs)."""
        torch.manual_seed(seed)
        cfg = AutoConfig.for_model(self.model_type, **self.config)
        model = getattr(transformers, self.cls)(cfg) if self.cls else MODEL_CLASS[self.kind].from_config(cfg)
        model.eval()
        g = torch.Generator().manual_seed(seed + 1)
        if self.kind == "image":
            kwargs = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
                      "labels": torch.randint(0, cfg.num_labels, (BATCH,), generator=g)}
        elif self.kind == "speech":  # log-mel frames: twice the encoder's positions (its stride-2 conv)
            kwargs = {"input_features": torch.randn(BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g),
                      "labels": torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)}
        else:
            ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=g)
            kwargs = {"input_ids": ids, "labels": torch.roll(ids, 1, dims=1)}
        return model, kwargs

    @property
    def all_dims(self) -> dict:
        if self.kind == "image":
            return {"pixel_values": "batch channels height width", "labels": "batch", **self.dims}
        if self.kind == "speech":
            return {"input_features": "batch mel frames", "labels": "batch seq", **self.dims}
        return {**TOKENS, **self.dims}


MODEL_CLASS = {
    "causal": AutoModelForCausalLM,
    "masked": transformers.AutoModelForMaskedLM,
    "seq2seq": transformers.AutoModelForSeq2SeqLM,
    "image": transformers.AutoModelForImageClassification,
    "speech": transformers.AutoModelForSpeechSeq2Seq,
}

ARCHS = {a.name: a for a in [
    Arch("llama", "llama", DECODER, LLAMA_DIMS),
    Arch("mistral", "mistral", DECODER, LLAMA_DIMS),
    Arch("qwen2", "qwen2", DECODER, {**LLAMA_DIMS, "*.q_proj.bias": "heads", "*.k_proj.bias": "kv_heads",
                                     "*.v_proj.bias": "kv_heads"}),
    Arch("qwen3", "qwen3", dict(DECODER, head_dim=8), {**LLAMA_DIMS, "*.q_norm.weight": "head_dim",
                                                       "*.k_norm.weight": "head_dim"}),
    Arch("gemma", "gemma", dict(DECODER, head_dim=8, tie_word_embeddings=True), LLAMA_DIMS),
    Arch("gemma2", "gemma2", dict(DECODER, head_dim=8, tie_word_embeddings=True), LLAMA_DIMS),
    Arch("gemma3", "gemma3_text", dict(DECODER, head_dim=8, tie_word_embeddings=True),
         {**LLAMA_DIMS, "*.q_norm.weight": "head_dim", "*.k_norm.weight": "head_dim"}),
    Arch("phi", "phi", DECODER, {
        "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "kv_heads hidden", "*.v_proj.weight": "kv_heads hidden",
        "*.q_proj.bias": "heads", "*.k_proj.bias": "kv_heads", "*.v_proj.bias": "kv_heads",
        "*.dense.weight": "hidden heads", "*.dense.bias": "hidden", "*.fc1.weight": "ffn hidden", "*.fc1.bias": "ffn",
        "*.fc2.weight": "hidden ffn", "*.fc2.bias": "hidden", "*layernorm.*": "hidden",
        "*embed_tokens.weight": "vocab hidden", "lm_head.weight": "vocab hidden", "lm_head.bias": "vocab"},
        tp_reduces={"model.layers": 1}),
    # Fused projections: q|k|v and gate|up are split by chunk/slice after the matmul.
    Arch("phi3", "phi3", DECODER, {
        "*.qkv_proj.weight": "qkv hidden", "*.o_proj.weight": "hidden heads", "*.gate_up_proj.weight": "gate_up hidden",
        "*.down_proj.weight": "hidden ffn", "*layernorm.weight": "hidden", "*embed_tokens.weight": "vocab hidden",
        "lm_head.weight": "vocab hidden"}, tp_layout={"heads": "tp", "ffn": "tp"}),
    Arch("gpt2", "gpt2", dict(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, use_cache=False), {
        "*.wte.weight": "vocab hidden", "*.wpe.weight": "positions hidden", "*.c_attn.weight": "hidden qkv",
        "*.c_attn.bias": "qkv", "*.attn.c_proj.weight": "heads hidden", "*.c_proj.bias": "hidden",
        "*.c_fc.weight": "hidden ffn", "*.c_fc.bias": "ffn", "*.mlp.c_proj.weight": "ffn hidden",
        "*.ln_*.weight": "hidden", "*.ln_*.bias": "hidden"},
        tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"transformer.h": 2}),
    # GPT-NeoX's fused q|k|v is laid out per head, so heads shard its rows directly.
    Arch("gpt_neox", "gpt_neox", DECODER, {
        "*.query_key_value.weight": "heads3 hidden", "*.attention.dense.weight": "hidden heads",
        "*.dense_h_to_4h.weight": "ffn hidden", "*.dense_h_to_4h.bias": "ffn", "*.dense_4h_to_h.weight": "hidden ffn",
        "*layernorm.*": "hidden", "*.embed_in.weight": "vocab hidden", "lm_head.weight": "vocab hidden"},
        tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"gpt_neox.layers": 1}),
    Arch("opt", "opt", dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                            max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False, pad_token_id=0), {
        "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "heads hidden", "*.v_proj.weight": "heads hidden",
        "*.q_proj.bias": "heads", "*.k_proj.bias": "heads", "*.v_proj.bias": "heads",
        "*.out_proj.weight": "hidden heads", "*.fc1.weight": "ffn hidden", "*.fc1.bias": "ffn",
        "*.fc2.weight": "hidden ffn", "*.embed_tokens.weight": "vocab hidden"},
        tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"model.decoder.layers": 2}),
    Arch("mixtral", "mixtral", dict(DECODER, num_local_experts=4, num_experts_per_tok=2,
                                    experts_implementation="batched_mm"), {**ATTENTION_DIMS, **EXPERTS_DIMS}, tp_layout={"heads": "tp", "kv_heads": "tp"},
         tp_reduces={"model.layers": 1}),
    Arch("qwen2_moe", "qwen2_moe", dict(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64, experts_implementation="batched_mm"), {
        **LLAMA_DIMS, **EXPERTS_DIMS, "*.q_proj.bias": "heads", "*.k_proj.bias": "kv_heads",
        "*.v_proj.bias": "kv_heads"}),
    Arch("olmoe", "olmoe", dict(DECODER, num_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm"),
         {**ATTENTION_DIMS, **EXPERTS_DIMS}, tp_layout={"heads": "tp", "kv_heads": "tp"},
         tp_reduces={"model.layers": 3}),
    Arch("bert", "bert", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                              num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2), {
        "*.query.weight": "heads hidden", "*.key.weight": "heads hidden", "*.value.weight": "heads hidden",
        "*.query.bias": "heads", "*.key.bias": "heads", "*.value.bias": "heads",
        "*.attention.output.dense.weight": "hidden heads", "*.intermediate.dense.weight": "ffn hidden",
        "*.intermediate.dense.bias": "ffn", "*.layer.?.output.dense.weight": "hidden ffn",
        "*.word_embeddings.weight": "vocab hidden"},
        tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"bert.encoder.layer": 2}, kind="masked"),
    Arch("t5", "t5", dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS, num_decoder_layers=LAYERS,
                          num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False), {
        "*.q.weight": "heads hidden", "*.k.weight": "heads hidden", "*.v.weight": "heads hidden",
        "*.o.weight": "hidden heads", "*.wi.weight": "ffn hidden", "*.wo.weight": "hidden ffn",
        "shared.weight": "vocab hidden"},
        tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"encoder.block": 2, "decoder.block": 3}, kind="seq2seq"),
    Arch("vit", "vit", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_labels=8), {
        "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "heads hidden", "*.v_proj.weight": "heads hidden",
        "*.q_proj.bias": "heads", "*.k_proj.bias": "heads", "*.v_proj.bias": "heads",
        "*.o_proj.weight": "hidden heads", "*.fc1.weight": "ffn hidden", "*.fc1.bias": "ffn",
        "*.fc2.weight": "hidden ffn", "*.projection.weight": "hidden channels - -"},
        tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"vit.layers": 2}, kind="image"),
]}

# Added architectures: each planned once, dp=2 x tp=2 (tests/test_hf_models.py::test_zoo_megatron_plan).
NORMS = {"*layernorm.weight": "hidden", "*layernorm.bias": "hidden", "*.norm.weight": "hidden", "*.norm.bias": "hidden"}
ENC_DEC_ATTENTION = {
    "*_attn.q_proj.weight": "heads hidden", "*_attn.k_proj.weight": "heads hidden", "*_attn.v_proj.weight": "heads hidden",
    "*_attn.q_proj.bias": "heads", "*_attn.k_proj.bias": "heads", "*_attn.v_proj.bias": "heads",
    "*_attn.out_proj.weight": "hidden heads", "*.fc1.weight": "ffn hidden", "*.fc1.bias": "ffn",
    "*.fc2.weight": "hidden ffn", "*.embed_tokens.weight": "vocab hidden"}
ZOO = {a.name: a for a in [
    Arch("granite", "granite", DECODER, LLAMA_DIMS),
    Arch("stablelm", "stablelm", DECODER, {**LLAMA_DIMS, **NORMS}),
    Arch("helium", "helium", dict(DECODER, head_dim=8), LLAMA_DIMS),
    # OLMo's layer norms have no weights
    Arch("olmo", "olmo", DECODER, {k: v for k, v in LLAMA_DIMS.items() if "layernorm" not in k}),
    # q/k norms over all heads: one all-reduce of a [batch, seq, 1] variance each, as OLMoE's
    Arch("olmo2", "olmo2", DECODER, {**LLAMA_DIMS, "*.q_norm.weight": "heads", "*.k_norm.weight": "kv_heads"},
         tp_reduces={"model.layers": 4}),
    # parallel attention + MLP (both read one norm, summed into the residual): 2 here, where one
    # all-reduce of their sum would do
    Arch("cohere", "cohere", DECODER, LLAMA_DIMS, tp_reduces={}, tp_block_outputs=True),
    Arch("starcoder2", "starcoder2", DECODER, {
        **ATTENTION_DIMS, **NORMS, "*.q_proj.bias": "heads", "*.k_proj.bias": "kv_heads", "*.v_proj.bias": "kv_heads",
        "*.o_proj.bias": "hidden", "*.c_fc.weight": "ffn hidden", "*.c_fc.bias": "ffn", "*.c_proj.weight": "hidden ffn",
        "*.c_proj.bias": "hidden"}),
    Arch("qwen3_moe", "qwen3_moe", dict(DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        experts_implementation="batched_mm"),
         {**ATTENTION_DIMS, **EXPERTS_DIMS, "*.q_norm.weight": "head_dim", "*.k_norm.weight": "head_dim"},
         tp_layout={"heads": "tp", "kv_heads": "tp"}, tp_reduces={"model.layers": 1}),
    Arch("gptj", "gptj", dict(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_inner=64, rotary_dim=4,
                              n_positions=64, use_cache=False), {
        "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "heads hidden", "*.v_proj.weight": "heads hidden",
        "*.out_proj.weight": "hidden heads", "*.fc_in.weight": "ffn hidden", "*.fc_in.bias": "ffn",
        "*.fc_out.weight": "hidden ffn", "*.fc_out.bias": "hidden", "*.ln_*": "hidden", "*.wte.weight": "vocab hidden"},
         tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"transformer.h": 1}),
    Arch("roberta", "roberta", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2, pad_token_id=1), {
        "*.query.weight": "heads hidden", "*.key.weight": "heads hidden", "*.value.weight": "heads hidden",
        "*.query.bias": "heads", "*.key.bias": "heads", "*.value.bias": "heads",
        "*.attention.output.dense.weight": "hidden heads", "*.intermediate.dense.weight": "ffn hidden",
        "*.intermediate.dense.bias": "ffn", "*.layer.?.output.dense.weight": "hidden ffn",
        "*.word_embeddings.weight": "vocab hidden"},
         tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"roberta.encoder.layer": 2}, kind="masked"),
    Arch("distilbert", "distilbert", dict(vocab_size=64, dim=32, hidden_dim=64, n_layers=LAYERS, n_heads=4,
                                          max_position_embeddings=64), {
        "*.q_lin.weight": "heads hidden", "*.k_lin.weight": "heads hidden", "*.v_lin.weight": "heads hidden",
        "*.q_lin.bias": "heads", "*.k_lin.bias": "heads", "*.v_lin.bias": "heads", "*.out_lin.weight": "hidden heads",
        "*.lin1.weight": "ffn hidden", "*.lin1.bias": "ffn", "*.lin2.weight": "hidden ffn",
        "*.word_embeddings.weight": "vocab hidden"},
         tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"distilbert.transformer.layer": 2}, kind="masked"),
    Arch("bart", "bart", dict(vocab_size=64, d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS,
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              max_position_embeddings=64, use_cache=False, pad_token_id=0, decoder_start_token_id=2),
         ENC_DEC_ATTENTION, tp_layout={"heads": "tp", "ffn": "tp"},
         tp_reduces={"model.encoder.layers": 2, "model.decoder.layers": 3}, kind="seq2seq"),
    Arch("whisper", "whisper", dict(vocab_size=64, d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, max_target_positions=32,
                                    use_cache=False, pad_token_id=0, decoder_start_token_id=1),
         {k: v for k, v in ENC_DEC_ATTENTION.items() if k != "*_attn.k_proj.bias"},  # k has no bias
         tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"model.encoder.layers": 2, "model.decoder.layers": 3},
         kind="speech", not_strict="index"),
    Arch("deit", "deit", dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=LAYERS, num_attention_heads=4, num_labels=8), {
        "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "heads hidden", "*.v_proj.weight": "heads hidden",
        "*.q_proj.bias": "heads", "*.k_proj.bias": "heads", "*.v_proj.bias": "heads",
        "*.o_proj.weight": "hidden heads", "*.fc1.weight": "ffn hidden", "*.fc1.bias": "ffn",
        "*.fc2.weight": "hidden ffn", "*.projection.weight": "hidden channels - -"},
         tp_layout={"heads": "tp", "ffn": "tp"}, tp_reduces={"deit.layers": 2}, kind="image",
         cls="DeiTForImageClassification"),
    Arch("mamba", "mamba", dict(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=LAYERS, expand=2,
                                conv_kernel=4, time_step_rank=4, use_cache=False, pad_token_id=0), {
        "*.in_proj.weight": "inner2 hidden", "*.conv1d.weight": "inner - -", "*.conv1d.bias": "inner",
        "*.x_proj.weight": "dt_bc inner", "*.dt_proj.weight": "inner rank", "*.dt_proj.bias": "inner",
        "*.A_log": "inner state", "*.D": "inner", "*.out_proj.weight": "hidden inner", "*.embeddings.weight": "vocab hidden"},
         # x_proj contracts the split inner dim: its dt|B|C sum is taken once for dt, once for B, and
         # once per time step for C (the scan's select passes the pending sum on), then out_proj
         tp_layout={"inner": "tp"}, tp_reduces={"backbone.layers": 2 + SEQ + 1}),
]}


def main(names):
    import autoshard
    from collections import Counter
    for name in names or list(ARCHS) + list(ZOO):
        arch = {**ARCHS, **ZOO}[name]
        model, kwargs = arch.build()
        for layout in ({"batch": "dp"}, {"batch": "dp", **arch.tp_layout}):
            mesh = autoshard.Mesh({"dp": 2} if len(layout) == 1 else {"dp": 2, "tp": 2})
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                try:
                    plan = autoshard.autoshard(model, (), kwargs, mesh=mesh, dims=arch.all_dims, layout=layout)
                except Exception as e:
                    print(f"== {name} {layout}: {type(e).__name__}: {str(e)[:400]}")
                    continue
            print(f"== {name} {layout} ({plan.timings['capture']:.2f}s capture)")
            for x in w:
                print("   warning:", str(x.message)[:200])
            print("  ", dict(Counter((c.phase, c.kind, c.axes[0]) for c in plan.collectives)))
            for c in plan.collectives:
                if c.phase == "forward" and (c.kind == "all_gather" or c.axes == ("dp",)):
                    print("    ", c.kind, c.axes, c.where, c.why[:160])


if __name__ == "__main__":
    main(sys.argv[1:])
