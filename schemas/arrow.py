"""Arrow schemas of the results and accounting Parquet files under a job's OUTPUT.

Layout: OUTPUT/results/<shard_id>.parquet (one row per input row) and OUTPUT/accounting/<shard_id>.parquet (one row
per shard attempt). Both are written once, with create-only semantics, and never overwritten.
"""

from __future__ import annotations

import pyarrow as pa

RESULTS_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False, metadata={"doc": "the input row's id (its id column, as text, or "
                                                                  "its row position in the file)"}),
    pa.field("completion", pa.string(), metadata={"doc": "generated text; empty on error"}),
    pa.field("finish_reason", pa.string(), nullable=False, metadata={"doc": "stop | length | error"}),
    pa.field("prompt_tokens", pa.int32(), nullable=False, metadata={"doc": "prompt length in tokens"}),
    pa.field("completion_tokens", pa.int32(), nullable=False, metadata={"doc": "generated tokens"}),
    pa.field("error", pa.string(), metadata={"doc": "null when the row ran; else what was wrong and the fix"}),
    pa.field("model", pa.string(), nullable=False, metadata={"doc": "model file name"}),
])

ACCOUNTING_SCHEMA = pa.schema([
    pa.field("shard_id", pa.string(), nullable=False),
    pa.field("attempt", pa.int32(), nullable=False, metadata={"doc": "1 for the first run of the shard"}),
    pa.field("input_path", pa.string(), nullable=False),
    pa.field("row_start", pa.int64(), nullable=False, metadata={"doc": "first row of the shard in its file"}),
    pa.field("row_end", pa.int64(), nullable=False, metadata={"doc": "one past the last row"}),
    pa.field("rows", pa.int64(), nullable=False),
    pa.field("rows_ok", pa.int64(), nullable=False),
    pa.field("rows_error", pa.int64(), nullable=False),
    pa.field("input_tokens", pa.int64(), nullable=False, metadata={"doc": "prompt tokens, tokens"}),
    pa.field("output_tokens", pa.int64(), nullable=False, metadata={"doc": "completion tokens, tokens"}),
    pa.field("wall_s", pa.float64(), nullable=False, metadata={"doc": "generation wall time, seconds"}),
    pa.field("output_tokens_per_s", pa.float64(), nullable=False),
    pa.field("device", pa.string(), nullable=False, metadata={"doc": "cpu or the GPU's name"}),
    pa.field("price_per_hour_usd", pa.float64(), nullable=False, metadata={"doc": "price of the device, USD/hour"}),
    pa.field("cost_usd", pa.float64(), nullable=False, metadata={"doc": "wall_s / 3600 * price_per_hour_usd"}),
    pa.field("tokens_per_dollar", pa.float64(), metadata={"doc": "output tokens / cost_usd; null when cost is 0"}),
    pa.field("model", pa.string(), nullable=False),
    pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
])
