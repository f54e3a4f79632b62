#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-batched-bench (the CPU peer of bench/peers.py) from the llama.cpp vendored
# in the llama-cpp-python sdist, once per version and CPU kind, into a cache outside the repository.
#
#   bash bench/build_llama_cpp.sh            # prints the folder that holds the binaries (builds it when missing)
#
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), TOKENMILL_LLAMA_CPP_CACHE (default ~/.cache/tokenmill/llama.cpp),
# JOBS (parallel compile jobs, default: all cores). -DGGML_NATIVE=ON builds for this CPU's instruction set (AVX2 or
# AVX512...), so the cache key includes a hash of the CPU's flags. About 16 minutes on 2 cores.
# Exits 3, saying why on stderr, when cmake, a C++ compiler or the sdist is not to be had (bench/peers.py then
# reports llama.cpp as "not installed").
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="${TOKENMILL_LLAMA_CPP_CACHE:-$HOME/.cache/tokenmill/llama.cpp}"
flags_hash="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
out="$cache/$version-$flags_hash"

if [ -x "$out/bin/llama-server" ] && [ -x "$out/bin/llama-batched-bench" ]; then
    echo "$out/bin"
    exit 0
fi
for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null || { echo "llama.cpp not built: $tool is missing (apt-get install cmake g++)" >&2; exit 3; }
done
python="${PYTHON:-python3}"
mkdir -p "$cache/src"
sdist="$(ls "$cache"/src/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)"
if [ -z "$sdist" ]; then
    "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache/src" >&2 ||
        { echo "llama.cpp not built: could not download the llama-cpp-python $version sdist" >&2; exit 3; }
    sdist="$cache/src/llama_cpp_python-$version.tar.gz"
fi
work="$(mktemp -d "$cache/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$work/build" -j "${JOBS:-$(nproc)}" --target llama-server llama-batched-bench >&2
mkdir -p "$out.tmp/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-batched-bench" "$out.tmp/bin/"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out/bin"
