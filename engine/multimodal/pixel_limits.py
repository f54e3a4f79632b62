"""Pixel limits of a vision-language model's images (EngineConfig.max_image_pixels / min_image_pixels; a job's
--max-pixels / --min-pixels) as the parameters of the model's own Hugging Face image processor: the processor then
resizes, tiles and counts placeholders as it always does, with those values (never resizing by hand). Which parameter
applies is read from the processor itself, family by family (vLLM passes the same limits to the same processors as
mm_processor_kwargs):

- dynamic resolution (Qwen2-VL / Qwen2.5-VL's Qwen2VLImageProcessor: patch_size, merge_size and `size`
  {"shortest_edge", "longest_edge"} in pixels, HF's smart_resize): the limits are `size` itself. The smallest image
  it makes is one merged patch, (patch_size * merge_size)^2 pixels: a lower --max-pixels cannot be honoured.
- tiling (Idefics3 / SmolVLM: `size` {"longest_edge"} and tiles of `max_image_size` {"longest_edge"}): every image
  is resized to that longest edge, then cut into tiles; --max-pixels N sets the longest edge to the largest multiple
  of the tile side whose square is at most N (so the resized image holds at most N pixels). Below one tile it cannot
  be honoured; the longest edge is the only size, so there is no --min-pixels.
- anyres (LLaVA-NeXT: `image_grid_pinpoints`): an image is resized into the best of the pinpoint resolutions; the
  limits keep the pinpoints of at least --min-pixels and at most --max-pixels pixels. The model's features follow
  the same pinpoints (its config's image_grid_pinpoints: LLMEngine builds it with the kept ones).
- one fixed size (LLaVA-1.5's CLIPImageProcessor: resize, then crop_size): every image is that size; a limit it
  meets changes nothing, one it does not is refused.

No torch; the processor object only (transformers' image processors, Pillow backends).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: The names a refusal gives the two limits: the engine's fields (a job says --max-pixels / --min-pixels).
ENGINE_NAMES = ("max_image_pixels", "min_image_pixels")


def _get(size: object, key: str) -> Any:
    """A value of an image processor's size dict (a dict or transformers' SizeDict); None when absent."""
    if isinstance(size, Mapping):
        return size.get(key)
    return getattr(size, key, None)


def _kind(ip: Any) -> str:
    """The image processor's class name less its backend suffix (Qwen2VLImageProcessorPil: Qwen2VLImageProcessor)."""
    return type(ip).__name__.removesuffix("Pil").removesuffix("Fast")


def _fixed_area(ip: Any) -> tuple[int, int] | None:
    """(height, width) every image is resized or cropped to by a fixed-size processor, or None when the size varies."""
    crop = getattr(ip, "crop_size", None)
    if getattr(ip, "do_center_crop", False) and _get(crop, "height") and _get(crop, "width"):
        return int(_get(crop, "height")), int(_get(crop, "width"))
    size = getattr(ip, "size", None)
    if _get(size, "height") and _get(size, "width"):
        return int(_get(size, "height")), int(_get(size, "width"))
    return None


def pixel_limit_kwargs(ip: Any, max_pixels: int | None, min_pixels: int | None,
                       names: tuple[str, str] = ENGINE_NAMES) -> dict[str, Any]:
    """The keyword arguments of HF image processor `ip`'s own parameters that apply the pixel limits (`max_pixels`,
    `min_pixels`: width x height after resizing, or None for the processor's own): {"size": {...}} (dynamic
    resolution, tiling), {"image_grid_pinpoints": [[h, w], ...]} (anyres), or {} when nothing changes (no limit
    given; a fixed-size processor within them). Build the processor anew with them (`type(ip).from_dict(
    ip.to_dict(), **kwargs)`). `names`: how a refusal names the two limits.

    Raises ValueError (one line naming the limit and the fix) for a limit below 1, a min above the max, or a value
    the processor cannot honour: below the smallest image it makes (one merged patch, one tile, the smallest
    pinpoint, the fixed size), a minimum on a processor without one, or a processor with no pixel parameter."""
    max_name, min_name = names
    for name, value in ((max_name, max_pixels), (min_name, min_pixels)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 (pixels: width x height), got {value!r}")
    if max_pixels is None and min_pixels is None:
        return {}
    kind = _kind(ip)
    size = getattr(ip, "size", None)
    if getattr(ip, "merge_size", None) and _get(size, "longest_edge") and _get(size, "shortest_edge"):
        return _dynamic(ip, kind, size, max_pixels, min_pixels, names)
    tile = _get(getattr(ip, "max_image_size", None), "longest_edge")
    if tile and getattr(ip, "do_image_splitting", False) and _get(size, "longest_edge"):
        return _tiled(kind, int(tile), max_pixels, min_pixels, names)
    pinpoints = [(int(h), int(w)) for h, w in getattr(ip, "image_grid_pinpoints", None) or ()]
    if pinpoints:
        return _anyres(kind, pinpoints, max_pixels, min_pixels, names)
    if tile:  # tiles without splitting: every image is one tile
        return _fixed(kind, (int(tile), int(tile)), max_pixels, min_pixels, names)
    fixed = _fixed_area(ip)
    if fixed is not None:
        return _fixed(kind, fixed, max_pixels, min_pixels, names)
    given = max_name if max_pixels is not None else min_name
    raise ValueError(f"{given}: the model's image processor ({kind}) has no pixel limit tokenmill knows how to set; "
                     f"drop {given} (its own sizes apply)")


def _dynamic(ip: Any, kind: str, size: object, max_pixels: int | None, min_pixels: int | None,
             names: tuple[str, str]) -> dict[str, Any]:
    """Qwen2-VL's size {"shortest_edge": min pixels, "longest_edge": max pixels} (HF smart_resize's bounds)."""
    unit = int(ip.patch_size) * int(ip.merge_size)
    high = int(_get(size, "longest_edge")) if max_pixels is None else max_pixels
    low = int(_get(size, "shortest_edge")) if min_pixels is None else min_pixels
    if high < unit * unit:
        raise ValueError(f"{names[0]} {high} is below the smallest image {kind} makes, one merged patch of {unit}x"
                         f"{unit} = {unit * unit} pixels; give at least {unit * unit}")
    if low > high:
        which = names[1] if min_pixels is not None else f"the processor's min_pixels {low}"
        raise ValueError(f"{names[0]} {high} is below {which}: the image processor's pixel range would be empty; "
                         f"give {names[0]} >= {low}" + ("" if min_pixels is not None else f" or lower {names[1]}"))
    return {"size": {"shortest_edge": low, "longest_edge": high}}


def _tiled(kind: str, tile: int, max_pixels: int | None, min_pixels: int | None,
           names: tuple[str, str]) -> dict[str, Any]:
    """Idefics3 / SmolVLM's size {"longest_edge": E}, E the largest multiple of the tile side with E^2 <= max_pixels."""
    if min_pixels is not None:
        raise ValueError(f"{names[1]}: {kind} resizes every image to one longest edge (then tiles of {tile}x{tile}), "
                         f"so it has no lower pixel limit; drop {names[1]} ({names[0]} sets that edge)")
    if max_pixels is None:
        return {}
    edge = math.isqrt(max_pixels) // tile * tile
    if edge < tile:
        raise ValueError(f"{names[0]} {max_pixels} is below one {tile}x{tile} tile of {kind} ({tile * tile} pixels, "
                         f"the smallest image it makes); give at least {tile * tile}")
    return {"size": {"longest_edge": edge}}


def _anyres(kind: str, pinpoints: list[tuple[int, int]], max_pixels: int | None, min_pixels: int | None,
            names: tuple[str, str]) -> dict[str, Any]:
    """LLaVA-NeXT's image_grid_pinpoints within [min_pixels, max_pixels] (in their order)."""
    kept = [(h, w) for h, w in pinpoints if (max_pixels is None or h * w <= max_pixels)
            and (min_pixels is None or h * w >= min_pixels)]
    if not kept:
        areas = sorted(h * w for h, w in pinpoints)
        bounds = " and ".join(f"{n} {v}" for n, v in zip(names, (max_pixels, min_pixels), strict=True)
                              if v is not None)
        raise ValueError(f"{bounds} leave none of {kind}'s image_grid_pinpoints ({len(pinpoints)} resolutions of "
                         f"{areas[0]} to {areas[-1]} pixels); give {names[0]} >= {areas[0]}"
                         + (f" and {names[1]} <= {areas[-1]}" if min_pixels is not None else ""))
    return {} if kept == pinpoints else {"image_grid_pinpoints": [list(p) for p in kept]}


def _fixed(kind: str, shape: tuple[int, int], max_pixels: int | None, min_pixels: int | None,
           names: tuple[str, str]) -> dict[str, Any]:
    """A processor that makes every image height x width: limits it meets change nothing."""
    h, w = shape
    if max_pixels is not None and max_pixels < h * w:
        raise ValueError(f"{names[0]} {max_pixels} is below the one size {kind} makes every image, {w}x{h} = "
                         f"{h * w} pixels (the model takes no smaller); give at least {h * w}, or drop {names[0]}")
    if min_pixels is not None and min_pixels > h * w:
        raise ValueError(f"{names[1]} {min_pixels} is above the one size {kind} makes every image, {w}x{h} = "
                         f"{h * w} pixels; give at most {h * w}, or drop {names[1]}")
    return {}


def limited(ip: Any, kwargs: dict[str, Any]) -> Any:
    """The image processor `ip` built anew with `kwargs` (pixel_limit_kwargs) over its own settings; `ip` itself
    when there are none."""
    return type(ip).from_dict(ip.to_dict(), **kwargs) if kwargs else ip
