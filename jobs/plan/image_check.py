"""A job's image options against its model, on the client before any work (jobs.spec.checked_spec): --image-column for
a text-only model, --max-pixels for a processor without a pixel limit, and --dry-run of a vision-language job (its
forecast does not count image tokens yet). Reads config files only, no torch."""

from __future__ import annotations

import json
import os

from jobs.errors import JobError
from jobs.plan.preflight import client_model_path
from jobs.plan.task_check import model_architecture
from schemas.job_spec import JobSpec

#: The files of a model folder that hold its image processor's settings (transformers' processor and image
#: processor configs; newer versions nest the image processor's inside processor_config.json).
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def takes_images(model: str | None) -> bool | None:
    """Whether the local model (as check_model returns it) is a vision-language model (its registry entry's
    takes_images: engine.model.registry); None for a model at a URL (its worker reads it). Raises JobError as
    jobs.plan.task_check.model_architecture."""
    from engine.model.registry import model_entry

    found = model_architecture(model)
    return None if found is None else model_entry(found[0]).takes_images


def _image_processor_config(folder: str) -> dict[str, object]:
    """The image processor settings of a model folder (the first of _PROCESSOR_FILES that exists; {} when none)."""
    for name in _PROCESSOR_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            return cfg.get("image_processor", cfg) if isinstance(cfg, dict) else {}
    return {}


def check_images(model: str | None, spec: JobSpec) -> None:
    """Refuse, before any work, --image-column (or --max-images-per-row, --max-pixels) for a text-only model (one
    line naming the fix), and --max-pixels for a model whose image processor has no pixel limit to override
    (LLaVA-1.5's CLIP processor resizes and crops every image to one size, e.g. 336x336: its image tokens are
    fixed, 576) or whose limit tokenmill does not set yet. `model` as check_model returns it; a model at a URL is
    checked by its worker (image rows on a text-only model become error rows). Raises JobError (exit 2)."""
    c = spec.columns
    flags = [f for f, v in (("--image-column", c.image), ("--max-images-per-row", c.max_images_per_row),
                            ("--max-pixels", c.max_pixels)) if v is not None]
    if not flags:
        return
    vlm = takes_images(model)
    if vlm is False:
        raise JobError(f"{flags[0]} needs a vision-language model, but --model {client_model_path(model)} is "
                       "text-only (it takes no images); pick one such as LLaVA-1.5, or drop the image options")
    if c.max_pixels is None or vlm is None:
        return
    folder = client_model_path(model) or ""
    try:
        cfg = _image_processor_config(folder) if os.path.isdir(folder) else {}
    except (OSError, ValueError) as e:
        raise JobError(f"--max-pixels: cannot read the image processor config of {folder} ({e})") from e
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
    kind = cfg.get("image_processor_type", "its image processor")
    if "max_pixels" in cfg or "max_pixels" in size:
        raise JobError(f"--max-pixels: overriding the pixel limit of {kind} is not supported yet; drop --max-pixels "
                       "(the processor's own limit applies)")
    crop = cfg.get("crop_size") if isinstance(cfg.get("crop_size"), dict) else size
    shape = f"{crop.get('width', '?')}x{crop.get('height', '?')}" if crop and "width" in crop else "one fixed size"
    raise JobError(f"--max-pixels: {kind} of --model {folder} has no pixel limit: it resizes every image to "
                   f"{shape} pixels, so every image costs the same tokens; drop --max-pixels")


def refuse_image_forecast(spec: JobSpec) -> None:
    """Refuse --dry-run of a job with images (--image-column, or a vision-language --model): its forecast and
    memory fit do not count image tokens yet. Raises JobError (exit 2, one line)."""
    if spec.columns.image is not None or takes_images(spec.model):
        raise JobError("--dry-run does not forecast jobs with images yet (image tokens are not counted); run the job "
                       "on a few rows with --limit to measure it")
