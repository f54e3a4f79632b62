"""A job's image options against its model, on the client before any work (jobs.spec.checked_spec): --image-column for
a text-only model (config files only, no torch), and --max-pixels / --min-pixels the model's image processor cannot
honour (its HF image processor loaded here, through transformers)."""

from __future__ import annotations

from jobs.errors import JobError
from jobs.plan.preflight import client_model_path
from jobs.plan.task_check import model_architecture
from schemas.job_spec import JobSpec


def takes_images(model: str | None) -> bool | None:
    """Whether the local model (as check_model returns it) is a vision-language model (its registry entry's
    takes_images: engine.model.registry); None for a model at a URL (its worker reads it). Raises JobError as
    jobs.plan.task_check.model_architecture."""
    from engine.model.registry import model_entry

    found = model_architecture(model)
    return None if found is None else model_entry(found[0]).takes_images


def check_images(model: str | None, spec: JobSpec) -> None:
    """Refuse, before any work, --image-column (or --max-images-per-row, --max-pixels, --min-pixels) for a text-only
    model (one line naming the fix), and pixel limits the model's image processor cannot honour (check_pixel_limits:
    below the smallest image it makes, such as LLaVA-1.5's one size, or a minimum where it has none). `model` as
    check_model returns it; a model at a URL is checked by its worker (image rows on a text-only model become error
    rows; limits it cannot honour fail its load). Raises JobError (exit 2)."""
    c = spec.columns
    flags = [f for f, v in (("--image-column", c.image), ("--max-images-per-row", c.max_images_per_row),
                            ("--max-pixels", c.max_pixels), ("--min-pixels", c.min_pixels)) if v is not None]
    if not flags:
        return
    vlm = takes_images(model)
    if vlm is False:
        raise JobError(f"{flags[0]} needs a vision-language model, but --model {client_model_path(model)} is "
                       "text-only (it takes no images); pick one such as LLaVA-1.5, or drop the image options")
    if (c.max_pixels is None and c.min_pixels is None) or vlm is None:
        return
    check_pixel_limits(client_model_path(model) or "", c.max_pixels, c.min_pixels)


def check_pixel_limits(folder: str, max_pixels: int | None, min_pixels: int | None) -> None:
    """Refuse pixel limits the image processor of the local model `folder` cannot honour: the engine's own rule
    (engine.multimodal.pixel_limits.pixel_limit_kwargs) on the same processor, naming --max-pixels / --min-pixels.
    The one client check that loads transformers (and so torch): only a job with pixel limits pays it. Raises
    JobError (exit 2, one line)."""
    import transformers

    from engine.multimodal.pixel_limits import pixel_limit_kwargs

    try:
        processor = transformers.AutoImageProcessor.from_pretrained(folder)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise JobError(f"--max-pixels / --min-pixels: cannot load the image processor of {folder} "
                       f"({type(e).__name__}: {e}); check its preprocessor_config.json / processor_config.json") from e
    try:
        pixel_limit_kwargs(processor, max_pixels, min_pixels, names=("--max-pixels", "--min-pixels"))
    except ValueError as e:
        raise JobError(str(e)) from e
