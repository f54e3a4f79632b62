"""Micro-benchmark: the fp32 encoder's C++ attention (engine/kernels/csrc/encoder_kernels.cpp) vs the torch path it
replaces on CPUs without AVX-512 (torch's SDPA on rows padded per batch, with a key-padding mask where lengths differ),
one layer's attention of random q, k, v at all-MiniLM-like batch shapes (the token budget's rows x longest row).

Usage:
    python -m bench.encoder_kernels                      # head_dim 32 and 64, 384 channels (12 or 6 heads)
    python -m bench.encoder_kernels --head-dims 32 --repeats 10

Row lengths: the longest row, then the others uniform in [longest / 2, longest] (seeded), sorted longest first as
the embedder batches them; "8 x 256 full" has no padding (every text cut at 256 tokens). Prints the best of
`--repeats` timings of 20 calls each after 3 untimed, in milliseconds, the ratio, and the largest difference.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from bench.common import new_parser
from engine.kernels import cpu_kernels
from engine.kernels.cpu_kernels import cpu_ops
from engine.layers.encoder_attention import EncoderMetadata, encoder_attention

SHAPES = [(107, 19), (31, 65), (16, 125), (10, 192), (8, 256), (5, 384), (4, 512)]


def per_call_ms(fn: object, repeats: int) -> float:
    """The best of `repeats` means of 20 calls of fn() after 3 untimed, in milliseconds."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        best = min(best, (time.perf_counter() - t0) / 20)
    return best * 1e3


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ops = cpu_ops()
    if ops is None or not ops.encoder_attention_available():
        raise SystemExit("the C++ kernels are not built for AVX2 + FMA here (python -m engine.kernels.cpu_kernels)")
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}")
    for dim in args.head_dims:
        for rows, longest in SHAPES:
            full = (rows, longest) == (8, 256)
            lens = [longest] * rows if full else sorted(
                [longest] + torch.randint(longest // 2, longest + 1, (rows - 1,), generator=gen).tolist(), reverse=True)
            qkv = torch.randn(sum(lens), 3, 384 // dim, dim, generator=gen)
            meta = EncoderMetadata.of(lens, torch.device("cpu"))
            with torch.inference_mode(), torch_path():
                sdpa = per_call_ms(lambda q=qkv, m=meta: encoder_attention(q, m), args.repeats)
                want = encoder_attention(qkv, meta)
            with torch.inference_mode():
                ours = per_call_ms(lambda q=qkv, c=meta.cu_seqlens, d=dim: ops.encoder_attention(q, c, d ** -0.5),
                                   args.repeats)
                diff = (ops.encoder_attention(qkv, meta.cu_seqlens, dim ** -0.5) - want).abs().max()
            name = f"{rows} x {longest}{' full' if full else ''}"
            print(f"head_dim {dim:3d}  {name:14s} SDPA {sdpa:7.2f} ms  kernel {ours:7.2f} ms  {sdpa / ours:5.2f}x  "
                  f"max diff {float(diff):.1e}")


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """encoder_attention takes the torch path (SDPA on the padded rows) inside, whatever the CPU: the rule of
    engine.kernels.cpu_kernels.encoder_fp32_ops told this is an AVX-512 CPU."""
    saved = cpu_kernels.cpu_has_avx512
    cpu_kernels.cpu_has_avx512 = lambda: True
    try:
        yield
    finally:
        cpu_kernels.cpu_has_avx512 = saved


if __name__ == "__main__":
    main()
