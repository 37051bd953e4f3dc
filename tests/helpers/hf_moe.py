"""Tiny Hugging Face mixture-of-experts models (random weights, no downloads) in each of
transformers' experts implementations, and the attention dims a user names for them."""
import pytest
import torch


class CausalLMLoss(torch.nn.Module):
    """A causal LM's loss on its input ids as labels: one tensor out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


HF_DIMS = {"input_ids": "batch seq", "*.q_proj.weight": "heads hidden", "*.k_proj.weight": "kv_heads hidden",
           "*.v_proj.weight": "kv_heads hidden", "*.o_proj.weight": "hidden heads"}


def hf_moe(name, impl):
    """A tiny Hugging Face MoE (4 experts, 2 per token) with ``experts_implementation=impl``."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, use_cache=False, experts_implementation=impl)
    torch.manual_seed(0)
    config, cls = {
        "mixtral": (lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
                    transformers.MixtralForCausalLM),
        "qwen2_moe": (lambda: transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=16, shared_expert_intermediate_size=32),
                      transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=16), transformers.Qwen3MoeForCausalLM),
        "olmoe": (lambda: transformers.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2),
                  transformers.OlmoeForCausalLM),
        # per-expert biases, selected per row like the weights
        "gpt_oss": (lambda: transformers.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, head_dim=4,
                                                      layer_types=["full_attention"] * 2),
                    transformers.GptOssForCausalLM),
    }[name]
    model = cls(config())
    assert model.config._experts_implementation == impl
    return CausalLMLoss(model.eval()), (torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)),)
