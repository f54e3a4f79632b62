"""The vision side of a Qwen2-VL / Qwen2.5-VL config (ModelConfig.vision of the qwen2_vl and qwen2_5_vl families):
the vision transformer's shape, its window attention, the patch merger, the image placeholder token and the
multimodal RoPE sections of the language model. Its own module beside engine.vision_config (LLaVA's CLIP tower)
because the two towers share almost no field. No torch.

Sources: Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution" (2024);
Bai et al., "Qwen2.5-VL Technical Report" (2025); HF transformers' Qwen2VLVisionConfig, Qwen2_5_VLVisionConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The vision MLP's activations tokenmill implements for these towers (HF ACT2FN names).
QWEN_VISION_ACTS = ("silu", "quick_gelu", "gelu", "gelu_pytorch_tanh")
#: "rms": RMSNorm blocks, a gated (SwiGLU) MLP and window attention (Qwen2.5-VL); "layer": LayerNorm blocks, a
#: two-layer fc1/fc2 MLP and full attention in every block (Qwen2-VL).
QWEN_VISION_STYLES = ("rms", "layer")


@dataclass(frozen=True)
class QwenVisionConfig:
    """A Qwen2-VL / Qwen2.5-VL vision transformer and its patch merger.

    Attributes:
        hidden_size / intermediate_size / num_layers / num_heads: the tower's width, MLP width, blocks and heads.
        out_hidden_size: the merger's output width (the language model's hidden size).
        patch_size: side of a patch in pixels; temporal_patch_size: frames per patch (an image is repeated to it).
        spatial_merge_size: the merger joins spatial_merge_size^2 neighbouring patches into one token.
        image_token_id: the placeholder token (<|image_pad|>); an image of grid (t, h, w) patches takes
            t * h * w / spatial_merge_size^2 of them (`tokens_of`).
        mrope_section: the language model's multimodal RoPE sections (temporal, height, width), in rotary
            frequencies: they sum to head_dim / 2.
        style: QWEN_VISION_STYLES ("rms": Qwen2.5-VL, "layer": Qwen2-VL).
        in_channels: input channels (3).
        hidden_act: the MLP's activation (QWEN_VISION_ACTS).
        window_size: the side of an attention window in pixels (Qwen2.5-VL); 0: full attention in every block.
        fullatt_block_indexes: the blocks with full attention over the image when window_size is set.
        rope_theta: the base of the vision attention's 2D rotary embedding.
        norm_eps: epsilon of the tower's and the merger's norms (1e-6 in HF's code, not a config field).

    Raises:
        ValueError: naming a field whose value tokenmill does not implement or an inconsistent shape.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    image_token_id: int
    mrope_section: tuple[int, int, int]
    style: str = "rms"
    temporal_patch_size: int = 2
    in_channels: int = 3
    hidden_act: str = "silu"
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "mrope_section", tuple(int(s) for s in self.mrope_section))
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "out_hidden_size", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "in_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"QwenVisionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size ({self.hidden_size}) / num_heads ({self.num_heads}) must be a "
                             "multiple of 4 (the 2D rotary embedding's height and width halves)")
        if self.style not in QWEN_VISION_STYLES:
            raise ValueError(f"vision style {self.style!r} is not one of {QWEN_VISION_STYLES}")
        if self.hidden_act not in QWEN_VISION_ACTS:
            raise ValueError(f"vision_config hidden_act {self.hidden_act!r} is not implemented; tokenmill runs "
                             f"{QWEN_VISION_ACTS}")
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ValueError(f"rope mrope_section {list(self.mrope_section)} must be 3 sections (temporal, height, "
                             "width) of >= 0 frequencies")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size < 0 or self.window_size % unit:
            raise ValueError(f"vision_config window_size {self.window_size} must be a multiple of patch_size * "
                             f"spatial_merge_size ({unit}), or 0")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"vision_config fullatt_block_indexes {bad} are outside the tower's {self.num_layers} "
                             "blocks")

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (the processor's pixel_values columns): channels * frames * patch^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merger_window(self) -> int:
        """The side of an attention window in merged tokens (HF's vit_merger_window_size); 0: no windows."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    def windowed(self, layer: int) -> bool:
        """Whether block `layer` attends within windows (not in fullatt_block_indexes, window_size set)."""
        return self.merger_window > 0 and layer not in self.fullatt_block_indexes

    def tokens_of(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens (= merged feature rows) of an image of grid (t, h, w) patches. Raises ValueError when
        h or w is not a multiple of spatial_merge_size (the processor resizes to multiples of it)."""
        t, h, w = grid_thw
        m = self.spatial_merge_size
        if h % m or w % m or t < 1:
            raise ValueError(f"image grid {tuple(grid_thw)} is not a whole number of {m}x{m} merged tokens")
        return t * h * w // (m * m)

    @property
    def tokens_per_image(self) -> int:
        """The most placeholder tokens the encoder cache budgets one image for (engine.worker.mm_embeds'
        default_budget): Qwen's default max_pixels (12845056) in merged tokens. An image's own count varies with
        its size: `tokens_of`."""
        return 12845056 // (self.patch_size * self.spatial_merge_size) ** 2
