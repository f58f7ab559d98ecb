"""Tiny random-weight HF causal LMs of the named MoE families (2 layers, 4 experts, top-2)."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_experts_per_tok=2,
              tie_word_embeddings=False)

FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=24, decoder_sparse_step=1,
                                         mlp_only_layers=[], norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4)),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=24,
                                             first_k_dense_replace=0, n_group=4, topk_group=2, q_lora_rank=16,
                                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=16)),
}


def build_model(family: str, dtype=torch.float32, implementation="grouped_mm", seed=0):
    import transformers

    config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    config._experts_implementation = implementation
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "bias" in name:
                p.normal_(0.0, 0.05)
        for name, buf in model.named_buffers():  # DeepSeek's score-correction bias: make routing non-trivial
            if "e_score_correction_bias" in name:
                buf.normal_(0.0, 0.1)
    return model.to(dtype).train()


def moe_layer_count(model) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "gate_up_proj") or hasattr(m, "up_proj") and
               getattr(m, "has_gate", None) is False)
