"""A GGUF file's header read without gguf.GGUFReader: the metadata values asked for, the tensors' names, element
counts and types, and the whole header as engine.loading.gguf_config reads a config from it (GGUFHeader), for the
client's checks before a job (jobs.plan.preflight, jobs.plan.model_fit). Imports no torch. GGUFReader parses every
field, seconds for a 49k-token vocabulary; this reads a few KiB (the keys asked for), or skips over the arrays'
values to the tensor infos. Format: the GGUF spec, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(little-endian, version 2 and 3: uint64 counts and string lengths).
"""

from __future__ import annotations

import math
import mmap
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
                if elem == _GGUF_STRING:
                    _skip_strings(f, count)
                else:
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


def string_starts(buf: Any, offset: int, count: int, byteorder: str = "little") -> list[int]:
    """Where each of `count` GGUF strings (a uint64 length in `byteorder`, then its bytes) laid end to end from byte
    `offset` of the bytes-like `buf` (bytes, an mmap, a uint8 ndarray) starts, and the offset past the last:
    [start_0, ..., start_count], walked without reading the strings (SmolLM2's 49k-token vocabulary in a few ms).
    Raises EOFError, its argument the offset the data would reach, where a string runs past the end of `buf`."""
    starts = [offset]
    with memoryview(buf) as raw, raw.cast("B") as view:  # released on any exit: an mmap then closes
        for _ in range(count):
            if offset + 8 > len(view):
                raise EOFError(offset + 8)
            offset += 8 + int.from_bytes(view[offset:offset + 8], byteorder)
            if offset > len(view):
                raise EOFError(offset)
            starts.append(offset)
    return starts


def _skip_strings(f: IO[bytes], count: int) -> None:
    """Move `f` past an array of `count` GGUF strings (string_starts over a memory map of the file, not a read and a
    seek each). Raises ValueError when the array runs past the end of the file."""
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            end = string_starts(m, f.tell(), count)[-1]
        except EOFError:
            raise ValueError("the GGUF header ends early: the file is cut short") from None
    f.seek(end)


def _unpack(f: IO[bytes], fmt: str) -> Any:
    data = f.read(struct.calcsize(fmt))
    if len(data) != struct.calcsize(fmt):
        raise ValueError("the GGUF header ends early: the file is cut short")
    return struct.unpack(fmt, data)[0]


class Unfollowed(ValueError):
    """A header this scan does not follow (an array of arrays, a value type newer than the spec)."""


class _Field:
    """A metadata value as gguf.GGUFReader's ReaderField offers it to engine.loading.gguf_config: `contents()`, and
    for an array `data` as long as the array. An array is parsed on `contents()` only (a vocabulary: 49k-200k
    strings)."""

    def __init__(self, value: Any = None, array: tuple[str, int, int, int] | None = None) -> None:
        self._value, self._array = value, array  # array: (path, offset of its first element, element type, count)

    @property
    def data(self) -> range:
        return range(self._array[3] if self._array else 1)

    def contents(self) -> Any:
        if self._array is None:
            return self._value
        path, offset, elem, count = self._array
        with open(path, "rb") as f:
            f.seek(offset)
            if elem == _GGUF_STRING:
                return [_read_str(f) for _ in range(count)]
            fmt = "<" + _GGUF_SCALARS[elem]
            return [v for (v,) in struct.iter_unpack(fmt, f.read(count * struct.calcsize(fmt)))]


class _Tensor:
    """A tensor as gguf.GGUFReader's ReaderTensor offers it to engine.loading.gguf_config: `name`, `n_elements`,
    `type_id` (ggml's), `tensor_type` (gguf.GGMLQuantizationType) and `data` (its raw bytes as uint8, read on use:
    the RoPE factor tensors)."""

    def __init__(self, path: str, name: str, dims: list[int], type_id: int, start: int) -> None:
        self.path, self.name, self.dims, self.type_id, self._start = path, name, dims, type_id, start
        self.n_elements = math.prod(dims)

    @property
    def tensor_type(self) -> Any:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id)

    @property
    def data(self) -> Any:
        import numpy as np
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return np.fromfile(self.path, dtype=np.uint8, count=self.n_elements // block * size, offset=self._start)


class GGUFHeader:
    """A GGUF file's header read without gguf.GGUFReader (whose parse of every field takes seconds for a large
    vocabulary), with the `fields` and `tensors` engine.loading.gguf_config reads a config and tensor names from:
    scalars and strings parsed, arrays skipped over and parsed on `contents()` only, tensor infos by name with their
    data read on use. Format: the GGUF spec (little-endian, version 2 and 3; data aligned to `general.alignment`,
    default 32). Raises ValueError for a file that is not GGUF v2/v3, whose header is cut short, or that this scan
    does not follow (an array of arrays, a value type newer than the spec)."""

    def __init__(self, path: str) -> None:
        self.fields: dict[str, _Field] = {}
        infos = []
        with open(path, "rb") as f:
            magic, version = f.read(4), _unpack(f, "<I")
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"{path} is not a GGUF v2/v3 file (magic {magic!r}, version {version})")
            n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
            for _ in range(n_kv):
                key, kind = _read_str(f), _unpack(f, "<I")
                if kind == _GGUF_ARRAY:
                    elem, count = _unpack(f, "<I"), _unpack(f, "<Q")
                    self.fields[key] = _Field(array=(path, f.tell(), elem, count))
                    if elem == _GGUF_STRING:
                        _skip_strings(f, count)
                    elif elem in _GGUF_SCALARS:
                        f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[elem]), os.SEEK_CUR)
                    else:
                        raise Unfollowed(f"{path}: metadata {key} is an array of type {elem}, which this scan does "
                                          "not follow")
                elif kind == _GGUF_STRING or kind in _GGUF_SCALARS:
                    self.fields[key] = _Field(_read_str(f) if kind == _GGUF_STRING
                                              else _unpack(f, "<" + _GGUF_SCALARS[kind]))
                else:
                    raise Unfollowed(f"{path}: metadata {key} has value type {kind}, which this scan does not follow")
            for _ in range(n_tensors):
                name = _read_str(f)
                dims = [_unpack(f, "<Q") for _ in range(_unpack(f, "<I"))]
                infos.append((name, dims, _unpack(f, "<I"), _unpack(f, "<Q")))
            align = int(self.fields["general.alignment"].contents()) if "general.alignment" in self.fields else 32
            data_start = -(-f.tell() // align) * align
        self.tensors = [_Tensor(path, name, dims, kind, data_start + offset) for name, dims, kind, offset in infos]

