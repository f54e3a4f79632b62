"""The eager (matmul, softmax, matmul) form of attention, for what torch's scaled_dot_product_attention cannot do:
Gemma 2's soft-capped scores and gpt-oss's attention sinks.

Attention sinks (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025; Xiao et al., "Efficient Streaming Language
Models with Attention Sinks", 2023): each query head h has a learned logit `sinks[h]` that joins the softmax's
denominator as one more key whose value is zero: p_t = exp(s_t) / (sum_u exp(s_u) + exp(sinks[h])). A head can so
put weight on "nothing" and its outputs sum to less than one of the values. HF transformers' eager gpt-oss attention
appends the sink as a last score column, takes the softmax and drops that column; this does the same.
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Raise ValueError unless `sinks` is None or a float tensor of shape [num_heads]."""
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)
                              or not sinks.is_floating_point()):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be None or a float tensor [num_heads={num_heads}], got {shape}")


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, *,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    gqa: bool = False) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + mask [, sinks]) v with the softmax in fp32, as HF transformers' eager attention.

    Args:
        q: [..., H, Lq, D]; k, v: [..., Hkv, L, D] with Hkv = H, or with `gqa` any divisor of H (query head h reads
            KV head h // (H // Hkv)).
        mask: additive (0 or -inf), broadcast to [..., H, Lq, L].
        scale: multiplies the scores.
        softcap: c > 0 maps each scaled score s to c * tanh(s / c) before the mask (Gemma 2); None: not capped.
        sinks: per-head logits broadcast to [..., H, Lq, 1] (module docstring); None: no sink.
    Returns:
        [..., H, Lq, D] in q's dtype.
    """
    if gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = (s + mask).float()
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        sink = sinks.float().expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(q.dtype), v)
