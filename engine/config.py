"""Frozen, validated configs of the model shape and of the engine (the engine's knobs: engine.engine_config, and RoPE
scaling: engine.rope_scaling, both re-exported here; RopeScaling is ModelConfig's field type)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.engine_config import EngineConfig
from engine.rope_scaling import RopeScaling
from engine.vision_config import QwenVisionConfig, VisionConfig, vision_config_from_dict

__all__ = ["EngineConfig", "ModelConfig", "RopeScaling"]

#: The MLP's activation: SwiGLU, GeGLU with tanh-approximate GELU, or an encoder's ungated exact (erf) GELU (BERT).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
LAYER_TYPES = ("full_attention", "sliding_attention")
#: How a mixture-of-experts router turns its logits into the top-k experts' weights (engine.layers.moe.route).
ROUTERS = ("softmax_topk", "topk_softmax")
#: What a sequence classifier's head reads of a row (ModelConfig.classifier_pooling).
CLASSIFIER_POOLINGS = ("cls", "mean")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Touvron et al., "LLaMA", 2023; GQA: Ainslie et al., 2023).

    Attributes:
        vocab_size: number of token ids.
        hidden_size: model width d_model.
        intermediate_size: SwiGLU hidden width.
        num_layers: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention; num_heads % num_kv_heads == 0).
        head_dim: width of one head (usually hidden_size // num_heads).
        rope_theta: RoPE base frequency (Su et al., RoFormer, 2021).
        rms_norm_eps: epsilon of RMSNorm (Zhang & Sennrich, 2019); of the encoder's LayerNorms (HF layer_norm_eps).
        max_position_embeddings: the model's context length in tokens.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        bos_token_id / eos_token_id: special ids from the model file.
        architecture: the family's registry name (engine.model.architectures): engine.model.registry builds its model
            class; the models read the fields below, never the name.
        qkv_bias: q_proj/k_proj/v_proj carry a bias (Qwen2).
        qk_norm: per-head RMSNorm of queries and keys before RoPE (q_norm / k_norm, [head_dim]; Qwen3).
        rope_scaling: RopeScaling, or None for plain RoPE (a dict, as JSON holds it, is converted).
        eos_token_ids: every token id that ends a sequence (generation_config.json's `eos_token_id` list; Llama 3's
            <|eot_id|> and <|end_of_text|>); eos_token_id is one of them.
        sliding_window: when set (W >= 1), the query at position i attends only to keys at positions j with
            i - W < j <= i: the last W keys, its own included (Mistral; Jiang et al., "Mistral 7B", 2023; the same
            boundary as HF transformers' `sliding_window_overlay`). None: full causal attention. With layer_types,
            only the "sliding_attention" layers use it. An encoder's window is symmetric: the query at i attends the
            keys of its row with |i - j| <= W (ModernBERT: HF's sliding_window = local_attention // 2).
        layer_types: per layer "full_attention" or "sliding_attention" (Gemma 2/3: local and global layers
            interleaved); () = every layer alike (sliding_window, when set, on all of them).
        hidden_act: the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU with the tanh
            approximation of GELU, Gemma; Shazeer, "GLU Variants Improve Transformer", 2020); "gelu": the exact GELU
            of an encoder's MLP (BERT's ungated one; ModernBERT's GeGLU gate).
        norm_weight_offset: every RMSNorm multiplies by (offset + weight), computed in fp32 (Gemma: 1.0, its
            weights stored centred on 0); 0.0: by weight.
        embedding_scale: the token embeddings are multiplied by this (Gemma: sqrt(hidden_size), rounded to the
            model's dtype as HF transformers does); None: not scaled.
        query_pre_attn_scalar: attention scores scale by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5
            (Gemma).
        attn_logit_softcapping: attention scores s (after the scale) become c * tanh(s / c) before the mask and
            softmax (Gemma 2, c = 50); None: not capped.
        final_logit_softcapping: the LM head's logits become c * tanh(logits / c) (Gemma 2, c = 30).
        sandwich_norms: each block also normalizes its attention output and its MLP output before the residual
            add (post_attention_layernorm on the attention output, pre_feedforward_layernorm before the MLP,
            post_feedforward_layernorm after it: Gemma 2/3); False: Llama's pre-norm blocks.
        rotary_dim: RoPE rotates the first rotary_dim dims of each head (rotate-half within them) and passes the rest
            through (HF's partial_rotary_factor: rotary_dim = int(head_dim * factor); Phi-4-mini); None: all of them.
        rope_local_theta: the RoPE base of the "sliding_attention" layers, with no RoPE scaling (Gemma 3's
            rope_local_base_freq); None: every layer uses rope_theta and rope_scaling.
        num_experts: experts of each layer's sparse MLP block (engine.layers.moe; Qwen3-MoE, Qwen2-MoE, Mixtral);
            0 = a dense SwiGLU MLP of intermediate_size.
        num_experts_per_tok: experts each token runs (top-k), 1 <= k <= num_experts when num_experts > 0.
        moe_intermediate_size: SwiGLU width of one expert.
        router: "softmax_topk" (softmax over every expert, then the top k; Qwen2/3-MoE) or "topk_softmax" (the
            top k logits, then a softmax over those k; Mixtral).
        norm_topk_prob: with "softmax_topk", divide the k weights by their sum (Qwen3-MoE's norm_topk_prob).
        shared_expert_intermediate_size: width of a shared expert every token runs, its output scaled by
            sigmoid(shared_expert_gate(x)) (Qwen2-MoE); 0 = none.
        attention_sinks / o_bias: a learned logit per head in its softmax's denominator (engine.layers.attention),
            a bias on o_proj (gpt-oss). expert_bias: the router and every expert projection carry biases (gpt-oss).
        swiglu_limit / swiglu_alpha: the experts' clamped SwiGLU (gpt-oss; engine.layers.moe); None: SwiGLU.
        type_vocab_size: rows of an encoder's token type (segment) embedding (BERT: 2); 0 for a decoder.
        position_padding_idx: an encoder's padding_idx where its absolute positions count from padding_idx + 1 over
            a row's non-pad tokens, a pad token sitting at padding_idx (XLM-RoBERTa: 1); None: from 0 (BERT).
        labels: a sequence classifier's label names in id order (config.json id2label; engine.model.classifier);
            () for every other model. regression: its head gives raw scores, not classes (problem_type
            "regression", or a single label without a problem_type). multi_label: its labels are independent
            (problem_type "multi_label_classification"): a sigmoid per label, not a softmax over them.
            classifier_pooling: what its head reads of a row: "cls" (one token: an
            encoder's first, [CLS]; a decoder's last) or "mean" (the mean of the row's tokens: ModernBERT's
            classifier_pooling "mean").
        pooling_files: the model's folder holds sentence-transformers files (modules.json; engine.pooling.st_config):
            a causal decoder's folder so is an embedding model too (task "embed": engine.model.registry.config_tasks).
        lm_head: the causal decoder holds its LM head (its own or tied); False: the trunk alone, as
            sentence-transformers saves an embedding model (Qwen3-Embedding-4B/8B: untied, no lm_head.weight): it
            embeds and cannot generate. Only with pooling_files.
        vision: a vision-language model's image encoder and projector (engine.vision_config.VisionConfig, or
            engine.vision_config.QwenVisionConfig for Qwen2-VL / Qwen2.5-VL, its Qwen3VisionConfig for Qwen3-VL; a
            dict, as JSON holds it, is converted); None for a text-only model.

    Raises:
        ValueError: when the shape is inconsistent.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    embedding_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sandwich_norms: bool = False
    rope_local_theta: float | None = None
    rotary_dim: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    attention_sinks: bool = False
    o_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    type_vocab_size: int = 0
    position_padding_idx: int | None = None
    labels: tuple[str, ...] = ()
    regression: bool = False
    multi_label: bool = False
    classifier_pooling: str = "cls"
    pooling_files: bool = False
    lm_head: bool = True
    vision: VisionConfig | QwenVisionConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", vision_config_from_dict(self.vision))
        object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        object.__setattr__(self, "labels", tuple(str(t) for t in self.labels))  # a JSON round trip gives a list
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        ids = tuple(int(i) for i in self.eos_token_ids)
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids = (int(self.eos_token_id), *ids)
        object.__setattr__(self, "eos_token_ids", ids)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be None or an int >= 1 (tokens), got "
                             f"{self.sliding_window!r}")
        self._check_variants()
        if self.num_experts:
            self._check_experts()

    def _check_variants(self) -> None:
        """The fields of the Gemma / Phi variants: Raises ValueError naming a bad value."""
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"ModelConfig.layer_types must list {self.num_layers} of {LAYER_TYPES}, got "
                             f"{self.layer_types}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window is None")
        if self.rotary_dim is not None and not (2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"ModelConfig.rotary_dim must be even, in [2, head_dim={self.head_dim}], got "
                             f"{self.rotary_dim!r}")
        if not self.lm_head and (self.tie_word_embeddings or not self.pooling_files):
            raise ValueError("ModelConfig.lm_head=False (a decoder embedding model's trunk) needs pooling_files and "
                             "untied word embeddings")
        pad = self.position_padding_idx
        if pad is not None and not 0 <= pad < self.max_position_embeddings - 2:
            raise ValueError(f"ModelConfig.position_padding_idx must be None or in [0, max_position_embeddings - 2 = "
                             f"{self.max_position_embeddings - 2}), got {pad!r}")
        if self.classifier_pooling not in CLASSIFIER_POOLINGS:
            raise ValueError(f"ModelConfig.classifier_pooling must be one of {CLASSIFIER_POOLINGS}, got "
                             f"{self.classifier_pooling!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not implemented; tokenmill runs {HIDDEN_ACTS}")
        for name in ("embedding_scale", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_theta", "swiglu_limit"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be None or > 0, got {value!r}")

    @property
    def max_row_tokens(self) -> int:
        """Most tokens of one encoder row: max_position_embeddings, less the padding_idx + 1 positions XLM-RoBERTa's
        rows skip (514 -> 512)."""
        pad = self.position_padding_idx
        return self.max_position_embeddings - (0 if pad is None else pad + 1)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: full causal attention there)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_is_local(self, layer: int) -> bool:
        """Whether layer `layer` takes the local RoPE table (rope_local_theta set and a sliding layer)."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    def _check_experts(self) -> None:
        """Raises ValueError for an inconsistent mixture-of-experts shape."""
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                             f"{self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"ModelConfig.moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.router not in ROUTERS:
            raise ValueError(f"ModelConfig.router must be one of {ROUTERS}, got {self.router!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("ModelConfig.shared_expert_intermediate_size must be >= 0, got "
                             f"{self.shared_expert_intermediate_size}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The config saved as `dataclasses.asdict(cfg)` (JSON: the weights cache, tokenmill folders). Raises
        ValueError naming a field this version does not know (a newer writer)."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"model config has fields {sorted(unknown)} this tokenmill does not know; upgrade it")
        return cls(**values)
