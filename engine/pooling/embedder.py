"""Texts to embeddings: tokenized and truncated as sentence-transformers does (engine.text.tokenizer.
Tokenizer.encode_truncated), batched longest first within a token budget, run without a KV cache through an
encoder (engine.layers.encoder_attention packs the rows) or a causal decoder embedding model (Qwen3-Embedding:
engine.model.packed_forward, causal within each row), and pooled (engine.pooling.pooler, with the model's Dense
modules: engine.pooling.dense).

Batching: the rows sorted by length, longest first (the LPT order generation uses too), cut into batches whose
padded size (rows x the batch's longest row, what attention computes) stays within `max_batch_tokens`
(EngineConfig.max_num_batched_tokens) and whose rows are at most `max_batch_rows` (max_num_seqs); a row longer than
the budget runs alone. Sorting keeps the attention padding small; the projections and the MLP run on the packed
tokens only (why attention is padded per batch and not block-diagonal or per row: engine.layers.encoder_attention).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from engine.layers.encoder_attention import EncoderMetadata
from engine.model.base import ModelBase
from engine.model.packed_forward import forward_packed
from engine.outputs import EmbeddingOutput
from engine.pooling.dense import Dense
from engine.pooling.embed_options import EmbedOptions
from engine.pooling.pooler import pool
from engine.pooling.st_config import PoolingConfig
from engine.text.prompts import text_problem
from engine.text.tokenizer import Tokenizer


def plan_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_rows: int) -> list[list[int]]:
    """Indices into `lengths` grouped into batches: longest first, each batch's rows x its longest row <=
    max_batch_tokens (a longer row alone) and at most max_batch_rows rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_batch_rows and \
                (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class Embedder:
    """An embedding model, its tokenizer and its pooling: `embed(texts)`.

    Args:
        model: a filled model of task "embed": an encoder (forward(ids, positions, [], EncoderMetadata) ->
            [T, hidden]) or a causal decoder (one with KV cache specs: engine.model.packed_forward runs it).
        tokenizer: its tokenizer (None: `embed` raises ValueError).
        pooling: how it pools (engine.pooling.st_config.read_pooling_config).
        device: where the model is.
        max_batch_tokens: padded tokens per forward (EngineConfig.max_num_batched_tokens).
        max_batch_rows: rows per forward (EngineConfig.max_num_seqs).

    Raises:
        ValueError: a model whose folder has sentence-transformers files (ModelConfig.pooling_files) with a pooling
            not read from them (a copy that lost modules.json would pool otherwise), or Dense weights that do not
            load (engine.pooling.dense.Dense).
    """

    def __init__(self, model: ModelBase, tokenizer: Tokenizer | None, pooling: PoolingConfig, device: torch.device,
                 max_batch_tokens: int, max_batch_rows: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        self.dimension = pooling.dimension(model.config.hidden_size)
        self.max_length = pooling.max_seq_length
        if getattr(model.config, "pooling_files", False) and pooling.source != "modules.json":
            raise ValueError(f"this {model.config.architecture} embedding model's config says its folder holds "
                             "sentence-transformers files, but its pooling was not read from a modules.json; copy "
                             "modules.json and its module folders beside the model")
        self.dense = [Dense(d, device) for d in pooling.dense]
        self.causal = any(spec.has_cache for spec in model.kv_cache_specs)  # a decoder: engine.model.packed_forward
        # NOTE: one forward at a time: shards of one worker call embed from their own threads (pipeline.shard_embed);
        # interleaved batches would only fight over the same cores.
        self._forward_lock = threading.Lock()

    def embed(self, texts: Sequence[object], request_ids: Sequence[str] | None = None,
              options: EmbedOptions | None = None) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per text, in order (module docstring), as `options` ask (engine.pooling.embed_options:
        a prefix before each text, Matryoshka dimensions, normalization, no truncation). A text that is not a
        string, or is empty or only whitespace (nothing to embed but [CLS] [SEP]; sentence-transformers would
        return that vector), gets an error output and the others still embed; so does, with options.truncate
        False, a text (prefix included) over max_length tokens. Raises ValueError when request_ids and texts differ
        in length, for options.dimensions over the model's width, or without a tokenizer."""
        options = options or EmbedOptions()
        options.check(self.dimension)
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (random weights); build it with one to embed texts")
        ids = [str(i) for i in range(len(texts))] if request_ids is None else [str(r) for r in request_ids]
        if len(ids) != len(texts):
            raise ValueError(f"embed got {len(texts)} texts but {len(ids)} request ids; give one id per text")
        out: list[EmbeddingOutput | None] = [None] * len(texts)
        good: list[int] = []
        for i, text in enumerate(texts):
            problem = text_problem(text)
            if problem is None:
                good.append(i)
            else:
                out[i] = EmbeddingOutput(ids[i], None, 0, error=problem)
        strings = self._strings([str(texts[i]) for i in good], options)
        encoded = self.tokenizer.encode_truncated(strings, self.max_length) if good else []
        if not options.truncate:
            good, encoded = self._refuse_long(self.tokenizer, good, encoded, strings, ids, out)
        for batch in plan_batches([len(row) for row, _ in encoded], self.max_batch_tokens, self.max_batch_rows):
            with self._forward_lock:
                vectors = self._run([encoded[j][0] for j in batch], options)
            for j, vec in zip(batch, vectors, strict=True):
                row, cut = encoded[j]
                out[good[j]] = EmbeddingOutput(ids[good[j]], vec, len(row), truncated=cut)
        return [o for o in out if o is not None]

    def _strings(self, texts: list[str], options: EmbedOptions) -> list[str]:
        """The texts as the tokenizer gets them: the prefix before each, lower-cased where the model's files say."""
        strings = [options.prefix + t for t in texts]
        return [t.lower() for t in strings] if self.pooling.do_lower_case else strings

    def token_counts(self, texts: Sequence[object], options: EmbedOptions | None = None) -> list[int]:
        """Tokens each text would be embedded with (special tokens and the prefix included, cut at max_length as
        embed cuts them), tokenized only: no forward. 0 for a text embed makes an error output of (not a string,
        empty). Raises ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (random weights); build it with one to count tokens")
        options = options or EmbedOptions()
        good = [i for i, text in enumerate(texts) if text_problem(text) is None]
        counts = [0] * len(texts)
        if good:
            strings = self._strings([str(texts[i]) for i in good], options)
            for i, (row, _) in zip(good, self.tokenizer.encode_truncated(strings, self.max_length), strict=True):
                counts[i] = len(row)
        return counts

    def _refuse_long(self, tokenizer: Tokenizer, good: list[int], encoded: list[tuple[list[int], bool]],
                     strings: list[str], ids: list[str], out: list[EmbeddingOutput | None]
                     ) -> tuple[list[int], list[tuple[list[int], bool]]]:
        """(good, encoded) without the rows truncation cut, each of those an error output in `out` naming its
        whole length (tokenized again, uncut) and the limit."""
        cut = [j for j, (_, was_cut) in enumerate(encoded) if was_cut]
        whole = tokenizer.encode_truncated([strings[j] for j in cut], 1 << 30) if cut else []  # uncut: 2^30
        for j, (row, _) in zip(cut, whole, strict=True):
            out[good[j]] = EmbeddingOutput(ids[good[j]], None, 0, error=(
                f"the text is {len(row)} tokens (special tokens and any prefix included), over the model's limit "
                f"of {self.max_length} (max_seq_length); shorten it, or let it be truncated (no --no-truncate)"))
        keep = [j for j, (_, was_cut) in enumerate(encoded) if not was_cut]
        return [good[j] for j in keep], [encoded[j] for j in keep]

    def _hidden(self, rows: list[list[int]], token_types: list[list[int]] | None = None) -> torch.Tensor:
        """Last hidden states [T, hidden] (model dtype) of token-id rows packed back to back, in one forward: an
        encoder's attending both ways within each row, a causal decoder's causally (engine.model.packed_forward).
        token_types: each row's token type ids (a cross-encoder's pair: engine.pooling.scorer), read by an encoder
        (a causal decoder has none); None: 0 everywhere."""
        if self.causal:
            return forward_packed(self.model, rows, self.device)
        lens = [len(r) for r in rows]
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
        meta = EncoderMetadata.of(lens, self.device)
        types = {} if token_types is None else {"token_type_ids": torch.tensor(  # only a pair's: BERT's forward
            [t for r in token_types for t in r], dtype=torch.int64, device=self.device)}
        return self.model(ids.to(self.device), positions.to(self.device), [], meta, **types)

    @torch.inference_mode()
    def _run(self, rows: list[list[int]], options: EmbedOptions) -> np.ndarray:
        """float32 [len(rows), options.dimensions or dimension] embeddings of token-id rows (one forward)."""
        hidden = self._hidden(rows)
        return options.apply(pool(hidden, [len(r) for r in rows], self.pooling, self.dense)).cpu().numpy()
