"""The parameter names a model of a given shape holds: what a model file must provide, exactly (no tensor dropped,
none missing). Imports no torch at module level: the CLI reads a model folder's header through it (issue 31)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import ModelConfig

EMBEDDING = "embed_tokens"  # the token embedding's module name (HF, without "model.")
LM_HEAD = "lm_head"  # the LM head's module name; its weight is left out of a model file when tied to EMBEDDING
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "gate_up_proj")  # the serving layout (ModelBase.fuse_projections)


def is_linear_weight(name: str) -> bool:
    """True for the weight of a decoder projection (fused or not) or the LM head (HF names without "model."). A
    mixture-of-experts layer's stacked expert weights ("layers.0.mlp.experts.gate_proj.weight", [E, out, in];
    engine.layers.moe) are not: the INT4/INT8 paths and the GGUF block kernels take 2-D projections only."""
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and ".experts." not in name and (
        module.rsplit(".", 1)[-1] in LINEAR_MODULES + FUSED_MODULES or module == LM_HEAD)


#: A mixture-of-experts layer's stacked expert projections (engine.layers.moe.GroupedExperts; gate_up after fusing).
EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def is_expert_weight(name: str) -> bool:
    """True for a mixture-of-experts layer's stacked expert projection weight, e.g.
    "layers.0.mlp.experts.gate_proj.weight" [E, out, in] (not its bias): what the INT4 paths quantize per expert
    (engine.quant.experts) where is_linear_weight's 2-D projections are quantized whole."""
    module = name.removesuffix(".weight")
    owner, _, last = module.rpartition(".")
    return name.endswith(".weight") and owner.endswith(".experts") and last in EXPERT_MODULES


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name (HF, without "model.") -> shape of every parameter the causal decoder (engine.model.decoder, and the family
    files built on it: gemma, moe_decoder, gpt_oss) holds for shape `cfg`, a tied LM head left out: the same names and
    shapes as that model's state_dict, from the config alone (no torch: the CLI's fit check, jobs.plan.model_fit).
    tests/engine/model/test_param_shapes.py holds the two equal."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {f"{EMBEDDING}.weight": (cfg.vocab_size, h)}

    def linear(name: str, n_in: int, n_out: int, bias: bool = False) -> None:
        shapes[f"{name}.weight"] = (n_out, n_in)
        if bias:
            shapes[f"{name}.bias"] = (n_out,)

    def mlp(prefix: str, width: int) -> None:
        linear(f"{prefix}.gate_proj", h, width)
        linear(f"{prefix}.up_proj", h, width)
        linear(f"{prefix}.down_proj", width, h)

    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        if cfg.attention_sinks:
            shapes[f"{p}.self_attn.sinks"] = (cfg.num_heads,)
        linear(f"{p}.self_attn.q_proj", h, cfg.num_heads * hd, cfg.qkv_bias)
        linear(f"{p}.self_attn.k_proj", h, cfg.num_kv_heads * hd, cfg.qkv_bias)
        linear(f"{p}.self_attn.v_proj", h, cfg.num_kv_heads * hd, cfg.qkv_bias)
        linear(f"{p}.self_attn.o_proj", cfg.num_heads * hd, h, cfg.o_bias)
        if cfg.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        if cfg.num_experts:
            e, width = cfg.num_experts, cfg.moe_intermediate_size
            linear(f"{p}.mlp.gate", h, e, cfg.expert_bias)
            for name, out, n_in in (("gate_proj", width, h), ("up_proj", width, h), ("down_proj", h, width)):
                shapes[f"{p}.mlp.experts.{name}.weight"] = (e, out, n_in)
                if cfg.expert_bias:
                    shapes[f"{p}.mlp.experts.{name}.bias"] = (e, out)
            if cfg.shared_expert_intermediate_size:
                mlp(f"{p}.mlp.shared_expert", cfg.shared_expert_intermediate_size)
                linear(f"{p}.mlp.shared_expert_gate", h, 1)
        else:
            mlp(f"{p}.mlp", cfg.intermediate_size)
        if cfg.sandwich_norms:
            shapes[f"{p}.pre_feedforward_layernorm.weight"] = shapes[f"{p}.post_feedforward_layernorm.weight"] = (h,)
    shapes["norm.weight"] = (h,)
    if not cfg.tie_word_embeddings and cfg.lm_head:
        linear(LM_HEAD, h, cfg.vocab_size)
    return shapes


def check_tensor_names(names: Iterable[str], cfg: ModelConfig, source: str, fused: bool = False,
                       expected: Iterable[str] | None = None) -> None:
    """Every name in `names` (our parameter names; with `fused`, as `fuse_names` gives them: a Phi-3 file's) is a
    parameter of a model of shape `cfg` (the causal decoder's `param_shapes`, or `expected`: the registry entry's
    names), and none is missing.

    Raises ValueError naming the first unknown tensor and the architecture (a tensor we would otherwise drop), or
    the missing ones."""
    wanted = param_shapes(cfg) if expected is None else list(expected)
    want = set(fuse_names(wanted) if fused else wanted)
    names = set(names)
    if cfg.tie_word_embeddings:
        names.discard(f"{LM_HEAD}.weight")
    extra = sorted(names - want)
    if extra:
        raise ValueError(f"{source} holds tensor {extra[0]!r} (and {len(extra) - 1} more) that the {cfg.architecture} "
                         "architecture does not use; tokenmill would drop it and compute something else")
    missing = sorted(want - names)
    if missing:
        raise ValueError(f"{source} lacks tensors {missing[:5]} (and {max(0, len(missing) - 5)} more) of the "
                         f"{cfg.architecture} architecture")


#: Fused projections of model files (Phi-3): the fused module and the parts it holds, rows in this order.
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fused_rows(cfg: ModelConfig, fused: str) -> list[int]:
    """Output rows of each part of a fused module ("self_attn.qkv_proj" or "mlp.gate_up_proj") of shape `cfg`."""
    if fused == "self_attn.qkv_proj":
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    return [cfg.intermediate_size, cfg.intermediate_size]


def fuse_names(names: Iterable[str]) -> list[str]:
    """Our parameter names as a file with fused projections names them: each layer's q/k/v and gate/up parameters
    as one qkv_proj / gate_up_proj parameter (e.g. "layers.0.self_attn.qkv_proj.weight"), order kept."""
    out: dict[str, None] = {}
    for name in names:
        for fused, parts in FUSED_PARTS.items():
            for part in parts:
                name = name.replace(f".{part}.", f".{fused}.")
        out[name] = None
    return list(out)


def split_fused(name: str, value: object, cfg: ModelConfig) -> list[tuple[str, object]]:
    """[(our name, rows)] of a fused file tensor (`name` our "layers.N.self_attn.qkv_proj.weight" style, or a module
    name without ".weight"; `value` rows first: a tensor, an array, or anything with `map_rows(fn)` such as packed
    INT4 or GGUF blocks), split by `fused_rows`; any other tensor as [(name, value)]."""
    for fused, parts in FUSED_PARTS.items():
        marker = f".{fused}"
        if marker in name:
            prefix, _, suffix = name.partition(marker)
            out, start = [], 0
            for part, rows in zip(parts, fused_rows(cfg, fused), strict=True):
                piece = (value.map_rows(lambda x, a=start, b=start + rows: x[a:b]) if hasattr(value, "map_rows")
                         else value[start:start + rows])
                out.append((f"{prefix}.{part}{suffix}", piece))
                start += rows
            if start != value_rows(value):
                raise ValueError(f"{name} has {value_rows(value)} rows; {cfg.architecture} of this shape needs {start}")
            return out
    return [(name, value)]


def value_rows(value: object) -> int:
    """Rows (the first dimension) of a tensor, an array, or an object with `out_features` / `shape` (INT4, GGUF
    blocks)."""
    if hasattr(value, "out_features"):
        return int(value.out_features)
    return int(value.shape[0])
