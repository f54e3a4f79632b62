"""What the engine calls on a model, whatever its family: the type the runner, the loaders and the quantizers hold.

A model class is named in one place only, engine.model.registry (`build_model`); everything else holds a
`ModelBase`. Its contract (vLLM's split of a model's forward and its LM head: `forward` then `compute_logits`):

- `forward(input_ids, rope_rows, kv_caches, meta, attn_fn, *, inputs_embeds=None)` -> hidden states [T, hidden]
  after the final norm: token ids int64 [T], or input embeddings [T, hidden] in the model's dtype instead; a
  DeepStack model (Qwen3-VL: its encode_images gives [tokens, 1 + K, hidden]) also takes `deepstack=`
  DeepStackFeatures with inputs_embeds, the runner passing it only to such a model;
- `compute_logits(hidden)` -> logits [S, vocab]: the LM head, a separate step;
- `encode_images(pixel_values[, grid_thw], *, image_sizes=None)` -> image features (vision-language models only:
  config.vision);
- `kv_cache_specs`: one engine.core.kv_cache_spec.KVCacheSpec per layer, the KV cache layout the model declares
  (memory fit, the KV pool and the runner read it, never a family name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import nn

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.core.kv_cache_spec import KVCacheSpec
    from engine.layers.attention import AttentionMetadata
    from engine.layers.rope import RotaryEmbedding


class DeepStackFeatures(NamedTuple):
    """The image features a DeepStack model adds to its decoder's hidden states at a step's image placeholder rows
    (Meng et al., "DeepStack", 2024; HF Qwen3VLTextModel._deepstack_process): features[:, i] is added to the rows'
    hidden states after decoder layer i, for i < K. Gathered with the step's input embeddings
    (engine.worker.mm_embeds), from the levels 1..K of the encoder's output.

    Attributes:
        rows: int64 [N], the step's rows (token indices in the flattened step) that are image placeholders.
        features: [N, K, hidden] in the model's dtype, row n of them for rows[n].
    """

    rows: torch.Tensor
    features: torch.Tensor


class ModelBase(nn.Module):
    """A model of the engine: see the module docstring. Subclasses set the attributes below in __init__.

    Attributes:
        config: the model's shape.
        max_positions: positions its RoPE tables cover.
        rotary: the RoPE tables (engine.layers.rope.RotaryEmbedding; the runner reads `long_from` / `table_rows`).
        layers: the blocks, one per layer (the quantizers walk their projections by HF names).
        embed_tokens / lm_head: the token embedding and the LM head (HF names without "model.").
        kv_cache_specs: the KV cache layout, one KVCacheSpec per layer (kind "none" where a layer keeps no cache).
        uses_mrope: `forward` takes multimodal RoPE rows int64 [3, T] for the steps with image prompts (Qwen2-VL:
            engine.multimodal.mrope); False (the class default): rope rows int64 [T] only.
        bidirectional_images: in prefill the placeholders of one image attend to each other (Gemma 3: the runner
            sets AttentionMetadata.image_spans, the scheduler never ends a prefill chunk inside an image); False
            (the class default): causal attention over every token.
    """

    uses_mrope: ClassVar[bool] = False
    bidirectional_images: ClassVar[bool] = False

    config: ModelConfig
    max_positions: int
    rotary: RotaryEmbedding
    layers: nn.ModuleList
    embed_tokens: nn.Module
    lm_head: nn.Module
    kv_cache_specs: tuple[KVCacheSpec, ...]

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn_fn: object = None, *, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm of int64 input_ids [T] (or of inputs_embeds [T, hidden]
        when input_ids is None), rope_rows int64 [T], one (k_cache, v_cache) per layer as kv_cache_specs lays them
        out, the step's attention metadata and paged attention function."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """Logits [S, vocab] of hidden [S, hidden]: fp32, or in the model's dtype when not full_precision."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, hidden] of int64 input_ids [T] (what `forward` takes as inputs_embeds)."""
        raise NotImplementedError

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None, *,
                      image_sizes: list[tuple[int, int]] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Image features [N, tokens per image, hidden] of pixel_values [N, channels, H, W] (a vision-language
        model's: config.vision set); for a dynamic-resolution model (Qwen2-VL) [sum of tokens, hidden] of the
        images' patches concatenated and their grids int64 [N, 3] (Qwen3-VL: [sum of tokens, 1 + K, hidden], level 0
        the input embeddings, levels 1..K its DeepStack features); for LLaVA-NeXT, whose token count varies, N
        tensors [tokens_i, hidden] of pixel_values [N, tiles, channels, H, W] and the images' original (height,
        width), image_sizes (MultiModalItem.image_size; given only for items that carry one). A text-only model raises
        NotImplementedError."""
        raise NotImplementedError(f"the {self.config.architecture} model takes no images")

    def fuse_projections(self) -> int:
        """Merge projections into the serving layout, in place; the number of merged modules (0: none)."""
        return 0

    def materialize_rotary(self, device: torch.device) -> None:
        """(Re)build the RoPE tables on `device` (after building on the meta device)."""

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head (ModelConfig.tie_word_embeddings)."""
        self.lm_head.weight = self.embed_tokens.weight
