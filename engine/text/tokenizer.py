"""Tokenizer and chat template, read from the model file by HF transformers (which understands `gguf_file`).

Chat templates are rendered by transformers in jinja2's ImmutableSandboxedEnvironment, so a template shipped inside
a model file cannot reach Python objects.

Building the tokenizer from a GGUF file parses its vocabulary and merges in Python (about a CPU-second per process:
every Dask worker paid it at start-up), so the result is cached as an HF tokenizer folder (tokenizer.json and its
config) under $TOKENMILL_CACHE_DIR (default $XDG_CACHE_HOME/tokenmill or ~/.cache/tokenmill), keyed by the file's path,
size, modification time and the transformers version; a later load reads that folder in a fraction of a second.

The build itself (`_build_gguf_tokenizer`) is transformers' own: the tokenizer class AutoTokenizer would pick, loaded
with `from_pretrained(folder, gguf_file=name)`. AutoTokenizer finds that class by building the model's whole config
from the file first (transformers' legacy GGUF config reader: ~8 of the ~9 CPU-s an uncached load cost on SmolLM2),
although for the architectures tokenmill runs the class follows from `general.architecture` alone; so those pick the
class from transformers' table directly and skip the config, and any other file takes AutoTokenizer's full path. The
saved tokenizer folders of both paths are byte-identical (tests/engine/text/test_tokenizer_gguf.py).

User text is text. A prompt, a chat message's content (or any string in a message) is encoded so that the spelling
of a control token in it (`<|im_end|>`, `<|im_start|>system`) becomes the ordinary tokens of those characters, never
the control token: only the chat template's own markers are control tokens, so a row cannot end its turn or open a
forged system turn. Chat messages go through transformers' `apply_chat_template(..., sanitize_control_tokens=True)`
(control tokens = the tokenizer's special tokens plus the added tokens written in the template; see
Tokenizer.apply_chat_template for why the token ids of ordinary text are exactly those of encoding the rendered text
whole); raw prompts through `encode(..., split_special_tokens=True)`. `allow_special_tokens=True` (the job option
--allow-special-tokens) parses them as control tokens, for users who need raw control.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from schemas import settings

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """tokenmill's cache folder: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill
    (schemas.settings.cache_dir)."""
    return settings.cache_dir()


def _gguf_tokenizer_cache(path: str) -> Path:
    """The cache folder of the tokenizer of the GGUF file at `path` (a new key whenever the file changes)."""
    import transformers

    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


# GGUF `general.architecture` -> the transformers model_type load_gguf_checkpoint gives it (it renames qwen2moe and
# qwen3moe, gemma3 to gemma3_text and gpt-oss to gpt_oss): the architectures tokenmill runs
# (engine.model.architectures).
_GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                     "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
                     "gpt-oss": "gpt_oss"}


def _build_gguf_tokenizer(path: str) -> Any:
    """The transformers tokenizer of the GGUF file at `path`, the one `AutoTokenizer.from_pretrained(folder,
    gguf_file=name)` builds, in about a tenth of its CPU time for the architectures of `_GGUF_MODEL_TYPES`.

    AutoTokenizer reads the file's whole config (transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint,
    gguf's GGUFReader over every metadata value) only to learn the model_type, whose entry in its tokenizer table
    (TOKENIZER_MAPPING_NAMES; TokenizersBackend when absent) is the class it then loads with the same
    `from_pretrained(folder, gguf_file=name)`. For a file of an architecture in `_GGUF_MODEL_TYPES` the model_type
    follows from `general.architecture` alone, so the class is looked up directly. The full AutoTokenizer path runs
    instead wherever AutoTokenizer would decide otherwise: another architecture, a llama file named like a Mistral model
    (load_gguf_checkpoint calls those "mistral"), a Mistral-format class, or a tokenizer_config.json beside the file
    (AutoTokenizer reads the class from it).

    Raises ValueError (one line naming the file and the fix) when the file is not (complete) GGUF, has no tokenizer
    (`tokenizer.ggml.model` / `tokenizer.ggml.tokens`), or one of a kind transformers cannot build; OSError when
    it cannot be read.
    """
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_TYPES
    from transformers.integrations.gguf.reader import read_gguf_metadata
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    folder, name = os.path.split(os.path.abspath(path))
    try:  # counts only for the string arrays: the vocabulary is read once, below
        metadata, _ = read_gguf_metadata(path)
    except struct.error as e:  # the metadata runs past the end of the file
        raise ValueError(f"{path} is not a complete GGUF file ({e}); download or convert the model again") from e
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.model/tokens metadata); convert the model with "
                         "its tokenizer (llama.cpp convert_hf_to_gguf.py) or pass the model folder with its tokenizer "
                         "files")
    if kind not in GGUF_TOKENIZER_TYPES:
        raise ValueError(f"{path} holds a {kind!r} tokenizer, which transformers cannot build from a GGUF file (it "
                         f"builds {sorted(GGUF_TOKENIZER_TYPES)}); pass the model folder with its tokenizer files")
    arch = metadata["general.architecture"]
    model_name = str(metadata.get("general.name", ""))
    cls = None
    if arch in _GGUF_MODEL_TYPES and "mistral" not in model_name.lower() \
            and not os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        class_name = TOKENIZER_MAPPING_NAMES.get(_GGUF_MODEL_TYPES[arch])
        cls = TokenizersBackend if class_name is None else tokenizer_class_from_name(class_name)
        if cls is not None and cls.__name__ == "MistralCommonBackend":
            cls = None
    if cls is None:
        log.debug("building the tokenizer of %s through AutoTokenizer's full GGUF path", path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return cls.from_pretrained(folder, gguf_file=name, _from_auto=True)


class Tokenizer:
    """Text <-> token ids for one model.

    Attributes: eos_token_id (int | None), bos_token_id (int | None), vocab_size (int), has_chat_template (bool).
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        """Wrap a transformers tokenizer. Raises RuntimeError when the installed transformers cannot encode message
        contents as plain text (apply_chat_template without `sanitize_control_tokens`): an older release would pass
        the flag on to the template and silently parse control tokens in user text."""
        if "sanitize_control_tokens" not in inspect.signature(hf_tokenizer.apply_chat_template).parameters:
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__} cannot keep control tokens in user text as "
                               "text (no apply_chat_template(sanitize_control_tokens=...)); pip install "
                               "'transformers>=5.24'")
        self._tok = hf_tokenizer
        # split_special_tokens is a switch on the shared Rust tokenizer that each encode call sets: one call at a time
        self._lock = threading.Lock()
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    @classmethod
    def from_model_path(cls, path: str) -> Tokenizer:
        """The tokenizer of a local model: a GGUF file's (`from_gguf`, cached) or a tokenmill model folder's (the HF
        tokenizer files saved in it). Raises OSError when `path` cannot be read."""
        if not os.path.isdir(path):
            return cls.from_gguf(path)
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        return cls(AutoTokenizer.from_pretrained(path))

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (jinja; a vision-language model's processor holds its template, not its
        tokenizer)."""
        self._tok.chat_template = template
        self.has_chat_template = True

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer underneath (what engine.loading.tokenmill_folder saves beside a model's
        weights)."""
        return self._tok

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """Load the tokenizer (vocab, merges, special tokens, chat template) stored in a GGUF file.

        Cached after the first build (module docstring). Raises OSError when `path` cannot be read, ValueError when it
        is not a GGUF file or holds no tokenizer, or one transformers cannot build."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        cached = _gguf_tokenizer_cache(path)
        if (cached / "tokenizer.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(cached))
            except Exception as e:  # a damaged cache entry: rebuild it from the model file
                log.warning("ignoring the cached tokenizer at %s (%s); rebuilding it from %s", cached, e, path)
                shutil.rmtree(cached, ignore_errors=True)
        hf_logging.disable_progress_bar()
        tok = _build_gguf_tokenizer(path)
        try:  # written beside, then renamed into place: concurrent workers never read half a folder
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-")
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, cached)
            except OSError:  # another process got there first
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:  # a read-only home: no cache, same tokenizer
            log.debug("tokenizer cache not written (%s)", e)
        return cls(tok)

    def encode(self, text: str, *, allow_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` as the model's tokenizer splits it (with BOS only if the model file asks for it).

        `text` is text: the spelling of a special token in it (`<|im_end|>`) is encoded as the characters it is made
        of, never as the special token (split_special_tokens=True); for text without such spellings the ids are the
        tokenizer's default encoding exactly. allow_special_tokens=True parses them as special tokens.
        """
        with self._lock:
            return list(self._tok.encode(text, split_special_tokens=not allow_special_tokens))

    def encode_truncated(self, texts: list[str], max_length: int) -> list[tuple[list[int], bool]]:
        """(token ids, whether cut) of each text as sentence-transformers tokenizes it for an embedding: special
        tokens added ([CLS] ... [SEP]), a control token's spelling parsed as the token (its tokenizer call's
        default), cut to `max_length` tokens by truncation "longest_first" (the text's tail dropped, the special
        tokens kept)."""
        return [(ids, cut) for ids, _, cut in self._encode_cut(texts, None, max_length)]

    def encode_pairs_truncated(self, texts: list[str], pairs: list[str], max_length: int
                               ) -> list[tuple[list[int], list[int], bool]]:
        """(token ids, token type ids, whether cut) of each (text, pair) encoded as one sequence, as HF tokenizers
        encode `tokenizer(text, pair)` and sentence-transformers' CrossEncoder feeds a pair: [CLS] a [SEP] b [SEP]
        (BERT; XLM-RoBERTa <s> a </s></s> b </s>), token type 1 on the second segment where the tokenizer gives
        types (BERT; all 0 otherwise), cut to `max_length` tokens by truncation "longest_first" (a token at a time
        from the end of the longer text). Raises ValueError when texts and pairs differ in length."""
        if len(texts) != len(pairs):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} text pairs; give one pair per text")
        return self._encode_cut(texts, pairs, max_length)

    def _encode_cut(self, texts: list[str], pairs: list[str] | None, max_length: int
                    ) -> list[tuple[list[int], list[int], bool]]:
        """(ids, token type ids, whether cut) of texts (with their pairs), truncated "longest_first"."""
        with self._lock:
            enc = self._tok(texts, pairs, truncation=True, max_length=max_length, split_special_tokens=False,
                            return_token_type_ids=True)
            ids = [list(row) for row in enc["input_ids"]]
            types = [list(row) for row in enc["token_type_ids"]]
            encodings = getattr(enc, "encodings", None)
            if encodings is not None:  # a fast tokenizer keeps what truncation cut
                cut = [bool(e.overflowing) for e in encodings]
            else:
                cut = [len(whole) > len(row) for row, whole in
                       zip(ids, self._tok(texts, pairs, split_special_tokens=False)["input_ids"], strict=True)]
        return list(zip(ids, types, cut, strict=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; special tokens (EOS, chat markers) left out by default."""
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, allow_special_tokens: bool = False) -> list[int]:
        """Token ids of `messages` ([{"role": ..., "content": ...}, ...]) in the model's chat format, ending with
        the assistant generation prompt.

        The messages are user text (module docstring): transformers' sanitize_control_tokens wraps each control
        token spelt in a message's strings in two private-use markers before the template renders them, then encodes
        the rendered text split at the markers: the marked spellings as plain text, the rest, with the template's own
        control tokens, as usual. It needs no trust in the template: a template that trims, re-cases or repeats a
        content carries the markers along, and a marker it separates from its token is dropped but still splits the
        text, so no control token can form across it. Token ids of ordinary text are unchanged: a message without a
        control token's spelling gets no marker, so the rendered text is encoded whole, exactly as without
        sanitizing, and no merge is cut at a content's boundary (tested on every GSM8K and AlpacaEval prompt).
        allow_special_tokens=True encodes the rendered text whole with control tokens parsed (raw control).

        Raises ValueError when the model file has no chat template (send raw text with use_chat_template=False), a
        message lacks role/content, the template fails on the messages, or a control token's spelling cannot be
        kept as text (the tokenizer makes the control token from plain text).
        """
        if not self.has_chat_template:
            raise ValueError("this model file has no chat template; send raw prompts (--no-chat-template)")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content' keys, got {m!r}")
        try:
            with self._lock:
                if allow_special_tokens:
                    text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                    return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=False))
                return list(self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False, sanitize_control_tokens=True))
        except (TemplateError, TypeError) as e:  # content the template cannot render (a null, a number)
            raise ValueError(f"the model's chat template cannot render these messages ({type(e).__name__}: {e}); "
                             "give each message a text content") from e
