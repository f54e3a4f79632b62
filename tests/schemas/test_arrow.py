"""The results and accounting schemas: the contract between the writers, the readers and issue 5's resume logic."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA


def test_results_schema_columns_types_and_nullability() -> None:
    assert RESULTS_SCHEMA.names == ["id", "completion", "finish_reason", "prompt_tokens", "completion_tokens",
                                    "error", "model", "model_fingerprint", "logprobs", "valid", "samples",
                                    "note", "images", "input_file", "input_row"]
    types = {f.name: f.type for f in RESULTS_SCHEMA}
    assert types["id"] == pa.string() and types["prompt_tokens"] == pa.int32() == types["completion_tokens"]
    assert types["input_row"] == pa.int64()
    nullable = {f.name for f in RESULTS_SCHEMA if f.nullable}
    # error is null exactly when the row ran; a null id stays null (input_file + input_row name every row); a row of
    # a job started before models were pinned has no model_fingerprint; logprobs, valid and samples are null unless
    # asked for (and in results written before they existed)
    assert nullable == {"id", "completion", "error", "model_fingerprint", "logprobs", "valid", "samples", "note",
                        "images"}
    assert types["valid"] == pa.bool_()
    assert types["logprobs"].value_type.field("top_logprobs").type.value_type.field("logprob").type == pa.float32()


def test_accounting_schema_has_the_bill() -> None:
    needed = {"shard_id": pa.string(), "attempt": pa.int32(), "rows": pa.int64(), "rows_ok": pa.int64(),
              "rows_error": pa.int64(), "input_tokens": pa.int64(), "output_tokens": pa.int64(),
              "wall_s": pa.float64(), "output_tokens_per_s": pa.float64(), "device": pa.string(),
              "dtype": pa.string(), "quantization": pa.string(),
              "price_per_hour_usd": pa.float64(), "cost_usd": pa.float64(), "tokens_per_dollar": pa.float64(),
              "model": pa.string(), "model_fingerprint": pa.string()}
    types = {f.name: f.type for f in ACCOUNTING_SCHEMA}
    assert {k: types.get(k) for k in needed} == needed
    # The per-dollar numbers are the only nullable numbers: undefined when the price is 0 (input tokens and rows per
    # dollar: null in accounting written before they existed); model_fingerprint is null in accounting of jobs
    # started before models were pinned.
    assert [f.name for f in ACCOUNTING_SCHEMA if f.nullable] == ["tokens_per_dollar", "model_fingerprint",
                                                                 "input_tokens_per_dollar", "rows_per_dollar",
                                                                 "images"]
    assert ACCOUNTING_SCHEMA.field("finished_at").type == pa.timestamp("us", tz="UTC")


def test_schemas_reject_rows_that_break_them() -> None:
    ok = {"id": "gsm8k-test-0000", "completion": "Janet sells 9 eggs", "finish_reason": "length", "prompt_tokens": 96,
          "completion_tokens": 8, "error": None, "model": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert pa.Table.from_pylist([ok], schema=RESULTS_SCHEMA).num_rows == 1
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        pa.Table.from_pylist([{**ok, "prompt_tokens": "ninety-six"}], schema=RESULTS_SCHEMA)
    # Arrow tables carry nulls in non-nullable fields; the Parquet writer is what refuses them.
    with pytest.raises(pa.ArrowInvalid, match="non-nullable"):
        pq.write_table(pa.Table.from_pylist([{**ok, "id": None}], schema=RESULTS_SCHEMA), io.BytesIO())


def test_an_embed_jobs_rows_hold_a_fixed_size_vector() -> None:
    from schemas.arrow import embed_part_schema, embed_results_schema

    results, part = embed_results_schema(384), embed_part_schema(384)
    assert results.field("embedding").type == pa.list_(pa.float32(), 384)  # fixed_size_list<float32>[384]
    assert results.names == ["id", "embedding", "prompt_tokens", "truncated", "error", "model", "model_fingerprint",
                             "input_file", "input_row"]
    assert part.names == [*results.names[:-2], "row"]
    with pytest.raises(pa.ArrowInvalid):
        pa.Table.from_pylist([{"id": "a", "embedding": [0.0] * 3, "prompt_tokens": 1, "truncated": False,
                               "model": "m", "row": 0}], schema=embed_part_schema(4))
