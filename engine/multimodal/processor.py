"""An image prompt into the token ids it runs as and its images' MultiModalItems, through the model's own Hugging Face
processor (AutoProcessor of the model folder: LlavaProcessor over CLIPImageProcessor's Pillow backend, LLaVA-NeXT's
anyres, Idefics3's and SmolVLM's tiling processors, Gemma3Processor, Qwen2-VL's dynamic-resolution one; never
hand-written resizing or normalising): the chat template (the tokenizer's, else the processor's) renders the messages
with one image placeholder per image, the image processor makes each image's pixel_values (one image at a time: no
batch padding), and each placeholder is replaced by the token ids of the processor's own replacement text
(`replace_image_token`: LLaVA's image token repeated once per feature row; Idefics3's tiles, each a run of image
tokens after its <fake_token_around_image><row_r_col_c> tags, then the global image's; Gemma 3's <start_of_image>
placeholder by a run of soft tokens between it and <end_of_image>, in newlines that join the text around it
(engine.multimodal.rejoin); Qwen2-VL's one run per image of its merged patches), exactly as the processor's
`__call__` expands its text. As vLLM's multimodal processing, the text and the images are processed apart and merged
by the placeholders' offsets (vLLM's design; no code of it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.multimodal.anyres import anyres_tokens
from engine.multimodal.inputs import MultiModalItem, image_messages, image_size, load_image
from engine.multimodal.rejoin import rejoin
from engine.vision_config import QwenVisionConfig, VisionConfig

if TYPE_CHECKING:
    import numpy as np
    import torch

    from engine.text.tokenizer import Tokenizer


def mm_hash(pixel_values: torch.Tensor, grid_thw: tuple[int, ...] | None = None,
            image_size: tuple[int, int] | None = None) -> str:
    """Content hash (BLAKE2b-128, hex) of an image's pixel_values [channels, H, W] (or patches and their grid_thw, or
    LLaVA-NeXT's tiles [tiles, channels, H, W] and the original image_size): its shape, dtype, grid, size and bytes."""
    array = pixel_values.detach().cpu().contiguous().numpy()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{array.dtype}{array.shape}{grid_thw or ''}{'' if image_size is None else image_size}".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def image_only_processor(path: str) -> Any:
    """The HF processor of the folder at `path` (its processor_class, from processor_config.json or
    preprocessor_config.json) built without its video processor, whose torchvision backend tokenmill does not install
    (transformers' AutoProcessor raises ImportError for Qwen2-VL's): the Pillow image processor, the tokenizer and the
    chat template (chat_template.jinja or chat_template.json) and processor_config.json's settings, with the processor
    class's own text expansion. Raises ValueError when no processor class is named, ImportError when the class needs
    more than its video half (SmolVLMProcessor needs num2words, a dependency of tokenmill)."""
    import json
    from pathlib import Path

    import transformers

    configs = _processor_configs(path)
    names = [c.get("processor_class") for c in configs]
    name = next((n for n in names if n), None)
    if name is None or not hasattr(transformers, name):
        raise ValueError(f"{path} names no transformers processor class ({names})")
    base = getattr(transformers, name)
    # the processor's own settings (SmolVLM's image_seq_len: the image tokens per tile), as from_pretrained passes them
    own = {k: v for k, v in (configs[0] if Path(path, "processor_config.json").is_file() else {}).items()
           if k not in ("processor_class", "image_processor", "video_processor", "tokenizer", "chat_template")}

    class ImageOnly(base):  # the class's check of a None video processor looks up the torchvision-only mapping
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    template = None  # the processor's chat template (chat_template.jinja, or the older chat_template.json)
    if Path(path, "chat_template.jinja").is_file():
        template = Path(path, "chat_template.jinja").read_text()
    elif Path(path, "chat_template.json").is_file():
        template = json.loads(Path(path, "chat_template.json").read_text()).get("chat_template")
    return ImageOnly(image_processor=transformers.AutoImageProcessor.from_pretrained(path),
                     tokenizer=transformers.AutoTokenizer.from_pretrained(path), video_processor=None,
                     chat_template=template, **own)


def _processor_configs(path: str) -> list[dict]:
    """The folder's processor_config.json and preprocessor_config.json, parsed, those present in that order."""
    import json
    from pathlib import Path

    return [json.loads(f.read_text()) for f in
            (Path(path, "processor_config.json"), Path(path, "preprocessor_config.json")) if f.is_file()]


def _video_half_unloadable(path: str) -> bool:
    """Whether AutoProcessor must fail on the folder's processor: its class has a video processor and torchvision,
    that processor's only backend, is not installed (AutoProcessor raises ImportError after loading the tokenizer, so
    from_model_path goes to image_only_processor at once instead)."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return False
    name = next((n for n in (c.get("processor_class") for c in _processor_configs(path)) if n), None)
    return hasattr(transformers, name or "") and "video_processor" in getattr(transformers, name).get_attributes()


class ImageProcessor:
    """The model's HF processor, for prompts with images.

    Args:
        hf_processor: the transformers processor of the model folder (its `image_processor`, `image_token`,
            `replace_image_token`, and maybe `chat_template`).
        vision: the model's VisionConfig or QwenVisionConfig (its image token id and the feature rows of an image,
            checked against the processor's expansion).
    Raises ValueError when the processor's image token is not the model's.
    """

    def __init__(self, hf_processor: Any, vision: VisionConfig | QwenVisionConfig) -> None:
        self.hf = hf_processor
        self.vision = vision
        self.image_token: str = hf_processor.image_token
        token_id = getattr(hf_processor, "image_token_id", None)
        soft = getattr(hf_processor.tokenizer, "image_token_id", None)  # Gemma 3: the token the features fill
        if vision.image_token_id not in (token_id, soft):
            raise ValueError(f"the processor's image token {self.image_token!r} is id {token_id}; config.json says "
                             f"{vision.image_token_id}")
        #: The token the prompt holds once per image (the chat template's), which expands to the processor's
        #: replacement: the model's image token (LLaVA, ...), or Gemma 3's <start_of_image>.
        self.placeholder_id: int = token_id
        self.chat_template: str | None = getattr(hf_processor, "chat_template", None)
        self._images_kwargs: dict[str, Any] | None = None
        self._added: frozenset[int] | None = None

    @classmethod
    def from_model_path(cls, path: str, vision: VisionConfig | QwenVisionConfig, max_pixels: int | None = None,
                        min_pixels: int | None = None) -> ImageProcessor:
        """The processor of the model folder at `path` (AutoProcessor: processor_config.json or
        preprocessor_config.json; Pillow backends, no torchvision), its image processor built with the pixel limits
        (`max_pixels`, `min_pixels`: width x height, None = its own; engine.multimodal.pixel_limits: its own
        parameters), and `vision` with the anyres pinpoints those keep (the model is built with them: `vision`).
        Raises ValueError when the folder has none (a vision-language model's images need its own processor), for
        limits the processor cannot honour (pixel_limit_kwargs, naming EngineConfig's fields) or as __init__."""
        from dataclasses import replace

        from transformers import AutoProcessor

        from engine.multimodal.pixel_limits import limited, pixel_limit_kwargs

        try:
            try:
                if _video_half_unloadable(path):
                    raise ImportError(f"{path}: the processor's video half needs torchvision, which is not installed")
                hf = AutoProcessor.from_pretrained(path)
            except (ImportError, OSError) as e:  # a video processor that needs torchvision (Qwen2-VL's, SmolVLM's)
                try:  # or whose config the folder lacks: the image half alone
                    hf = image_only_processor(path)
                except (OSError, ValueError, KeyError, ImportError):
                    raise e from None
        except (OSError, ValueError, KeyError, ImportError) as e:
            raise ValueError(f"{path} has no image processor transformers can load ({type(e).__name__}: {e}); a "
                             "vision-language model folder needs its processor_config.json / "
                             "preprocessor_config.json") from e
        if not hasattr(hf, "image_processor") or not hasattr(hf, "image_token"):
            raise ValueError(f"{path}: AutoProcessor gives a {type(hf).__name__}, not a processor with images")
        limits = pixel_limit_kwargs(hf.image_processor, max_pixels, min_pixels)
        hf.image_processor = limited(hf.image_processor, limits)
        if "image_grid_pinpoints" in limits and isinstance(vision, VisionConfig):
            vision = replace(vision, image_grid_pinpoints=tuple(map(tuple, limits["image_grid_pinpoints"])))
        return cls(hf, vision)

    def process(self, prompt: object, tokenizer: Tokenizer, use_chat_template: bool = True,
                allow_special_tokens: bool = False) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """(token ids with every image's placeholders expanded, the images' MultiModalItems in prompt order) of an
        image prompt (engine.multimodal's forms). User text stays text (engine.text.tokenizer): an image token
        spelt in a message is plain characters; in a raw prompt (use_chat_template False) its spellings are the
        image placeholders. Raises ValueError (the request's error output) for a malformed prompt, an image
        Pillow cannot read, placeholders that do not match the images in number, or a processor whose expansion
        differs from the model's feature rows."""
        ids, raw_images = self._render(prompt, tokenizer, use_chat_template, allow_special_tokens)
        return self.expand(ids, [load_image(img) for img in raw_images])

    def _render(self, prompt: object, tokenizer: Tokenizer, use_chat_template: bool,
                allow_special_tokens: bool) -> tuple[list[int], list[object]]:
        """(token ids with one image token per image, the images as given) of an image prompt (`process`'s forms
        and flags). Raises ValueError as `process` for a malformed prompt."""
        text, raw_images, chat = image_messages(prompt)
        if chat:
            ids = tokenizer.apply_chat_template(text, allow_special_tokens=allow_special_tokens)
        elif use_chat_template:
            parts = [{"type": "image"} for _ in raw_images] + [{"type": "text", "text": text}]
            ids = tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                                allow_special_tokens=allow_special_tokens)
        else:  # raw: the image token's spellings are placeholders, so the text is encoded with its added tokens
            spelt = [t for t in self.hf.tokenizer.get_added_vocab() if t != self.image_token and t in text]
            if spelt and not allow_special_tokens:
                raise ValueError(f"the raw image prompt spells control tokens {spelt[:3]} besides "
                                 f"{self.image_token!r}; use the chat form, or allow_special_tokens to mean them")
            ids = tokenizer.encode(text, allow_special_tokens=True)
        return ids, raw_images

    def prompt_size(self, prompt: object, tokenizer: Tokenizer, use_chat_template: bool = True,
                    allow_special_tokens: bool = False) -> tuple[int, tuple[int, ...]]:
        """(tokens, each image's tokens in prompt order) of an image prompt as `process` expands it, counted without
        processing any pixels: Pillow reads each image's height and width from its header (engine.multimodal.inputs.
        image_size) and the processor's own count gives the tokens an image of that size expands into (HF
        processors' _get_num_multimodal_tokens, as vLLM sizes its inputs: the placeholders with the tags the
        processor writes around them; where a processor lacks it, the image is processed; Gemma 3's counts its soft
        tokens, and the one text it writes for every image is spliced in as `process` does: _fixed_replacement).
        Bytes whose header reads but whose pixels do not decode are counted; the run makes them an error row.
        Raises ValueError as
        `process` (a malformed prompt, an image Pillow cannot open, placeholders and images that differ in number)."""
        ids, raw_images = self._render(prompt, tokenizer, use_chat_template, allow_special_tokens)
        self._placeholders(ids, len(raw_images))
        if not raw_images:
            return len(ids), ()
        counter = getattr(self.hf, "_get_num_multimodal_tokens", None)
        if counter is not None:
            counts = tuple(int(n) for n in counter(image_sizes=[image_size(img) for img in raw_images])
                           .num_image_tokens)
        else:
            counts = tuple(len(self._replacement(load_image(img))[0]) for img in raw_images)
        fixed = self._fixed_replacement()
        if fixed is not None:  # Gemma 3: the count is the soft tokens; the text around them is spliced, and joins
            return len(self._splice(ids, [fixed] * len(raw_images))[0]), counts
        return len(ids) - len(raw_images) + sum(counts), counts

    def expand(self, ids: list[int], images: list[Any]) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Replace the i-th placeholder of `ids` by the processor's replacement for images[i] (decoded Pillow images)
        and make their items: one per run of image tokens in the replacement (LLaVA, Gemma 3: one per image;
        Idefics3 / SmolVLM: one per tile, each tile's run apart), in order. Raises ValueError as `process`."""
        token = self.vision.image_token_id
        self._placeholders(ids, len(images))
        replacements: list[list[int]] = []
        found: list[tuple[int, Any, int, int, tuple[int, ...] | None, tuple[int, int] | None]] = []
        for k, image in enumerate(images):
            replacement, tiles, size, grid = self._replacement(image)
            runs = _runs(replacement, token)
            if grid is not None and len(runs) == 1:  # dynamic resolution (Qwen2-VL): the image's patches and grid
                pixels, expected = [tiles], self.vision.tokens_of(grid)
            elif len(runs) == 1 and len(tiles) > 1 and getattr(self.vision, "image_grid_pinpoints", ()):
                if size is None:  # anyres (LLaVA-NeXT): one run for the base and grid tiles
                    raise ValueError("the processor gives no image_sizes for an anyres image")
                pixels, expected = [tiles], anyres_tokens(self.vision, size)
            elif runs and grid is None and len(runs) == len(tiles):
                pixels, expected, size = list(tiles), self.vision.tokens_per_image, None
            else:
                raise ValueError(f"the processor writes {len(runs)} runs of image tokens for an image of {len(tiles)} "
                                 "tiles; tokenmill runs one run per tile, or one for all (anyres, dynamic resolution)")
            for (start, length), pv in zip(runs, pixels, strict=True):
                if length != expected:
                    raise ValueError(f"the processor expands an image (tile) into {length} placeholder tokens but "
                                     f"the model gives {expected} feature rows (check processor_config.json's "
                                     "patch_size, merge_size, image_seq_len, num_additional_image_tokens and "
                                     "vision_feature_select_strategy)")
                found.append((k, pv, start, length, grid, size))
            replacements.append(replacement)
        out, where = self._splice(ids, replacements)
        return out, tuple(MultiModalItem(pv, where(k, start), length, mm_hash(pv, grid, size), grid, size)
                          for k, pv, start, length, grid, size in found)

    def _placeholders(self, ids: list[int], num_images: int) -> list[int]:
        """Indices of the image placeholders in `ids`; raises ValueError unless there is one per image."""
        at = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(at) != num_images:
            raise ValueError(f"the prompt has {len(at)} image placeholders ({self.image_token!r}) but {num_images} "
                             "images; give one image per placeholder")
        return at

    def _splice(self, ids: list[int], replacements: list[list[int]]) -> tuple[list[int], Callable[[int, int], int]]:
        """(`ids` with its k-th placeholder replaced by replacements[k], where(k, j): the index there of token j of
        replacement k, an added token). Text a replacement begins or ends with is tokenized with the prompt's text
        beside it, as the processor's tokenization of the whole text does (engine.multimodal.rejoin)."""
        out: list[int] = []
        starts, cuts = [], []
        prev = 0
        for pos, replacement in zip(self._placeholders(ids, len(replacements)), replacements, strict=True):
            out += ids[prev:pos]
            starts.append(len(out))
            cuts += [len(out), len(out) + len(replacement)]
            out += replacement
            prev = pos + 1
        out += ids[prev:]
        if self._added is None:
            self._added = frozenset(self.hf.tokenizer.get_added_vocab().values())
        out, shift = rejoin(out, cuts, self.hf.tokenizer, self._added)
        return out, lambda k, j: starts[k] + j + shift[starts[k] + j]

    def _fixed_replacement(self) -> list[int] | None:
        """Token ids of the replacement every image gets where the processor writes one text for all (Gemma3Processor's
        full_image_sequence, pan-and-scan off); None otherwise."""
        text = getattr(self.hf, "full_image_sequence", None)
        if not isinstance(text, str) or self._image_kwargs().get("do_pan_and_scan"):
            return None
        return self.hf.tokenizer.encode(text, add_special_tokens=False)

    def _replacement(self, image: Any) -> tuple[list[int], torch.Tensor, tuple[int, int] | None,
                                                tuple[int, int, int] | None]:
        """(token ids of the processor's replacement text, the float32 tiles [tiles, channels, H, W] in order, the
        image's (height, width) where the processor reports image_sizes, else None, its patch grid (frames, rows,
        columns) where it reports image_grid_thw, else None: the tiles are then its patches [t * h * w, dim]) of one
        decoded image, through the processor's own path (`_process_images`: its image processor with the processor's
        image kwargs, then `replace_image_token`). Tiles a pixel_attention_mask marks wholly padding are dropped (HF
        drops them before the encoder); a tile partly padded raises ValueError (not produced by the processors
        tokenmill runs)."""
        import torch

        processed, texts = self.hf._process_images([image], **self._image_kwargs())
        replacement = self.hf.tokenizer.encode(texts[0], add_special_tokens=False)
        pixels = torch.as_tensor(processed["pixel_values"])
        grids = processed.get("image_grid_thw")
        if grids is not None:  # dynamic resolution: the image's patches, as they are
            grid = tuple(int(n) for n in torch.as_tensor(grids).reshape(-1)[:3])
            return replacement, pixels.float().contiguous(), None, grid
        tiles = pixels.reshape(-1, *pixels.shape[-3:]).float()
        mask = processed.get("pixel_attention_mask")
        if mask is not None:
            mask = torch.as_tensor(mask).reshape(-1, *pixels.shape[-2:]).bool()
            real = mask.flatten(1).any(1)
            if not bool(mask[real].all()):
                raise ValueError("the image processor padded part of a tile; tokenmill runs wholly valid tiles only")
            tiles = tiles[real]
        sizes = processed.get("image_sizes")
        size = None if sizes is None else tuple(int(x) for x in torch.as_tensor(sizes).reshape(-1)[:2])
        return replacement, tiles.contiguous(), size, None

    def _image_kwargs(self) -> dict[str, Any]:
        """The processor's image kwargs: its own merge of its image defaults, as its __call__ does (once)."""
        if self._images_kwargs is None:
            self._images_kwargs = self.hf._merge_kwargs(tokenizer_init_kwargs=self.hf.tokenizer.init_kwargs,
                                                        return_tensors="pt")["images_kwargs"]
        return self._images_kwargs

    def mrope_positions(self, num_tokens: int, items: tuple[MultiModalItem, ...]) -> np.ndarray | None:
        """The M-RoPE positions int64 [3, num_tokens] of a prompt with images `items` (engine.multimodal.mrope) for a
        model with M-RoPE (Qwen2-VL: a QwenVisionConfig); None for another model or a prompt without images (plain
        RoPE positions are its M-RoPE ones). Raises ValueError as mrope.prompt_positions."""
        if not items or not isinstance(self.vision, QwenVisionConfig):
            return None
        from engine.multimodal.mrope import prompt_positions

        return prompt_positions(num_tokens, items, self.vision.spatial_merge_size)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`, in order."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
