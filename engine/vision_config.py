"""The vision side of a vision-language model's config (ModelConfig.vision): its image encoder's shape, which of its
hidden states feed the projector, and the image placeholder token. Its own module, as engine.rope_scaling, because
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
    anyres tiling of it (image_grid_pinpoints), or Idefics3's SigLIP encoder and pixel-shuffle connector
    (scale_factor; Laurençon et al. 2024, Zhai et al., SigLIP 2023).

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
        scale_factor: the connector's pixel shuffle (Idefics3 / SmolVLM: each scale_factor x scale_factor block of
            patches becomes one feature row of scale_factor^2 times the width); 1: none (LLaVA).
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
    def max_tokens_per_image(self) -> int:
        """The most placeholder tokens one MultiModalItem can take: tokens_per_image, or under anyres the base tile's
        plus the largest pinpoint's feature grid with a newline row each, before unpadding (engine.multimodal.
        anyres; the encoder cache's budget is sized from it)."""
        return self.tokens_per_image + max(
            (h // self.patch_size * (w // self.patch_size + 1) for h, w in self.image_grid_pinpoints), default=0)

    @property
    def layers_run(self) -> int:
        """Encoder layers whose output the projector needs: the layers up to `feature_layer` (the later ones are
        loaded, as the checkpoint holds them, but never run)."""
        return self.feature_layer % (self.num_layers + 1)
