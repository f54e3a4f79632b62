"""The model registry: an architecture's name -> its model class, its config reader, its tensor names and its KV
cache layout. `build_model(config)` is the only place a model class is named (tests/engine/model/test_registry.py
holds engine/ to it); everything else holds an engine.model.base.ModelBase.

A family whose math differs from another's only in ModelConfig fields is one entry here pointing at the generic
causal decoder (engine.model.decoder: Llama, Mistral, Qwen2, Qwen3, Phi-3), plus its config reader
(engine.model.architectures.Architecture); a structurally new family is one model module and one entry: Gemma 2/3
(engine.model.gemma), the mixture-of-experts families (engine.model.moe_decoder: Qwen3-MoE, Qwen2-MoE, Mixtral) and
gpt-oss (engine.model.gpt_oss); the encoders BERT and XLM-RoBERTa share engine.model.bert, ModernBERT is
engine.model.modernbert; the vision-language LLaVA-1.5 is engine.model.llava, LLaVA-NeXT engine.model.llava_next,
Idefics3 / SmolVLM engine.model.idefics3, Gemma 3 engine.model.gemma3_vl, Qwen2-VL / Qwen2.5-VL
engine.model.qwen_vl, Qwen3-VL engine.model.qwen3_vl (DeepStack). Imports no torch at module level (memory fit and
the tensor names read it in the CLI's client): the model classes are imported when a model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ModelConfig
from engine.core.kv_cache_spec import KVCacheSpec
from engine.model.architectures import ARCHITECTURES, Architecture, get_architecture
from engine.model.bert_names import bert_kv_layout, bert_param_shapes
from engine.model.classifier_names import with_head
from engine.model.kv_layout import decoder_kv_layout
from engine.model.modernbert_names import modernbert_param_shapes
from engine.model.qwen_vl_names import qwen3_vl_param_shapes, qwen_vl_param_shapes
from engine.model.tensor_names import param_shapes
from engine.model.vision_names import (
    gemma3_vl_param_shapes,
    idefics3_param_shapes,
    llava_next_param_shapes,
    llava_param_shapes,
)

if TYPE_CHECKING:
    from engine.model.base import ModelBase


def _model_class(module: str, name: str) -> Callable[[], type[ModelBase]]:
    """A ModelEntry.model_class: imports class `name` of engine.model.`module` when called (torch)."""
    return lambda: getattr(importlib.import_module(f"engine.model.{module}"), name)


@dataclass(frozen=True)
class ModelEntry:
    """How to build and size one architecture's model.

    Attributes:
        model_class: returns the class (imported on the call: torch).
        param_shapes: HF name (without "model.") -> shape of every parameter the model holds for a config, a
            tied LM head left out (no torch).
        kv_layout: the KV cache layout (one KVCacheSpec per layer) the model declares for a config (no torch).
        tasks: what the model does (schemas.engine_choices.TASKS): "generate" (a causal LM: LLMEngine.generate),
            "embed" (an encoder whose pooled hidden states are embeddings: LLMEngine.embed), "classify" (a
            sequence classifier: LLMEngine.classify); "score" is not listed: model_tasks derives it. A causal
            decoder's folder with sentence-transformers files embeds too (config_tasks).
        takes_images: a vision-language model (ModelConfig.vision; prompts may carry images: engine.multimodal).
    """

    model_class: Callable[[], type[ModelBase]]
    param_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    kv_layout: Callable[[ModelConfig], tuple[KVCacheSpec, ...]]
    tasks: tuple[str, ...] = ("generate",)
    takes_images: bool = False


#: The generic causal decoder: every family whose differences are ModelConfig fields.
CAUSAL_DECODER = ModelEntry(_model_class("decoder", "LlamaModel"), param_shapes, decoder_kv_layout)
#: The families with files of their own (subclasses of the causal decoder: their parameter names and KV layout are
#: its own, told by the config's fields).
GEMMA = ModelEntry(_model_class("gemma", "GemmaModel"), param_shapes, decoder_kv_layout)
MOE_DECODER = ModelEntry(_model_class("moe_decoder", "MoEDecoderModel"), param_shapes, decoder_kv_layout)
GPT_OSS = ModelEntry(_model_class("gpt_oss", "GptOssDecoder"), param_shapes, decoder_kv_layout)
#: The BERT encoder (engine.model.bert), and XLM-RoBERTa, which differs from it in config values only.
BERT_ENCODER = ModelEntry(_model_class("bert", "BertEncoderModel"), bert_param_shapes, bert_kv_layout,
                          tasks=("embed",))
#: The ModernBERT encoder (engine.model.modernbert): no KV cache either.
MODERNBERT_ENCODER = ModelEntry(_model_class("modernbert", "ModernBertEncoderModel"), modernbert_param_shapes,
                                bert_kv_layout, tasks=("embed",))

#: LLaVA-1.5 (engine.model.llava): the causal decoder with a CLIP vision tower and a projector; its KV cache is the
#: decoder's (the tower keeps none).
LLAVA = ModelEntry(_model_class("llava", "LlavaVLM"), llava_param_shapes, decoder_kv_layout, takes_images=True)
#: LLaVA-NeXT (engine.model.llava_next): LLaVA with anyres tiles, unpadding and an image_newline vector.
LLAVA_NEXT = ModelEntry(_model_class("llava_next", "LlavaNextVLM"), llava_next_param_shapes, decoder_kv_layout,
                        takes_images=True)
#: Idefics3 / SmolVLM (engine.model.idefics3): a Llama decoder with a SigLIP encoder and a pixel-shuffle connector.
IDEFICS3 = ModelEntry(_model_class("idefics3", "Idefics3VLM"), idefics3_param_shapes, decoder_kv_layout,
                      takes_images=True)
#: Gemma 3 vision-language (engine.model.gemma3_vl): the Gemma 3 decoder with a SigLIP tower and a pooling projector,
#: its images' soft tokens attending to each other in prefill.
GEMMA3_VL = ModelEntry(_model_class("gemma3_vl", "Gemma3VLM"), gemma3_vl_param_shapes, decoder_kv_layout,
                       takes_images=True)
#: Qwen2-VL / Qwen2.5-VL (engine.model.qwen_vl): the Qwen2 decoder with M-RoPE and a dynamic-resolution vision tower.
QWEN_VL = ModelEntry(_model_class("qwen_vl", "QwenVLModel"), qwen_vl_param_shapes, decoder_kv_layout,
                     takes_images=True)
#: Qwen3-VL (engine.model.qwen3_vl): the Qwen3 decoder with interleaved M-RoPE, a vision tower with a learned position
#: grid, and DeepStack features added after the first decoder layers.
QWEN3_VL = ModelEntry(_model_class("qwen3_vl", "Qwen3VLModel"), qwen3_vl_param_shapes, decoder_kv_layout,
                      takes_images=True)

#: Architecture name (engine.model.architectures) -> its entry.
MODELS: dict[str, ModelEntry] = {
    "llama": CAUSAL_DECODER,
    "qwen2": CAUSAL_DECODER,
    "qwen3": CAUSAL_DECODER,
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "phi3": CAUSAL_DECODER,
    "qwen3_moe": MOE_DECODER,
    "qwen2_moe": MOE_DECODER,
    "mixtral": MOE_DECODER,
    "gpt_oss": GPT_OSS,
    "bert": BERT_ENCODER,
    "xlm_roberta": BERT_ENCODER,
    "modernbert": MODERNBERT_ENCODER,
    "llava": LLAVA,
    "llava_next": LLAVA_NEXT,
    "idefics3": IDEFICS3,
    "gemma3_vl": GEMMA3_VL,
    "qwen2_5_vl": QWEN_VL,
    "qwen2_vl": QWEN_VL,
    "qwen3_vl": QWEN3_VL,
}

#: Sequence classifiers (ModelConfig.labels set; engine.model.classifier_names): architecture -> its entry.
_ENCODER_CLASSIFIER = ModelEntry(_model_class("classifier", "EncoderClassifier"), with_head(bert_param_shapes),
                                 bert_kv_layout, tasks=("classify",))
_DECODER_CLASSIFIER = ModelEntry(_model_class("classifier", "DecoderClassifier"), with_head(param_shapes),
                                 decoder_kv_layout, tasks=("classify",))
_MODERNBERT_CLASSIFIER = ModelEntry(_model_class("classifier", "ModernBertClassifier"),
                                   with_head(modernbert_param_shapes), bert_kv_layout, tasks=("classify",))
CLASSIFIERS: dict[str, ModelEntry] = {"bert": _ENCODER_CLASSIFIER, "xlm_roberta": _ENCODER_CLASSIFIER,
                                      "modernbert": _MODERNBERT_CLASSIFIER, "llama": _DECODER_CLASSIFIER,
                                      "qwen2": _DECODER_CLASSIFIER}


def entry_of(cfg: ModelConfig) -> ModelEntry:
    """The entry of the model of shape `cfg`: its architecture's classifier when cfg.labels is set, else
    model_entry's. Raises ValueError as model_entry, or for a classifier of an architecture without one."""
    if not cfg.labels:
        return model_entry(cfg.architecture)
    model_tasks(cfg.architecture, True)  # raises for an architecture without a classifier
    return CLASSIFIERS[get_architecture(cfg.architecture).name]


def model_entry(architecture: str) -> ModelEntry:
    """The entry of `architecture` (a registry name, HF model_type or GGUF architecture: get_architecture's).
    Raises ValueError listing the families we run."""
    arch = get_architecture(architecture)
    entry = MODELS.get(arch.name)
    if entry is None:
        raise ValueError(f"architecture {arch.name!r} has a config reader but no model in engine.model.registry")
    return entry


def model_tasks(architecture: str, classifier: bool = False, num_labels: int = 0) -> tuple[str, ...]:
    """The tasks the model of `architecture` does ("generate", "embed", "classify", "score"; `classifier`: its
    sequence classifier's, of `num_labels` labels). "score" (LLMEngine.score: a relevance per text pair) follows
    from the others: an embedding model scores by cosine, a classifier of one label is a cross-encoder; raises
    ValueError as model_entry."""
    if not classifier:
        tasks = model_entry(architecture).tasks
        return (*tasks, "score") if "embed" in tasks else tasks
    entry = CLASSIFIERS.get(get_architecture(architecture).name)
    if entry is None:
        raise ValueError(f"a {architecture} model has no sequence classifier in tokenmill")
    return (*entry.tasks, "score") if num_labels == 1 else entry.tasks


def config_tasks(cfg: ModelConfig) -> tuple[str, ...]:
    """The tasks the model of shape `cfg` does: model_tasks' for its architecture (its classifier's when cfg.labels),
    and for a causal decoder whose folder holds sentence-transformers files (cfg.pooling_files) "embed" and "score"
    too, with "generate" only while it holds an LM head (cfg.lm_head). A causal LM without those files does not
    embed: tokenmill does not guess a pooling for hidden states that were never trained as embeddings (README,
    Embeddings). Raises ValueError as model_tasks."""
    tasks = model_tasks(cfg.architecture, bool(cfg.labels), len(cfg.labels))
    if cfg.labels or "generate" not in tasks or not cfg.pooling_files:
        return tasks
    return ("generate", "embed", "score") if cfg.lm_head else ("embed", "score")


#: How to ask for each task, in task_problem's lines.
_HOW = {"embed": "LLMEngine.embed, tokenmill run --task embed", "generate": "LLMEngine.generate, --task generate",
        "classify": "LLMEngine.classify, --task classify",
        "score": "LLMEngine.score, --task score --text-pair-column COLUMN"}


def task_problem(architecture: str, task: str, classifier: bool = False, num_labels: int = 0,
                 tasks: tuple[str, ...] | None = None) -> str | None:
    """One line when the model of `architecture` (`classifier`: its sequence classifier, of `num_labels` labels)
    cannot do `task` ("generate", "embed", "classify" or "score"), naming what it does and how to ask for that (for
    score, why: a classifier of several labels has no one relevance logit); None when it can. `tasks`: what the
    model does when its folder says more than its architecture (config_tasks); None: model_tasks'. Raises ValueError
    as model_entry."""
    tasks = tasks or model_tasks(architecture, classifier, num_labels)
    if task in tasks:
        return None
    name = get_architecture(architecture).name
    if task == "embed" and "generate" in tasks:
        return (f"a {name} model cannot embed: a causal LM embeds only when its folder holds sentence-transformers "
                "files (modules.json, 1_Pooling/config.json: Qwen3-Embedding's lasttoken pooling), since its hidden "
                "states are no embeddings unless trained so and tokenmill does not guess a pooling; pick an "
                "embedding model, or ask for generate (LLMEngine.generate, --task generate)")
    if task == "score":
        what = (f"a {name} sequence classifier of {num_labels} labels cannot score text pairs: scoring takes a "
                "cross-encoder's one logit (num_labels 1) or an embedding model's cosine" if classifier else
                f"a {name} model cannot score text pairs: it is no cross-encoder (a *ForSequenceClassification of "
                "1 label) nor embedding model")
        return (f"{what}; pick such a model (e.g. cross-encoder/ms-marco-MiniLM-L6-v2, or all-MiniLM-L6-v2), or ask "
                f"for {' or '.join(tasks)} ({'; '.join(_HOW[t] for t in tasks)})")
    return (f"a {name} model cannot {task}: it does {' and '.join(tasks)} "
            f"({'; '.join(_HOW[t] for t in tasks)}); pick a model that does {task}, or ask for "
            f"{' or '.join(tasks)}")


def refuse_task(cfg: ModelConfig, task: str) -> None:
    """Raise ValueError (task_problem's line) when the model of shape `cfg` cannot do `task`."""
    problem = task_problem(cfg.architecture, task, bool(cfg.labels), len(cfg.labels), config_tasks(cfg))
    if problem is not None:
        raise ValueError(problem)


def quantization_problem(architecture: str, quantization: str) -> str | None:
    """One line when `quantization` (EngineConfig.quantization) cannot apply to the model of `architecture`: int4 and
    int8 quantize a causal decoder's projections (engine.quant), not an encoder's, which would otherwise run
    unquantized or fail to load; a vision-language model runs unquantized only ("none": the quantized loads do not
    place its vision tower yet). None when it can. Raises ValueError as model_entry."""
    if model_entry(architecture).takes_images and quantization != "none":
        return (f"--quantization {quantization} is not implemented for a {get_architecture(architecture).name} "
                "model (vision-language); run it with --quantization none")
    if quantization in ("none", "auto") or "generate" in model_entry(architecture).tasks:
        return None
    return (f"--quantization {quantization} quantizes a causal decoder's projections; a "
            f"{get_architecture(architecture).name} model (an encoder) runs with --quantization none or auto")


def config_reader(architecture: str) -> Architecture:
    """The config reader (engine.model.architectures.Architecture) of `architecture`; raises ValueError."""
    return get_architecture(architecture)


def kv_cache_layout(cfg: ModelConfig) -> tuple[KVCacheSpec, ...]:
    """The KV cache layout, one KVCacheSpec per layer, of the model of shape `cfg` (what its `kv_cache_specs`
    says once built), from the config alone."""
    return entry_of(cfg).kv_layout(cfg)


def build_model(cfg: ModelConfig, max_positions: int | None = None) -> ModelBase:
    """The model of `cfg.architecture` of shape `cfg`, its RoPE tables for `max_positions` positions (None:
    cfg.max_position_embeddings), built on the current default device (the loaders build on the meta device, then
    fill). Raises ValueError for an architecture not in the registry."""
    return entry_of(cfg).model_class()(cfg, max_positions or cfg.max_position_embeddings)


def registered() -> tuple[str, ...]:
    """The architectures with a model, in engine.model.architectures.ARCHITECTURES' order."""
    return tuple(a.name for a in ARCHITECTURES if a.name in MODELS)


def model_param_names(cfg: ModelConfig) -> list[str]:
    """Names (HF, without "model.") of every parameter the model of shape `cfg` holds, a tied LM head left out:
    what a model file must provide, exactly (built on the meta device: no memory)."""
    import torch

    with torch.device("meta"):
        model = build_model(cfg, 1)
    return [k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
