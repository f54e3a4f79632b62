#!/bin/sh
# The image's entry point, under tini (`tini -- tokenmill-entrypoint CMD...`): checks that the caches tokenmill
# compiles into are writable, then execs CMD (default `tokenmill --help`) in this process, so tini's SIGTERM reaches
# it. Exit 2 when a cache is not writable (e.g. a read-only root filesystem without a volume at ~/.cache).
set -eu
: "${HOME:=/home/tokenmill}"
: "${TRITON_CACHE_DIR:=$HOME/.cache/triton}"
: "${TORCH_EXTENSIONS_DIR:=$HOME/.cache/torch_extensions}"
export HOME TRITON_CACHE_DIR TORCH_EXTENSIONS_DIR
for dir in "$TRITON_CACHE_DIR" "$TORCH_EXTENSIONS_DIR"; do
    if ! mkdir -p "$dir" 2>/dev/null || [ ! -w "$dir" ]; then
        echo "tokenmill-entrypoint: $dir is not writable by uid $(id -u): mount a writable volume there" \
             "(kernels are compiled into it at run time), or set TRITON_CACHE_DIR / TORCH_EXTENSIONS_DIR" >&2
        exit 2
    fi
done
if [ "$#" -eq 0 ]; then
    set -- tokenmill --help
fi
exec "$@"
