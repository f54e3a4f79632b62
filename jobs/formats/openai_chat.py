"""The chat messages of OpenAI batch lines (/v1/chat/completions): each message's content as text, or as content parts
of text and images ({"type": "image_url", "image_url": {"url": ...}} with a data: URL, an https:// or s3:// URL or a
path: the job's worker reads those, pipeline.images). A file whose lines carry image parts is staged with its
messages column as JSON text (one list per row, read back by pipeline.shard_rows), since the parts do not fit the
text messages' struct column."""

from __future__ import annotations

import json
from typing import Any

from jobs.formats.openai_embeddings import BadRequest as _BadRequest


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An image_url part as the engine takes it ({"type": "image_url", "image_url": {"url": ...}}; OpenAI's
    `detail` is dropped: the model's processor decides the resolution)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else None
    if not isinstance(url, str) or not url:
        raise _BadRequest(f"{where} must be {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}} with a "
                          "data: URL, an https:// or s3:// URL")
    return {"type": "image_url", "image_url": {"url": url}}


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, the text parts of a content-part list joined, or (with image parts) the list
    of text and image parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("text", "image_url")
                                         for p in content):
        if all(p["type"] == "text" for p in content):
            return "".join(str(p.get("text", "")) for p in content)
        return [{"type": "text", "text": str(p.get("text", ""))} if p["type"] == "text"
                else _image_part(p, f"{where}[{i}]") for i, p in enumerate(content)]
    raise _BadRequest(f"{where} must be text or a list of text and image_url parts; audio, files and tool calls are "
                      "not supported")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body's messages as {role, content} (developer read as system: chat templates know system). Raises
    _BadRequest (the line's error row) for a missing or malformed list."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("body.messages must be a non-empty list of {role, content} for /v1/chat/completions")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _BadRequest(f"body.messages[{i}] must be an object with a role and a content")
        role = "system" if m["role"] == "developer" else m["role"]  # chat templates know system, not developer
        out.append({"role": role, "content": _content(m.get("content"), f"body.messages[{i}].content")})
    return out


def messages_as_json(rows: list[dict[str, Any]]) -> bool:
    """When a row's messages hold content parts (images), turn every row's messages into JSON text (in place) and
    return True: the staged file's messages column is then text; else leave them and return False."""
    if not any(isinstance(m.get("content"), list) for r in rows for m in r.get("messages") or ()):
        return False
    for r in rows:
        if r.get("messages") is not None:
            r["messages"] = json.dumps(r["messages"], ensure_ascii=False)
    return True
