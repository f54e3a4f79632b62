"""The lines of a JSONL batch file as bytes, for jobs.formats.openai_batch to decode and parse one at a time (one
line of invalid UTF-8 is that line's error row, not the whole file's)."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from typing import IO

from jobs.errors import JobError

# Byte order marks of the encodings a JSONL file is not in (UTF-8's own is skipped). UTF-32 first: its LE mark
# starts with UTF-16's.
_OTHER_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
               (codecs.BOM_UTF16_BE, "UTF-16"))


def batch_file_lines(f: IO[bytes], url: str) -> Iterator[bytes]:
    """The lines of a batch file opened in binary, as bytes, for parse_batch_lines to decode one by one: one line of
    invalid UTF-8 is that line's error row, not the whole file's. A leading UTF-8 byte order mark (what Windows
    editors write) is skipped. Line ends are \\n, \\r\\n or \\r, as in Python's text mode, so line numbers match
    an editor's. Raises JobError (exit 2) when the file starts with a UTF-16 or UTF-32 byte order mark: every line
    would be garbage."""
    first = True
    for raw in f:
        if first:
            first = False
            for bom, name in _OTHER_BOMS:
                if raw.startswith(bom):
                    raise JobError(f"the OpenAI batch file {url!r} is {name} encoded (it starts with a {name} byte "
                                   f"order mark); save it as UTF-8 (e.g. `iconv -f {name} -t UTF-8`)")
            raw = raw.removeprefix(codecs.BOM_UTF8)
        yield from raw.splitlines() or [raw]
