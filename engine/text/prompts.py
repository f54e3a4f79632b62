"""What a prompt may be, and the one check of it: text, chat messages, or token ids.

`prompt_problem` is the only validator: the pipeline calls it on every row before the engine sees it (an unusable
row becomes an error row), and `LLMEngine.prompt_token_ids` calls it before tokenizing, so a prompt the pipeline
accepts is one the engine runs and the other way round. No tokenizer needed; the vocabulary check of token ids is
the engine's (it knows the vocabulary).
"""

from __future__ import annotations

from typing import Any

# A prompt is text (wrapped in the chat template unless use_chat_template=False), a list of chat messages
# ({"role": ..., "content": ...}), or a list of token ids (sent as they are); for a vision-language model also an
# image prompt: {"prompt" | "messages": ..., "images": [...]}, or messages with image content parts (engine.multimodal
# documents the forms; RequestBuilder.prompt_inputs routes them, before prompt_problem).
Prompt = str | list[dict[str, Any]] | list[int] | dict[str, Any]

CHAT_ROLES = ("system", "user", "assistant", "tool")


def prompt_problem(prompt: object, *, token_ids: bool = True) -> str | None:
    """What makes `prompt` unusable, found without a tokenizer, as a sentence that says the fix; None when it looks
    fine. Refused: null, blank text, an empty messages list, a message that is not {role, content} with a role in
    CHAT_ROLES and text content, and any other type. A list of ints is token ids (checked against the vocabulary
    when tokenized) when `token_ids`, else a messages list like any other (a text or messages column's rows)."""
    if prompt is None:
        return "the prompt is null; fill in the prompt column for this row"
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty; give it some text"
    if isinstance(prompt, list):
        if token_ids and prompt and all(isinstance(t, int) for t in prompt):
            return None
        return _messages_problem(prompt)
    return (f"the prompt is {type(prompt).__name__} {prompt!r}, not text or a list of chat messages; a messages "
            "column stored as text must hold a JSON list of {role, content} objects")


def _messages_problem(messages: list[Any]) -> str | None:
    """What is wrong with a chat messages list (a message that is not {role, content}, a role outside CHAT_ROLES,
    content that is not text), or None."""
    if not messages:
        return "the messages list is empty; give at least one {role, content} message"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return (f"message {i} is {type(m).__name__} {m!r}, not a {{role, content}} object; give each message "
                    "as {\"role\": ..., \"content\": ...}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            return f"message {i} has role {role!r}; use one of {', '.join(CHAT_ROLES)}"
        if not isinstance(content, str):
            return (f"message {i} ({role}) has content {content!r} of type {type(content).__name__}; content must "
                    "be text")
    return None


def text_problem(text: object) -> str | None:
    """What makes `text` unusable as a text to embed, as a sentence that says the fix; None when it is usable. Refused:
    null, any other type than a string, empty or only whitespace (it would embed as [CLS] [SEP] alone)."""
    if text is None:
        return "the text is null; fill in the text column for this row"
    if not isinstance(text, str):
        return f"the text is {type(text).__name__} {text!r}, not a string; store the text column as strings"
    if not text.strip():
        return ("the text is empty; give it some text" if not text else
                "the text is only whitespace; give it some text")
    return None
