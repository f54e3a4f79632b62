"""The model families tokenmill runs: one registry entry per architecture.

An entry says how a family's Hugging Face `config.json` and GGUF metadata become a ModelConfig (the fields it reads,
the ones it refuses when set to something the engine does not implement; engine.model.hf_config reads a config.json
through it), its GGUF architecture name, and whether llama.cpp's converter permuted its Q/K rows. Tensor names come
from the `gguf` package (`gguf.get_tensor_name_map`: the table llama.cpp's convert_hf_to_gguf.py itself uses), never a
hand-written table. The registry (engine.model.registry) maps each name to its model class (the generic decoder, or
a family's file: engine.model.gemma, moe_decoder, gpt_oss; the encoders: engine.model.bert, modernbert); everything
downstream (the models, the quantized paths, the weights cache, the kernels) reads ModelConfig fields (qkv_bias,
qk_norm, rope_scaling, sliding_window, ...), never a family name.

Adding a family: one `Architecture` in ARCHITECTURES plus its test (tests/engine/model/test_families.py; the
mixture-of-experts families: tests/engine/model/test_moe_families.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import ModelConfig
from engine.model.family_fields import (
    bert_fields,
    gemma2_fields,
    gemma3_fields,
    gemma_gguf_fields,
    gpt_oss_fields,
    gpt_oss_gguf_fields,
    modernbert_fields,
    phi3_fields,
    phi3_gguf_fields,
    xlm_roberta_fields,
)

_SILU = ("silu", "swish")


@dataclass(frozen=True)
class Architecture:
    """One model family.

    Attributes:
        name: registry name (also ModelConfig.architecture of GGUF files).
        hf_model_types: config.json `model_type` values it reads ("mistral" is Llama's math plus a window).
        gguf_arch: `general.architecture` of its GGUF files (gguf.MODEL_ARCH_NAMES); "" where none is read.
        gguf_permuted_qk: llama.cpp's converter permuted Q/K rows to interleaved RoPE pairs (llama does; qwen2/qwen3
            do not): they are un-permuted on load.
        qkv_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: per-head q_norm / k_norm before RoPE (Qwen3).
        refused: (config.json field, the values we implement): any other value is an error naming the field.
        window: reads the sliding window of a config.json dict (None = full attention); raises ValueError.
        reads: config.json fields of engine.model.hf_config._MATH_FIELDS this family implements (read by `fields`,
            not refused).
        fields: more ModelConfig fields of a config.json dict (engine.model.family_fields; they override the
            common ones); raises ValueError naming what it does not implement.
        fused_projections: its files hold Q/K/V as one qkv_proj and gate/up as one gate_up_proj (Phi-3; GGUF
            attn_qkv, ffn_up of twice the width): split on load into our q/k/v and gate/up parameters
            (engine.model.tensor_names.split_fused).
        rope_types: the rope_scaling types its configs may set (None: engine.model.hf_config._COMMON_ROPE's).
        gguf_fields: more ModelConfig fields of its GGUF metadata: called with `get(key without "{arch}.",
            default)` and the keywords layers, hidden, heads, head_dim (engine.model.family_fields).
        router: None for a dense MLP; else the family's mixture-of-experts router (ModelConfig.router,
            engine.layers.moe), its expert fields read by engine.model.hf_config.moe_from_hf / the GGUF reader.
        shared_expert: each MoE layer also has Qwen2-MoE's gated shared expert.
        gguf_norm_topk: whether llama.cpp renormalises the top-k weights of this GGUF architecture when the file has
            no `{arch}.expert_weights_norm` (its qwen3moe graph does, qwen2moe's does not).
        hf_renames: (old, new) substrings of HF checkpoint keys renamed to our parameter names (Mixtral's
            block_sparse_moe / w1 w2 w3 -> mlp / gate_proj down_proj up_proj).
        hf_stacked_experts: its HF checkpoints hold each layer's experts stacked and transposed, gate and up
            interleaved in one gate_up_proj, dense or as MXFP4 blocks and scales (gpt-oss:
            engine.loading.gpt_oss_tensors).
        gguf_gating: the `{arch}.expert_gating_func` values of its GGUF files that mean its router (absent: None;
            llama.cpp's enum: 1 softmax over every expert's logit, 3 softmax over the selected experts' logits).
        gguf_yarn_truncate: whether YaRN's correction range is rounded to whole dims (HF's rope_scaling `truncate`)
            for its GGUF files, which do not say (llama.cpp always rounds): the family's own configs decide.
        gguf_stop_tokens: end-of-generation tokens of its vocabulary, by text, beyond the file's EOS / EOT / EOM ids
            (its HF generation_config's eos_token_id list; llama.cpp marks them by text too).
        hf_unused: prefixes of HF checkpoint keys the model does not use by design, skipped on load (BertModel's
            NSP pooler, which sentence-transformers does not run either; its saved position_ids buffer).
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_arch: str
    gguf_permuted_qk: bool
    qkv_bias: bool
    qk_norm: bool
    refused: tuple[tuple[str, tuple[Any, ...]], ...]
    window: Callable[[dict[str, Any]], int | None]
    reads: tuple[str, ...] = ()
    fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    fused_projections: bool = False
    rope_types: tuple[str, ...] | None = None
    gguf_fields: Callable[..., dict[str, Any]] | None = None
    router: str | None = None
    shared_expert: bool = False
    gguf_norm_topk: bool = False
    hf_renames: tuple[tuple[str, str], ...] = ()
    hf_stacked_experts: bool = False
    gguf_gating: tuple[int | None, ...] = (None, 1)
    gguf_yarn_truncate: bool = True
    gguf_stop_tokens: tuple[str, ...] = ()
    hf_unused: tuple[str, ...] = ()


def _mistral_window(config: dict[str, Any]) -> int | None:
    """Mistral's `sliding_window` (every layer); Llama configs have none."""
    w = config.get("sliding_window")
    return int(w) if w is not None else None


def _no_window(config: dict[str, Any]) -> int | None:
    """Families whose `fields` reader sets the window with the layer types (Gemma)."""
    return None


#: The engine.model.hf_config._MATH_FIELDS the Gemma readers implement.
_GEMMA_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")


def _qwen_window(config: dict[str, Any]) -> int | None:
    """Qwen2/Qwen3: a window only with `use_sliding_window`, on the layers `layer_types` (or `max_window_layers`:
    layers from that index on) mark sliding. Per-layer windows (some layers full, some sliding) are refused."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        start = int(config.get("max_window_layers", n)) if config.get("use_sliding_window") else n
        types = ["sliding_attention" if config.get("use_sliding_window") and i >= start else "full_attention"
                 for i in range(n)]
    kinds = set(types)
    if kinds == {"full_attention"} or not config.get("use_sliding_window"):
        return None
    if kinds == {"sliding_attention"} and config.get("sliding_window"):
        return int(config["sliding_window"])
    raise ValueError(f"config.json asks for a sliding window on some layers only (layer_types {types[:4]}..., "
                     f"max_window_layers={config.get('max_window_layers')}); tokenmill runs one window for every "
                     "layer or none: set use_sliding_window false")


#: The checkpoint keys of LLaVA and LLaVA-NeXT: unused position ids, and the renames of every layout HF has written.
_LLAVA_KEYS: dict[str, Any] = dict(
    hf_unused=("vision_tower.vision_model.embeddings.position_ids", "vision_tower.embeddings.position_ids",
               "model.vision_tower.embeddings.position_ids"),
    hf_renames=(("language_model.model.", ""), ("language_model.lm_head.", "lm_head."), ("language_model.", ""),
                ("vision_tower.vision_model.", "vision_tower.")))

ARCHITECTURES: tuple[Architecture, ...] = (
    # Llama 2/3/3.1/3.2, SmolLM, TinyLlama; Mistral (HF model_type "mistral"; llama.cpp writes it as "llama").
    Architecture("llama", ("llama", "mistral"), "llama", gguf_permuted_qk=True, qkv_bias=False, qk_norm=False,
                 refused=(("attention_bias", (False, None)), ("mlp_bias", (False, None)), ("hidden_act", _SILU)),
                 window=_mistral_window),
    # Qwen2 / Qwen2.5: QKV bias, tied or untied embeddings, YaRN when the config has it.
    Architecture("qwen2", ("qwen2",), "qwen2", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(("hidden_act", _SILU),), window=_qwen_window),
    # Qwen3: per-head q_norm / k_norm, no bias, explicit head_dim.
    Architecture("qwen3", ("qwen3",), "qwen3", gguf_permuted_qk=False, qkv_bias=False, qk_norm=True,
                 refused=(("attention_bias", (False, None)), ("hidden_act", _SILU)), window=_qwen_window),
    # Gemma 2: soft-capped attention and logits, sandwich norms of (1 + weight), GeGLU, alternating windows.
    Architecture("gemma2", ("gemma2",), "gemma2", gguf_permuted_qk=False, qkv_bias=False, qk_norm=False,
                 refused=(("attention_bias", (False, None)),), window=_no_window, reads=_GEMMA_FIELDS,
                 fields=gemma2_fields, rope_types=("default",),
                 gguf_fields=functools.partial(gemma_gguf_fields, gemma3=False)),
    # Gemma 3 text (Gemma3ForCausalLM: the 1B, or a text-only checkpoint): q/k norms, local and global RoPE bases.
    Architecture("gemma3_text", ("gemma3_text",), "gemma3", gguf_permuted_qk=False, qkv_bias=False, qk_norm=True,
                 refused=(("attention_bias", (False, None)),), window=_no_window, reads=_GEMMA_FIELDS,
                 fields=gemma3_fields, gguf_fields=functools.partial(gemma_gguf_fields, gemma3=True)),
    # Phi-3 / Phi-3.5 / Phi-4 (dense): fused qkv_proj and gate_up_proj, LongRoPE (rope_scaling type longrope / su).
    Architecture("phi3", ("phi3",), "phi3", gguf_permuted_qk=False, qkv_bias=False, qk_norm=False,
                 refused=(("hidden_act", _SILU),), window=_mistral_window, fused_projections=True,
                 rope_types=("default", "longrope"), reads=("partial_rotary_factor",), fields=phi3_fields,
                 gguf_fields=phi3_gguf_fields),
    # Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B): Qwen3's attention, softmax-then-top-k routing, norm_topk_prob.
    Architecture("qwen3_moe", ("qwen3_moe",), "qwen3moe", gguf_permuted_qk=False, qkv_bias=False, qk_norm=True,
                 refused=(("attention_bias", (False, None)), ("hidden_act", _SILU)), window=_qwen_window,
                 router="softmax_topk", gguf_norm_topk=True),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, softmax-then-top-k, a gated shared expert.
    Architecture("qwen2_moe", ("qwen2_moe",), "qwen2moe", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(("qkv_bias", (True, None)), ("hidden_act", _SILU)), window=_qwen_window,
                 router="softmax_topk", shared_expert=True, gguf_norm_topk=False),
    # Mixtral 8x7B / 8x22B: Mistral's attention, top-k-then-softmax routing; llama.cpp writes it as "llama" with
    # expert tensors (after the dense llama entry, which a GGUF "llama" file without experts gets).
    Architecture("mixtral", ("mixtral",), "llama", gguf_permuted_qk=True, qkv_bias=False, qk_norm=False,
                 refused=(("hidden_act", _SILU),), window=_mistral_window, router="topk_softmax",
                 hf_renames=((".block_sparse_moe.", ".mlp."), (".w1.weight", ".gate_proj.weight"),
                             (".w2.weight", ".down_proj.weight"), (".w3.weight", ".up_proj.weight"))),
    # gpt-oss 20b / 120b: attention sinks, q/k/v/o biases, alternating sliding windows, YaRN, top-k-then-softmax
    # routing over biased logits, biased experts with a clamped SwiGLU, MXFP4 experts (dequantized exactly on load).
    # Every gpt-oss config sets YaRN's truncate false (OpenAI's reference does not round), which its GGUF cannot say;
    # its stop tokens are <|return|>, <|call|> and <|endoftext|> (generation_config.json).
    Architecture("gpt_oss", ("gpt_oss",), "gpt-oss", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(), window=_no_window, fields=gpt_oss_fields, router="topk_softmax",
                 hf_renames=((".mlp.router.", ".mlp.gate."),), hf_stacked_experts=True,
                 gguf_fields=gpt_oss_gguf_fields, gguf_gating=(None, 3), gguf_yarn_truncate=False,
                 gguf_stop_tokens=("<|return|>", "<|call|>", "<|endoftext|>")),
    # BERT (BertModel) encoders, e.g. sentence-transformers' all-MiniLM-L6-v2: embeddings only (engine.model.bert).
    # No GGUF name: tokenmill reads BERT from HF folders only (a GGUF "bert" file is refused as unsupported).
    Architecture("bert", ("bert",), "", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(("hidden_act", ("gelu",)), ("is_decoder", (False, None)),
                          ("add_cross_attention", (False, None))),
                 window=_no_window, fields=bert_fields, hf_unused=("pooler.", "embeddings.position_ids"),
                 hf_renames=(("bert.", ""),)),  # BertForSequenceClassification's encoder (its pooler kept)
    # XLM-RoBERTa (XLMRobertaModel: multilingual-e5, bge-m3's dense vectors): BERT's model, its positions counted
    # from pad_token_id + 1 (engine.model.bert: `positions`); HF folders only, as BERT.
    Architecture("xlm_roberta", ("xlm-roberta",), "", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(("hidden_act", ("gelu",)), ("is_decoder", (False, None)),
                          ("add_cross_attention", (False, None))),
                 window=_no_window, fields=xlm_roberta_fields,
                 hf_unused=("pooler.", "embeddings.position_ids"), hf_renames=(("roberta.", ""),)),
    # ModernBERT (ModernBertModel: gte-modernbert, modernbert-embed; engine.model.modernbert): RoPE of two bases,
    # global and symmetric sliding-window layers, GeGLU, bias-free pre-LN blocks; HF folders only. A bias, another
    # activation or a scaled RoPE (rope_types) is refused.
    Architecture("modernbert", ("modernbert",), "", gguf_permuted_qk=False, qkv_bias=False, qk_norm=False,
                 refused=(("hidden_activation", ("gelu",)), ("attention_bias", (False, None)),
                          ("mlp_bias", (False, None)), ("norm_bias", (False, None))),
                 window=_no_window, fields=modernbert_fields, rope_types=("default",)),
    # LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP vision tower and a projector before a Llama-family decoder
    # (engine.model.llava; its config: engine.model.llava_config). Checkpoint keys in every layout HF has written:
    # the original "language_model.model.*" / "vision_tower.vision_model.*", transformers 5's "model.language_model.*"
    # / "model.vision_tower.*". No GGUF: llama.cpp's mmproj pair is refused.
    Architecture("llava", ("llava",), "", gguf_permuted_qk=False, qkv_bias=False, qk_norm=False, refused=(),
                 window=_no_window, **_LLAVA_KEYS),
    # LLaVA-NeXT (LlavaNextForConditionalGeneration): LLaVA's keys plus "image_newline" (engine.model.llava_next).
    Architecture("llava_next", ("llava_next",), "", gguf_permuted_qk=False, qkv_bias=False, qk_norm=False,
                 refused=(), window=_no_window, **_LLAVA_KEYS),
    # Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): a SigLIP encoder and
    # a pixel-shuffle connector before a Llama decoder (engine.model.idefics3; its config: engine.model.
    # idefics3_config). Checkpoint keys "model.text_model.*", "model.vision_model.*", "model.connector.*". No GGUF.
    Architecture("idefics3", ("idefics3", "smolvlm"), "", gguf_permuted_qk=False, qkv_bias=False, qk_norm=False,
                 refused=(), window=_no_window, hf_renames=(("text_model.", ""),)),
    # Gemma 3 vision-language (Gemma3ForConditionalGeneration, model_type "gemma3", which hf_config.config_from_hf
    # reads before any lookup: get_architecture("gemma3") is the text entry's GGUF name): a SigLIP tower and an
    # average-pooling projector before the Gemma 3 text decoder, the image's soft tokens attending to each other in
    # prefill (engine.model.gemma3_vl; its config: engine.model.gemma3_vl_config). LLaVA's key layouts; the SigLIP
    # pooling head a vision_use_head config keeps is never run (HF's Gemma 3 reads the last hidden state). No GGUF.
    Architecture("gemma3_vl", ("gemma3",), "", gguf_permuted_qk=False, qkv_bias=False, qk_norm=True, refused=(),
                 window=_no_window, hf_renames=_LLAVA_KEYS["hf_renames"],
                 hf_unused=(*_LLAVA_KEYS["hf_unused"], "vision_tower.vision_model.head.", "vision_tower.head.",
                            "model.vision_tower.vision_model.head.", "model.vision_tower.head.")),
    # Qwen2.5-VL and Qwen2-VL (Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration): a
    # dynamic-resolution vision tower before a Qwen2 decoder with multimodal RoPE (engine.model.qwen_vl; its config:
    # engine.model.qwen_vl_config). Checkpoint keys as transformers saves them ("model.layers.*", "visual.*",
    # "lm_head.*") or as its modules name them ("model.language_model.*", "model.visual.*"). HF folders only.
    Architecture("qwen2_5_vl", ("qwen2_5_vl",), "", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(), window=_no_window, hf_renames=(("language_model.", ""),)),
    Architecture("qwen2_vl", ("qwen2_vl",), "", gguf_permuted_qk=False, qkv_bias=True, qk_norm=False,
                 refused=(), window=_no_window, hf_renames=(("language_model.", ""),)),
    # Qwen3-VL (Qwen3VLForConditionalGeneration, the dense models): a Qwen3 decoder (q/k norms) with interleaved
    # M-RoPE and DeepStack, after a vision tower with a learned position grid (engine.model.qwen3_vl; its config:
    # engine.model.qwen_vl_config). Checkpoint keys "model.language_model.*", "model.visual.*", "lm_head.*"; the
    # vision blocks' "mlp.linear_fc1/2" are Qwen2-VL's "mlp.fc1/2" (engine.model.qwen_vision.VisionMLP). HF folders
    # only. Qwen3-VL-MoE (qwen3_vl_moe) is not run: its experts are stored stacked, gate and up concatenated.
    Architecture("qwen3_vl", ("qwen3_vl",), "", gguf_permuted_qk=False, qkv_bias=False, qk_norm=True,
                 refused=(), window=_no_window, hf_renames=(("language_model.", ""), (".mlp.linear_fc", ".mlp.fc"))),
)


def supported() -> str:
    """The families we run, for error messages: "llama (llama, mistral), qwen2 (qwen2), qwen3 (qwen3)"."""
    return ", ".join(f"{a.name} ({', '.join(a.hf_model_types)})" for a in ARCHITECTURES)


def get_architecture(name: str) -> Architecture:
    """The entry whose registry name, HF model_type or GGUF architecture is `name`.

    Raises ValueError listing the families we run."""
    for a in ARCHITECTURES:
        if name == a.name or name in a.hf_model_types or (a.gguf_arch and name == a.gguf_arch):
            return a
    raise ValueError(f"architecture {name!r} is not supported; tokenmill runs {supported()}")


def gguf_architecture(gguf_arch: str, has_experts: bool) -> Architecture:
    """The entry of a GGUF file's `general.architecture`: the mixture-of-experts entry when the file has experts
    (`{arch}.expert_count` > 0; llama.cpp writes Mixtral as "llama"), else the dense one.

    Raises ValueError naming the architecture (and whether it had experts) when no entry runs it."""
    for a in ARCHITECTURES:
        if a.gguf_arch == gguf_arch and (a.router is not None) == has_experts:
            return a
    known = any(a.gguf_arch == gguf_arch for a in ARCHITECTURES)
    kind = (" with experts" if has_experts else " without experts") if known else ""
    raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}{kind}; tokenmill runs {supported()} (GGUF: "
                     f"{', '.join(dict.fromkeys(a.gguf_arch for a in ARCHITECTURES if a.gguf_arch))})")


def describe(cfg: ModelConfig) -> str:
    """One line naming a model's family and shape, for `tokenmill doctor` and the engine's load log: "qwen3_moe,
    48 layers, hidden 2048, 128 experts (8 active per token)"."""
    text = f"{cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}"
    if cfg.num_experts:
        text += f", {cfg.num_experts} experts ({cfg.num_experts_per_tok} active per token"
        text += ", plus a shared expert)" if cfg.shared_expert_intermediate_size else ")"
    return text


def hf_to_gguf_names(arch: Architecture, param_names: list[str], num_layers: int) -> dict[str, str]:
    """{GGUF tensor name: our parameter name} for `param_names` (HF names without "model.", e.g.
    "layers.0.self_attn.q_proj.bias"), through the gguf package's TensorNameMap of `arch`.

    Raises ValueError naming a parameter the map cannot place (a registry entry out of step with gguf)."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(by_name[arch.gguf_arch], num_layers)
    out = {}
    for name in param_names:
        hf = name if name == "lm_head.weight" else f"model.{name}"
        gname = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"the gguf package has no {arch.gguf_arch} tensor name for {name}")
        if not name.endswith((".weight", ".bias")):  # NOTE: the converter names every tensor with a suffix:
            gname += ".weight"  # gpt-oss's attention `sinks` are written as `blk.N.attn_sinks.weight`
        out[gname] = name
    return out
