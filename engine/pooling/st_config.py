"""How a model pools, from its sentence-transformers files (no torch): modules.json lists the modules (Transformer,
Pooling, Normalize), the Pooling module's config.json its modes, the Transformer's sentence_bert_config.json its
max_seq_length and do_lower_case.

Source: sentence-transformers' Pooling (sentence_transformer/modules/pooling.py: the modes and their legacy
`pooling_mode_*` keys, concatenated in that order), Normalize (L2) and Transformer (max_seq_length caps the
tokenizer's model_max_length, itself capped at max_position_embeddings). A folder without modules.json pools as
sentence-transformers does for a plain Hugging Face model: mean pooling, no normalization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The pooling modes tokenmill implements (sentence-transformers' names; engine.pooling.pooler).
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
#: sentence-transformers' legacy keys of 1_Pooling/config.json, in its concatenation order.
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
#: modules.json module types (their last dotted part) tokenmill runs.
_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    """How hidden states become one embedding per text.

    Attributes:
        modes: pooling modes (POOLING_MODES), their vectors concatenated in this order.
        normalize: L2-normalize the pooled vector (sentence-transformers' Normalize module).
        max_seq_length: most tokens of a text, special tokens included; longer texts are truncated to it.
        do_lower_case: lower-case each text before tokenizing.
        source: where it was read ("modules.json" or "default"), for logs.

    Raises:
        ValueError: for an unknown mode or a max_seq_length < 2.
    """

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int = 512
    do_lower_case: bool = False
    source: str = "default"

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in POOLING_MODES]
        if not self.modes or bad:
            raise ValueError(f"pooling mode {bad or list(self.modes)} is not implemented; tokenmill pools with "
                             f"{', '.join(POOLING_MODES)}")
        if self.max_seq_length < 2:
            raise ValueError(f"max_seq_length must be >= 2 tokens, got {self.max_seq_length}")

    def dimension(self, hidden_size: int) -> int:
        """Elements of one embedding of a model of `hidden_size`."""
        return hidden_size * len(self.modes)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); fix or remove it") from e


def pooling_modes(config: dict[str, Any]) -> tuple[str, ...]:
    """The modes of a 1_Pooling/config.json dict: its `pooling_mode` (a name or a list), else the legacy
    `pooling_mode_*` flags in sentence-transformers' order (none set: mean)."""
    mode = config.get("pooling_mode")
    if mode is not None:
        return (mode,) if isinstance(mode, str) else tuple(mode)
    return tuple(m for key, m in _LEGACY_KEYS.items() if config.get(key)) or ("mean",)


def read_pooling_config(folder: str, hidden_size: int, max_positions: int,
                        tokenizer_max_length: int | None = None) -> PoolingConfig:
    """The PoolingConfig of the model folder `folder` (hidden_size: its width; max_positions: the most tokens a
    row can hold, ModelConfig.max_row_tokens; tokenizer_max_length: the tokenizer's model_max_length, when it has
    one).

    Raises ValueError naming the file for a module tokenmill does not run (Dense, a second Pooling, ...), a pooling
    mode it does not implement, or a pooled width other than hidden_size."""
    root = Path(folder)
    limit = min(max_positions, tokenizer_max_length or max_positions)
    if not (root / "modules.json").is_file():
        return PoolingConfig(max_seq_length=limit)
    modules = _read(root / "modules.json")
    types = [str(m.get("type", "")) for m in modules] if isinstance(modules, list) else []
    kinds = [t.rsplit(".", 1)[-1] for t in types]
    unknown = [t for t, k in zip(types, kinds, strict=True) if k not in _MODULES]
    if unknown:
        raise ValueError(f"{root / 'modules.json'} lists module {unknown[0]!r}, which tokenmill does not run; it runs "
                         f"{', '.join(_MODULES)} (Dense and other modules: not yet)")
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise ValueError(f"{root / 'modules.json'} lists modules {kinds}; tokenmill runs Transformer, Pooling and an "
                         "optional Normalize, in that order")
    by_kind = {k: m for k, m in zip(kinds, modules, strict=True)}
    st = root / str(by_kind["Transformer"].get("path", "")) / "sentence_bert_config.json"
    st_config = _read(st) if st.is_file() else {}
    pool = root / str(by_kind["Pooling"].get("path", "")) / "config.json"
    pool_config = _read(pool) if pool.is_file() else {}
    width = pool_config.get("word_embedding_dimension", pool_config.get("embedding_dimension", hidden_size))
    if width != hidden_size:
        raise ValueError(f"{pool} pools vectors of {width} elements, but the model's hidden size is {hidden_size}")
    modes = pooling_modes(pool_config)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ValueError(f"{pool} asks for pooling mode {bad[0]!r}, which tokenmill does not implement; it pools "
                         f"with {', '.join(POOLING_MODES)}")
    max_len = st_config.get("max_seq_length")
    return PoolingConfig(modes=modes, normalize="Normalize" in kinds,
                         max_seq_length=min(int(max_len), max_positions) if max_len else limit,
                         do_lower_case=bool(st_config.get("do_lower_case", False)), source="modules.json")
