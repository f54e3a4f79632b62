"""Embedding throughput on a GPU (issue 53): LLMEngine.embed over real texts with random weights of a real embedding
model's shape, built from its released config.json and sentence-transformers pooling (no weights to carry):

- bge-large-en-v1.5 (BAAI): BERT-large, 24 layers, hidden 1024, 16 heads, intermediate 4096, vocabulary 30522,
  512 positions; CLS pooling, Normalize; max_seq_length 512;
- qwen3-embedding-0.6b (Qwen): Qwen3, 28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
  vocabulary 151669, tied embeddings; last-token pooling, Normalize; max_seq_length 32768. Built as
  sentence-transformers loads it: the trunk (no LM head kept: an embed-only engine, no KV pool).

The texts: bench.common.real_texts (GSM8K questions and answers, AlpacaEval instructions and reference outputs),
tokenized by the BERT uncased WordPiece tokenizer (all-MiniLM-L6-v2's = bge-large's vocabulary; its ids are valid
Qwen3 ids too). Qwen3's own byte-level BPE is not carried to the device: its token counts differ by some percent,
so compare input tokens/s across the two shapes, not rows/s. Each engine embeds the texts once to warm up (kernels,
allocator), then `--repeats` times; the best counts. Prints one JSON line per shape (rows/s, input tokens/s, input
tokens and rows per dollar at --price-per-hour) and a table.

Usage (bench/gpu_session.sh's `embed` step):
    python -m bench.embed_gpu --device cuda                           # both shapes, bf16, 4,248 texts
    python -m bench.embed_gpu --device cuda --embed-preset bge-large-en-v1.5 --rows 2000 --price-per-hour 3.5
Smoke run on a CPU (the same shapes cut to 2 layers of width 64: tests/bench/test_embed_gpu.py):
    python -m bench.embed_gpu --device cpu --tiny --rows 32
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from bench.common import ROOT, emit, preset_parser, real_texts

if TYPE_CHECKING:
    from engine import EngineConfig, LLMEngine
    from engine.config import ModelConfig
    from engine.pooling.st_config import PoolingConfig

# config.json of BAAI/bge-large-en-v1.5 (the fields a BERT folder's loader reads; dropout and init: training only).
_BGE_LARGE = {"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": 1024, "intermediate_size": 4096,
              "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
              "num_attention_heads": 16, "num_hidden_layers": 24, "pad_token_id": 0,
              "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": 30522}
# config.json of Qwen/Qwen3-Embedding-0.6B.
_QWEN3_EMBEDDING = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
                    "eos_token_id": 151643, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
                    "intermediate_size": 3072, "max_position_embeddings": 32768, "max_window_layers": 28,
                    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
                    "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
                    "vocab_size": 151669}
#: name -> (config.json, 1_Pooling mode, sentence_bert_config.json max_seq_length): each release's own files.
EMBED_PRESETS: dict[str, tuple[dict, str, int]] = {"bge-large-en-v1.5": (_BGE_LARGE, "cls", 512),
                                                   "qwen3-embedding-0.6b": (_QWEN3_EMBEDDING, "lasttoken", 32768)}
#: --tiny: each shape cut to this (the family, vocabulary, pooling and head layout kept) for a CPU smoke run.
_TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
#: Where bench/gpu_prepare.sh puts the BERT tokenizer's files for the device (all-MiniLM-L6-v2's, weights left out).
DEVICE_TOKENIZER = ROOT / ".gpu" / "bert_tokenizer"


def embed_preset(name: str, tiny: bool = False) -> tuple[ModelConfig, PoolingConfig]:
    """(ModelConfig, PoolingConfig) of the embedding model `name` (EMBED_PRESETS), read as LLMEngine.from_model
    reads its folder (engine.model.hf_config.config_from_hf; a decoder's sentence-transformers files: pooling_files,
    its trunk only); `tiny`: 2 layers of width 64 (4 heads; a decoder's 2 KV heads of 16). Raises ValueError naming
    the known presets for another name."""
    from engine.model.hf_config import config_from_hf
    from engine.pooling.st_config import PoolingConfig

    if name not in EMBED_PRESETS:
        raise ValueError(f"unknown embed preset {name!r}; known: {', '.join(EMBED_PRESETS)}")
    config, mode, max_seq_length = EMBED_PRESETS[name]
    decoder = mode == "lasttoken"
    if tiny:
        config = {**config, **_TINY, **({"num_key_value_heads": 2, "head_dim": 16} if decoder else {})}
    cfg = config_from_hf(config)
    if decoder:  # as a folder with modules.json loads: embeds; sentence-transformers keeps the trunk alone
        cfg = dataclasses.replace(cfg, pooling_files=True, lm_head=False, tie_word_embeddings=False)  # no head to tie
    return cfg, PoolingConfig(modes=(mode,), normalize=True, max_seq_length=max_seq_length, source="modules.json")


def preset_embedder(name: str, config: EngineConfig, tokenizer_path: str, *, tiny: bool = False,
                    seed: int = 0) -> LLMEngine:
    """An embed-only engine over random N(0, 0.02) weights of `name`'s shape (embed_preset; norms 1), on
    config.device in config.dtype, with the tokenizer of the folder `tokenizer_path`. Raises ValueError for an
    unknown name, OSError when the tokenizer cannot be read."""
    from engine import LLMEngine
    from engine.loading.presets import random_model
    from engine.text.tokenizer import Tokenizer
    from engine.worker.device import resolve_device, resolve_dtype

    cfg, pooling = embed_preset(name, tiny)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model = random_model(cfg, dtype, device, seed=seed, max_positions=pooling.max_seq_length)
    return LLMEngine(model, cfg, Tokenizer.from_model_path(tokenizer_path), config,
                     f"{name}{' (tiny)' if tiny else ''} (random weights)", device, dtype, pooling=pooling)


def tokenizer_folder(path: str | None) -> str:
    """The BERT tokenizer's folder: `path`, else DEVICE_TOKENIZER where bench/gpu_prepare.sh put it, else the
    installed all-MiniLM-L6-v2's (engine.loading.model_files.default_embedding_model_path)."""
    if path:
        return path
    if DEVICE_TOKENIZER.is_dir():
        return str(DEVICE_TOKENIZER)
    from engine.loading.model_files import default_embedding_model_path

    return default_embedding_model_path()


def measure(engine: LLMEngine, texts: list[str], repeats: int) -> tuple[float, int]:
    """(the best of `repeats` timed embeds of `texts` after one warm-up, in wall seconds, the input tokens read).
    embed returns host arrays, so a call's time includes the device's work. Raises RuntimeError when a text fails."""
    outs = engine.embed(texts)
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} texts could not be embedded: {errors[:3]}")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.embed(texts)
        best = min(best, time.perf_counter() - t0)
    return best, sum(o.num_prompt_tokens for o in outs)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark (module docstring); returns the rows it printed."""
    ap = preset_parser(__doc__, "--embed-preset", list(EMBED_PRESETS), "2 layers of width 64 (a CPU smoke run)")
    ap.add_argument("--rows", type=int, default=0, help="texts to embed (0: all 4,248 real texts)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-batch-tokens", type=int, default=32768, help="tokens per forward (the token budget)")
    ap.add_argument("--max-num-seqs", type=int, default=512, help="rows per forward")
    args = ap.parse_args(argv)

    import torch

    from engine import EngineConfig

    texts = real_texts()
    texts = texts[:args.rows] if args.rows else texts
    config = EngineConfig(device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_batch_tokens,
                          max_num_seqs=args.max_num_seqs)
    rows = []
    for name in args.embed_preset or list(EMBED_PRESETS):
        engine = preset_embedder(name, config, tokenizer_folder(args.tokenizer), tiny=args.tiny)
        seconds, tokens = measure(engine, texts, args.repeats)
        dollars = seconds / 3600 * args.price_per_hour
        rows.append({"preset": name, "tiny": args.tiny, "device": engine.device_name,
                     "dtype": str(engine.dtype).removeprefix("torch."), "rows": len(texts), "input_tokens": tokens,
                     "seconds": round(seconds, 4), "rows_per_s": round(len(texts) / seconds, 1),
                     "input_tokens_per_s": round(tokens / seconds), "price_per_hour_usd": args.price_per_hour,
                     "input_tokens_per_dollar": round(tokens / dollars), "rows_per_dollar": round(len(texts) / dollars),
                     "dimension": engine.pooling_runner.pooling.dimension(engine.model_config.hidden_size)})
        emit(**rows[-1])
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{'preset':22s} {'rows/s':>9s} {'input tok/s':>12s} {'input tok/$':>14s} {'rows/$':>12s}  device")
    for r in rows:
        print(f"{r['preset']:22s} {r['rows_per_s']:9,.1f} {r['input_tokens_per_s']:12,} "
              f"{r['input_tokens_per_dollar']:14,} {r['rows_per_dollar']:12,}  {r['device']} {r['dtype']}")
    return rows


if __name__ == "__main__":
    main()
