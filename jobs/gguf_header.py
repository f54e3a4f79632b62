"""A GGUF file's header read without gguf.GGUFReader: the metadata values asked for and the tensors' names, element
counts and types, for the client's checks before a job (jobs.preflight, jobs.model_fit). GGUFReader parses every
field, seconds for a 49k-token vocabulary; this reads a few KiB (the keys asked for), or skips over the values to
the tensor infos. Format: the GGUF spec, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian,
version 2 and 3: uint64 counts and string lengths).
"""

from __future__ import annotations

import math
import os
import struct
from typing import IO, Any

# GGUF metadata value types (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): fixed sizes by struct code.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: str, keys: set[str]) -> dict[str, Any]:
    """The scalar metadata values of `keys` in the GGUF file at `path` (those it has), read from its header only.

    The header's key/value pairs are scanned in order and the scan stops once every key is found: models written
    by llama.cpp put the `{arch}.*` hyperparameters before the tokenizer's vocabulary arrays, so this reads a few
    KiB where gguf.GGUFReader parses every field (seconds for a 49k-token vocabulary). Format: the GGUF spec
    (little-endian, version 2 and 3: uint64 counts and string lengths). A header this scan does not follow (an
    array of arrays, a value type newer than the spec) is read with gguf.GGUFReader instead. Raises ValueError for a
    file that is not GGUF v2/v3 or whose header is cut short.
    """
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        magic, version = f.read(4), _unpack(f, "<I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        _unpack(f, "<Q")  # tensor count
        for _ in range(_unpack(f, "<Q")):
            key = _read_str(f)
            kind = _unpack(f, "<I")
            if kind not in _GGUF_SCALARS and kind not in (_GGUF_STRING, _GGUF_ARRAY):
                return _gguf_reader_metadata(path, keys)
            if kind == _GGUF_ARRAY:
                elem, count = _unpack(f, "<I"), _unpack(f, "<Q")
                if elem not in _GGUF_SCALARS and elem != _GGUF_STRING:
                    return _gguf_reader_metadata(path, keys)
                for _ in range(count) if elem == _GGUF_STRING else ():
                    f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
                if elem != _GGUF_STRING:
                    f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[elem]), os.SEEK_CUR)
                continue
            value = _read_str(f) if kind == _GGUF_STRING else _unpack(f, "<" + _GGUF_SCALARS[kind])
            if key in keys:
                found[key] = value
                if len(found) == len(keys):
                    break
    return found


def _gguf_reader_metadata(path: str, keys: set[str]) -> dict[str, Any]:
    """gguf_metadata's values read by gguf.GGUFReader (every field: slower, for headers the scan does not follow)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    return {k: fields[k].contents() for k in keys if k in fields}


def _read_str(f: IO[bytes]) -> str:
    """A GGUF string: uint64 length, then UTF-8 bytes. Raises ValueError for a length past the end of the file."""
    length = _unpack(f, "<Q")
    if length > os.fstat(f.fileno()).st_size - f.tell():
        raise ValueError("the GGUF header holds a string longer than the file: the file is damaged")
    return f.read(length).decode("utf-8", "replace")


def _unpack(f: IO[bytes], fmt: str) -> Any:
    data = f.read(struct.calcsize(fmt))
    if len(data) != struct.calcsize(fmt):
        raise ValueError("the GGUF header ends early: the file is cut short")
    return struct.unpack(fmt, data)[0]


def gguf_tensor_infos(path: str) -> list[tuple[str, int, int]] | None:
    """(name, element count, ggml type id) of every tensor of the GGUF file at `path`, from its header (every
    metadata value skipped over, not parsed), or None for a header this scan does not follow (an array of arrays,
    a value type newer than the spec). Raises ValueError for a file that is not GGUF v2/v3 or whose header is cut
    short."""
    with open(path, "rb") as f:
        magic, version = f.read(4), _unpack(f, "<I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
        for _ in range(n_kv):
            f.seek(_unpack(f, "<Q"), os.SEEK_CUR)  # the key
            kind = _unpack(f, "<I")
            if kind == _GGUF_ARRAY:
                elem, count = _unpack(f, "<I"), _unpack(f, "<Q")
                if elem == _GGUF_STRING:
                    for _ in range(count):
                        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
                elif elem in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[elem]), os.SEEK_CUR)
                else:
                    return None
            elif kind == _GGUF_STRING:
                f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
            elif kind in _GGUF_SCALARS:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), os.SEEK_CUR)
            else:
                return None
        out = []
        for _ in range(n_tensors):
            name = _read_str(f)
            dims = [_unpack(f, "<Q") for _ in range(_unpack(f, "<I"))]
            kind = _unpack(f, "<I")
            _unpack(f, "<Q")  # offset of the data
            out.append((name, math.prod(dims), kind))
    return out
