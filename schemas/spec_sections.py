"""The sections of a job spec (schemas.job_spec.JobSpec): which columns hold what, how to sample, how to cut and
checkpoint shards, how to embed, the cluster and the engine, each a frozen, strict pydantic model whose fields carry
their defaults, ranges, descriptions and `tokenmill run` option metadata (Cli). schemas.job_spec assembles them into
the spec, its flat options and its parsing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.engine_choices import DEFAULT_MAX_NUM_SEQS, DTYPES, EMBEDDING_DTYPES, QUANTIZATIONS
from schemas.sampling import SAMPLING_RANGES


@dataclass(frozen=True)
class Cli:
    """How a spec field appears as a `tokenmill run` option (metadata in the field's Annotated type).

    Attributes:
        name: the option's name when it is not the field's (`prompt` -> `prompt_column`, shown as --prompt-column).
        envvar: an environment variable that sets the option when the flag is not given.
    """

    name: str | None = None
    envvar: str | None = None


class _Section(BaseModel):
    # strict: a YAML "100" is not silently the integer 100; stop (a list in YAML) opts out field by field.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, defer_build=True)


_Name = Annotated[str, Field(min_length=1)]


class Columns(_Section):
    """Which input columns hold what."""

    prompt: Annotated[_Name, Field(description="Column of prompt text."), Cli("prompt_column")] = "prompt"
    messages: Annotated[_Name, Field(description="Column of chat messages [{role, content}], used when the prompt "
                                                 "column is absent."), Cli("messages_column")] = "messages"
    id: Annotated[_Name, Field(description="Column of row ids; row positions when the input lacks it."),
                  Cli("id_column")] = "id"
    text_pair: Annotated[_Name | None, Field(description="Column of each row's second text, for --task score (and "
                                                         "only then; required there): the prompt column holds the "
                                                         "first (a query), this one the second (a document)."),
                         Cli("text_pair_column")] = None
    image: Annotated[_Name | None, Field(description="Column of each row's images, for a vision-language model: "
                                                     "image bytes, Hugging Face datasets' Image struct {bytes, "
                                                     "path}, a local path or fsspec URL (s3://...) as text, or a "
                                                     "list of those (several images per row). A text-only model is "
                                                     "refused."), Cli("image_column")] = None
    max_images_per_row: Annotated[int | None, Field(ge=1, description="Most images in one row (its image column "
                                                                      "and its messages' image parts); a row with "
                                                                      "more is an error row. null = no limit but "
                                                                      "--max-model-len.")] = None
    max_pixels: Annotated[int | None, Field(ge=1, description="Most pixels of one image (width x height after "
                                                              "resizing), set through the model's own image "
                                                              "processor (Qwen2-VL's max_pixels, Idefics3's longest "
                                                              "edge, LLaVA-NeXT's grid pinpoints): fewer image "
                                                              "tokens. null = the processor's own. Below the "
                                                              "smallest image the model takes (LLaVA-1.5: its one "
                                                              "size, 336x336) it is refused.")] = None
    min_pixels: Annotated[int | None, Field(ge=1, description=(
        "Fewest pixels of one image, as max_pixels (Qwen2-VL enlarges smaller images; LLaVA-NeXT keeps the larger "
        "grid pinpoints). null = the processor's own; refused where it has no lower limit (Idefics3)."))] = None
    chat_template: Annotated[bool, Field(description="Wrap text prompts in the model's chat template "
                                                     "(--no-chat-template sends them raw).")] = True
    allow_special_tokens: Annotated[bool, Field(description="Parse control-token text in prompts and message "
                                                            "contents (<|im_end|>, <|im_start|>system) as the "
                                                            "model's control tokens, for raw control. Off: user "
                                                            "text is encoded as text, so only the chat template's "
                                                            "own markers are control tokens.")] = False


def _range(name: str) -> dict[str, float]:
    return SAMPLING_RANGES[name].field_kwargs()


class Sampling(_Section):
    """How to sample, per row (engine.SamplingParams; the ranges are schemas.sampling's, shared with per-row columns
    and OpenAI batch bodies). A row's own columns of the same names win over these."""

    max_tokens: Annotated[int, Field(**_range("max_tokens"), description="Most output tokens per row, an integer "
                                                                         ">= 1.")] = 256
    temperature: Annotated[float, Field(**_range("temperature"), description="0 = greedy; > 0 samples.")] = 0.0
    top_p: Annotated[float, Field(**_range("top_p"), description="Nucleus sampling mass in (0, 1].")] = 1.0
    top_k: Annotated[int, Field(**_range("top_k"), description="Keep the k likeliest tokens; 0 or -1 = off.")] = 0
    seed: Annotated[int | None, Field(**_range("seed"), description="An integer >= 0 makes sampled rows "
                                                                    "reproducible (each row mixes it with its id); "
                                                                    "null = unseeded.")] = None
    stop: Annotated[tuple[_Name, ...], Field(strict=False, description="Stop strings, non-empty; the output ends "
                                                                       "before the first one (repeat --stop).")] = ()
    n: Annotated[int, Field(**_range("n"), description="Samples per row (1-128), sharing the prompt's KV blocks; "
                                                       "results hold them in the `samples` column.")] = 1
    logprobs: Annotated[int | None, Field(**_range("logprobs"), description="Log probability of each output token "
                                                                            "and of the N likeliest ones (0-20), "
                                                                            "from the raw logits (before "
                                                                            "temperature and penalties); null = "
                                                                            "none.")] = None
    presence_penalty: Annotated[float, Field(**_range("presence_penalty"), description="Subtracted from the logit "
                                                                                       "of each token already in "
                                                                                       "the output, in [-2, 2] "
                                                                                       "(OpenAI).")] = 0.0
    frequency_penalty: Annotated[float, Field(**_range("frequency_penalty"), description="Subtracted per "
                                                                                         "occurrence in the "
                                                                                         "output, in [-2, 2] "
                                                                                         "(OpenAI).")] = 0.0
    repetition_penalty: Annotated[float, Field(**_range("repetition_penalty"), description="Divides positive "
                                                                                           "(multiplies negative) "
                                                                                           "logits of prompt and "
                                                                                           "output tokens; 1 = off "
                                                                                           "(vLLM, HF).")] = 1.0
    min_tokens: Annotated[int, Field(**_range("min_tokens"), description="End-of-sequence and stop tokens are "
                                                                         "masked until this many tokens are "
                                                                         "out.")] = 0
    json_schema: Annotated[str | None, Field(min_length=1, description="Constrain every output to JSON valid "
                                                                       "against this JSON Schema: a file path or "
                                                                       "URL, or the schema as JSON text. Rows cut "
                                                                       "by max_tokens are flagged valid=false.")] = None
    json_object: Annotated[bool, Field(description="Constrain every output to a JSON object (OpenAI's "
                                                   "json_object).")] = False
    regex: Annotated[str | None, Field(min_length=1, description="Constrain every output to match this regular "
                                                                 "expression.")] = None
    choices: Annotated[tuple[_Name, ...] | None, Field(strict=False, description="Constrain every output to one "
                                                                                 "of these strings (repeat "
                                                                                 "--choices).")] = None


class Sharding(_Section):
    """How the input is cut into shards and how often a running shard checkpoints."""

    rows_per_shard: Annotated[int, Field(ge=1, description="Rows per shard, the unit of scheduling, retry and "
                                                           "accounting; fixed once the job has started.")] = 1000
    limit: Annotated[int | None, Field(ge=1, description="Only the first N rows of the input; null = all. Fixed "
                                                         "once the job has started.")] = None
    checkpoint_rows: Annotated[int, Field(ge=1, description="A running shard commits its finished rows every N "
                                                            "rows ...")] = 64
    checkpoint_seconds: Annotated[float, Field(gt=0, description="... or every T seconds, whichever comes "
                                                                 "first.")] = 60.0


class Cluster(_Section):
    """Where the shards run."""

    scheduler: Annotated[str | None, Field(pattern=r"^(tcp|tls|ws|wss|inproc)://",
                                           description="Dask scheduler address such as tcp://host:8786 of an "
                                                       "existing cluster; null = an embedded LocalCluster."),
                         Cli(envvar="DASK_SCHEDULER_ADDRESS")] = None
    workers: Annotated[int, Field(ge=1, description="Worker processes of the embedded LocalCluster, each holding "
                                                    "one engine.")] = 1
    gpus_per_worker: Annotated[int, Field(ge=0, description="GPUs each worker holds; > 0 makes every shard ask for "
                                                            "resources {GPU: 1}.")] = 0


class Embedding(_Section):
    """How an embed job (--task embed) makes each row's vector (engine.pooling.embed_options); a job of --task
    generate refuses these options."""

    dimensions: Annotated[int | None, Field(ge=1, description=(
        "Keep the first N elements of each embedding, then L2-normalize it (Matryoshka); the results' `embedding` "
        "column is N wide. More than the model's width is refused. null = the whole vector."))] = None
    normalize: Annotated[bool, Field(description=(
        "L2-normalize each embedding after pooling, whatever the model's files say."))] = False
    prefix: Annotated[str, Field(description=(
        "Text put before every row's text before it is tokenized (e5's \"query: \" / \"passage: \"); its tokens "
        "count in prompt_tokens and in max_seq_length."))] = ""
    truncate: Annotated[bool, Field(description=(
        "Cut a text over the model's max_seq_length (the row says `truncated`); --no-truncate makes it an error row "
        "naming its length and the limit."))] = True
    embedding_dtype: Annotated[Literal[EMBEDDING_DTYPES], Field(description=(
        "The element type of the results' `embedding` column: float32, or float16 (half the bytes; the engine "
        "computes float32 and each vector is rounded to float16 as its checkpoint part is written). A job resumes "
        "only with the dtype it started with."))] = "float32"


class Engine(_Section):
    """The engine's device and limits, per worker (engine.EngineConfig)."""

    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="auto, cpu, cuda or cuda:N."),
                      Cli(envvar="TOKENMILL_DEVICE")] = "auto"
    dtype: Annotated[Literal[DTYPES],
                     Field(description="auto (bf16 on cuda and on cpus with native bf16, else fp32), float32, "
                                       "bfloat16 or float16."), Cli(envvar="TOKENMILL_DTYPE")] = "auto"
    quantization: Annotated[Literal[QUANTIZATIONS],
                            Field(description="none (weights dequantized to dtype, the reference), auto (INT4 where "
                                              "the model file stores INT4), int4 (every projection INT4 on load), "
                                              "int8 (W8A8 on the CPU: int8 weights per channel, int8 activations "
                                              "per token)."), Cli(envvar="TOKENMILL_QUANTIZATION")] = "none"
    max_num_seqs: Annotated[int, Field(ge=1, description="Most rows decoding at once per engine."),
                            Cli(envvar="TOKENMILL_MAX_NUM_SEQS")] = DEFAULT_MAX_NUM_SEQS
    kv_cache_gib: Annotated[float | None, Field(gt=0, description="KV cache size on cpu, GiB per worker, > 0; null "
                                                                  "= half the memory free at load (on cuda the pool "
                                                                  "is sized from free memory)."),
                            Cli(envvar="TOKENMILL_KV_CACHE_GIB")] = None
    max_model_len: Annotated[int | None, Field(ge=2, description="Most tokens (prompt + output) per row; longer "
                                                                 "prompts become error rows. null = the model's "
                                                                 "context."),
                             Cli(envvar="TOKENMILL_MAX_MODEL_LEN")] = None
