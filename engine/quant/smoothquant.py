"""SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", ICML 2023): move activation outliers into the weights before W8A8 quantization.

For a linear y = x W^T whose input channel j has activation range a_j = max|x[:, j]| (over calibration tokens) and
weight range w_j = max|W[:, j]|, the smoothing factor s_j = a_j^alpha / w_j^(1 - alpha) rescales x_j / s_j and
W[:, j] * s_j: the product is unchanged, and per-token INT8 activations no longer spend their range on a few
outlier channels. The division by s is folded into what produces x, so nothing is added at run time:
- the fused QKV and gate/up projections: into the RMSNorm gains before them;
- down_proj: into the up half of gate_up_proj (silu(gate) * up is linear in up);
- a mixture-of-experts block's input: into the norm before it, every expert's gate/up and a shared expert's, the
  router and the shared expert's gate (smooth_model).
o_proj is left as it is (its input mixes heads that share V rows under GQA), and so is the LM head, which stays in the
compute dtype (engine.quant.int8_linear). alpha = 0.5, the paper's default, measured best here (bench/README.md).

Calibration: per-channel maxima from one forward over `calibration_text` (built in, written for this purpose; not
from any evaluation set), which is enough for channel ranges: outlier channels are a property of the model.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.moe import SparseMoE
from engine.model.base import ModelBase
from engine.model.sequence_forward import forward_sequence

#: Text of the calibration forward: a mix of instructions, arithmetic, code, lists and prose.
CALIBRATION_TEXT = """\
Write a short note to a colleague explaining why the nightly data export failed and what you changed to fix it.
The export stopped at 02:14 because the disk that holds the temporary files filled up. I moved the temporary
directory to the larger volume, added a check that stops the job early with a clear message when less than 20 GB is
free, and re-ran the export by hand; it finished at 05:40 and the files are in the usual bucket.

Question: A bakery sells muffins for $3 each and cookies for $1.50 each. On Saturday it sold 48 muffins and twice as
many cookies. How much money did it make? Answer: It sold 2 * 48 = 96 cookies, which brought in 96 * 1.5 = $144.
The muffins brought in 48 * 3 = $144. Together that is 144 + 144 = $288.

def moving_average(values: list[float], window: int) -> list[float]:
    if window <= 0:
        raise ValueError("window must be positive")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out

Here are five tips for a first trip to the mountains: 1. Check the weather the evening before and again in the
morning. 2. Tell someone where you are going and when you expect to be back. 3. Carry more water than you think you
need. 4. Start early, because storms often build in the afternoon. 5. Turn around if the trail becomes unsafe.

Der Zug nach München fährt um 8:15 Uhr von Gleis 4 ab. La réunion est reportée à jeudi prochain, à 14 heures.
The committee reviewed 1,250 applications, invited 87 candidates to interview, and offered 12 positions (about 1%).
Summarize the main argument of the article in two sentences, then list three questions it leaves unanswered.
"""


@torch.inference_mode()
def input_channel_maxima(model: ModelBase, token_ids: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """max |input| per input channel (fp32 [K]) of each module in `names`, over one forward of token_ids
    (int64 [n]) from an empty private KV cache."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            a = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            stats[name] = a if name not in stats else torch.maximum(stats[name], a)
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        forward_sequence(model, token_ids, model.embed_tokens.weight.dtype)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _factors(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_max = weight.detach().abs().amax(0).float().clamp_min(1e-5)
    return (act_max.clamp_min(1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp_min(1e-5)


def _divide_norm(norm: nn.Module, s: torch.Tensor) -> None:
    """Divide an RMSNorm's effective weight (offset + weight: engine.layers.rms_norm.RMSNorm) by s [K], in place."""
    offset, w = getattr(norm, "offset", 0.0), norm.weight
    if offset:
        w.copy_(((offset + w.float()) / s - offset).to(w.dtype))
    else:
        w.div_(s.to(w.dtype))


@torch.inference_mode()
def smooth_model(model: ModelBase, token_ids: torch.Tensor, alpha: float = 0.5) -> None:
    """Apply SmoothQuant in place to a fused model (ModelBase.fuse_projections) with plain nn.Linear weights;
    the model computes the same function (up to rounding) afterwards. token_ids: int64 [n] calibration tokens.
    A mixture-of-experts block (engine.layers.moe.SparseMoE) is smoothed at its input: one factor per channel from
    the block's input and every weight that reads it (each expert's gate/up, a shared expert's), multiplied into
    those and into the router and the shared expert's gate (which stay in the compute dtype: the product is the same
    function); a shared expert's down as a dense MLP's. The experts' down projections are not smoothed (their
    inputs differ per expert: a factor per expert, from the tokens routed to it, is not implemented).
    Raises ValueError when the projections are not fused plain nn.Linear layers."""
    for layer in model.layers:
        mlps = [layer.mlp.shared_expert] if isinstance(layer.mlp, SparseMoE) else [layer.mlp]
        if not (isinstance(layer.self_attn.qkv_proj, nn.Linear) and all(
                m is None or isinstance(m.gate_up_proj, nn.Linear) for m in mlps)) or (
                isinstance(layer.mlp, SparseMoE) and layer.mlp.experts.gate_up_proj is None):
            raise ValueError("smooth_model needs fused nn.Linear projections: call fuse_projections() first, on "
                             "a model loaded with quantization='none'")
    names = []
    for i, layer in enumerate(model.layers):
        names.append(f"layers.{i}.self_attn.qkv_proj")
        if isinstance(layer.mlp, SparseMoE):
            names.append(f"layers.{i}.mlp")
            if layer.mlp.shared_expert is not None:
                names.append(f"layers.{i}.mlp.shared_expert.down_proj")
        else:
            names += [f"layers.{i}.mlp.gate_up_proj", f"layers.{i}.mlp.down_proj"]
    stats = input_channel_maxima(model, token_ids, names)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        s = _factors(stats[f"layers.{i}.self_attn.qkv_proj"], attn.qkv_proj.weight, alpha)
        _divide_norm(layer.input_layernorm, s)
        attn.qkv_proj.weight.mul_(s.to(attn.qkv_proj.weight.dtype))
        norm = layer.mlp_input_norm  # pre_feedforward_layernorm in Gemma's sandwich-norm blocks
        if isinstance(mlp, SparseMoE):
            _smooth_moe(mlp, norm, stats, f"layers.{i}.mlp", alpha)
            continue
        s = _factors(stats[f"layers.{i}.mlp.gate_up_proj"], mlp.gate_up_proj.weight, alpha)
        _divide_norm(norm, s)
        mlp.gate_up_proj.weight.mul_(s.to(mlp.gate_up_proj.weight.dtype))
        _smooth_down(mlp, stats[f"layers.{i}.mlp.down_proj"], alpha)


def _smooth_down(mlp: nn.Module, act_max: torch.Tensor, alpha: float) -> None:
    """SmoothQuant of a fused SwiGLU MLP's down_proj, its factor divided out of the up half of gate_up_proj."""
    s = _factors(act_max, mlp.down_proj.weight, alpha)
    mlp.gate_up_proj.weight[mlp.intermediate_size:].div_(s[:, None].to(mlp.gate_up_proj.weight.dtype))
    mlp.down_proj.weight.mul_(s.to(mlp.down_proj.weight.dtype))


def _smooth_moe(moe: SparseMoE, norm: nn.Module, stats: dict[str, torch.Tensor], name: str, alpha: float) -> None:
    """SmoothQuant of a mixture-of-experts block's input (smooth_model says which weights), and its shared expert's
    down_proj."""
    experts, shared = moe.experts, moe.shared_expert
    gate_up = experts.gate_up_proj.weight
    readers = [gate_up.reshape(-1, gate_up.shape[-1])] + ([shared.gate_up_proj.weight] if shared is not None else [])
    s = _factors(stats[name], torch.cat([w.detach().float() for w in readers]), alpha)
    _divide_norm(norm, s)
    for w in [gate_up, moe.gate.weight] + ([] if shared is None else [shared.gate_up_proj.weight,
                                                                      moe.shared_expert_gate.weight]):
        w.mul_(s.to(w.dtype))
    if shared is not None:
        _smooth_down(shared, stats[f"{name}.shared_expert.down_proj"], alpha)
