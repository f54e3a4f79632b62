"""The parameter names a model of a given shape holds: what a model file must provide, exactly (no tensor dropped,
none missing). Imports no torch at module level: the CLI reads a model folder's header through it (issue 31)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import ModelConfig

EMBEDDING = "embed_tokens"  # the token embedding's module name (HF, without "model.")
LM_HEAD = "lm_head"  # the LM head's module name; its weight is left out of a model file when tied to EMBEDDING


def model_param_names(cfg: ModelConfig) -> list[str]:
    """Names (HF, without "model.") of every parameter a model of shape `cfg` holds, a tied LM head left out:
    what a model file must provide, exactly (built on the meta device: no memory)."""
    import torch

    from engine.model.decoder import LlamaModel

    with torch.device("meta"):
        model = LlamaModel(cfg, 1)
    return [k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == f"{LM_HEAD}.weight")]


def check_tensor_names(names: Iterable[str], cfg: ModelConfig, source: str) -> None:
    """Every name in `names` (our parameter names) is a parameter of a model of shape `cfg`, and none is missing.

    Raises ValueError naming the first unknown tensor and the architecture (a tensor we would otherwise drop), or
    the missing ones."""
    expected = set(model_param_names(cfg))
    names = set(names)
    if cfg.tie_word_embeddings:
        names.discard(f"{LM_HEAD}.weight")
    extra = sorted(names - expected)
    if extra:
        raise ValueError(f"{source} holds tensor {extra[0]!r} (and {len(extra) - 1} more) that the {cfg.architecture} "
                         "architecture does not use; tokenmill would drop it and compute something else")
    missing = sorted(expected - names)
    if missing:
        raise ValueError(f"{source} lacks tensors {missing[:5]} (and {max(0, len(missing) - 5)} more) of the "
                         f"{cfg.architecture} architecture")
