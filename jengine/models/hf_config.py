"""An HF `config.json` dict (transformers 4.x or 5.x layout) read into a `ModelConfig`: the
keys every family shares, the defaults HF assumes, and the configurations jengine refuses. A
family's own keys and switches come from its record (`jengine.models.family.Family`);
`jengine.models.registry.model_config_from_hf` picks the record by `model_type`."""

from __future__ import annotations

from typing import Any

from jengine.models.config import ModelConfig, RopeConfig
from jengine.models.family import Family


def config_from_hf(hf: dict[str, Any], family: Family) -> ModelConfig:
    """Builds the config of `family` from an HF `config.json` dict.

    Raises:
      ValueError: a rope scaling or layout jengine does not run.
    """
    model_type = hf["model_type"]
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    rope, local_rope = rope_from_hf(hf)
    sliding_window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if family.sliding_window_flag and not hf.get("use_sliding_window", False):
        sliding_window = None
    if sliding_window is None:
        sliding_layers = (False,) * num_layers
    elif layer_types:
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
    elif family.default_sliding:
        sliding_layers = family.default_sliding(hf, num_layers)
    else:
        sliding_layers = (True,) * num_layers
    if not any(sliding_layers):
        sliding_window = None
    attention_bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        max_position_embeddings=_context_length(hf, rope),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        local_rope=local_rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tied_by_default)),
        qkv_bias=attention_bias,
        o_bias=bool(hf.get("attention_out_bias", attention_bias)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        partial_rotary_factor=_partial_rotary_factor(hf),
        sliding_window=None if sliding_window is None else int(sliding_window),
        sliding_layers=sliding_layers,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )
    fields.update(family.switches)
    if family.hf_fields:
        fields.update(family.hf_fields(hf, fields))
    return ModelConfig(**fields)


def eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: HF gives one id, a list of them, or none."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _context_length(hf: dict[str, Any], rope: RopeConfig) -> int:
    """The positions the model serves: longrope with only its short factors stops where HF
    would switch to the long ones; dynamic NTK goes `factor` times past the trained length (as
    vLLM does: HF sets no limit)."""
    trained = int(hf.get("max_position_embeddings", 2048))
    if rope.rope_type == "longrope" and rope.long_factors is None:
        return rope.original_max_position_embeddings
    if rope.rope_type == "dynamic":
        return int(trained * max(rope.factor, 1.0))
    return trained


def _partial_rotary_factor(hf: dict[str, Any]) -> float:
    """transformers 5 keeps it in `rope_parameters`, 4.x at the top level."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def rope_from_hf(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """Rope settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params and "full_attention" in params:  # per layer type (Gemma 3 in transformers 5)
        full = RopeConfig.from_hf(params["full_attention"])
        local = params.get("sliding_attention")
        return full, RopeConfig.from_hf(local) if local else None
    # Longrope's factors depend on these two top-level fields (Phi-3 keeps them there).
    positions = {key: hf[key] for key in ("original_max_position_embeddings",
                                          "max_position_embeddings") if key in hf}
    if params:
        return RopeConfig.from_hf({**positions, **params}, hf.get("rope_theta")), None
    scaling = hf.get("rope_scaling")
    scaling = {**positions, **scaling} if scaling else None
    rope = RopeConfig.from_hf(scaling, hf.get("rope_theta", 10000.0))
    local = None
    if "rope_local_base_freq" in hf:
        local = RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return rope, local
