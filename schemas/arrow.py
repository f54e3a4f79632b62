"""Arrow schemas of the results and accounting Parquet files under a job's OUTPUT.

Layout: OUTPUT/results/<shard_id>.parquet (one row per input row) and OUTPUT/accounting/<shard_id>.attempt-NNN.parquet
(one row, by the attempt that finished the shard). While a shard runs, OUTPUT/checkpoints/<shard_id>/ holds its
checkpoint parts (CHECKPOINT_PART_SCHEMA). All are written once, with create-only semantics, and never overwritten.
Accounting files written before the dtype, quantization and model_fingerprint columns existed lack them; readers take
them as null (pipeline.accounting.committed_accounting_of), as checkpoint parts read without model_fingerprint.
Results and parts written before the logprobs, valid and samples columns existed read them as null (no logprobs
asked, unconstrained, n = 1), which is what those rows were.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.engine_choices import EMBEDDING_DTYPES

# One output token's log probability (natural log, from the model's raw logits: before temperature, penalties,
# logit_bias and grammar masks, as vLLM v1's raw_logprobs) and the likeliest tokens there (OpenAI's top_logprobs).
_TOP_LOGPROB = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32()),
                                    ("top_logprobs", pa.list_(_TOP_LOGPROB))]))
_LOGPROBS_DOC = ("null unless logprobs was asked for; else one entry per output token: token_id, token (its text: "
                 "the token decoded alone, so a token holding part of a multi-byte character reads U+FFFD), "
                 "logprob (natural log, from the raw logits before temperature, penalties and grammar masks) and "
                 "top_logprobs (the N likeliest tokens there, most likely first)")
_VALID_DOC = ("for a structured output (json_schema, json_object, regex, choices): true when the completion "
              "completed the constraint (parses and validates), false when it was cut first (finish_reason length); "
              "null for unconstrained rows")
# What HF transformers' tokenizer.decode(output_ids, skip_special_tokens=True) and vLLM's final detokenization give
# (engine.text.detokenizer): the text of a completion cut inside a multi-byte character ends with U+FFFD.
_COMPLETION_DOC = ("generated text (empty on error): the decode of the output token ids, special tokens skipped, cut "
                   "before the stop string that ended it; a completion cut inside a multi-byte UTF-8 character "
                   "(finish_reason length) ends with U+FFFD, one per incomplete character, as HF transformers' "
                   "decode of the same ids (the OpenAI export's text is the same string)")
SAMPLES_TYPE = pa.list_(pa.struct([
    pa.field("completion", pa.string()), pa.field("finish_reason", pa.string()),
    pa.field("completion_tokens", pa.int32()), pa.field("valid", pa.bool_(), metadata={"doc": _VALID_DOC}),
    pa.field("logprobs", LOGPROBS_TYPE)]))

# The fields of a finished row, in results and in checkpoint parts alike.
_ROW_FIELDS = [
    pa.field("id", pa.string(), metadata={"doc": "the input row's id (its id column, as text; null where that is "
                                                 "null), or its row position in the file when the input has no id "
                                                 "column. Ids may repeat: input_file + input_row name a row"}),
    pa.field("completion", pa.string(), metadata={"doc": _COMPLETION_DOC}),
    pa.field("finish_reason", pa.string(), nullable=False, metadata={"doc": "stop | length | error"}),
    pa.field("prompt_tokens", pa.int32(), nullable=False, metadata={
        "doc": "prompt length in tokens (an over-long prompt's error row too); 0 for an error row whose prompt was "
               "never tokenized (null, empty, malformed)"}),
    pa.field("completion_tokens", pa.int32(), nullable=False,
             metadata={"doc": "generated tokens (with n > 1: of all n samples, as OpenAI's usage counts them)"}),
    pa.field("error", pa.string(), metadata={"doc": "null when the row ran; else what was wrong and the fix"}),
    pa.field("model", pa.string(), nullable=False, metadata={"doc": "model file name"}),
    pa.field("model_fingerprint", pa.string(), metadata={
        "doc": "sha256:<hex> of the model's files (sizes and hashes or ETags; pipeline.model_pin) that the engine "
               "which generated the row had loaded (the job's pinned model for the error rows of a shard with no "
               "row to run, which loads no engine); null for rows of a job started before models were pinned"}),
    pa.field("logprobs", LOGPROBS_TYPE, metadata={"doc": _LOGPROBS_DOC}),
    pa.field("valid", pa.bool_(), metadata={"doc": _VALID_DOC}),
    pa.field("samples", SAMPLES_TYPE, metadata={
        "doc": "null unless n > 1; else the n samples in order, each with its completion, finish_reason, "
               "completion_tokens, valid and logprobs (the row's own completion and finish_reason are sample 0's)"}),
    pa.field("note", pa.string(), metadata={
        "doc": "null, or what a row that ran needs said beside its fields: a finish_reason length row whose "
               "max_tokens was cut to fit --max-model-len (prompt + max_tokens did not fit) names both; null in "
               "results written before the column existed"}),
    pa.field("images", pa.int32(), metadata={
        "doc": "images in the row's prompt (its image column and its messages' image parts; an error row's as "
               "given), their tokens counted in prompt_tokens; null for a row without images and in results "
               "written before the column existed"}),
]

RESULTS_SCHEMA = pa.schema(_ROW_FIELDS + [
    pa.field("input_file", pa.string(), nullable=False, metadata={"doc": "the input file of the row (fsspec URL)"}),
    pa.field("input_row", pa.int64(), nullable=False,
             metadata={"doc": "the row's position in input_file, 0-based: unique with input_file, even where ids "
                              "repeat or are null"}),
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
    pa.field("input_tokens", pa.int64(), nullable=False, metadata={
        "doc": "prompt tokens of the rows that ran (error rows' prompts were never computed), tokens"}),
    pa.field("output_tokens", pa.int64(), nullable=False, metadata={"doc": "completion tokens, tokens"}),
    pa.field("wall_s", pa.float64(), nullable=False, metadata={"doc": "this attempt's generation wall time, seconds"}),
    pa.field("output_tokens_per_s", pa.float64(), nullable=False,
             metadata={"doc": "tokens this attempt generated / wall_s, tokens per second"}),
    pa.field("device", pa.string(), nullable=False, metadata={"doc": "cpu or the GPU's name"}),
    pa.field("dtype", pa.string(), nullable=False,
             metadata={"doc": "the torch dtype the engine ran in (float32, bfloat16, float16), 'auto' resolved"}),
    pa.field("quantization", pa.string(), nullable=False,
             metadata={"doc": "how the engine held the weights: none, auto, int4 or int8 (EngineConfig.quantization); "
                              "for an already quantized model (GPTQ, AWQ, compressed-tensors) followed by how its "
                              "layers loaded, e.g. 'auto (gptq 4-bit, group 128: 224 layers INT4 as stored, 0 "
                              "dequantized exactly)'"}),
    pa.field("price_per_hour_usd", pa.float64(), nullable=False, metadata={"doc": "price of the device, USD/hour"}),
    pa.field("cost_usd", pa.float64(), nullable=False, metadata={
        "doc": "device_s_billed / 3600 * price_per_hour_usd: every attempt of the shard, lost time included, USD"}),
    pa.field("tokens_per_dollar", pa.float64(), metadata={"doc": "output tokens / cost_usd; null when cost is 0"}),
    pa.field("attempts", pa.int32(), nullable=False, metadata={"doc": "attempts the shard took (this one's number)"}),
    pa.field("preemptions", pa.int32(), nullable=False,
             metadata={"doc": "earlier attempts that ended without finishing: killed or interrupted"}),
    pa.field("device_s", pa.float64(), nullable=False,
             metadata={"doc": "device-seconds of this attempt, from claiming it to committing the results: its share "
                              "of the engine's steps (by tokens computed, where shards shared the engine) plus the "
                              "time the engine ran no step; 0 for an attempt with no row to run (every row an error "
                              "row found before any engine): it loads no engine; see pipeline.accounting"}),
    pa.field("device_s_lost", pa.float64(), nullable=False,
             metadata={"doc": "device-seconds of earlier attempts after their last commit (work no commit kept); "
                              "an estimate, see pipeline.accounting"}),
    pa.field("device_s_billed", pa.float64(), nullable=False,
             metadata={"doc": "device-seconds of every attempt of the shard (this one's device_s included), seconds"}),
    pa.field("rows_resumed", pa.int64(), nullable=False,
             metadata={"doc": "rows taken from earlier attempts' checkpoints, not generated by this attempt"}),
    pa.field("kv_preemptions", pa.int64(), nullable=False,
             metadata={"doc": "times the engine evicted a row's KV blocks and recomputed them, summed over rows"}),
    pa.field("model", pa.string(), nullable=False),
    pa.field("model_fingerprint", pa.string(), metadata={
        "doc": "the model's fingerprint (as in results); null in accounting written before models were pinned"}),
    pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("generated_tokens", pa.int64(), nullable=False, metadata={
        "doc": "output tokens this attempt generated itself (not rows resumed from checkpoints), tokens; absent "
               "(read as null) in accounting written before the column existed"}),
    pa.field("input_tokens_per_dollar", pa.float64(), metadata={
        "doc": "input_tokens / cost_usd (an embed job's measure: it writes no output tokens); null when cost is 0 "
               "and in accounting written before the column existed"}),
    pa.field("rows_per_dollar", pa.float64(), metadata={
        "doc": "rows / cost_usd; null when cost is 0 and in accounting written before the column existed"}),
    pa.field("images", pa.int64(), metadata={
        "doc": "images in the prompts of the rows that ran (their image tokens are in input_tokens); null in "
               "accounting written before the column existed"}),
])

# A checkpoint part under OUTPUT/checkpoints/<shard_id>/: finished rows as in RESULTS_SCHEMA (less input_file and
# input_row, which the shard adds when it commits its results), plus where each row sits
# in the shard (the resume and dedupe key: ids may repeat in an input, positions cannot), its KV recompute count and
# its latency.
CHECKPOINT_PART_SCHEMA = pa.schema(_ROW_FIELDS + [
    pa.field("row", pa.int64(), nullable=False, metadata={"doc": "position of the row in its shard, 0-based"}),
    pa.field("kv_preemptions", pa.int32(), nullable=False, metadata={"doc": "RequestOutput.num_preemptions"}),
    pa.field("latency_s", pa.float64(), metadata={"doc": "seconds from the start of the attempt's generate call to "
                                                         "the row's last token (tokenmill report); null for error "
                                                         "rows and in parts written before the column existed"}),
])


# The rows of an embed job (`--task embed`): the embedding of each row's text instead of a completion.
_BY_NAME = {f.name: f for f in _ROW_FIELDS}
_INPUT_FIELDS = [RESULTS_SCHEMA.field("input_file"), RESULTS_SCHEMA.field("input_row")]


def _embed_fields(dim: int, dtype: str = "float32") -> list[pa.Field]:
    """The fields of an embed job's finished row, in results and in checkpoint parts alike (`dim`: elements of one
    embedding, the model's hidden size times its pooling modes; `dtype`: its element type, float32 or float16 (the
    job's --embedding-dtype)). Raises ValueError for another dtype."""
    if dtype not in EMBEDDING_DTYPES:
        raise ValueError(f"embedding dtype must be {' or '.join(EMBEDDING_DTYPES)}, got {dtype!r}")
    return _text_fields([pa.field("embedding", pa.list_(pa.type_for_alias(dtype), dim), metadata={
        "doc": f"the text's embedding, {dim} {dtype} values, pooled and normalized as the model's "
               "sentence-transformers files say (engine.pooling; computed in float32, then rounded to the job's "
               "--embedding-dtype); null for an error row"})])


def _text_fields(outputs: list[pa.Field]) -> list[pa.Field]:
    """The fields of an embed or classify job's finished row: id, the task's `outputs`, the tokens read, whether
    truncated, error and model."""
    return [
        _BY_NAME["id"], *outputs,
        pa.field("prompt_tokens", pa.int32(), nullable=False, metadata={
            "doc": "tokens the model read, special tokens included, after truncation; 0 for an error row"}),
        pa.field("truncated", pa.bool_(), nullable=False, metadata={
            "doc": "true when the text ran past the model's max_seq_length (sentence_bert_config.json; a "
                   "classifier's: its positions) and its tail was dropped (sentence-transformers cuts the same "
                   "tokens, silently)"}),
        _BY_NAME["error"], _BY_NAME["model"], _BY_NAME["model_fingerprint"],
    ]


def embed_results_schema(dim: int, dtype: str = "float32") -> pa.Schema:
    """OUTPUT/results/<shard_id>.parquet of an embed job: one row per input row, `embedding` as
    fixed_size_list<dtype>[dim] (float32, or float16 on request)."""
    return pa.schema(_embed_fields(dim, dtype) + _INPUT_FIELDS)


def embed_part_schema(dim: int, dtype: str = "float32") -> pa.Schema:
    """A checkpoint part of an embed job: its finished rows (embed_results_schema less input_file and input_row)
    plus each row's position in the shard."""
    return pa.schema(_embed_fields(dim, dtype) + [CHECKPOINT_PART_SCHEMA.field("row")])


# The rows of a classify job (`--task classify`): the label of each row's text and its scores.
_CLASSIFY_FIELDS = _text_fields([
    pa.field("label", pa.string(), metadata={
        "doc": "the most probable label (config.json id2label); null for a regression head and an error row"}),
    pa.field("score", pa.float32(), metadata={
        "doc": "the label's probability (softmax; a multi-label head's sigmoid); a regression head's raw score; "
               "null for an error row"}),
    pa.field("scores", pa.list_(pa.float32()), metadata={
        "doc": "every label's probability, by label id (softmax; a multi-label head's sigmoid per label); a "
               "regression head's raw logits; null for an error row"}),
    pa.field("labels", pa.list_(pa.string()), metadata={
        "doc": "a multi-label head's labels (problem_type multi_label_classification) whose probability is >= 0.5, "
               "in id order, possibly empty; null for a single-label or regression head (and in rows written "
               "before the column existed) and for an error row"})])
#: OUTPUT/results/<shard_id>.parquet of a classify job: one row per input row.
CLASSIFY_RESULTS_SCHEMA = pa.schema(_CLASSIFY_FIELDS + _INPUT_FIELDS)
#: A checkpoint part of a classify job: its finished rows plus each row's position in the shard.
CLASSIFY_PART_SCHEMA = pa.schema(_CLASSIFY_FIELDS + [CHECKPOINT_PART_SCHEMA.field("row")])


# The rows of a score job (`--task score`): the relevance of each row's (text, text pair).
_SCORE_FIELDS = _text_fields([pa.field("score", pa.float32(), metadata={
    "doc": "the pair's relevance: a cross-encoder's logit through sentence-transformers' CrossEncoder activation "
           "(sigmoid, in (0, 1), unless the model's files name Identity), or an embedding model's cosine similarity "
           "of the two texts' embeddings (in [-1, 1]); prompt_tokens counts the pair's tokens (both texts'), "
           "truncated says a text was cut; null for an error row"})])
#: OUTPUT/results/<shard_id>.parquet of a score job: one row per input row.
SCORE_RESULTS_SCHEMA = pa.schema(_SCORE_FIELDS + _INPUT_FIELDS)
#: A checkpoint part of a score job: its finished rows plus each row's position in the shard.
SCORE_PART_SCHEMA = pa.schema(_SCORE_FIELDS + [CHECKPOINT_PART_SCHEMA.field("row")])
