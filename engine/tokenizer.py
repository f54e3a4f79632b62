"""Tokenizer and chat template, read from the model file by HF transformers (which understands `gguf_file`).

Chat templates are rendered by transformers in jinja2's ImmutableSandboxedEnvironment, so a template shipped inside
a model file cannot reach Python objects.
"""

from __future__ import annotations

import os
from typing import Any


class Tokenizer:
    """Text <-> token ids for one model.

    Attributes: eos_token_id (int | None), bos_token_id (int | None), vocab_size (int), has_chat_template (bool).
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """Load the tokenizer (vocab, merges, special tokens, chat template) stored in a GGUF file."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the model's tokenizer splits it (with BOS only if the model file asks for it)."""
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; special tokens (EOS, chat markers) left out by default."""
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` ([{"role": ..., "content": ...}, ...]) in the model's chat format, ending with
        the assistant generation prompt.

        Raises ValueError when the model file has no chat template (send raw text with use_chat_template=False)
        or a message lacks role/content.
        """
        if not self.has_chat_template:
            raise ValueError("this model file has no chat template; send raw prompts (--no-chat-template)")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content' keys, got {m!r}")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self._tok.encode(text, add_special_tokens=False))
