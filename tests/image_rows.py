"""Helpers of the image job tests (tests/pipeline/test_image_shards.py, tests/jobs/test_image_jobs.py,
tests/jobs/test_image_limits.py): the tiny LLaVA and Qwen2.5-VL folders of tests/engine/llava_models.py and
qwen_vl_models.py, real pictures drawn with Pillow in several sizes, modes and formats, and a Parquet written in
Hugging Face datasets' Image layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa

sys.path.append(str(Path(__file__).resolve().parent / "engine"))  # the engine tests' helper modules

from llava_models import build_llava, data_url, encoded, picture  # noqa: E402
from qwen_vl_models import build_qwen_vl  # noqa: E402

__all__ = ["IMAGE_FEATURE", "data_url", "encoded", "hf_image_table", "llava_folder", "picture", "pictures",
           "qwen_vl_folder"]

#: Hugging Face datasets' Image feature column: struct<bytes: binary, path: string>.
IMAGE_FEATURE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def llava_folder(folder: Path, gguf_path: str) -> str:
    """The tiny LLaVA-1.5 (16 image tokens per image) saved in `folder` with its processor; returns its path."""
    from engine.text.tokenizer import Tokenizer

    build_llava(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    return str(folder)


def qwen_vl_folder(folder: Path, gguf_path: str) -> str:
    """The tiny Qwen2.5-VL (dynamic resolution: 8x8 to 24x24 patches of 4 pixels, 2x2 merged) saved in `folder`
    with its processor; returns its path."""
    from engine.text.tokenizer import Tokenizer

    build_qwen_vl(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    return str(folder)


def pictures() -> list[bytes]:
    """Six encoded pictures: RGB PNG 64x48, L JPEG 80x80, RGBA PNG 40x90, CMYK JPEG 120x60, P PNG 56x56, RGB JPEG
    200x150."""
    kinds = [("RGB", (64, 48), "PNG"), ("L", (80, 80), "JPEG"), ("RGBA", (40, 90), "PNG"),
             ("CMYK", (120, 60), "JPEG"), ("P", (56, 56), "PNG"), ("RGB", (200, 150), "JPEG")]
    return [encoded(picture(mode, size, seed), fmt) for seed, (mode, size, fmt) in enumerate(kinds)]


def hf_image_table(columns: dict[str, list], image_column: str) -> pa.Table:
    """A table as Hugging Face `datasets` writes one with an Image feature (Dataset.to_parquet): the image column
    is struct<bytes: binary, path: string> and the schema metadata `huggingface` names the features, the image
    column's as {"_type": "Image"} (a list column's as a list of one). Text columns are Value("string")."""
    fields, features = [], {}
    for name, values in columns.items():
        if name != image_column:
            fields.append((name, pa.string()))
            features[name] = {"dtype": "string", "_type": "Value"}
        elif values and any(isinstance(v, list) for v in values):
            fields.append((name, pa.list_(IMAGE_FEATURE)))
            features[name] = [{"_type": "Image"}]
        else:
            fields.append((name, IMAGE_FEATURE))
            features[name] = {"_type": "Image"}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    return pa.Table.from_pydict(columns, schema=pa.schema(fields, metadata=meta))
