"""Throughput: our engine vs HF transformers `generate` on the same real prompts, same process, same device.

Usage:
    python -m bench.throughput --num-prompts 64 --workload both           # CPU, the default SmolLM2 GGUF, fp32
    python -m bench.throughput --device cuda                                # GPU: llama-3.1-8b shape, random bf16,
                                                                            # 512 requests, W1 and W2, HF beside it
    python -m bench.throughput --device cuda --workload w1 --skip-hf --preset qwen3-30b-a3b --quantization int4
                                                                            # the random weights INT4 g128 (MoE
                                                                            # experts on the grouped INT4 kernel)
Prints output tokens/s of both and the ratio. EOS is ignored (ignore_eos for ours, min_new_tokens for HF) so both do
the same work, as in vLLM's throughput benchmark. Workloads:
    w1: every request generates --max-tokens tokens.
    w2: each request generates as many tokens as its AlpacaEval reference answer (capped at --w2-max-tokens): the
        variable-length case where continuous batching matters. HF's static batch runs until its longest request;
        only each request's own tokens count as output.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import pyarrow.parquet as pq
import torch

from bench.common import data_file, new_parser
from engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from engine.loading.model_files import resolve_model_path


def alpaca_rows(n: int) -> tuple[list[str], list[str]]:
    """The first n AlpacaEval instructions and reference answers (real text, varied lengths)."""
    path = data_file("alpaca_eval.parquet")
    t = pq.read_table(path, columns=["instruction", "reference_output"]).slice(0, n)
    return t.column("instruction").to_pylist(), t.column("reference_output").to_pylist()


def run_ours(engine: LLMEngine, prompt_ids: list[list[int]], max_tokens: list[int], temperature: float = 0.0,
             top_p: float = 1.0) -> tuple[float, int]:
    """Seconds and output tokens for one generate over all prompts (greedy unless temperature > 0)."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=temperature, top_p=top_p) for m in max_tokens]
    t0 = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    return time.perf_counter() - t0, sum(o.num_output_tokens for o in outs)


def run_hf(model: torch.nn.Module, prompt_ids: list[list[int]], max_tokens: list[int], batch_size: int,
           pad_id: int, device: torch.device, temperature: float = 0.0, top_p: float = 1.0) -> tuple[float, int]:
    """Seconds and useful output tokens for HF static batched generate (left padding), batches in prompt order;
    a batch runs until its longest request."""
    t0 = time.perf_counter()
    total = 0
    for i in range(0, len(prompt_ids), batch_size):
        batch, lens = prompt_ids[i:i + batch_size], max_tokens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), pad_token_id=pad_id,
                                 **({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
                                    if temperature > 0 else {"do_sample": False}))
        total += sum(min(m, out.shape[1] - width) for m in lens)
    return time.perf_counter() - t0, total


def hf_random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """HF model of the same family and shape with random weights (throughput only: the outputs are not compared):
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (QKV bias) or Qwen3ForCausalLM (q/k norms), by
    cfg.architecture."""
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[cfg.architecture]
    hf_cfg = config_class(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                          intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                          num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                          max_position_embeddings=8192, tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(dtype)
    return model.eval()


def run_hf_generate_batch(model: torch.nn.Module, prompt_ids: list[list[int]], max_tokens: list[int]
                          ) -> tuple[float, int]:
    """Seconds and output tokens of HF's continuous batching (`generate_batch`, paged); one max_new_tokens for
    all requests, so only W1 is comparable."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=prompt_ids, generation_config=gen)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(len(o.generated_tokens) for o in outs.values())


def active_parameters(model: torch.nn.Module, cfg: ModelConfig) -> float:
    """Parameters one token computes with: all of `model`'s (INT4 weights included: Int4Linear, the grouped INT4
    kernel's expert stacks), but of a mixture-of-experts model's experts (named *.experts.*) only num_experts_per_tok
    of num_experts, the share the router sends it to (the compute roof counts 2 FLOP per active parameter per
    token)."""
    from engine.layers.moe import GroupedExperts
    from engine.quant.int4_linear import Int4Linear

    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    total = sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in model.named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            total += m.in_features * m.out_features * (share if ".experts." in name else 1.0)
        elif isinstance(m, GroupedExperts) and m.gemms is None and m.int4 is not None:
            total += share * sum(w.num_experts * w.out_features * w.in_features for w in m.int4)
    return total


def preset_engine(preset: str, cfg: EngineConfig) -> LLMEngine:
    """An engine over random weights of `preset`; under cfg.quantization "int4" they are quantized round-to-nearest
    at g128 (engine.ptq.quantize.quantize_model: the projections, and a mixture-of-experts model's experts as
    stacks the grouped INT4 kernel runs on CUDA), in an eager engine with a 16-block KV pool first so quantizing has
    room, then with cfg's pool (as bench/gpu_profile.py does)."""
    if cfg.quantization != "int4":
        return LLMEngine.from_config(preset, cfg)
    from engine.ptq.quantize import quantize_model

    engine = LLMEngine.from_config(preset, dataclasses.replace(cfg, num_kv_blocks=16, enforce_eager=True))
    quantize_model(engine.runner.model, 128)
    engine.runner.kv_caches = []
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return engine.with_config(cfg)


def roofs(device: torch.device) -> tuple[float, float]:
    """Measured bf16 matmul FLOP/s (8192^3) and device copy bytes/s (1 GiB), the roofs of this run."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.empty(1 << 29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        a @ b
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    flops = 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 20 * 2 * src.numel() * 2 / (time.perf_counter() - t0)  # read + write
    return flops, bw


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="GGUF path or URL (default on cpu: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--preset", default=None, help="random-weights shape instead of a GGUF (engine.loading.presets: "
                                                   "llama-3.1-8b, qwen2.5-7b, mistral-7b-v0.3, qwen3-8b, ...; "
                                                   "default on cuda: llama-3.1-8b)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 on cpu, 512 on cuda")
    ap.add_argument("--workload", choices=["w1", "w2", "both"], default=None, help="default w1 on cpu, both on cuda")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="output tokens per request in w1; default 64 on cpu, 256 on cuda")
    ap.add_argument("--w2-max-tokens", type=int, default=None,
                    help="cap on w2's reference lengths; default 256 on cpu, 1024 on cuda")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="default 64 on cpu, 256 on cuda")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 64 on cpu, 512 on cuda")
    ap.add_argument("--sync-steps", action="store_true",
                    help="EngineConfig.async_scheduling=False: the synchronous step loop (the before of the async A/B)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", default="none", choices=["none", "auto", "int4"],
                    help="how --model's weights are held (EngineConfig.quantization; 'auto' keeps a GPTQ/AWQ/GGUF "
                         "4-bit checkpoint INT4); with --preset, int4 quantizes the random weights (preset_engine)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="tokens per sequence (default 4096 for --preset, else the model's context)")
    ap.add_argument("--hf-static-w2", action="store_true",
                    help="on cuda, also run HF's static batch on w2 (skipped by default: about 6 minutes on an H100)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    n = args.num_prompts or (512 if cuda else 64)
    workload = args.workload or ("both" if cuda else "w1")
    workloads = ["w1", "w2"] if workload == "both" else [workload]
    preset = args.preset or ("llama-3.1-8b" if cuda and args.model is None else None)
    dtype = "bfloat16" if cuda else "float32"
    cfg = EngineConfig(device=args.device, dtype=dtype, max_num_seqs=args.max_num_seqs or (512 if cuda else 64),
                       max_model_len=args.max_model_len or (4096 if preset else None), quantization=args.quantization,
                       async_scheduling=False if args.sync_steps else None)

    torch.manual_seed(0)
    tokenizer_engine = None
    if preset:
        from engine.loading.model_files import default_model_path
        from engine.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(default_model_path())  # AlpacaEval prompt lengths, counted as in the data doc
        engine = preset_engine(preset, cfg)
    else:
        path = resolve_model_path(args.model)
        engine = tokenizer_engine = LLMEngine.from_model(path, cfg)
        tokenizer = engine.tokenizer
    prompts, references = alpaca_rows(n)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ref_lens = [len(tokenizer.encode(r)) for r in references]
    pad = engine.eos_token_id if engine.eos_token_id is not None else 0
    hf_bs = args.hf_batch_size or (256 if cuda else 64)
    run_ours(engine, prompt_ids[:2], [4, 4])  # warm-up
    rows: list[tuple[str, str, float, int, int]] = []  # workload, engine, seconds, output tokens, total tokens
    prompt_tokens = sum(len(p) for p in prompt_ids)
    workload_tokens = {}
    for w in workloads:
        if w == "w1":
            workload_tokens[w] = [args.max_tokens or (256 if cuda else 64)] * n
        else:
            workload_tokens[w] = [max(1, min(args.w2_max_tokens or (1024 if cuda else 256), r)) for r in ref_lens]
    for w in workloads:  # ours first, all workloads; then HF alone on the device (both at once need > 80 GB)
        engine.reset_prefix_cache()  # every run starts cold: no reuse of an earlier workload's prompt blocks
        s, tok = run_ours(engine, prompt_ids, workload_tokens[w])
        rows.append((w, "tokenmill", s, tok, tok + prompt_tokens))
        print(f"{w} tokenmill: {tok} output tokens in {s:.2f} s ({tok / s:.1f} tok/s)", flush=True)
    info = (engine.device, engine.device_name, engine.model_name, engine.model_config,
            active_parameters(engine.runner.model, engine.model_config))
    device, device_name, model_name, model_config, num_params = info
    del engine, tokenizer_engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if not args.skip_hf:
        if preset:
            hf = hf_random_model(model_config, getattr(torch, dtype), device)
        else:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                      dtype=torch.float32).to(args.device).eval()
        for w in workloads:
            max_tokens = workload_tokens[w]
            if cuda and w == "w1":
                s, tok = run_hf_generate_batch(hf, prompt_ids, max_tokens)
                rows.append((w, "HF generate_batch (continuous)", s, tok, tok + prompt_tokens))
                print(f"{w} HF generate_batch: {tok} output tokens in {s:.2f} s ({tok / s:.1f} tok/s)", flush=True)
            if cuda and w == "w2" and not args.hf_static_w2:
                print("w2 HF generate (static batch): skipped on cuda (about 6 minutes on an H100; --hf-static-w2 "
                      "runs it)", flush=True)
                continue
            s, tok = run_hf(hf, prompt_ids, max_tokens, hf_bs, pad, device)
            rows.append((w, f"HF generate (static batch {hf_bs})", s, tok, tok + prompt_tokens))
            print(f"{w} HF generate: {tok} output tokens in {s:.2f} s ({tok / s:.1f} tok/s)", flush=True)
        del hf

    print(f"\ndevice={device_name} torch={torch.__version__} dtype={dtype} model={model_name} "
          f"threads={torch.get_num_threads()} requests={n} (AlpacaEval, {prompt_tokens} prompt tokens)")
    print(f"{'workload':<9} {'engine':<34} {'seconds':>9} {'out tokens':>11} {'out tok/s':>10} {'total tok/s':>12} "
          f"{'vs HF':>7}")
    for w in workloads:
        group = [r for r in rows if r[0] == w]
        base = group[-1][3] / group[-1][2] if group[-1][1].startswith("HF") else None
        for _, name, s, tok, total in group:
            ratio = f"{tok / s / base:>6.2f}x" if base else f"{'n/a':>7}"
            print(f"{w:<9} {name:<34} {s:>9.2f} {tok:>11d} {tok / s:>10.1f} {total / s:>12.1f} {ratio}")
    if cuda:
        flops, bw = roofs(device)
        params = num_params
        compute_roof = flops / (2 * params)
        print(f"\nroofs: bf16 matmul {flops / 1e12:.0f} TFLOP/s -> {compute_roof:,.0f} tok/s at "
              f"2 x {params / 1e9:.2f}e9 FLOP/token{' (active)' if model_config.num_experts else ''}; copy "
              f"{bw / 1e9:.0f} GB/s")
        for w, name, s, tok, _ in rows:
            if name == "tokenmill":
                print(f"{w}: tokenmill at {tok / s / compute_roof:.1%} of the compute roof")


if __name__ == "__main__":
    main()
