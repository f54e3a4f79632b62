"""GPTQ: calibrated INT4 weight quantization with error feedback (the alternative to round-to-nearest).

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (ICLR 2023, arXiv:2210.17323), Algorithm 1, as in the authors' reference code (IST-DASLab/gptq,
`gptq.py` `fasterquant`):

    per linear layer with weight W [N, K] and calibration inputs X [T, K] (T tokens):
      H = 2 X^T X / T                       (Hessian of the layer's squared output error ||X W^T - X Wq^T||^2)
      dead inputs (H_jj = 0): W[:, j] = 0, H_jj = 1
      H += damp * mean(diag H) * I          (dampening, damp = 1%)
      U = cholesky(H^-1) upper              (so U_jj^2 is the OBS denominator [H_F^-1]_jj of column j)
      for each block of 128 columns, for each column j in it:
          at a group start: (scale, zero) of the group from the current, error-updated, W[:, j:j+g]
          q_j = quantize(W[:, j]); e = (W[:, j] - dequant(q_j)) / U_jj
          W[:, j+1:block end] -= e U[j, j+1:block end]       (error feedback inside the block)
      W[:, block end:] -= E U[block, block end:]             (lazy batch update of the later columns)

The output is an ordinary `Int4Weight` in the tinygemm convention of engine.quant.qparams: w = (q - 8) * s + z,
q in 0..15, scale/zero bf16 [N, Kp / g], q computed against the bf16-rounded scale/zero. `act_order=True`
quantizes columns by decreasing H_jj (the paper's "act-order" heuristic) with groups kept in storage order
("static groups": each group's scale/zero is fitted on the original W before any update), so the packed format is
unchanged.

Two changes to the group parameters, both for "massive activations" (Sun et al., "Massive Activations in Large
Language Models", arXiv:2402.17762: a few input features thousands of times larger than the rest, on the first
token, which the model uses as an attention sink). SmolLM2-135M's layers.11.mlp.down_proj meets one near 3,000;
the reference fit treats that feature's weights like any other, and round-to-nearest at g128 of that one
projection costs +9.6% perplexity (bench/README.md):
  1. the squared-error group fit (`qparams._mse_fit`, method="mse") weights each column by H_jj, the mean squared
     input it meets (as llama.cpp's importance-matrix quantization weights its fit): that projection's cost falls
     under 0.1%;
  2. `refit=True`: after the column loop, every row's scales and zeros are re-solved for its codes on the full
     Hessian (`refit_group_qparams`, least squares in 2G unknowns per row) and kept where that lowers the error.
Whole model, g128, 20k AlpacaEval tokens: +18.4% as published -> +12.0% with both (damp 0.01); the other
combinations measured +12.3% to +14.0% (bench/README.md, INT4). The driver (engine.ptq.quantize) then trains the
group scales and zeros (and the RMSNorm gains) end to end against the unquantized model (engine.ptq.tune): +9.8%
with 128 calibration sequences and one epoch.

Model pipeline (`gptq_quantize_model`), as the reference llama.py with `--true-sequential`: the calibration
sequences are embedded once, then decoder layer i sees the outputs of the already quantized layers 0..i-1; inside
a layer the projections are done in four steps that each see the quantized earlier ones: (q, k, v) share one
Hessian, then o_proj, then (gate, up), then down_proj. Everything runs in fp32 on the model's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from engine.layers.attention import paged_attention_ref
from engine.model.base import ModelBase
from engine.model.sequence_forward import private_prefill
from engine.ptq.refit import refit_group_qparams, row_errors
from engine.quant.qparams import Int4Weight, _mse_fit, check_group_size, pack_uint4, padded_in_features

#: Per decoder layer, the projections quantized together (same input, so one Hessian), in forward order.
SEQUENTIAL_GROUPS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


class HessianAccumulator:
    """Running H = 2 X^T X / T over calibration inputs of one linear layer.

    `add(x)` takes the layer's input x: float [..., K] (any leading shape, flattened to rows); `hessian` is fp32
    [K, K], accumulated in fp32 as the reference code does (fp64 doubled the cost of a calibration pass on CPU).
    `tokens` counts rows seen.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate X^T X of a batch of layer inputs x [..., in_features] (any float dtype; summed in fp32)."""
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum.addmm_(x.t(), x)
        self.tokens += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        """fp32 [in_features, in_features]: 2 X^T X / T over the T tokens added. Raises ValueError when none were."""
        if self.tokens == 0:
            raise ValueError("no calibration inputs reached this layer")
        return 2.0 * self.sum / self.tokens


def _group_qparams(wg: torch.Tensor, method: str, scale_dtype: torch.dtype, importance: torch.Tensor | None = None,
                   mse_steps: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [N] rounded to `scale_dtype` for one group wg: fp32 [N, g], as qparams.quantize_int4 does:
    min-max or the squared-error fit weighted by `importance` (fp32 [g], H_jj of the group's columns), then
    zero = min + 8 * scale."""
    lo, hi = wg.amin(-1), wg.amax(-1)
    if method == "mse":
        s, lo = _mse_fit(wg[:, None, :], lo[:, None], hi[:, None], mse_steps, importance)
        s, lo = s[:, 0], lo[:, 0]
    elif method == "minmax":
        s = (hi - lo).clamp(min=1e-6) / 15
    else:
        raise ValueError(f"method must be 'minmax' or 'mse', got {method!r}")
    scales = s.to(scale_dtype)
    zeros = (lo + 8 * scales.float()).to(scale_dtype)
    return scales, zeros


def _quant_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8-valued fp32 [N] in 0..15 and its dequantized value (q - 8) * s + z for a column w: fp32 [N] with
    its group's scale/zero s, z: fp32 [N] (the exact arithmetic of Int4Weight.dequantize)."""
    q = ((w - (z - 8 * s)) / s).round_().clamp_(0, 15)
    return q, (q - 8) * s + z


@contextmanager
def _few_threads(device: torch.device) -> Iterator[None]:
    """One intra-op thread on CPU for the column loop: its ops are tiny ([N, <=128]) and thread hand-offs dominate
    (measured 0.49 s with 1 thread vs 2.6 s with 2 for N=576, K=1536 on 2 shared cores)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _gptq_columns(W: torch.Tensor, Hinv: torch.Tensor, Q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  sf: torch.Tensor, zf: torch.Tensor, perm: torch.Tensor, importance: torch.Tensor, group_size: int,
                  block_size: int, method: str, act_order: bool, scale_dtype: torch.dtype) -> None:
    """The blocked column loop of Algorithm 1 (module docstring), in place: W fp32 [N, K] (permuted order) is
    consumed, Q fp32 [N, K] gets the codes 0..15, scales/zeros ([N, G], and their fp32 copies sf/zf) get the group
    parameters unless act_order (static groups, already set). Hinv: upper Cholesky factor of H^-1, [K, K];
    importance: fp32 [K], H_jj in storage order (the weights of the group fit)."""
    k = W.shape[1]
    order = perm.tolist()  # host ints once (a per-column int() would sync the device every column)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = order[i1 + i]
            g = col // group_size
            if not act_order and col % group_size == 0:
                # Group start: fit on the current (error-updated) columns of this group, including later blocks.
                need = min(group_size, k - col)
                grp = W1[:, i:i + need]
                if grp.shape[1] < need:
                    grp = torch.cat((grp, W[:, i2:i2 + need - grp.shape[1]]), dim=1)
                scales[:, g], zeros[:, g] = _group_qparams(grp, method, scale_dtype, importance[col:col + need])
                sf[:, g], zf[:, g] = scales[:, g].float(), zeros[:, g].float()
            q, dq = _quant_column(W1[:, i], sf[:, g], zf[:, g])
            Q[:, i1 + i] = q
            err = (W1[:, i] - dq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]


@torch.no_grad()
def gptq_quantize_weight(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, *, damp: float = 0.01,
                         block_size: int = 128, method: str = "mse", act_order: bool = False, refit: bool = True,
                         scale_dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
    """GPTQ one weight (module docstring).

    Args:
        w: float [N, K], the weight as nn.Linear stores it (out_features x in_features).
        hessian: float [K, K], 2 X^T X / T of the layer's calibration inputs (HessianAccumulator.hessian).
        group_size: input features per scale/zero group (32, 64, 128, 256); K is padded to a multiple of it.
        damp: dampening, a fraction of mean(diag H) added to the diagonal (the paper's 1%).
        block_size: columns per lazy-update block (128 in the paper; changes speed, not the result beyond rounding).
        method: group scale/zero fit, "mse" (default; weighted by H_jj) or "minmax".
        act_order: quantize columns in order of decreasing H_jj, with static groups.
        refit: after the column loop, re-solve every row's scales and zeros for its codes on the Hessian
            (refit_group_qparams), keeping the rows where that lowers the output error.
        scale_dtype: dtype of the stored scales and zeros (bf16, the portable format).
    Returns an Int4Weight (qweight uint8 [N, Kp / 2], scales/zeros [N, Kp / group_size]).
    Raises ValueError for a bad group size or method or mismatched shapes.
    """
    check_group_size(group_size)
    if w.dim() != 2 or tuple(hessian.shape) != (w.shape[1], w.shape[1]):
        raise ValueError(f"weight must be [N, K] and hessian [K, K]; got {tuple(w.shape)} and {tuple(hessian.shape)}")
    if method not in ("minmax", "mse"):
        raise ValueError(f"method must be 'minmax' or 'mse', got {method!r}")
    n, k = w.shape
    kp = padded_in_features(k, group_size)
    ngroups = kp // group_size
    W = w.detach().clone().float()
    H = hessian.detach().clone().float().to(W.device)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    W0 = W  # the original (dead-zeroed) weight: W[:, perm] below is a copy, the loop never touches this one
    importance = torch.diag(H).clone()
    scales = torch.empty(n, ngroups, dtype=scale_dtype, device=W.device)
    zeros = torch.empty_like(scales)
    if act_order:
        for gi in range(ngroups):  # static groups: fitted on the (dead-zeroed) original weight
            cols = slice(gi * group_size, (gi + 1) * group_size)
            scales[:, gi], zeros[:, gi] = _group_qparams(W[:, cols], method, scale_dtype, importance[cols])
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(k, device=W.device)
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    H_damped = H
    W, H = W[:, perm], H[perm][:, perm]
    L = torch.linalg.cholesky(H)
    # H^-1 = L^-T L^-1 by a triangular solve (torch.cholesky_inverse measured 11.5 s for K=1536 on this CPU, the
    # solve 0.1 s), then its upper Cholesky factor U (H^-1 = U^T U).
    eye = torch.eye(k, dtype=H.dtype, device=H.device)
    l_inv = torch.linalg.solve_triangular(L, eye, upper=False)
    Hinv = torch.linalg.cholesky(l_inv.t() @ l_inv, upper=True)
    Q = torch.zeros(n, k, dtype=torch.float32, device=W.device)  # q values in permuted order
    sf, zf = scales.float(), zeros.float()
    with _few_threads(W.device):
        _gptq_columns(W, Hinv, Q, scales, zeros, sf, zf, perm, importance, group_size, block_size, method, act_order,
                      scale_dtype)
    q_full = torch.empty(n, kp, dtype=torch.float32, device=W.device)
    q_full[:, perm] = Q
    if refit:
        q, g_of = q_full[:, :k], torch.arange(k, device=W.device) // group_size
        new_s, new_z = refit_group_qparams(W0, q, H_damped, group_size, scale_dtype)
        before = row_errors(W0, (q - 8) * sf[:, g_of] + zf[:, g_of], H_damped)
        after = row_errors(W0, (q - 8) * new_s.float()[:, g_of] + new_z.float()[:, g_of], H_damped)
        better = (after < before) & (new_s.float() > 0).all(-1)
        scales = torch.where(better[:, None], new_s, scales)
        zeros = torch.where(better[:, None], new_z, zeros)
        sf, zf = scales.float(), zeros.float()
    if kp > k:  # padding columns hold the code of 0.0 (they meet zero activations)
        s_pad, z_pad = sf[:, -1:], zf[:, -1:]
        q_full[:, k:] = (8 - z_pad / s_pad).round().clamp(0, 15).expand(n, kp - k)
    return Int4Weight(pack_uint4(q_full), scales, zeros, k, group_size)


@torch.no_grad()
def gptq_quantize_model(model: ModelBase, calibration: torch.Tensor, group_size: int = 128, *,
                        damp: float = 0.01, method: str = "mse", act_order: bool = False, refit: bool = True,
                        on_layer: Callable[[int, float], None] | None = None) -> dict[str, Int4Weight]:
    """GPTQ every decoder projection of a filled fp32 `model`, layer by layer (module docstring).

    Args:
        model: ModelBase with plain fp32 nn.Linear projections. Modified in place: each quantized
            projection's weight is replaced by its dequantized INT4 value (so later layers calibrate on quantized
            outputs); swap in Int4Linear modules afterwards (engine.ptq.quantize.quantize_model does).
        calibration: int64 [S, L] token ids (engine.ptq.calibration), S sequences of L tokens each.
        group_size, damp, method, act_order, refit: as gptq_quantize_weight.
        on_layer: progress callback (layer index, seconds so far).
    Returns {module name: Int4Weight}. Cost: about one forward of the decoder over the S * L tokens (each stage
    of a layer is computed once per sequence and kept) plus the GPTQ solves. Peak extra memory: fp32
    [S, L, hidden] for the residual stream plus [S, L, intermediate] for one stage's inputs. Raises ValueError when
    the projections are not fp32, or for a Gemma block (its stages are not the ones cut here).
    """
    import time

    cfg = model.config
    if cfg.sandwich_norms or cfg.hidden_act != "silu" or cfg.embedding_scale or cfg.rope_local_theta:
        raise ValueError(f"GPTQ calibration runs Llama's decoder block; the {cfg.architecture} block (sandwich norms, "
                         "GeGLU, scaled embeddings, local RoPE) is not implemented there: quantize with RTN")
    if (dt := model.layers[0].self_attn.q_proj.weight.dtype) != torch.float32:
        raise ValueError(f"GPTQ calibrates in fp32 but the model's projections are {dt}: load it with "
                         "dtype='float32' (tokenmill quantize does), then quantize")

    t0 = time.perf_counter()
    device = next(model.parameters()).device
    s, seq_len = calibration.shape
    dtype = torch.float32
    meta, (k_cache, v_cache) = private_prefill(model.config, seq_len, dtype, device)
    cos, sin = model.rotary(model.rotary.table_rows(torch.arange(seq_len, device=device), seq_len), dtype)
    hidden = [model.embed_tokens(calibration[i].to(device)).to(dtype) for i in range(s)]
    out: dict[str, Int4Weight] = {}

    def quantize_group(li: int, stage: int, inputs: list[torch.Tensor]) -> None:
        acc = HessianAccumulator(inputs[0].shape[-1], device)
        for a in inputs:
            acc.add(a)
        h = acc.hessian
        for nm in SEQUENTIAL_GROUPS[stage]:
            lin = model.layers[li].get_submodule(nm)
            q = gptq_quantize_weight(lin.weight, h, group_size, damp=damp, method=method, act_order=act_order,
                                     refit=refit)
            lin.weight.data = q.dequantize(lin.weight.dtype).to(lin.weight.device)
            out[f"layers.{li}.{nm}"] = q

    for li, layer in enumerate(model.layers):
        # DecoderLayer.forward (engine.model.decoder) cut at each projection group's input; every stage runs once per
        # sequence, after the groups before it are quantized, so the cost is one layer forward.
        xs = [layer.input_layernorm(x) for x in hidden]
        quantize_group(li, 0, xs)
        xs = [layer.self_attn.attend(a, cos, sin, k_cache, v_cache, meta, paged_attention_ref) for a in xs]
        quantize_group(li, 1, xs)
        hidden = [x + layer.self_attn.o_proj(o) for x, o in zip(hidden, xs, strict=True)]
        xs = [layer.post_attention_layernorm(x) for x in hidden]
        quantize_group(li, 2, xs)
        xs = [F.silu(layer.mlp.gate_proj(b)) * layer.mlp.up_proj(b) for b in xs]
        quantize_group(li, 3, xs)
        hidden = [x + layer.mlp.down_proj(m) for x, m in zip(hidden, xs, strict=True)]
        del xs
        if on_layer is not None:
            on_layer(li, time.perf_counter() - t0)
    return out


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    """Relative output error ||X W^T - X Wq^T||_F / ||X W^T||_F of a linear layer: x float [T, K], w and wq float
    [N, K]. The quantity GPTQ minimizes (up to the normalization)."""
    ref = x.float() @ w.float().t()
    return float((ref - x.float() @ wq.float().t()).norm() / ref.norm().clamp(min=math.ulp(1.0)))
