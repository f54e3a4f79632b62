"""A GGUF file's config (ModelConfig) from its metadata and the map of its tensor names to our parameter names,
through the architecture registry (engine.model.architectures): what a file sets that tokenmill does not run is a
ValueError naming it, before any tensor is read. Imports no torch: the CLI checks a GGUF file through it before a
job (jobs.plan.preflight, with engine.loading.gguf_header's header-only reader), the engine when it loads one
(engine.loading.gguf_file, with gguf's GGUFReader).

A reader is anything with GGUFReader's `fields` ({key: field with `contents()`; an array's `data` as long as the
array}) and `tensors` (each with `name`, and for the RoPE factor tensors `data` and `tensor_type`).

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; what each family's keys mean: llama.cpp's
convert_hf_to_gguf.py (what it writes) and llama-model.cpp (how it reads them).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from engine.config import ModelConfig
from engine.loading.gguf_rope import ROPE_TENSORS, gguf_rope_scaling
from engine.model.architectures import get_architecture, gguf_architecture, hf_to_gguf_names
from engine.model.tensor_names import check_tensor_names, fuse_names, param_shapes

log = logging.getLogger(__name__)


def _field(reader: object, key: str, default: object = None) -> object:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    return default if f is None else f.contents()


def _arch_field(reader: object, arch: str, key: str, default: object) -> object:
    """The metadata value `{arch}.{key}`, or `default`."""
    return _field(reader, f"{arch}.{key}", default)


def _token_ids(reader: object, texts: tuple[str, ...]) -> list[int]:
    """The ids of the tokens spelled `texts` in the file's vocabulary (`tokenizer.ggml.tokens`), those it has."""
    if not texts:
        return []
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return [i for i, token in enumerate(tokens) if token in texts]  # type: ignore[attr-defined]


def read_gguf_config(reader: object) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...) through the
    architecture's registry entry (engine.model.architectures): QKV bias and q/k norms by family, RoPE scaling from
    `{arch}.rope.scaling.*` or, for Llama 3, the `rope_freqs.weight` factors llama.cpp's converter writes, every stop
    token (EOS, EOT, EOM ids, and the family's end-of-generation tokens by text: Architecture.gguf_stop_tokens).

    Raises ValueError for an architecture we do not run (listing those we do) or a RoPE scaling, expert router or
    family field (engine.model.family_fields) we do not implement, naming it.
    """
    arch = str(_field(reader, "general.architecture"))
    entry = gguf_architecture(arch, bool(_field(reader, f"{arch}.expert_count", 0)))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    tensors = {t.name: t for t in reader.tensors}  # type: ignore[attr-defined]
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if not head_dim and "partial_rotary_factor" not in entry.reads:  # else rope.dimension_count is the rotated part
        head_dim = _field(reader, f"{arch}.rope.dimension_count")
    max_pos = int(_field(reader, f"{arch}.context_length", 2048))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    stops = tuple(dict.fromkeys(int(i) for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id"),
                                                 _field(reader, "tokenizer.ggml.eom_token_id"),
                                                 *_token_ids(reader, entry.gguf_stop_tokens)) if i is not None))
    window = _field(reader, f"{arch}.attention.sliding_window")
    if arch == "llama" and not window:
        _warn_mistral_without_window(str(_field(reader, "general.name") or ""),
                                     str(_field(reader, "general.basename") or ""))
    get = functools.partial(_arch_field, reader, arch)
    fields = {} if entry.gguf_fields is None else entry.gguf_fields(
        get, layers=int(_field(reader, f"{arch}.block_count")), hidden=hidden, heads=heads,
        head_dim=int(head_dim) if head_dim else hidden // heads)
    return ModelConfig(**{**dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim) if head_dim else hidden // heads,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        architecture=entry.name,
        qkv_bias=entry.qkv_bias,
        qk_norm=entry.qk_norm,
        rope_scaling=gguf_rope_scaling(get, tensors, max_pos, entry.gguf_yarn_truncate),
        eos_token_ids=stops,
        sliding_window=int(window) if window else None,
        **_gguf_experts(reader, arch, entry),
    ), **fields})


@functools.cache
def _warn_mistral_without_window(name: str, basename: str) -> None:
    """Warn, once per model name, when a llama GGUF names a Mistral model but has no sliding-window key.

    llama.cpp's convert_hf_to_gguf.py writes Mistral as architecture "llama" without `llama.attention.sliding_window`,
    so such a file runs with full attention. Only the name in its metadata (general.name / general.basename) says
    it came from Mistral: whether its Hugging Face config had a window (Mistral 7B v0.1: 4096; v0.2 and later: none)
    is not in the file, so the warning says what follows in either case."""
    if not re.search(r"mistral", f"{name} {basename}", re.IGNORECASE):
        return
    log.warning("the GGUF %r names a Mistral model but holds no sliding window (llama.cpp's converter writes none): "
                "it runs with full attention. Where the Hugging Face config has a window (Mistral 7B v0.1: 4096 "
                "tokens), sequences longer than the window differ from Hugging Face's; load the Hugging Face folder "
                "to keep it", name or basename)


def _gguf_experts(reader: object, arch: str, entry: Any) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from `{arch}.expert_*` metadata ({} for a dense entry), as llama.cpp
    reads them: the expert width from expert_feed_forward_length (else feed_forward_length, as Mixtral's files
    have), the renormalisation from expert_weights_norm (else llama.cpp's default for the architecture,
    Architecture.gguf_norm_topk). Raises ValueError for a gating function the family's router does not compute
    (Architecture.gguf_gating), a scale of the experts' weights (expert_weights_scale other than 0 or 1) or shared
    experts the family has not."""
    if entry.router is None:
        return {}
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in entry.gguf_gating:
        raise ValueError(f"GGUF {arch}.expert_gating_func={gating} is not implemented for {entry.name}; its router "
                         f"({entry.router}) is llama.cpp's expert_gating_func {entry.gguf_gating[-1]}")
    scale = _field(reader, f"{arch}.expert_weights_scale")
    if scale not in (None, 0, 1):  # llama.cpp multiplies the routing weights by it unless 0 or 1
        raise ValueError(f"GGUF {arch}.expert_weights_scale={scale} is not implemented; tokenmill scales the "
                         "experts' routing weights by 1")
    shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0) if entry.shared_expert else 0
    if entry.shared_expert and not shared:
        raise ValueError(f"GGUF {arch} file lacks {arch}.expert_shared_feed_forward_length")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    width = _field(reader, f"{arch}.expert_feed_forward_length") or _field(reader, f"{arch}.feed_forward_length")
    return dict(num_experts=int(_field(reader, f"{arch}.expert_count")),
                num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0)),
                moe_intermediate_size=int(width), router=entry.router, shared_expert_intermediate_size=shared,
                norm_topk_prob=entry.router == "softmax_topk" and bool(entry.gguf_norm_topk if norm is None else norm))


def gguf_name_map(reader: Any, cfg: ModelConfig) -> dict[str, str]:
    """{GGUF tensor name: our parameter name} for every tensor of the file but the RoPE factors (`rope_freqs`,
    `rope_factors_*`: read into cfg.rope_scaling), checked: Raises ValueError naming a tensor the architecture does
    not place, or a missing one. Families with fused projections (Phi-3) map attn_qkv / ffn_up to their fused
    names (qkv_proj, gate_up_proj: split when read)."""
    entry = get_architecture(cfg.architecture)
    names = list(param_shapes(cfg))  # a tied LM head left out
    table = hf_to_gguf_names(entry, fuse_names(names) if entry.fused_projections else names, cfg.num_layers)
    out = {}
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        if t.name not in table:
            raise ValueError(f"GGUF tensor {t.name!r} is not part of the {cfg.architecture} architecture as tokenmill "
                             "runs it; tokenmill would drop it and compute something else")
        out[t.name] = table[t.name]
    check_tensor_names(out.values(), cfg, "the GGUF file", fused=entry.fused_projections)
    return out
