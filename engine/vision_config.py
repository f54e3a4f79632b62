"""The vision side of a vision-language model's config (ModelConfig.vision): its image encoder's shape, which of its
hidden states feed the projector, and the image placeholder token. VisionConfig is LLaVA's CLIP tower and projector;
QwenVisionConfig Qwen2-VL's and Qwen2.5-VL's dynamic-resolution tower, patch merger and M-RoPE sections (Wang et al.,
"Qwen2-VL", 2024; Bai et al., "Qwen2.5-VL Technical Report", 2025; HF transformers' Qwen2VLVisionConfig and
Qwen2_5_VLVisionConfig), and its subclass Qwen3VisionConfig Qwen3-VL's (learned position grid, DeepStack): the
LLaVA and Qwen towers share almost no field. Its own module, as engine.rope_scaling, because
engine/config.py is at the file size limit and every subpackage that knows the shape imports engine.config."""

from __future__ import annotations

from dataclasses import dataclass

#: The encoder MLP's and the projector's activations tokenmill implements (HF ACT2FN names): CLIP's quick GELU
#: x * sigmoid(1.702 x) (Radford et al., CLIP 2021), the exact (erf) GELU, and GELU's tanh approximation.
VISION_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
#: vision_feature_select_strategy: "default" drops the CLS token's row, "full" keeps it (HF LlavaModel).
SELECT_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class VisionConfig:
    """A ViT vision tower and its projector: LLaVA's CLIP tower and two-layer projector (Liu et al., "Visual Instruction
    Tuning" 2023 and "Improved Baselines with Visual Instruction Tuning" 2023; Radford et al., CLIP 2021), LLaVA-NeXT's
    anyres tiling of it (image_grid_pinpoints), Idefics3's SigLIP encoder and pixel-shuffle connector (scale_factor;
    Laurençon et al. 2024, Zhai et al., SigLIP 2023), or Gemma 3's SigLIP tower and average-pooling projector
    (scale_factor; Gemma Team, "Gemma 3 Technical Report" 2025).

    Attributes:
        hidden_size / intermediate_size / num_layers / num_heads: the encoder's width, MLP width, blocks and heads.
        image_size: side of the square image the tower takes, in pixels (the processor's crop size).
        patch_size: side of one patch in pixels; the tower sees (image_size / patch_size)^2 patches plus a CLS token.
        num_channels: input channels (3: RGB).
        layer_norm_eps: epsilon of the encoder's LayerNorms.
        hidden_act: the encoder MLP's activation (VISION_ACTS).
        feature_layer: which hidden state feeds the projector, as an index into HF's hidden_states tuple (the
            embeddings after pre_layrnorm are 0, layer i's output is i + 1; negative counts from the end: LLaVA-1.5's
            -2 is the second-to-last layer's output).
        select_strategy: "default" drops the CLS row, "full" keeps it (SELECT_STRATEGIES); a tower without a CLS
            token (Idefics3's SigLIP) reads as "default".
        scale_factor: the connector's reduction of each scale_factor x scale_factor block of patches to one feature
            row: Idefics3's / SmolVLM's pixel shuffle (of scale_factor^2 times the width), Gemma 3's average pooling
            (its kernel: patches per side / sqrt(mm_tokens_per_image)); 1: none (LLaVA).
        image_grid_pinpoints: LLaVA-NeXT's anyres resolutions, (height, width) pairs in pixels, each a multiple of
            image_size (engine.multimodal.anyres); empty: an image is one tile of tokens_per_image (LLaVA-1.5).
        projector_hidden_act: the activation between the projector's two linears (VISION_ACTS).
        projector_bias: the projector's linears carry biases.
        image_token_id: the placeholder token id; each image takes `tokens_per_image` of them in the prompt.

    Raises:
        ValueError: naming a field whose value tokenmill does not implement or an inconsistent shape.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    image_token_id: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    feature_layer: int = -2
    select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    scale_factor: int = 1
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "image_size", "patch_size",
                     "num_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"VisionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                             f"({self.num_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size ({self.image_size}) must be a multiple of patch_size "
                             f"({self.patch_size})")
        if self.scale_factor < 1 or (self.image_size // self.patch_size) % self.scale_factor:
            raise ValueError(f"vision scale_factor {self.scale_factor} must be >= 1 and divide the "
                             f"{self.image_size // self.patch_size} patches of a side")
        pinpoints = tuple((int(h), int(w)) for h, w in self.image_grid_pinpoints)  # JSON gives lists
        object.__setattr__(self, "image_grid_pinpoints", pinpoints)
        if any(h < self.image_size or w < self.image_size or h % self.image_size or w % self.image_size
               for h, w in pinpoints):
            raise ValueError(f"image_grid_pinpoints {[list(p) for p in pinpoints]} must be multiples of the vision "
                             f"image_size {self.image_size}")
        for name in ("hidden_act", "projector_hidden_act"):
            if getattr(self, name) not in VISION_ACTS:
                raise ValueError(f"vision {name} {getattr(self, name)!r} is not implemented; tokenmill runs "
                                 f"{VISION_ACTS}")
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} is not implemented; tokenmill "
                             f"runs {SELECT_STRATEGIES}")
        if not -(self.num_layers + 1) <= self.feature_layer <= self.num_layers:
            raise ValueError(f"vision_feature_layer {self.feature_layer} is outside the tower's {self.num_layers + 1} "
                             "hidden states")

    @property
    def num_patches(self) -> int:
        """Patches of one image: (image_size / patch_size) squared."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and projected feature rows) of one image (one tile, for the families that split
        images): the patches over scale_factor squared, plus the CLS row under "full"."""
        return self.num_patches // self.scale_factor ** 2 + (self.select_strategy == "full")

    @property
    def layers_run(self) -> int:
        """Encoder layers whose output the projector needs: the layers up to `feature_layer` (the later ones are
        loaded, as the checkpoint holds them, but never run)."""
        return self.feature_layer % (self.num_layers + 1)


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


@dataclass(frozen=True)
class Qwen3VisionConfig(QwenVisionConfig):
    """A Qwen3-VL vision transformer (HF Qwen3VLVisionConfig; Qwen team, "Qwen3-VL Technical Report", 2025): Qwen2-VL's
    LayerNorm blocks with full attention (style "layer"; a biased patch embedding and a GELU-tanh MLP), a learned
    position embedding interpolated to each image's grid, and DeepStack (Meng et al., "DeepStack", 2024): the patch
    features after the blocks deepstack_visual_indexes, each merged by a merger of its own, added to the language
    model's hidden states after its first len(deepstack_visual_indexes) layers. Its language model's M-RoPE is
    interleaved (HF Qwen3VLTextRotaryEmbedding: frequency j reads height when j % 3 == 1, width when j % 3 == 2, within
    3 * section; time elsewhere).

    Attributes (beyond QwenVisionConfig's):
        num_position_embeddings: rows of the learned position table, a square grid (side^2).
        deepstack_visual_indexes: the blocks whose outputs feed the DeepStack mergers, in HF's order (distinct).

    Raises:
        ValueError: as QwenVisionConfig, or for a table that is not a square grid, windows (Qwen3-VL has none) or
            repeated / out-of-range deepstack indexes.
    """

    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        side = self.position_grid_side
        if side < 1 or side * side != self.num_position_embeddings:
            raise ValueError(f"vision_config num_position_embeddings {self.num_position_embeddings} is not a square "
                             "grid (side^2 rows)")
        if self.style != "layer" or self.window_size:
            raise ValueError("a Qwen3-VL vision tower has LayerNorm blocks and no window attention (style 'layer', "
                             "window_size 0)")
        ds = self.deepstack_visual_indexes
        if len(set(ds)) != len(ds) or any(not 0 <= i < self.num_layers for i in ds):
            raise ValueError(f"vision_config deepstack_visual_indexes {list(ds)} must be distinct blocks of the "
                             f"tower's {self.num_layers}")

    @property
    def position_grid_side(self) -> int:
        """Side of the square learned position grid: sqrt(num_position_embeddings), rounded down (HF's)."""
        return int(self.num_position_embeddings ** 0.5)


def vision_config_from_dict(values: dict) -> VisionConfig | QwenVisionConfig:
    """The vision config saved as `dataclasses.asdict` (ModelConfig.from_dict's JSON): Qwen3VisionConfig when it has
    deepstack fields, QwenVisionConfig when it has a spatial merge, else VisionConfig. Raises TypeError for fields
    the class does not have, ValueError as the class."""
    if "deepstack_visual_indexes" in values:
        return Qwen3VisionConfig(**values)
    return (QwenVisionConfig if "spatial_merge_size" in values else VisionConfig)(**values)
