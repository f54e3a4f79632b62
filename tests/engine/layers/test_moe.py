"""engine.layers.moe: the routers as HF transformers computes them (and a test that fails if the order of top-k and
softmax is swapped), ties, and the grouped expert computation (each active expert's rows multiplied once, no other
expert touched; oneDNN-packed experts equal to the stacked ones)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.layers.moe import SparseMoE, route

transformers = pytest.importorskip("transformers")

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 48, 8, 3, 40


def _cfg(router: str, renormalize: bool) -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=96, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       moe_intermediate_size=INTER, router=router, norm_topk_prob=renormalize)


def _hf_block(kind: str, renormalize: bool = False) -> torch.nn.Module:
    """HF's sparse block of `kind` ("qwen3_moe" or "mixtral") with random weights, fp32, eval."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                          moe_intermediate_size=INTER, norm_topk_prob=renormalize)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                         intermediate_size=INTER)
        block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


def _ours(hf: torch.nn.Module, router: str, renormalize: bool) -> SparseMoE:
    """Our block with `hf`'s weights (HF holds gate and up stacked as gate_up_proj [E, 2I, H])."""
    ours = SparseMoE(_cfg(router, renormalize)).eval()
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_proj.weight.copy_(hf.experts.gate_up_proj[:, :INTER])
        ours.experts.up_proj.weight.copy_(hf.experts.gate_up_proj[:, INTER:])
        ours.experts.down_proj.weight.copy_(hf.experts.down_proj)
    return ours


def _x() -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


def test_router_order_matches_each_family_and_swapping_fails() -> None:
    """Qwen3-MoE without renormalisation (softmax over all experts, then top-k) and Mixtral (top-k logits, then
    softmax over k) route the same experts with different weights: each of our routers equals its family's HF block,
    and the other order is far from it, so a swapped order fails here. With renormalisation the two coincide."""
    x = _x()
    qwen = _hf_block("qwen3_moe", renormalize=False)
    mixtral = _hf_block("mixtral")
    with torch.no_grad():
        want_qwen, want_mixtral = qwen(x[None])[0], mixtral(x[None])[0]
        got_qwen = _ours(qwen, "softmax_topk", False)(x)
        got_mixtral = _ours(mixtral, "topk_softmax", False)(x)
        swapped_qwen = _ours(qwen, "topk_softmax", False)(x)
        renormalized = _ours(qwen, "softmax_topk", True)(x)
    torch.testing.assert_close(got_qwen, want_qwen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_mixtral, want_mixtral, rtol=1e-5, atol=1e-5)
    assert (swapped_qwen - want_qwen).abs().max() > 0.05 * want_qwen.abs().max()  # > 1e4 x the tolerance
    torch.testing.assert_close(renormalized, swapped_qwen, rtol=1e-5, atol=1e-5)


def test_route_weights() -> None:
    """route on hand-made logits: softmax_topk's k weights are the full softmax's (summing to less than 1), its
    renormalised ones and topk_softmax's sum to 1; ids come back in increasing order with their weights."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 5.0, -1.0]])
    w, ids = route(logits, 2, "softmax_topk", False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 3], [0, 2]]
    torch.testing.assert_close(w, torch.stack([p[0, [1, 3]], p[1, [0, 2]]]))
    assert (w.sum(-1) < 1).all()
    for router, renorm in (("softmax_topk", True), ("topk_softmax", False)):
        w, ids = route(logits, 2, router, renorm)
        assert ids.tolist() == [[1, 3], [0, 2]]
        torch.testing.assert_close(w, torch.tensor([[0.7310586, 0.2689414], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="unknown MoE router 'sigmoid'"):
        route(logits, 2, "sigmoid", False)


def test_router_ties_as_hf() -> None:
    """Four experts with the same router row tie for the top 3 places on many tokens, so one of them must be left
    out; it is the one HF leaves out (both call torch.topk on the same probabilities), although the four compute
    different things."""
    qwen = _hf_block("qwen3_moe", renormalize=True)
    tied = [2, 5, 6, 7]
    x = _x()
    with torch.no_grad():
        qwen.gate.weight[tied] = 3.0 * qwen.gate.weight[2]
        _, ids = route(torch.nn.functional.linear(x, qwen.gate.weight), TOP_K, "softmax_topk", True)
        assert (torch.isin(ids, torch.tensor(tied)).sum(-1) == TOP_K).sum() > 5
        torch.testing.assert_close(_ours(qwen, "softmax_topk", True)(x), qwen(x[None])[0], rtol=1e-5, atol=1e-5)


def test_experts_run_grouped() -> None:
    """Each expert the router picked multiplies its rows once, in one call of all its rows (tokens in order); the
    others are never called."""
    ours = _ours(_hf_block("qwen3_moe"), "softmax_topk", False)
    x = _x()
    calls: list[tuple[int, int]] = []
    inner = ours.experts._expert

    def spy(e: int, rows: torch.Tensor) -> torch.Tensor:
        calls.append((e, rows.shape[0]))
        return inner(e, rows)

    ours.experts._expert = spy
    with torch.no_grad():
        _, ids = route(ours.gate(x), TOP_K, "softmax_topk", False)
        ours(x)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS).tolist()
    assert calls == [(e, n) for e, n in enumerate(counts) if n]
    assert sum(n for _, n in calls) == TOKENS * TOP_K and len(calls) < EXPERTS + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_fused_experts_equal_stacked(dtype: torch.dtype) -> None:
    """Fused gate/up and oneDNN-packed experts (engine.quant.after_load.pack_experts) compute what the stacked
    weights do; the shared expert (Qwen2-MoE) rides along."""
    from engine.layers.mlp import MLP
    from engine.quant.after_load import pack_experts
    from engine.quant.packed_linear import can_pack

    if not can_pack(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    cfg = ModelConfig(**{**_cfg("softmax_topk", False).__dict__, "shared_expert_intermediate_size": 80})
    torch.manual_seed(2)
    block = SparseMoE(cfg, MLP(cfg, 80))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    block = block.to(dtype).eval()
    x = _x().to(dtype)
    with torch.no_grad():
        want = block(x)
        assert block.fuse()
        fused = block(x)
        assert pack_experts(block.experts) and not pack_experts(block.experts)
        packed = block(x)
    tol = 1e-5 if dtype == torch.float32 else 0.1  # bf16: intermediates rounded in other places
    torch.testing.assert_close(fused, want, rtol=tol, atol=tol)
    torch.testing.assert_close(packed, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="freed when they were packed"):
        block.experts.stacked()


@pytest.mark.parametrize(("change", "match"), [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok must be in \[1, num_experts=8\], got 0"),
    ({"moe_intermediate_size": 0}, r"moe_intermediate_size must be >= 1"),
    ({"router": "sigmoid"}, r"router must be one of \('softmax_topk', 'topk_softmax'\), got 'sigmoid'"),
])
def test_bad_expert_shape_is_an_error(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**_cfg("softmax_topk", False).__dict__, **change})
