"""The quantized-folder cases of the loader tests (test_hf_quantized.py, test_hf_quantized_kernels.py): per case the
HF family, the writer (method, quantization_config, layer packer of quant_writers), how its layers load under
quantization "auto" on the CPU, and whether transformers runs the folder itself; the tiny HF model they quantize; and
HF's teacher-forced greedy choices, the reference the engine's tokens are compared to."""

from __future__ import annotations

import quant_writers as qw
import torch

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def act_order_index(k: int, group: int, seed: int = 7) -> torch.Tensor:
    """GPTQ act-order's g_idx: features taken in a (seeded random) order, each run of `group` one group. One seed
    for every layer: as in GPTQ, where q/k/v (and gate/up) share their input's Hessian and so its order."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    return g_idx


def _gptq(bits: int, group: int, sym: bool, v1: bool, act_order: bool = False):
    def layer(w):
        g_idx = act_order_index(w.shape[1], group) if act_order else None
        q, z, s, g = qw.rtn(w, bits, group, sym, g_idx=g_idx)
        return qw.gptq_tensors(q, z, s, g, bits, v1), qw.dequant(q, z, s, g)
    config = {"bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return "gptq", config, layer


def _awq(group: int):
    def layer(w):
        q, z, s, g = qw.rtn(w, 4, group, sym=False)
        return qw.awq_tensors(q, z, s), qw.dequant(q, z, s, g)
    return "awq", {"bits": 4, "group_size": group, "version": "gemm", "zero_point": True}, layer


def _ct_int(bits: int, strategy: str, sym: bool, packed: bool, activations: dict | None = None):
    group = 32 if strategy == "group" else -1

    def layer(w):  # fp32 scales holding bf16 values: exact in INT4, and HF dequantizes them in fp32
        q, z, s, g = qw.rtn(w, bits, group, sym, scale_dtype=torch.bfloat16)
        return qw.ct_int_tensors(q, z, s.float(), bits, packed, sym), qw.dequant(q, z, s, g)
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": group if group > 0 else None}
    return "compressed-tensors", qw.ct_config("pack-quantized" if packed else "int-quantized", weights,
                                              activations), layer


def _ct_fp8():
    def layer(w):
        s = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16).float()
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s}, q.float() * s
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    return "compressed-tensors", qw.ct_config("float-quantized", weights), layer


W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# case -> (family, writer, what "auto" keeps on the CPU ("int4": every layer INT4 as stored, "int8": INT8 as
# stored, "none": all dequantized), HF runs the folder itself)
CASES = {
    "gptq-4bit-g32-asym-v1": ("llama", _gptq(4, 32, sym=False, v1=True), "int4", False),
    "gptq-4bit-perchannel-sym-v2": ("qwen2", _gptq(4, -1, sym=True, v1=False), "int4", False),
    "gptq-4bit-g32-actorder": ("llama", _gptq(4, 32, sym=False, v1=True, act_order=True), "int4", False),
    "gptq-8bit-g32": ("qwen2", _gptq(8, 32, sym=True, v1=True), "none", False),
    "awq-gemm-g64": ("llama", _awq(64), "int4", False),
    "awq-gemm-g128": ("qwen2", _awq(128), "int4", False),
    "ct-w4a16-group-sym": ("llama", _ct_int(4, "group", sym=True, packed=True), "int4", True),
    "ct-w4a16-channel-asym": ("qwen2", _ct_int(4, "channel", sym=False, packed=True), "int4", False),
    "ct-w8a16-group": ("qwen2", _ct_int(8, "group", sym=True, packed=True), "none", True),
    "ct-w8a8-int-quantized": ("llama", _ct_int(8, "channel", sym=True, packed=False, activations=W8A8), "int8",
                              False),
    "ct-fp8-channel": ("llama", _ct_fp8(), "none", True),
}


def hf_model(transformers, family: str, vocab: int):
    """A tiny random fp32 HF model of `family` ("llama" or "qwen2", the latter with tied embeddings), weights drawn
    so that greedy decoding is far from degenerate."""
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    extra = {"tie_word_embeddings": family == "qwen2"}
    if family == "qwen2":
        extra["use_sliding_window"] = False
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cls(vocab_size=vocab, **SHAPE, **extra),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def hf_argmax(model, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """HF's greedy choice at each output position given the prompt and our earlier tokens (teacher forcing; equal to
    `outputs` exactly when HF's own greedy generation is: tests/engine/model/test_families.py)."""
    with torch.no_grad():
        return [model(torch.tensor([ids + seq])).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
                for ids, seq in zip(prompt_ids, outputs, strict=True)]
