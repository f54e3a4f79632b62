"""Which INT4 kernel serves an Int4Linear (engine.quant.int4_linear) on CUDA at M rows: tinygemm for the smallest
batches, GemLite's A16W4 Triton kernels between, and GemLite's weight dequantized to the activation dtype with the
dense GEMM for long prefill chunks; without GemLite, tinygemm below a crossover and dequantize + GEMM above. The
thresholds are measured crossovers (bench/README.md "INT4 with GemLite"); the modules and the CPU path are
engine.quant.int4_linear's. Plain Python over torch dtypes: no kernel runs here.
"""

from __future__ import annotations

import logging

import torch

from engine.quant.gemlite_int4 import GEMLITE_DTYPES

log = logging.getLogger(__name__)

#: CUDA without gemlite: rows M at and above which dequantize-then-GEMM beats tinygemm. Provisional (H100,
#: 2026-11-25); the H200 sweep of 2026-11-26 puts the crossover between M 64 and 128 (bench/README.md "INT4 with
#: GemLite: H200, 2026-11-26").
CUDA_DEQUANT_MIN_ROWS = 64
#: CUDA with gemlite: rows M up to which tinygemm serves: faster than GemLite at M = 1 and 8, not at 16, on an H200
#: (`python -m bench.int4 --device cuda`; bench/README.md "INT4 with GemLite: H200, 2026-11-26"). GemLite ran on
#: untuned configs there (engine.quant.gemlite_int4); its next sweep, tuned, prints the crossover to put here.
CUDA_TINYGEMM_MAX_ROWS = 8
#: CUDA with gemlite: rows M at and above which GemLite's weight is dequantized and the dense GEMM runs (the long
#: prefill chunks). Same H200 run: dequantize + GEMM beats GemLite at M = 2048 (a prefill chunk of
#: max_num_batched_tokens), not at 512; rows between were not measured (the sweep now has 1024 and 1536), so this
#: is the smallest M measured to gain.
CUDA_GEMLITE_DEQUANT_MIN_ROWS = 2048

#: Int4Linear's layouts on CUDA: "dual" = tinygemm's packed copy beside GemLite's (or beside the dequantize path's
#: without GemLite), "single" = one packed copy (engine.worker.memory_fit counts them: INT4_CUDA_COPIES).
INT4_LAYOUTS = ("dual", "single")

_FALLBACK_LOGGED: set[str] = set()


def cuda_kernel_plan(dtype: torch.dtype, out_features: int, tinygemm_max_rows: int | None | str,
                     dequant_min_rows: int | None | str, gemlite: bool | None,
                     gemlite_reason: str | None, layout: str = "dual") -> tuple[bool, int | None, int | None]:
    """Which kernels an Int4Linear on CUDA builds: (use GemLite, tinygemm_max_rows, dequant_min_rows).

    With GemLite: tinygemm for M <= tinygemm_max_rows ("auto" = CUDA_TINYGEMM_MAX_ROWS; 0 or None = never, and
    never when N is not a multiple of 8, tinygemm's N tile), dequantize + dense GEMM from M >= dequant_min_rows
    ("auto" = CUDA_GEMLITE_DEQUANT_MIN_ROWS; None = never), GemLite between. Without:
    (False, None, dequant_min_rows) as before ("auto" = CUDA_DEQUANT_MIN_ROWS; 0 when N % 8). gemlite: None = use
    it when `gemlite_reason` (engine.quant.gemlite_int4.gemlite_unavailable_reason()) is None, else log the reason
    once and fall back; True = required (ImportError with the reason; ValueError for fp32 activations, which
    GemLite does not serve here); False = never. layout "single" keeps one packed copy: no tinygemm with GemLite,
    and without it either tinygemm or the dequantize path, never both (tinygemm where N % 8 == 0).
    """
    if layout not in INT4_LAYOUTS:
        raise ValueError(f"INT4 layout must be one of {INT4_LAYOUTS}, got {layout!r}")
    single = layout == "single"
    use = False
    if dtype not in GEMLITE_DTYPES:
        if gemlite is True:
            raise ValueError(f"gemlite serves bf16 or fp16 activations, not {dtype}; pass gemlite=None for fp32")
    elif gemlite is not False:
        if gemlite_reason is None:
            use = True
        elif gemlite is True:
            raise ImportError(gemlite_reason)
        elif gemlite_reason not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(gemlite_reason)
            log.warning("INT4 on CUDA without GemLite: %s; using tinygemm below %s rows and dequantize + bf16 GEMM "
                        "above (slower than bf16 at large batch)", gemlite_reason, CUDA_DEQUANT_MIN_ROWS)
    if use:
        rows = 0 if single else CUDA_TINYGEMM_MAX_ROWS if tinygemm_max_rows == "auto" else (tinygemm_max_rows or 0)
        dequant = CUDA_GEMLITE_DEQUANT_MIN_ROWS if dequant_min_rows == "auto" else dequant_min_rows
        return True, 0 if out_features % 8 else rows, dequant
    rows = CUDA_DEQUANT_MIN_ROWS if dequant_min_rows == "auto" else dequant_min_rows
    if single and rows != 0:
        rows = None
    return False, None, 0 if out_features % 8 else rows


def gemlite_kernel_for(m: int, tinygemm_max_rows: int, dequant_min_rows: int | None) -> str:
    """The kernel of an Int4Linear with GemLite at `m` rows: "tinygemm" for m <= tinygemm_max_rows (0 = never),
    "dequant" for m >= dequant_min_rows (None = never), else "gemlite" (the thresholds: cuda_kernel_plan)."""
    if m <= tinygemm_max_rows:
        return "tinygemm"
    if dequant_min_rows is not None and m >= dequant_min_rows:
        return "dequant"
    return "gemlite"
