"""A shard's images: the image column's cells (--image-column) and the image parts of chat messages, read into the
engine's image prompt forms (engine.multimodal: {"prompt" | "messages", "images": [...]}) before any engine runs.

What a cell of the image column may hold (one image, or a list of them: several images per row):

- image bytes (a binary column: PNG, JPEG, ... whatever Pillow opens);
- Hugging Face datasets' Image feature, the struct {bytes, path}: the bytes when set, else the file at `path`;
- text: a `data:` URL (kept as it is), a local path or an fsspec URL (s3://..., https://...), read through fsspec
  with the storage layer's retries (pipeline.storage.retry_transient). A relative path is taken relative to the
  folder of the shard's input file.

Chat messages (the messages column, OpenAI batch lines) may hold image parts: {"type": "image_url", "image_url":
{"url": ...}} with a data: URL (kept) or a path / URL (read here, as above), and bare {"type": "image"} parts, which
take the row's image column images in order. Messages with no image part get the column's images at the start of
their first user message (LLaVA's layout: images, then the text).

A row whose image cannot be read (not found, denied, not a URL fsspec knows), or which holds more than
--max-images-per-row images, becomes an error row naming the image and the fix; the shard goes on. Bytes Pillow cannot
decode are found by the engine (the row's error output). A store that keeps failing after the retries fails the
shard (ShardError), so the rerun reads the images again.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from typing import Any

import fsspec
import pyarrow as pa

from pipeline.shard_rows import ShardError, ShardRows
from pipeline.storage import RETRY_ATTEMPTS, is_transient, retry_transient

#: Content part types of a chat message that are images (OpenAI's image_url, HF's image): engine.multimodal's.
IMAGE_PARTS = ("image", "image_url")


def cell_images(value: object) -> list[Any]:
    """The images of one image column cell: [] for null, the items of a list, else [value]."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _image_parts(prompt: object) -> list[dict[str, Any]]:
    """The image content parts of a messages list (none for any other prompt)."""
    if not isinstance(prompt, list):
        return []
    return [p for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") in IMAGE_PARTS]


def _resolve(path: str, base_url: str) -> str:
    """`path` as an fsspec URL: a URL or absolute path as it is, a relative path under the folder of `base_url`."""
    if "://" in path or os.path.isabs(path):
        return path
    return posixpath.join(base_url.rsplit("/", 1)[0], path)


@retry_transient
def _fetch(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def read_image(url: str) -> bytes:
    """The bytes of the image file at `url` (a local path or fsspec URL). Raises ValueError (one line: the row's
    error) when it cannot be read, ShardError when the store kept failing through the retries."""
    try:
        return _fetch(url)
    except Exception as e:  # any reader failure is this image's; a store that keeps failing is the shard's
        if is_transient(e):
            raise ShardError(f"cannot read image {url}: the store kept failing ({e}) through {RETRY_ATTEMPTS} tries; "
                             "run the job again (committed rows are kept)") from e
        raise ValueError(f"cannot read image {url} ({type(e).__name__}: {str(e).rstrip('.')}); fix the path or URL, "
                         "or the access to it") from e


def image_source(value: object, base_url: str) -> bytes | str:
    """An image of the image column as the engine takes it: bytes, or a data: URL. Raises ValueError (one line) for
    a struct with neither bytes nor path, another type, or a file that cannot be read (read_image)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        if not value.get("path"):
            raise ValueError("an image struct has neither bytes nor path; store the image's bytes or its path")
        value = value["path"]
    if not isinstance(value, str) or not value:
        raise ValueError(f"an image cell holds {type(value).__name__}; store image bytes, {{bytes, path}}, or a "
                         "path or URL as text")
    return value if value.startswith("data:") else read_image(_resolve(value, base_url))


def _read_parts(messages: list[Any], base_url: str) -> list[Any]:
    """`messages` with each image part that names a path or URL (not a data: URL) read into {"type": "image",
    "image": bytes}; the other parts as they are."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            ref = None
            if isinstance(p, dict) and p.get("type") == "image_url":
                ref = p.get("image_url")
                ref = ref.get("url") if isinstance(ref, dict) else ref
            elif isinstance(p, dict) and p.get("type") == "image":
                ref = p.get("image") if p.get("image") is not None else p.get("url")
            if isinstance(ref, str) and ref and not ref.startswith("data:"):
                p = {"type": "image", "image": read_image(_resolve(ref, base_url))}
            parts.append(p)
        out.append({**m, "content": parts})
    return out


def _with_images_first(messages: list[Any], n: int) -> list[Any]:
    """`messages` with `n` bare image parts at the start of the first user message (its text kept as a text part
    after them), for messages with no image part: the placement LLaVA-style templates expect. Raises ValueError
    when there is no user message."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            return [*messages[:i], {**m, "content": [{"type": "image"}] * n + text}, *messages[i + 1:]]
    raise ValueError("the messages have no user message to put the image column's images in; add one")


def _image_prompt(prompt: object, images: list[bytes | str], base_url: str) -> object:
    """The engine's image prompt of a row's `prompt` (text or messages) and its column `images`."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "images": images} if images else prompt
    if not isinstance(prompt, list):
        return prompt  # null or malformed: row_requests says what is wrong
    messages = _read_parts(prompt, base_url)
    if images and not _image_parts(messages):
        messages = _with_images_first(messages, len(images))
    return {"messages": messages, "images": images}


def image_rows(rows: ShardRows, base_url: str, image_column: str | None,
               max_images: int | None) -> tuple[ShardRows, list[int | None]]:
    """(`rows` with each row that has images as an engine image prompt, bad ones as error rows; the images of each
    row, None for a row without any). `base_url`: the shard's input file (relative paths are under its folder);
    `max_images`: --max-images-per-row (None: no limit). Rows without images are returned as they are. Raises
    ShardError when the store kept failing (read_image)."""
    cells = rows.images if rows.images is not None else [None] * len(rows.prompts)
    counts = [len(cell_images(c)) + len(_image_parts(p)) or None for c, p in zip(cells, rows.prompts, strict=True)]
    if not any(counts):
        return rows, counts
    prompts, errors = list(rows.prompts), list(rows.errors or [None] * len(rows.prompts))
    for k, n in enumerate(counts):
        if not n or errors[k] is not None or prompts[k] is None:
            continue
        if max_images is not None and n > max_images:
            errors[k] = (f"this row has {n} images, more than --max-images-per-row {max_images}; split the row or "
                         "raise --max-images-per-row")
            continue
        try:
            images = [image_source(v, base_url) for v in cell_images(cells[k])]
            prompts[k] = _image_prompt(prompts[k], images, base_url)
        except ValueError as e:
            errors[k] = f"{image_column or 'messages'}: {e}"
    return ShardRows(rows.ids, prompts, rows.overrides, errors, rows.positions, rows.pairs, rows.images), counts


def with_image_counts(to_table: Callable[..., pa.Table], counts: dict[int, int | None]) -> Callable[..., pa.Table]:
    """A checkpoint part builder (pipeline.checkpoint.PartTableFn) that fills the part's `images` column from
    `counts` (shard position -> images of the row)."""
    def table(rows: list[tuple[int, Any]], model: str, model_fingerprint: str | None = None) -> pa.Table:
        part = to_table(rows, model, model_fingerprint)
        i = part.schema.get_field_index("images")
        return part.set_column(i, part.schema.field(i), pa.array([counts.get(k) for k, _ in rows], pa.int32()))

    return table
