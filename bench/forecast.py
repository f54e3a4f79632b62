"""How far off is `tokenmill run --dry-run`? Forecast a job, run it, compare device-seconds.

Usage:
    python -m bench.forecast --rows 128 --max-tokens 32             # 128 GSM8K rows on the CPU, one worker
    python -m bench.forecast --rows 256 --rows-per-shard 8 --load 1  # one CPU-heavy process beside both
Prints the forecast (device-seconds, tokens, cost), the job's actual summary, and forecast / actual. With --load N,
N processes spin on the CPU from before the forecast's calibration until the job has ended (the issue 51 check: the
forecast must not follow the machine's load), and the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from bench.common import data_file, new_parser
from jobs.plan.forecast import Forecast, forecast_job
from jobs.spec import run_spec
from schemas.job_spec import JobSpec


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--start", type=int, default=0, help="first GSM8K row")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rows-per-shard", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--load", type=int, default=0, help="CPU-heavy processes beside the forecast and the job")
    args = ap.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    loads = []
    try:
        fc, actual = _forecast_and_run(args, loads)
    finally:
        for p in spinners:
            p.kill()
    print(json.dumps({"forecast": fc.as_dict(), "actual": {k: actual[k] for k in (
        "rows", "input_tokens", "output_tokens", "device_s", "cost_usd", "tokens_per_dollar")}}, indent=1))
    print(f"device-seconds: forecast {fc.device_s:.1f}, actual {actual['device_s']:.1f}, "
          f"forecast / actual {fc.device_s / actual['device_s']:.2f}; output tokens: forecast {fc.output_tokens}, "
          f"actual {actual['output_tokens']}; input tokens: forecast {fc.input_tokens}, "
          f"actual {actual['input_tokens']}; {args.load} spinning processes, 1-min load average after the forecast "
          f"{loads[0]:.1f}, after the job {loads[1]:.1f} ({os.cpu_count()} CPUs)")


def _forecast_and_run(args: argparse.Namespace, loads: list[float]) -> tuple[Forecast, dict[str, Any]]:
    """The forecast of the job `args` describe, then the job's summary (as_dict); appends the 1-minute load average
    after each to `loads`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.parquet"
        pq.write_table(pq.read_table(data_file("gsm8k_test.parquet"), columns=["id", "question"]).slice(
            args.start, args.rows), src)
        spec = JobSpec.from_options(input=str(src), output=str(Path(tmp) / "out"), prompt_column="question",
                                    max_tokens=args.max_tokens, rows_per_shard=args.rows_per_shard,
                                    workers=args.workers)
        fc = forecast_job(spec)
        loads.append(os.getloadavg()[0])
        assert not Path(spec.output).exists(), "the forecast wrote under OUTPUT"
        summary = run_spec(spec)
        loads.append(os.getloadavg()[0])
        return fc, summary.as_dict()


if __name__ == "__main__":
    main()
