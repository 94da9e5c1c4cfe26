"""The real targets' text configs as published, so that a plan needs no download (dflash.plan.configured.target_config
builds them)."""

from __future__ import annotations

# The real targets' text models as published (config.json on the hub of the repo each conf/target preset names;
# the text_config of the multimodal ones), so a plan needs no download. Keys that change no parameter count (the
# rope of some, token ids) are left at the class defaults where not verified.
# Qwen3.6-27B shares Qwen3.5-27B's text model (model_type qwen3_5).
_QWEN3_5_27B = ("Qwen3_5TextConfig", {
    "hidden_size": 5120, "num_hidden_layers": 64, "vocab_size": 248320, "intermediate_size": 17408,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}})
# Gemma 4 (Gemma4ForConditionalGeneration; its text_config, model_type gemma4_text): 5 sliding-window layers
# (window 1024, head_dim 256) then 1 full layer (global_head_dim 512, num_global_key_value_heads, keys reused as
# values), no per-layer embeddings (hidden_size_per_layer_input 0), no KV sharing, logits soft-capped at 30.
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
_GEMMA4 = {"vocab_size": 262144, "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True,
           "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "sliding_window": 1024,
           "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "max_position_embeddings": 262144,
           "rms_norm_eps": 1e-6, "rope_parameters": _GEMMA4_ROPE}
# GPT-OSS: alternating sliding-window (128) and full layers, attention sinks and biases, MoE of experts 2880 wide
# (intermediate_size is the expert's), YaRN rope; the hub's MXFP4 experts are counted as loaded (bf16).
_GPT_OSS = {"hidden_size": 2880, "vocab_size": 201088, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4, "sliding_window": 128,
            "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False}}
TARGETS = {
    # the real small models of the GGUF presets (their config as transformers dequantizes the files): a plan needs
    # no dequantized copy
    "smollm2_135m": ("LlamaConfig", {
        "hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 100_000.0}}),
    "gemma3_270m": ("Gemma3TextConfig", {
        "hidden_size": 640, "num_hidden_layers": 18, "vocab_size": 262144, "intermediate_size": 2048,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # transformers' MiniMaxM2Config defaults are MiniMax-M2's dimensions (its docstring), which M2.5 keeps: 62 layers,
    # hidden 3072, 48/8 heads x 128, 256 experts 1536 wide (top 8), vocab 200064
    "minimax_m2_5": ("MiniMaxM2Config", {}),
    "qwen3_8b": ("Qwen3Config", {
        "hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": 151936, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
    "qwen3_5_27b": _QWEN3_5_27B,
    "qwen3_6_27b": _QWEN3_5_27B,
    "llama3_1_8b_instruct": ("LlamaConfig", {
        "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "gemma4_31b_it": ("Gemma4TextConfig", {
        **_GEMMA4, "hidden_size": 5376, "num_hidden_layers": 60, "intermediate_size": 21504, "num_attention_heads": 32,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10}),
    # a dense MLP (2112 wide) and 128 experts (704 wide, top 8) side by side in every layer
    "gemma4_26b_a4b_it": ("Gemma4TextConfig", {
        **_GEMMA4, "hidden_size": 2816, "num_hidden_layers": 30, "intermediate_size": 2112, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "enable_moe_block": True, "num_experts": 128,
        "top_k_experts": 8, "moe_intermediate_size": 704,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5}),
    "gpt_oss_20b": ("GptOssConfig", {
        **_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 12}),
    "gpt_oss_120b": ("GptOssConfig", {
        **_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18}),
    # intermediate_size is the dense MLP of mlp_only_layers (none here); every layer is 128 experts, top 8.
    # rope not verified (no parameter depends on it): the class default
    "qwen3_coder_30b_a3b": ("Qwen3MoeConfig", {
        "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}),
    # hybrid like Qwen3.5 (3 Gated DeltaNet layers to 1 full-attention layer), every layer 256 experts (512 wide,
    # top 8) and a shared expert (512 wide); no dense MLP (the class has no intermediate_size)
    "qwen3_6_35b_a3b": ("Qwen3_5MoeTextConfig", {
        "hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}}),
}

