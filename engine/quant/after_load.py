"""Process after load, for a whole model: what the engine does to a filled model before its first step, each weight
through its held form (engine.quant.forms). Projections fused (one QKV and one gate/up GEMM per layer), the INT4
portable weights released once fused, then on the CPU every plain linear packed for oneDNN (DenseForm, or
GGUFBlocksForm where the weight kept its GGUF blocks) and on CUDA the INT4 GemLite kernels tuned and compiled.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu_features import cpu_has_avx512
from engine.layers.moe import GroupedExperts
from engine.model.base import ModelBase
from engine.quant.forms import DenseForm, GGUFBlocksForm
from engine.quant.int4_linear import prepare_int4_kernels, release_int4_sources
from engine.quant.packed_linear import PACKED_DTYPES, can_pack, packing_available
from engine.quant.state import set_module


def process_model_after_load(model: ModelBase, device: torch.device, max_rows: int) -> None:
    """Bring a filled model into its serving form on `device`, in place (idempotent: an engine sharing the model
    runs it again): projections fused (ModelBase.fuse_projections), INT4 sources released
    (engine.quant.int4_linear.release_int4_sources), then on the CPU `pack_linears` (unless `mkl_serves_better`),
    elsewhere the INT4 GemLite configs loaded or tuned (once per GPU model, cached on disk) and compiled for every
    row count up to `max_rows` (engine.quant.int4_linear.prepare_int4_kernels): not inside the first steps or the
    CUDA-graph warm-up."""
    model.fuse_projections()
    release_int4_sources(model)  # INT4 portable weights: kept for the fusion only
    if device.type == "cpu":
        if not mkl_serves_better(model):
            pack_linears(model)
    else:
        prepare_int4_kernels(model, max_rows)


def mkl_serves_better(model: ModelBase) -> bool:
    """True for an fp32 encoder (a model without a KV cache: BERT, XLM-RoBERTa, ModernBERT) on a CPU without AVX-512
    (engine.kernels.cpu_features.cpu_has_avx512): its linears stay nn.Linear, whose fp32 GEMM is MKL's sgemm, and
    are not packed for oneDNN. Measured on an AVX2-only AMD EPYC (Zen 3), 2 cores, at an encoder's shapes ([~2048,
    384] x [384, 384 / 1152 / 1536] and [~2048, 1536] x [1536, 384]): MKL's sgemm 153-181 GFLOP/s against oneDNN's
    packed GEMM's 140-165, and 100 with oneDNN's GELU epilogue; all-MiniLM-L6-v2 embeds 1.12x faster for it than
    with packed GEMMs and a separate GELU (bench/README.md "Embeddings on an AVX2-only CPU"). With AVX-512 oneDNN's
    packed GEMM is the faster one (195-201 GFLOP/s against MKL's 159-190 on an AVX512 EPYC), so there it packs.
    Decoders always pack: a seeded request's tokens rely on the packed GEMM giving a row the same bits whatever the
    batch (engine.quant.packed_linear's NOTE), which MKL's sgemm does not promise; an encoder's rows are embedded,
    not sampled."""
    if any(spec.has_cache for spec in model.kv_cache_specs) or cpu_has_avx512():
        return False
    return any(p.dtype == torch.float32 for p in model.parameters())


def pack_linears(model: nn.Module) -> int:
    """Replace, in place, every plain nn.Linear of a CPU model whose weight is fp32 or bf16 by its held form's module
    (a PackedLinear: DenseForm, or GGUFBlocksForm when the weight kept its GGUF blocks, `GGUFBlocksForm.of`; a tied
    LM head gets its own packed copy; the embedding is untouched; a bias is kept, added in the GEMM's epilogue).
    Other modules (INT4, INT8) stay, and so do bf16 ones where oneDNN cannot pack bf16 (`can_pack`). A
    mixture-of-experts block's experts (engine.layers.moe.GroupedExperts) get one PackedLinear per expert for
    gate/up and for down (their stacked weights freed). Fuse projections first (they are packed as they stand).
    Returns the number of modules replaced (experts count one per block; 0 when oneDNN is missing)."""
    if not packing_available():
        return 0
    names = [name for name, m in model.named_modules()
             if type(m) is nn.Linear and m.weight.device.type == "cpu"
             and m.weight.dtype in PACKED_DTYPES and can_pack(m.weight.dtype)]
    for name in names:
        module = model.get_submodule(name)
        set_module(model, name, _packed(module.weight, GGUFBlocksForm.of(module), module.bias))
    return len(names) + sum(pack_experts(m) for m in model.modules() if isinstance(m, GroupedExperts))


def _packed(weight: torch.Tensor, blocks: object, bias: torch.Tensor | None = None) -> nn.Module:
    """The CPU module of a plain weight: GGUFBlocksForm's with its blocks, else DenseForm's."""
    if blocks is None:
        return DenseForm(weight.dtype, "cpu").process_after_load(weight, bias)
    return GGUFBlocksForm(torch.float32, "cpu").process_after_load(blocks, bias, dense=weight)


def pack_experts(experts: GroupedExperts) -> bool:
    """Give each expert of `experts` a PackedLinear of its fused gate/up [2I, hidden] and of its down [hidden, I]
    weight (GroupedExperts.set_gemms), when they are CPU weights oneDNN packs (`can_pack`), with its rows of the
    stacked weights' GGUF blocks where they have some (fp32: the small-batch kernel, as for a dense projection).
    Returns whether it packed (False when already packed, INT4 or not packable)."""
    if experts.gemms is not None or experts.int4 is not None:
        return False
    gate_up, down = experts.stacked()
    if gate_up.device.type != "cpu" or gate_up.dtype not in PACKED_DTYPES or not can_pack(gate_up.dtype):
        return False

    def packed(module: nn.Module) -> list[nn.Module]:
        blocks, rows = GGUFBlocksForm.of(module), module.weight.shape[1]
        return [_packed(w, None if blocks is None else blocks.map_rows(lambda x, a=e * rows: x[a:a + rows]))
                for e, w in enumerate(module.weight.detach())]

    experts.set_gemms(packed(experts.gate_up_proj), packed(experts.down_proj))
    return True
