"""CLIP's vision tower (a ViT; Radford et al., "Learning Transferable Visual Models From Natural Language
Supervision", CLIP 2021; Dosovitskiy et al., ViT 2021) as HF transformers' CLIPVisionModel computes it, for the vision
-language families (engine.model.llava): patches by a strided convolution, a CLS embedding, learned absolute
positions, pre-LayerNorm ("pre_layrnorm", HF's spelling), pre-norm encoder blocks of bidirectional attention
(engine.layers.encoder_attention) and an MLP, post_layernorm (held, as the checkpoint has it; the LLaVA features are
a hidden state before it). Parameter names are CLIPVisionModel's without "vision_model.", so a checkpoint's tensors
fill it by name.

The blocks run on rows flattened to [N * L, width] (every image has the same L = patches + 1 tokens, so attention
needs no mask and no padding: one scaled_dot_product_attention call per layer for the batch of images).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.encoder_attention import EncoderMetadata, encoder_attention
from engine.vision_config import VisionConfig


def vision_act(name: str, x: torch.Tensor) -> torch.Tensor:
    """An activation of engine.vision_config.VISION_ACTS applied to x (any shape, any float dtype): "quick_gelu"
    x * sigmoid(1.702 x) (CLIP's), "gelu" (exact erf GELU), "gelu_pytorch_tanh" (the tanh approximation). Raises
    ValueError for another name."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"activation {name!r} is not implemented for the vision tower")


def empty_on_meta(rows: int, cols: int) -> torch.Tensor | None:
    """An uninitialised weight when building on the meta device (nn.Embedding's init there would import
    torch._dynamo: engine.model.decoder's NOTE), else None (nn.Embedding initialises its own)."""
    return torch.empty(rows, cols) if torch.empty(0).device.type == "meta" else None


class ClipVisionEmbeddings(nn.Module):
    """Patch, CLS and position embeddings (HF CLIPVisionEmbeddings, at the configured image size only)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.image_size = v.image_size
        self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, kernel_size=v.patch_size,
                                         stride=v.patch_size, bias=False)
        self.position_embedding = nn.Embedding(v.num_patches + 1, v.hidden_size,
                                               _weight=empty_on_meta(v.num_patches + 1, v.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, channels, image_size, image_size] (any float dtype; cast to the weights') -> [N, 1 +
        patches, width]. Raises ValueError for another image size (the processor resizes and crops to it)."""
        n, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"pixel_values are {h}x{w}; the vision tower takes {self.image_size}x{self.image_size} "
                             "(the model's image processor resizes and crops to it)")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.to(weight.dtype).expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class ClipAttention(nn.Module):
    """Multi-head self-attention with biased q/k/v/out projections (HF CLIPAttention; scale head_dim ** -0.5)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.hidden_size // v.num_heads
        self.q_proj = nn.Linear(v.hidden_size, v.hidden_size)
        self.k_proj = nn.Linear(v.hidden_size, v.hidden_size)
        self.v_proj = nn.Linear(v.hidden_size, v.hidden_size)
        self.out_proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """x [T, width] (the rows of meta's images, flattened) -> [T, width], the model's dtype."""
        qkv = torch.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=1)
        return self.out_proj(encoder_attention(qkv.view(x.shape[0], 3, self.num_heads, self.head_dim), meta))


class ClipMLP(nn.Module):
    """fc1, the activation, fc2 (HF CLIPMLP)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.act = v.hidden_act
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(vision_act(self.act, self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """One pre-norm block: x + attention(LN1(x)), then + MLP(LN2(.)) (HF CLIPEncoderLayer)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = ClipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = ClipMLP(v)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), meta)
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    """The blocks of the encoder (HF CLIPEncoder; SigLIP's are the same), as `encoder.layers.N`."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(v) for _ in range(v.num_layers))


class ClipVisionTower(nn.Module):
    """CLIPVisionModel's vision transformer: `forward` gives the hidden state VisionConfig.feature_layer selects."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.config = v
        self.embeddings = ClipVisionEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.encoder = ClipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, channels, image_size, image_size] -> the feature layer's hidden states [N, 1 + patches,
        width] in the weights' dtype (HF's `hidden_states[feature_layer]`: the layers past it are not run)."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        n, length, width = x.shape
        meta = EncoderMetadata.of([length] * n, x.device)
        h = x.reshape(n * length, width)
        for layer in self.encoder.layers[:self.config.layers_run]:
            h = layer(h, meta)
        return h.view(n, length, width)
