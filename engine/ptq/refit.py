"""Least-squares refit of INT4 group scales and zeros for fixed codes, on a layer's Hessian.

After GPTQ (engine.ptq.gptq) has chosen every weight's code q in 0..15, the dequantized weight
wq_n,i = (q_n,i - 8) s_n,g(i) + z_n,g(i) is linear in the row's 2G group parameters (s, z), so the ones that
minimize the layer's output error (w_n - wq_n) H (w_n - wq_n)^T, H = 2 X^T X / T, solve a 2G x 2G linear system
per row; the groups couple through H's off-diagonal blocks. Same objective as GPTQ (Frantar et al. 2022,
arXiv:2210.17323), solved for the group parameters instead of the codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.qparams import padded_in_features


def refit_group_qparams(w: torch.Tensor, codes: torch.Tensor, hessian: torch.Tensor, group_size: int,
                        scale_dtype: torch.dtype = torch.bfloat16,
                        row_chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros re-solved for fixed codes: per row n, the (scale, zero) of all G groups that minimize the
    layer's output error (w_n - wq_n) H (w_n - wq_n)^T with wq_n,i = (q_n,i - 8) s_n,g(i) + z_n,g(i), a linear
    least-squares problem in 2G unknowns (the normal equations couple the groups through H's off-diagonal
    blocks). Scales are rounded to `scale_dtype` first and the zeros solved again for the rounded scales, so the
    stored pair is what the kernel reads.

    Args:
        w: fp32 [N, K], the weight the quantization must reproduce (original, not error-updated).
        codes: fp32 [N, K] in 0..15.
        hessian: fp32 [K, K], dampened 2 X^T X / T.
        group_size: g; K is zero-padded to Kp = G * g (padding columns have zero weight in the objective).
        row_chunk: rows solved at once (peak extra memory about row_chunk * Kp * G * 4 bytes).
    Returns (scales, zeros), `scale_dtype` [N, G]. Cost about N * Kp^2 multiply-adds, one GEMM of the layer.
    """
    n, k = w.shape
    kp = padded_in_features(k, group_size)
    ng, g = kp // group_size, group_size
    H = F.pad(hessian.float(), (0, kp - k, 0, kp - k))
    Hb = H.view(kp, ng, g)
    R = Hb.sum(-1)  # [Kp, G]: R[i, h] = sum over j in group h of H_ij
    m_zz = R.view(ng, g, ng).sum(1)  # [G, G]
    eye = torch.eye(2 * ng, dtype=torch.float32, device=w.device)
    scales = torch.empty(n, ng, dtype=scale_dtype, device=w.device)
    zeros = torch.empty_like(scales)
    for r0 in range(0, n, row_chunk):
        W = F.pad(w[r0:r0 + row_chunk].float(), (0, kp - k))
        C = F.pad(codes[r0:r0 + row_chunk].float() - 8, (0, kp - k))  # padding: code 8, so it adds nothing
        rows = W.shape[0]
        Cg = C.view(rows, ng, g)
        HW = (W @ H).view(rows, ng, g)
        T = torch.einsum("ihj,nhj->nih", Hb, Cg).reshape(rows, ng, g, ng)  # sum over j in h of H_ij C_nj
        m_ss = torch.einsum("ngt,ngth->ngh", Cg, T)
        m_sz = torch.einsum("ngt,gth->ngh", Cg, R.view(ng, g, ng))
        M = torch.cat((torch.cat((m_ss, m_sz), 2), torch.cat((m_sz.transpose(1, 2), m_zz.expand(rows, ng, ng)), 2)),
                      1)
        rhs = torch.cat(((Cg * HW).sum(-1), HW.sum(-1)), 1)
        ridge = 1e-6 * M.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-30)
        theta = torch.linalg.solve(M + ridge[:, None, None] * eye, rhs)
        s = theta[:, :ng].to(scale_dtype).float()
        z = torch.linalg.solve(m_zz + ridge[:, None, None] * eye[:ng, :ng],
                               rhs[:, ng:] - (m_sz.transpose(1, 2) @ s[..., None])[..., 0])
        scales[r0:r0 + rows] = s.to(scale_dtype)
        zeros[r0:r0 + rows] = z.to(scale_dtype)
    return scales, zeros


def row_errors(w: torch.Tensor, wq: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """fp32 [N]: (w_n - wq_n) H (w_n - wq_n)^T per row, w and wq fp32 [N, K], H [K, K]."""
    e = w - wq
    return ((e @ hessian) * e).sum(-1)
