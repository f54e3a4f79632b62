"""The released config.json of each vision-language family the vision benchmarks run (bench.vision_models.FAMILIES),
written inline: the bench machines cannot reach the hub, and the weights are random, so the config is all a family
needs of its release. Each spells what its hub file spells (nested configs: only what differs from the config
class's defaults, as released); a field the release leaves to a default that the benchmarks read is written out and
marked as the default.
"""

from __future__ import annotations

#: llava-hf/llava-1.5-7b-hf's config.json (Vicuna-7B v1.5 on CLIP ViT-L/14 at 336 px: 576 image tokens; the nested
#: configs spell only what differs from LlamaConfig's and CLIPVisionConfig's defaults, as released).
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}

#: Qwen/Qwen2.5-VL-7B-Instruct's config.json (the Qwen2.5-7B decoder with M-RoPE; a 32-block ViT of width 1280 with
#: window attention, 2x2 patch merging into the decoder's width; dynamic resolution).
QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}

#: google/gemma-3-4b-it's config.json (the Gemma 3 4B decoder: 34 layers of width 2560, 5 sliding layers of window
#: 1024 to 1 global, linear RoPE scaling by 8 on the global layers; SigLIP So400m/14 at 896 px, its 64x64 patches
#: average-pooled to 256 soft tokens). Every field is the release's but text_config's vocab_size (262,208), which the
#: release leaves to Gemma3TextConfig's default (as it does the heads: 8 query and 4 KV of head_dim 256,
#: query_pre_attn_scalar 256, rope_theta 1e6 and rope_local_base_freq 1e4, 131,072 positions, rms_norm_eps 1e-6,
#: gelu_pytorch_tanh), written out because the benchmarks point it at their tokenizer's size.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024, "vocab_size": 262208},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False}}

#: Qwen/Qwen3-VL-8B-Instruct's config.json (the Qwen3-8B decoder, 36 layers of width 4096 with q/k norms and
#: interleaved M-RoPE; a 27-block ViT of width 1152 on 16-pixel patches with a learned 48x48 position grid, 2x2
#: merging, DeepStack features of blocks 8, 16 and 24 added to the first three decoder layers).
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
                    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
                    "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}

#: HuggingFaceTB/SmolVLM-256M-Instruct's config.json (SmolLM2-135M's decoder, 30 layers of width 576, untied head;
#: SigLIP B/16 at 512 px tiles, 12 layers of width 768 by Idefics3VisionConfig's default, a 4x pixel shuffle: 64 image
#: tokens a tile). The release's fields that change the model; its text_config also carries training leftovers
#: (perceiver_config, neftune_noise_alpha, transformers.js_config, _flash_attn_2_enabled, ...), left out here.
SMOLVLM_256M = {
    "architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190, "model_type": "idefics3",
    "scale_factor": 4,
    "text_config": {"architectures": ["VLlama3ForCausalLM"], "head_dim": 64, "hidden_size": 576,
                    "intermediate_size": 1536, "max_position_embeddings": 8192, "model_type": "llama",
                    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2,
                    "rms_norm_eps": 1e-05, "rope_theta": 100000, "torch_dtype": "bfloat16", "vocab_size": 49280},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.46.0", "use_cache": True,
    "vision_config": {"hidden_size": 768, "image_size": 512, "intermediate_size": 3072,
                      "max_image_size": {"longest_edge": 512}, "model_type": "idefics3", "num_attention_heads": 12,
                      "patch_size": 16, "size": {"longest_edge": 2048}, "tie_word_embeddings": False,
                      "use_base_siglip": False},
    "vocab_size": 49280}
