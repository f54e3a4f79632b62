"""How far off is `tokenmill run --dry-run`? Forecast a job, run it, compare device-seconds.

Usage:
    python -m bench.forecast --rows 128 --max-tokens 32             # 128 GSM8K rows on the CPU, one worker
Prints the forecast (device-seconds, tokens, cost), the job's actual summary, and forecast / actual.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from bench.common import data_file, new_parser
from jobs.plan.forecast import forecast_job
from jobs.spec import run_spec
from schemas.job_spec import JobSpec


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--start", type=int, default=0, help="first GSM8K row")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rows-per-shard", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.parquet"
        pq.write_table(pq.read_table(data_file("gsm8k_test.parquet"), columns=["id", "question"]).slice(
            args.start, args.rows), src)
        spec = JobSpec.from_options(input=str(src), output=str(Path(tmp) / "out"), prompt_column="question",
                                    max_tokens=args.max_tokens, rows_per_shard=args.rows_per_shard,
                                    workers=args.workers)
        fc = forecast_job(spec)
        assert not Path(spec.output).exists(), "the forecast wrote under OUTPUT"
        summary = run_spec(spec)
        actual = summary.as_dict()
    print(json.dumps({"forecast": fc.as_dict(), "actual": {k: actual[k] for k in (
        "rows", "input_tokens", "output_tokens", "device_s", "cost_usd", "tokens_per_dollar")}}, indent=1))
    print(f"device-seconds: forecast {fc.device_s:.1f}, actual {actual['device_s']:.1f}, "
          f"forecast / actual {fc.device_s / actual['device_s']:.2f}; output tokens: forecast {fc.output_tokens}, "
          f"actual {actual['output_tokens']}; input tokens: forecast {fc.input_tokens}, "
          f"actual {actual['input_tokens']}")


if __name__ == "__main__":
    main()
