"""INT4 benchmark.

CPU (default): perplexity of the default SmolLM2-135M-Instruct Q4_1 model on AlpacaEval reference answers, fp32
reference vs INT4 (GGUF Q4_1 native; requantized at group 32/64/128, projections only and with the embedding),
and the sizes of the bf16 and INT4 model folders; then GPTQ (engine.ptq.gptq) at the --gptq-groups group sizes,
calibrated on GSM8K test questions + answers and AlpacaEval instructions (not the evaluation text). GPTQ rows only:
    python -m bench.int4 --tokens 20000
    python -m bench.int4 --tokens 20000 --no-rtn --gptq-groups 128 --damp 0.01,0.1 [--no-refit]
GPTQ, then the same codes with their scales/zeros tuned end to end (engine.ptq.tune), two paired rows:
    python -m bench.int4 --tokens 20000 --no-rtn --gptq-groups 128 --tune-epochs 1
Where a group size hurts, one layer at a time (round-to-nearest):
    python -m bench.int4 --sensitivity --tokens 1024
CUDA (first run on an H100 2026-11-25, then an H200 2026-11-26: bench/README.md "GPU"): Llama-3.1-8B shape, random
weights, bf16 vs INT4 g128 in the same run: kernel sweep of one layer's GEMMs (fused QKV, O, fused gate/up, down) by
M: bf16, tinygemm, dequantize-then-GEMM and GemLite as our engine sets it up and as gemlite sets itself up (and
after its full autotune at --gemlite-max-rows), with the crossovers (CUDA_TINYGEMM_MAX_ROWS,
CUDA_GEMLITE_DEQUANT_MIN_ROWS); then the start-up of each variant and decode output tok/s at batch 1/8/32/128/512
(INT4 on its default kernels), KV room.
    python -m bench.int4 --device cuda [--sweep-only | --skip-sweep] [--gemlite-max-rows 1]
    python -m bench.int4 --device cpu --sweep-only     # smoke run of the sweep on small shapes (no GemLite on CPU)
Prints one JSON line per measurement.
"""

from __future__ import annotations

import tempfile
import time

import torch

from bench.common import data_file, emit, new_parser
from bench.int4_cuda import cuda, kernel_sweep


def _held_out_kl(model: torch.nn.Module, teacher: torch.nn.Module, rows: torch.Tensor) -> float:
    """Mean KL(teacher || model) in nats per token over the sequences int64 [S, L]."""
    from engine.ptq.tune import distillation_kl

    with torch.no_grad():
        return sum(distillation_kl(model, teacher, row).item() for row in rows) / len(rows)  # type: ignore[arg-type]


def _gptq_rows(path: str, ids: list[int], context: int, base: float, groups: list[int], samples: int, seq_len: int,
               act_order: bool, damps: list[float], refit: bool = True, tune_epochs: float = 0.0) -> None:
    """GPTQ rows: calibration = half GSM8K test question + answer, half AlpacaEval `instruction` (the prompts; the
    perplexity text is the `reference_output` answers), `samples` sequences of `seq_len` tokens. With tune_epochs,
    a second row for the same GPTQ codes after tuning the scales/zeros end to end (engine.ptq.tune): a paired
    comparison, free of the run-to-run spread of GPTQ settings. Each row also gives `held_out_kl`: the KL from the
    fp32 model to the quantized one (nats per token) on 8 x 256 tokens of AlpacaEval answers from row 400 on, text
    neither the calibration nor the perplexity (rows 0-35 for 20k tokens) uses: a tuning that fits its calibration
    text instead of the model lowers perplexity but raises this."""
    import copy

    import pyarrow.parquet as pq

    from engine.loading.open_model import open_model
    from engine.model.perplexity import perplexity
    from engine.ptq.calibration import calibration_batch
    from engine.ptq.gptq import gptq_quantize_model
    from engine.ptq.tune import tune_group_qparams

    t = pq.read_table(data_file("gsm8k_test.parquet"), columns=["question", "answer"])
    gsm = [f"{q}\n{a}" for q, a in zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True)]
    instructions = pq.read_table(data_file("alpaca_eval.parquet"), columns=["instruction"]).column(0).to_pylist()
    answers = pq.read_table(data_file("alpaca_eval.parquet"), columns=["reference_output"]).column(0).to_pylist()[400:]
    for g in groups:
        for damp in damps:
            m = open_model(path, torch.float32, torch.device("cpu"), quantization="none")
            cal = calibration_batch(m.tokenizer, [gsm, instructions], samples, seq_len)
            teacher = copy.deepcopy(m.model)
            held_out = calibration_batch(m.tokenizer, [answers], 8, 256)
            t0 = time.perf_counter()
            # The projections keep their dequantized weights: in fp32 that is what Int4Linear computes.
            weights = gptq_quantize_model(m.model, cal, g, act_order=act_order, damp=damp, refit=refit)
            seconds = round(time.perf_counter() - t0, 1)
            r = perplexity(m.model, ids, context)
            calibration = f"gsm8k question+answer + alpaca_eval instruction, {cal.shape[0]} x {cal.shape[1]} tokens"
            emit(variant=f"int4 g{g} gptq, projections", act_order=act_order, damp=damp, refit=refit,
                  calibration=calibration, perplexity=r.perplexity, tokens=r.tokens, rel=r.perplexity / base - 1,
                  held_out_kl=_held_out_kl(m.model, teacher, held_out), gptq_seconds=seconds)
            if tune_epochs:
                t0 = time.perf_counter()
                tune_group_qparams(m.model, teacher, weights, cal, epochs=tune_epochs)
                seconds = round(time.perf_counter() - t0, 1)
                r = perplexity(m.model, ids, context)
                emit(variant=f"int4 g{g} gptq + tuned scales/zeros and norm gains, projections",
                      act_order=act_order, damp=damp, refit=refit, tune_epochs=tune_epochs, calibration=calibration,
                      perplexity=r.perplexity, tokens=r.tokens, rel=r.perplexity / base - 1,
                      held_out_kl=_held_out_kl(m.model, teacher, held_out), tune_seconds=seconds)
            del m, teacher


def layer_sensitivity(tokens: int, context: int, group_size: int) -> None:
    """Round-to-nearest INT4 of one decoder layer at a time (its 7 projections; the rest fp32): one JSON line per
    layer with the perplexity change, then the same per projection for the worst layer. Shows where a group size
    hurts (bench/README.md, INT4: massive activations)."""
    import pyarrow.parquet as pq

    from engine.loading.model_files import default_model_path
    from engine.loading.open_model import open_model
    from engine.model.perplexity import perplexity, text_token_ids
    from engine.quant.qparams import quantize_int4
    from engine.quant.state import LINEAR_MODULES

    ref = open_model(default_model_path(), torch.float32, torch.device("cpu"), quantization="none")
    texts = pq.read_table(data_file("alpaca_eval.parquet"), columns=["reference_output"]).column(0).to_pylist()
    ids = text_token_ids(ref.tokenizer, texts, tokens)
    base = perplexity(ref.model, ids, context).perplexity
    emit(variant="fp32 (dequantized Q4_1)", perplexity=base)

    def rel_with_quantized(modules: list[torch.nn.Linear]) -> float:
        saved = [m.weight.data for m in modules]
        for m in modules:
            m.weight.data = quantize_int4(m.weight.data, group_size).dequantize()
        try:
            return perplexity(ref.model, ids, context).perplexity / base - 1
        finally:
            for m, w in zip(modules, saved, strict=True):
                m.weight.data = w

    def projections(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
        return {n: m for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] in LINEAR_MODULES}

    rels = []
    for i, layer in enumerate(ref.model.layers):
        rels.append(rel_with_quantized(list(projections(layer).values())))
        emit(variant=f"int4 g{group_size} rtn, layer {i} only", rel=rels[-1])
    worst = max(range(len(rels)), key=rels.__getitem__)
    for name, module in projections(ref.model.layers[worst]).items():
        emit(variant=f"int4 g{group_size} rtn, layers.{worst}.{name} only", rel=rel_with_quantized([module]))


def cpu(tokens: int, context: int, rtn: bool = True, gptq_groups: tuple[int, ...] = (), samples: int = 64,
        seq_len: int = 256, act_order: bool = True, damps: tuple[float, ...] = (0.01,), refit: bool = True,
        tune_epochs: float = 0.0) -> None:
    import pyarrow.parquet as pq

    from engine.loading.model_files import default_model_path
    from engine.loading.open_model import open_model
    from engine.loading.tokenmill_folder import folder_bytes
    from engine.model.perplexity import perplexity, text_token_ids
    from engine.ptq.quantize import quantize_model
    from engine.ptq.to_folder import quantize_to_folder

    path = default_model_path()
    cpu_dev = torch.device("cpu")
    ref = open_model(path, torch.float32, cpu_dev, quantization="none")
    texts = pq.read_table(data_file("alpaca_eval.parquet"), columns=["reference_output"]).column(0).to_pylist()
    ids = text_token_ids(ref.tokenizer, texts, tokens)
    t0 = time.perf_counter()
    base = perplexity(ref.model, ids, context)
    emit(variant="fp32 (dequantized Q4_1)", perplexity=base.perplexity, tokens=base.tokens,
          seconds=round(time.perf_counter() - t0, 1))
    del ref
    if gptq_groups:
        _gptq_rows(path, ids, context, base.perplexity, list(gptq_groups), samples, seq_len, act_order, list(damps),
                   refit, tune_epochs)
    if not rtn:
        return
    native = open_model(path, torch.float32, cpu_dev, quantization="auto")
    r = perplexity(native.model, ids, context)
    emit(variant="int4 native Q4_1 g32 (quantization=auto)", perplexity=r.perplexity, tokens=r.tokens,
          rel=r.perplexity / base.perplexity - 1)
    del native
    for g in (32, 64, 128):
        for emb in (False, True):
            m = open_model(path, torch.float32, cpu_dev, quantization="none")
            quantize_model(m.model, g, include_embedding=emb)
            r = perplexity(m.model, ids, context)
            emit(variant=f"int4 g{g} mse, projections{' + embedding/lm_head' if emb else ''}",
                  perplexity=r.perplexity, tokens=r.tokens, rel=r.perplexity / base.perplexity - 1)
            del m
    with tempfile.TemporaryDirectory() as tmp:
        quantize_to_folder(path, f"{tmp}/bf16", bits=16)
        bf16 = folder_bytes(f"{tmp}/bf16")
        emit(folder="bf16", bytes=bf16)
        for g in (32, 64, 128):
            for emb in (True, False):
                out = f"{tmp}/g{g}{'e' if emb else ''}"
                quantize_to_folder(path, out, bits=4, group_size=g, include_embedding=emb)
                emit(folder=f"int4 g{g}{' (embedding bf16)' if not emb else ''}", bytes=folder_bytes(out),
                      ratio=folder_bytes(out) / bf16)


def main() -> None:
    p = new_parser(__doc__)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=20000, help="cpu: tokens of reference answers to score")
    p.add_argument("--context", type=int, default=1024, help="cpu: perplexity chunk length")
    p.add_argument("--no-rtn", action="store_true", help="cpu: skip the native/round-to-nearest rows and folders")
    p.add_argument("--gptq-groups", default="128", help="cpu: GPTQ group sizes, comma-separated ('' = none)")
    p.add_argument("--calibration-samples", type=int, default=128, help="cpu: GPTQ calibration sequences")
    p.add_argument("--calibration-seq-len", type=int, default=256, help="cpu: tokens per calibration sequence")
    p.add_argument("--no-act-order", action="store_true", help="cpu: GPTQ without act-order")
    p.add_argument("--damp", default="0.01", help="cpu: GPTQ dampening (fraction of mean diag H), comma-separated")
    p.add_argument("--sensitivity", action="store_true",
                   help="cpu: round-to-nearest one layer at a time (then one projection of the worst layer) instead")
    p.add_argument("--group-size", type=int, default=128, help="cpu --sensitivity: group size")
    p.add_argument("--no-refit", action="store_true", help="cpu: GPTQ without the Hessian refit of scales/zeros")
    p.add_argument("--tune-epochs", type=float, default=0.0,
                   help="cpu: also tune the GPTQ scales/zeros end to end for this many epochs (a second, paired row)")
    p.add_argument("--batches", default="1,8,32,128,512", help="cuda: decode batch sizes")
    p.add_argument("--rows", default="1,8,16,32,64,128,512,1024,1536,2048",
                   help="kernel sweep: rows M (2048 = a prefill chunk, EngineConfig.max_num_batched_tokens)")
    p.add_argument("--sweep-only", action="store_true",
                   help="only the kernel sweep (with --device cpu: a smoke run on small shapes, no GemLite)")
    p.add_argument("--skip-sweep", action="store_true",
                   help="cuda: only the start-up and decode part (a GPU session can run the sweep as its own step)")
    p.add_argument("--gemlite-max-rows", default="",
                   help="cuda: rows M at which to also time GemLite after its full ('max') autotune from scratch, "
                        "comma-separated (minutes per M and shape: see bench.int4_cuda.GEMLITE_SETUPS)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if a.device == "cpu" and a.sweep_only:
        kernel_sweep(torch.device("cpu"), {"small_qkv": (384, 256), "small_down": (256, 512)}, rows[:4])
    elif a.device == "cpu" and a.sensitivity:
        layer_sensitivity(a.tokens, a.context, a.group_size)
    elif a.device == "cpu":
        cpu(a.tokens, a.context, not a.no_rtn, tuple(int(g) for g in a.gptq_groups.split(",") if g.strip()),
            a.calibration_samples, a.calibration_seq_len, not a.no_act_order,
            tuple(float(d) for d in a.damp.split(",")), not a.no_refit, a.tune_epochs)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA device")
        cuda([int(b) for b in a.batches.split(",")], a.prompt_len, a.max_tokens, rows, a.sweep_only,
             tuple(int(r) for r in a.gemlite_max_rows.split(",") if r.strip()), a.skip_sweep)


if __name__ == "__main__":
    main()
