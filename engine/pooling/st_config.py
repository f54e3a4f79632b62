"""How a model pools, from its sentence-transformers files (no torch): modules.json lists the modules (Transformer,
Pooling, Dense, Normalize), the Pooling module's config.json its modes, each Dense module's config.json its shape
and activation, the Transformer's sentence_bert_config.json its max_seq_length and do_lower_case.

Source: sentence-transformers' Pooling (sentence_transformer/modules/pooling.py: the modes and their legacy
`pooling_mode_*` keys, concatenated in that order), Dense (base/modules/dense.py: activation(linear(x)), plus x or
a projection of it with use_residual; weights engine.pooling.dense reads), Normalize (L2) and Transformer
(max_seq_length caps the tokenizer's model_max_length, itself capped at max_position_embeddings). A folder without
modules.json pools as sentence-transformers does for a plain Hugging Face model: mean pooling, no normalization.
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
_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
#: A Dense module's activation_function (sentence-transformers saves the torch class's full name) -> its name in
#: engine.pooling.dense.ACTIVATIONS.
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh",
                     "torch.nn.modules.activation.ReLU": "relu", "torch.nn.modules.activation.GELU": "gelu",
                     "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.activation.SiLU": "silu"}


@dataclass(frozen=True)
class DenseConfig:
    """One sentence-transformers Dense module after pooling: y = activation(x W^T + b), plus x (or x R^T when the
    widths differ) with `residual`.

    Attributes:
        folder: the module's folder (its weights: model.safetensors or pytorch_model.bin; engine.pooling.dense).
        in_features / out_features: its input and output widths.
        bias: whether the linear layer has a bias.
        activation: a DENSE_ACTIVATIONS value ("identity", "tanh", ...).
        residual: sentence-transformers' use_residual.
    """

    folder: str
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"
    residual: bool = False


@dataclass(frozen=True)
class PoolingConfig:
    """How hidden states become one embedding per text.

    Attributes:
        modes: pooling modes (POOLING_MODES), their vectors concatenated in this order.
        normalize: L2-normalize the pooled vector (sentence-transformers' Normalize module).
        max_seq_length: most tokens of a text, special tokens included; longer texts are truncated to it.
        do_lower_case: lower-case each text before tokenizing.
        source: where it was read ("modules.json" or "default"), for logs.
        dense: the Dense modules applied after pooling and before normalizing, in order.

    Raises:
        ValueError: for an unknown mode or a max_seq_length < 2.
    """

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int = 512
    do_lower_case: bool = False
    source: str = "default"
    dense: tuple[DenseConfig, ...] = ()

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in POOLING_MODES]
        if not self.modes or bad:
            raise ValueError(f"pooling mode {bad or list(self.modes)} is not implemented; tokenmill pools with "
                             f"{', '.join(POOLING_MODES)}")
        if self.max_seq_length < 2:
            raise ValueError(f"max_seq_length must be >= 2 tokens, got {self.max_seq_length}")

    def dimension(self, hidden_size: int) -> int:
        """Elements of one embedding of a model of `hidden_size` (the last Dense module's out_features)."""
        return self.dense[-1].out_features if self.dense else hidden_size * len(self.modes)


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

    Raises ValueError naming the file for a module tokenmill does not run (a second Pooling, a Dense module before
    pooling, an unknown Dense activation, ...), a pooling mode it does not implement, a pooled width other than
    hidden_size, or Dense widths that do not chain."""
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
                         f"{', '.join(_MODULES)}")
    tail = kinds[2:-1] if kinds[-1:] == ["Normalize"] else kinds[2:]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Dense" for k in tail):
        raise ValueError(f"{root / 'modules.json'} lists modules {kinds}; tokenmill runs Transformer, Pooling, any "
                         "Dense modules and an optional Normalize, in that order")
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
    dense = _dense_modules(root, [m for k, m in zip(kinds, modules, strict=True) if k == "Dense"],
                           hidden_size * len(modes))
    return PoolingConfig(modes=modes, normalize="Normalize" in kinds,
                         max_seq_length=min(int(max_len), max_positions) if max_len else limit,
                         do_lower_case=bool(st_config.get("do_lower_case", False)), source="modules.json",
                         dense=dense)


def _dense_modules(root: Path, modules: list[dict[str, Any]], width: int) -> tuple[DenseConfig, ...]:
    """The DenseConfig of each Dense entry of modules.json (in order) of the folder `root`, the first taking the
    pooled vectors of `width` elements. Raises ValueError naming the file for an activation tokenmill does not run,
    a module reading or writing other features than the sentence embedding, or widths that do not chain."""
    out: list[DenseConfig] = []
    for module in modules:
        path = root / str(module.get("path", ""))
        config = _read(path / "config.json")
        activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
        if activation not in DENSE_ACTIVATIONS:
            raise ValueError(f"{path / 'config.json'} asks for activation_function {activation!r}, which tokenmill "
                             f"does not run; it runs {', '.join(DENSE_ACTIVATIONS)}")
        features = {config.get(k, "sentence_embedding") for k in ("module_input_name", "module_output_name")}
        if features != {"sentence_embedding"}:
            raise ValueError(f"{path / 'config.json'}: a Dense module over {sorted(map(str, features))} is not run; "
                             "tokenmill runs Dense modules on the pooled sentence_embedding")
        try:
            dense = DenseConfig(str(path), int(config["in_features"]), int(config["out_features"]),
                                bool(config.get("bias", True)), DENSE_ACTIVATIONS[activation],
                                bool(config.get("use_residual", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path / 'config.json'} lacks a valid in_features / out_features ({e!r})") from e
        if dense.in_features != width:
            raise ValueError(f"{path / 'config.json'} takes vectors of {dense.in_features} elements, but what comes "
                             f"before it gives {width}")
        out.append(dense)
        width = dense.out_features
    return tuple(out)
