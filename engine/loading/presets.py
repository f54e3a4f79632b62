"""Named model shapes, filled with random weights, for benchmarks and fast tests (no weights to download)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig, RopeScaling
from engine.model.base import ModelBase
from engine.model.registry import build_model

PRESETS: dict[str, ModelConfig] = {
    # Meta Llama 3.1 8B (config.json and generation_config.json of meta-llama/Llama-3.1-8B-Instruct), its llama3
    # RoPE scaling and three stop tokens included (the weights are random: the shape and the cost are real).
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
                                architecture="llama", eos_token_ids=(128001, 128008, 128009),
                                rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192,
                                                         low_freq_factor=1.0, high_freq_factor=4.0)),
    # Qwen/Qwen2.5-7B-Instruct: QKV bias, untied embeddings, rope_theta 1e6, no sliding window (use_sliding_window
    # false), EOS <|im_end|> and <|endoftext|>.
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645,
                              architecture="qwen2", qkv_bias=True, eos_token_ids=(151645, 151643)),
    # mistralai/Mistral-7B-Instruct-v0.3: sliding_window null, vocabulary 32768, rope_theta 1e6.
    "mistral-7b-v0.3": ModelConfig(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                   num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=32768, bos_token_id=1,
                                   eos_token_id=2, architecture="mistral"),
    # Qwen/Qwen3-8B: per-head q/k RMSNorm, no bias, untied, head_dim 128, context 40960.
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                            max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                            architecture="qwen3", qk_norm=True, eos_token_ids=(151645, 151643)),
    # Qwen/Qwen3-30B-A3B: Qwen3's attention (q/k norms, head_dim 128), 48 sparse layers of 128 experts of width
    # 768, top-8 with norm_topk_prob (about 3B of its 30B parameters active per token).
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                                 num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                                 architecture="qwen3_moe", qk_norm=True, eos_token_ids=(151645, 151643),
                                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                 router="softmax_topk", norm_topk_prob=True),
    # HuggingFaceTB/SmolLM2-135M-Instruct, the default model's shape.
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                                eos_token_id=2),
    # A tiny model with SmolLM2's vocabulary (so its tokenizer works), for fast engine tests.
    "tiny": ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # "tiny" with SmolLM2-135M's context and RoPE base, a stand-in for the default model in pipeline and jobs tests
    # (same tokenizer, same limit on prompt length). Its LM head is not tied: a tied random head scores the current
    # token's own embedding highest, so greedy decoding would repeat the prompt's last token forever.
    "tiny-smollm2": ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1,
                                eos_token_id=2),
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig called `name`. Raises ValueError listing the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 max_positions: int | None = None) -> ModelBase:
    """A model (engine.model.registry.build_model) of shape `cfg` with N(0, 0.02) weights and biases (norms, q/k
    norms included, 1), built on the meta device and materialized once on `device` in `dtype`."""
    with torch.device("meta"):
        model = build_model(cfg, max_positions).to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.materialize_rotary(device)
    return model.eval()


def save_random_model(out_dir: str, model_config: ModelConfig | str, tokenizer_model: str | None = None, *,
                      seed: int = 0, never_eos: bool = False) -> str:
    """Write a model folder of random weights that `--model out_dir` (LLMEngine.from_model) loads: the format
    `tokenmill quantize --bits 16` writes (engine.loading.tokenmill_folder: bf16 weights, fp32 norms), holding
    random_model's
    weights of shape `model_config` (a preset name or a ModelConfig) and the tokenizer and chat template of
    `tokenizer_model` (a GGUF path or model folder; None = the default SmolLM2-135M-Instruct), so prompts, token
    counts and detokenization are the real model's. Returns out_dir.

    never_eos: zero the EOS token's LM-head row (tied: its embedding too), so its logit is exactly 0 while the
    others spread around it: greedy decoding never picks EOS (sampling, about once in vocab_size tokens) and rows
    run to max_tokens, as tests counting tokens expect. Raises ValueError for an unknown preset, FileExistsError
    when out_dir holds other files (engine.loading.tokenmill_folder.save_folder).
    """
    from engine.loading.model_files import resolve_model_path
    from engine.loading.tokenmill_folder import save_folder
    from engine.text.tokenizer import Tokenizer

    cfg = preset_config(model_config) if isinstance(model_config, str) else model_config
    model = random_model(cfg, torch.float32, torch.device("cpu"), seed=seed, max_positions=1)
    if never_eos:
        with torch.no_grad():
            model.lm_head.weight[cfg.eos_token_id].zero_()
    state = {name: w for name, w in model.state_dict().items()
             if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    path = resolve_model_path(tokenizer_model)
    save_folder(out_dir, cfg, state, Tokenizer.from_model_path(path).hf_tokenizer, bits=16, group_size=None,
                source=f"random weights (seed {seed})")
    return out_dir
