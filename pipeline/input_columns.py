"""What an input column must hold, checked on the files' schemas before any work (pipeline.input.validate_columns):
prompts are text or chat messages, a score job's text pairs are text; a column of another type is refused with the
pyarrow that converts it (text_fix)."""

from __future__ import annotations

import pyarrow as pa

from pipeline.config import InputError


def is_text_type(t: pa.DataType) -> bool:
    """Whether an Arrow column type holds text: string, large_string, string_view, or a dictionary of one (what
    pandas writes for a categorical column, polars for Categorical and Enum)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list_type(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)
            or pa.types.is_large_list_view(t) or pa.types.is_fixed_size_list(t))


def _is_messages_type(t: pa.DataType) -> bool:
    """A list of structs (chat messages; any Arrow list type), or text (JSON, parsed per row)."""
    if _is_list_type(t):
        return pa.types.is_struct(t.value_type)
    return is_text_type(t)


def text_fix(column: str, t: pa.DataType) -> str:
    """Python that turns column `column` (of type `t`) of a pyarrow Table named `table` into text, for an error
    message: a cast where pyarrow can cast `t` to string, else one text per row built from to_pylist() (lists
    joined by newlines, structs and maps as JSON). The expression evaluates to the new table."""
    try:
        pa.array([], t).cast(pa.string())  # pyarrow refuses nested types (lists, structs) here, as at run time
        values = f"table[{column!r}].cast(pa.string())"
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        row = ('"\\n".join(map(str, v))' if _is_list_type(t)
               else "json.dumps(v, default=str, ensure_ascii=False)")
        values = (f"pa.array([None if v is None else {row} for v in table[{column!r}].to_pylist()], "
                  "pa.string())")
    return f"table.set_column(table.schema.get_field_index({column!r}), {column!r}, {values})"


def check_column_type(url: str, column: str, t: pa.DataType, messages: bool) -> None:
    """Raise InputError when a prompt column is not text (or a messages column not a list of {role, content});
    the message says how to convert the column (text_fix), or which option reads it as it is."""
    if pa.types.is_null(t) or (_is_messages_type(t) if messages else is_text_type(t)):
        return  # an all-null column: every row becomes an error row that says so
    if messages:
        raise InputError(f"column {column!r} of {url} holds {t}, not chat messages: store each row as a list of "
                         "{role, content} structs, or as JSON text of one (json.dumps of the list), or name another "
                         "column with --messages-column")
    if _is_list_type(t) and pa.types.is_struct(t.value_type):
        raise InputError(f"column {column!r} of {url} holds {t}: chat messages, not text. Rename it to messages (the "
                         f"default --messages-column), or pass --messages-column {column} with a --prompt-column "
                         "that names no column of the file")
    raise InputError(f"column {column!r} of {url} holds {t}, not text (string). Convert it before the job (with "
                     f"pyarrow: `table = {text_fix(column, t)}`), or name another column with --prompt-column / "
                     "--messages-column")


def check_pair_column(url: str, column: str, schema: pa.Schema) -> None:
    """Raise InputError when a score job's text pair column (--text-pair-column) is missing from the file at `url`
    (naming the columns found) or holds no text (naming the conversion)."""
    if column not in schema.names:
        raise InputError(f"text pair column {column!r} not found in {url}; columns found: {schema.names}. Name the "
                         "column of each row's second text with --text-pair-column")
    t = schema.field(column).type
    if not (pa.types.is_null(t) or is_text_type(t)):
        raise InputError(f"text pair column {column!r} of {url} holds {t}, not text (string). Convert it before the "
                         f"job (with pyarrow: `table = {text_fix(column, t)}`), or name another --text-pair-column")


def _is_image_type(t: pa.DataType) -> bool:
    """Bytes, text (a path or URL), or a struct with a `bytes` or `path` field (HF datasets' Image feature)."""
    if pa.types.is_struct(t):
        return t.get_field_index("bytes") >= 0 or t.get_field_index("path") >= 0
    return (is_text_type(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)
            or pa.types.is_fixed_size_binary(t))


def check_image_column(url: str, column: str, schema: pa.Schema) -> None:
    """Raise InputError when the image column (--image-column) is missing from the file at `url` (naming the
    columns found) or holds neither images (bytes, {bytes, path} structs, paths or URLs as text) nor lists of
    them."""
    if column not in schema.names:
        raise InputError(f"image column {column!r} not found in {url}; columns found: {schema.names}. Name the "
                         "column of each row's images with --image-column")
    t = schema.field(column).type
    if not (pa.types.is_null(t) or _is_image_type(t) or (_is_list_type(t) and _is_image_type(t.value_type))):
        raise InputError(f"image column {column!r} of {url} holds {t}, not images: store image bytes (binary), "
                         "{bytes, path} structs (Hugging Face datasets' Image), paths or URLs as text, or a list of "
                         "those per row; or name another column with --image-column")
