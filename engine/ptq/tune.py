"""End-to-end tuning of INT4 group scales and zeros (and the RMSNorm gains), codes fixed, by distillation.

GPTQ (engine.ptq.gptq) picks every weight's 4-bit code layer by layer, each projection minimizing its own output
error. What it cannot see is how the errors of 210 projections add up at the logits. This pass keeps the codes
and trains only the group parameters, a 1/64 of the weights at g128 (one scale and one zero per 128 weights), on
the whole model's output: the KL divergence from the unquantized model's next-token distribution to the quantized
model's, on the calibration sequences. That is the "E2E-QP" stage of Chen et al., "EfficientQAT: Efficient
Quantization-Aware Training for Large Language Models" (arXiv:2407.11062, 2024: train the step sizes end to end with
the integer weights frozen), with the teacher's logits as targets, as in knowledge distillation (Hinton et al.,
arXiv:1503.02531). With `tune_norms` the RMSNorm gains (fp32, 2 per layer + the final one) are trained alongside,
as in Li et al., "Norm Tweaking: High-performance Low-bit Quantization of Large Language Models" (arXiv:2309.02784,
2023): a gain scales one input channel of q/k/v (or gate/up), a per-channel freedom the group grid does not have.

Parameterization, per group: scale = s0 * exp(a), zero = z0 + b * s0, a = b = 0 at the start (so Adam's step is
relative to each group's own scale), both rounded to bf16 in the forward with a straight-through gradient, so the
tuned pair is exactly what the folder stores and the kernel reads; Adam at 3e-4 on a cosine schedule (the gains
too, directly). On SmolLM2-135M at g128 (perplexity on AlpacaEval answer tokens vs the fp32 model's, and KL to it
on other, held-out answers) tuning lowers both after GPTQ, the gains a little more, and one epoch on 128 x 256
calibration tokens is the default; a 10x larger rate lowered that perplexity further but raised the held-out KL: it
fits the calibration text instead of the model (figures and commands: bench/README.md "INT4").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.rms_norm import RMSNorm
from engine.model.base import ModelBase
from engine.model.sequence_forward import forward_sequence
from engine.quant.qparams import Int4Weight, unpack_uint4
from engine.quant.state import set_module


class _TunableInt4Linear(nn.Module):
    """A projection as fixed codes and trainable per-group (a, b): weight [N, K] = (q - 8) * s + z with
    s = bf16(s0 * exp(a)), z = bf16(z0 + b * s0), q - 8 held as fp32 [N, G, g]."""

    def __init__(self, w: Int4Weight, device: torch.device) -> None:
        super().__init__()
        n, g = w.out_features, w.group_size
        self.register_buffer("codes", unpack_uint4(w.qweight.to(device)).view(n, -1, g).float() - 8)
        self.register_buffer("s0", w.scales.to(device, torch.float32))
        self.register_buffer("z0", w.zeros.to(device, torch.float32))
        self.a = nn.Parameter(torch.zeros_like(self.s0))
        self.b = nn.Parameter(torch.zeros_like(self.s0))
        self.source = w
        self.weight = torch.empty(0)  # set by refresh()

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, zeros) fp32 [N, G], bf16-representable, differentiable in a and b (straight-through)."""
        s = self.s0 * torch.exp(self.a)
        z = self.z0 + self.b * self.s0
        return (s + (s.to(torch.bfloat16).float() - s).detach(),
                z + (z.to(torch.bfloat16).float() - z).detach())

    def refresh(self) -> None:
        """Rebuild the weight from the current (a, b): once per optimizer step, shared by its sequences."""
        s, z = self.qparams()
        n = self.codes.shape[0]
        self.weight = (self.codes * s[..., None] + z[..., None]).view(n, -1)[:, :self.source.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def tuned(self) -> Int4Weight:
        """The source weight with the tuned scales and zeros (bf16, on the source's device)."""
        with torch.no_grad():
            s, z = self.qparams()
        dev = self.source.scales.device
        return Int4Weight(self.source.qweight, s.to(dev, torch.bfloat16), z.to(dev, torch.bfloat16),
                          self.source.in_features, self.source.group_size)


def _logits(model: ModelBase, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(forward_sequence(model, ids, torch.float32))


def teacher_log_probs(teacher: ModelBase, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's next-token log-probabilities fp32 [L, vocab] of ids int64 [L] (one sequence from position 0),
    without gradient: distillation_kl's target, to compute once where several models are scored on the same ids."""
    with torch.no_grad():
        return F.log_softmax(_logits(teacher, ids), -1)


def distillation_kl(model: ModelBase, teacher: ModelBase | None, ids: torch.Tensor,
                    target: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of KL(teacher || model) of the next-token distributions, in nats: a scalar fp32 tensor,
    differentiable in `model`'s parameters. ids: int64 [L], one sequence from position 0 (L >= 1); target: the
    teacher's `teacher_log_probs(teacher, ids)` if already computed (then `teacher` is not run and may be None).
    Raises ValueError when neither is given."""
    if target is None:
        if teacher is None:
            raise ValueError("distillation_kl needs the teacher model or its target log-probabilities; pass one")
        target = teacher_log_probs(teacher, ids)
    return F.kl_div(F.log_softmax(_logits(model, ids), -1), target, log_target=True, reduction="batchmean")


def tune_group_qparams(model: ModelBase, teacher: ModelBase, weights: dict[str, Int4Weight],
                       calibration: torch.Tensor, *, epochs: float = 1.0, lr: float = 3e-4, seqs_per_step: int = 2,
                       seed: int = 0, tune_norms: bool = True, norm_lr: float = 3e-4,
                       on_step: Callable[[int, int, float], None] | None = None) -> dict[str, Int4Weight]:
    """Tune the scales and zeros of the INT4 projections `weights` end to end (module docstring); codes unchanged.

    Args:
        model: fp32 ModelBase whose modules named in `weights` are plain nn.Linear holding (or about to hold) the
            dequantized weight, as engine.ptq.gptq.gptq_quantize_model leaves it. Modified in place: on return
            those weights are the dequantized tuned ones (and the norm gains tuned, with tune_norms);
            requires_grad flags are restored.
        teacher: the unquantized fp32 model (same config, same device); only run forward.
        weights: {module name: Int4Weight} (GPTQ's or round-to-nearest codes).
        calibration: int64 [S, L] token ids, each row one sequence from position 0 (the GPTQ calibration batch).
        epochs: passes over the S sequences (0 = no tuning); steps = round(epochs * S / seqs_per_step).
        lr: peak Adam learning rate on the log-scale and zero offsets (relative to each group's scale), decayed
            to 0 on a cosine (Loshchilov & Hutter, SGDR, arXiv:1608.03983). 3e-4 lowers held-out KL on SmolLM2;
            3e-3 overfits the calibration text (held-out KL rises; bench/README.md, INT4).
        seqs_per_step: sequences whose gradients are averaged per Adam step.
        seed: order of the sequences.
        tune_norms: also train every RMSNorm gain of `model`: they stay tuned in `model`, so write the model's
            own norm weights with the returned INT4 weights.
        norm_lr: their peak Adam rate (absolute: the gains are not reparameterized), same cosine; 1e-3 did worse
            than 3e-4 on SmolLM2 (held-out KL 0.0971 vs 0.0959).
        on_step: progress callback (step, steps, KL of the step's sequences in nats per token).
    Returns {module name: Int4Weight} with bf16 scales and zeros. Cost per step: seqs_per_step forwards of the
    teacher and forward + backward of the model over L tokens; memory: the model's activations for seqs_per_step
    sequences plus fp32 codes [N, Kp] and the rebuilt weight for every tuned projection (8 bytes per weight).
    Raises ValueError for an empty calibration batch, epochs < 0 or seqs_per_step < 1.
    """
    if calibration.ndim != 2 or calibration.shape[0] == 0 or calibration.shape[1] < 2:
        raise ValueError(f"calibration must be int64 [S, L] with S >= 1, L >= 2; got {tuple(calibration.shape)}")
    if epochs < 0 or seqs_per_step < 1:
        raise ValueError(f"epochs must be >= 0 and seqs_per_step >= 1, got {epochs} and {seqs_per_step}")
    s = calibration.shape[0]
    steps = round(epochs * s / seqs_per_step)
    if steps == 0:
        return dict(weights)
    device = next(model.parameters()).device
    grad_flags = {p: p.requires_grad for p in model.parameters()}
    originals = {name: model.get_submodule(name) for name in weights}
    tunable = {name: _TunableInt4Linear(w, device) for name, w in weights.items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in tunable.items():
        set_module(model, name, module)
    groups = [{"params": [p for m in tunable.values() for p in (m.a, m.b)], "lr": lr}]
    if tune_norms:
        groups.append({"params": [m.weight for m in model.modules() if isinstance(m, RMSNorm)], "lr": norm_lr})
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    opt = torch.optim.Adam(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * (i + 1) / steps)))
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(s, generator=gen) for _ in range(-(-steps * seqs_per_step // s))])
    try:
        with torch.enable_grad():
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                for m in tunable.values():
                    m.refresh()
                kl = sum(distillation_kl(model, teacher, calibration[i].to(device))
                         for i in order[step * seqs_per_step:(step + 1) * seqs_per_step].tolist()) / seqs_per_step
                kl.backward()  # type: ignore[union-attr]
                total = kl.item()  # type: ignore[union-attr]
                opt.step()
                sched.step()
                if on_step is not None:
                    on_step(step, steps, total)
    finally:
        out = {name: m.tuned() for name, m in tunable.items()}
        del tunable
        for name, original in originals.items():
            original.weight.data = out[name].dequantize(original.weight.dtype).to(original.weight.device)
            set_module(model, name, original)
        for p, flag in grad_flags.items():
            p.requires_grad_(flag)
    return out
