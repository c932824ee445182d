"""Nemotron-H (`nemotron_h`): a stack of single-purpose blocks, each RMSNorm -> one mixer ->
residual, the mixer one of Mamba2 ("M"), attention without rope ("*"), a ReLU² MLP ("-") or a
sparse MoE ("E"). The published checkpoints spell the stack as `hybrid_override_pattern`
("M-M-M*-..."); transformers 5 writes `layers_block_type`; both are read, with the older
"mamba" / "attention" names.

Only the Mamba2 blocks keep a recurrent state (`models/mamba2.py`) and only the attention
blocks keep KV pages; the MLP blocks keep neither (`ModelConfig.mlp_only_layers`). The MoE
block is DeepSeek-V3's router (sigmoid scores, `e_score_correction_bias` steering the choice,
group-limited top k, `routed_scaling_factor`: `moe.route_deepseek`) over non-gated ReLU²
experts, optionally inside a latent projection (`moe_latent_size`), plus a shared ReLU² MLP.
Each kind's weights stack over the blocks of that kind (`layer_ordinals`), the norm over all.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jengine.models import layers, mamba2, moe
from jengine.models.attention import AttentionMetadata, KVCache
from jengine.models.config import ModelConfig
from jengine.models.family import Family, ModelType, Network
from jengine.models.granite4 import attention
from jengine.models.layers import ParamSpec, project, rms_norm
from jengine.models.matmul import dot
from jengine.models.weight_rules import EXPERT, Rule, heads_in, o_in, same, transposed

LAYER = r"(?:model|backbone)\.layers\.(\d+)\."
ATTENTION_KEYS = ("wq", "wk", "wv", "wo")
MLP_KEYS = ("w_up", "w_down")
MOE_KEYS = ("router", "router_bias", "we_up", "we_down", "ws_up", "ws_down", "w_latent_in",
            "w_latent_out")
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def _kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """Each block's mixer: mamba | attention | mlp | moe."""
    return tuple("mamba" if lin else (only or "attention")
                 for lin, only in zip(cfg.linear_layers, cfg.mlp_only_layers, strict=True))


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight, stacked over the blocks of its kind. Projections are input-first."""
    kinds = _kinds(cfg)
    n, e, v = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    h, k, d, na = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_kv_layers
    nm, f = kinds.count("mlp"), cfg.intermediate_size
    specs = {
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "final_norm": ParamSpec((e,), ("embed",), "ones"),
        "wq": ParamSpec((na, e, h, d), ("layers", "embed", "q_heads", "head_dim"), contract=(1,)),
        "wk": ParamSpec((na, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wv": ParamSpec((na, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wo": ParamSpec((na, h, d, e), ("layers", "q_heads", "head_dim", "embed"),
                        contract=(1, 2)),
        "w_up": ParamSpec((nm, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_down": ParamSpec((nm, f, e), ("layers", "mlp", "embed"), contract=(1,)),
        **mamba2.mixer_specs(cfg),
    }
    ne = kinds.count("moe")
    if ne:
        x, fe, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        lat = cfg.moe_latent_size or e
        specs.update({
            "router": ParamSpec((ne, e, x), ("layers", "embed", "experts")),
            "router_bias": ParamSpec((ne, x), ("layers", "experts"), "zeros"),
            "we_up": ParamSpec((ne, x, lat, fe), ("layers", "experts", "latent", "mlp")),
            "we_down": ParamSpec((ne, x, fe, lat), ("layers", "experts", "mlp", "latent")),
            "ws_up": ParamSpec((ne, e, fs), ("layers", "embed", "mlp")),
            "ws_down": ParamSpec((ne, fs, e), ("layers", "mlp", "embed")),
        })
        if cfg.moe_latent_size:
            specs["w_latent_in"] = ParamSpec((ne, e, lat), ("layers", "embed", "latent"))
            specs["w_latent_out"] = ParamSpec((ne, lat, e), ("layers", "latent", "embed"))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


def layer_ordinals(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each kind's keys stack the blocks of that kind."""
    kinds = _kinds(cfg)

    def of(kind: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(kinds) if k == kind)

    return {**dict.fromkeys(ATTENTION_KEYS, of("attention")),
            **dict.fromkeys(mamba2.MIXER_KEYS, of("mamba")),
            **dict.fromkeys(MLP_KEYS, of("mlp")), **dict.fromkeys(MOE_KEYS, of("moe"))}


_KEYS = {"mamba": mamba2.MIXER_KEYS, "attention": ATTENTION_KEYS, "mlp": MLP_KEYS,
         "moe": MOE_KEYS}


def forward(params: dict[str, jax.Array], cfg: ModelConfig, kv: KVCache,
            md: AttentionMetadata, *, all_logits: bool = False, head: bool = True
            ) -> tuple[jax.Array, KVCache]:
    """One ragged step. Returns float32 logits [S, V] at `md.logits_indices` ([T, V] with
    `all_logits`; hidden states without `head`) and the updated cache."""
    mm, eps = cfg.matmul_backend, cfg.rms_norm_eps
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)  # [T, E]
    states = mamba2.States(kv, md)
    ordinal = dict.fromkeys(_KEYS, 0)
    for i, kind in enumerate(_kinds(cfg)):
        j = ordinal[kind]  # the block's place among those of its kind
        ordinal[kind] += 1
        if "layers" in params:
            p = params["layers"][i]
        else:
            p = {"norm": params["norm"][i],
                 **{key: params[key][j] for key in _KEYS[kind] if key in params}}
        h = rms_norm(x, p["norm"], eps, backend=mm)
        if kind == "mamba":
            out = mamba2.mixer(h, p, cfg, states, j, md, eps)
        elif kind == "attention":
            out, kv = attention(h, p, cfg, kv, j, md, None)
        elif kind == "mlp":
            out = _relu2_mlp(h, p["w_up"], p["w_down"], mm)
        else:
            out = _moe(h, p, cfg)
        x = x + out
    kv = states.written(kv)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def _relu2_mlp(h: jax.Array, up: jax.Array, down: jax.Array, mm: str) -> jax.Array:
    """down(relu(up(h))²): [T, E] -> [T, E]."""
    act = jnp.square(jax.nn.relu(project(h, up, "te,ef->tf", backend=mm)))
    return project(act, down, "tf,fe->te", backend=mm)


def _moe(h: jax.Array, p: dict[str, jax.Array], cfg: ModelConfig) -> jax.Array:
    """The routed ReLU² experts (in the latent width where there is one) + the shared MLP.
    Decode-sized steps gather their chosen experts, larger ones run every expert with a
    combine matrix zero off the chosen ones (`moe`'s rule, T * k against X)."""
    experts, weights = moe.route_deepseek(h, p["router"], cfg, p["router_bias"])  # [T, k]
    x = project(h, p["w_latent_in"], "te,el->tl") if "w_latent_in" in p else h
    if experts.size <= cfg.num_experts:
        act = jnp.square(jax.nn.relu(dot("tl,tklf->tkf", x, p["we_up"][experts])))
        out = dot("tkf,tkfl->tkl", act.astype(h.dtype), p["we_down"][experts])
        out = jnp.einsum("tkl,tk->tl", out, weights)
    else:
        combine = jnp.einsum("tk,tkx->tx", weights,
                             jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.float32))
        act = jnp.square(jax.nn.relu(dot("tl,xlf->txf", x, p["we_up"])))
        out = dot("txf,xfl->tl", (act * combine[:, :, None]).astype(h.dtype), p["we_down"])
    out = out.astype(h.dtype)
    if "w_latent_out" in p:
        out = project(out, p["w_latent_out"], "tl,le->te")
    return out + _relu2_mlp(h, p["ws_up"], p["ws_down"], cfg.matmul_backend)


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] -> float32 logits [N, V]."""
    return layers.lm_head(final_norm(params, cfg, x), params, cfg.tie_word_embeddings,
                          cfg.matmul_backend)


def final_norm(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend=cfg.matmul_backend)


NETWORK = Network(name="nemotron_h", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=("norm",) + ATTENTION_KEYS + MLP_KEYS + MOE_KEYS
                  + mamba2.MIXER_KEYS,
                  layer_ordinals=layer_ordinals, final_norm=final_norm)


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    mixer = LAYER + r"mixer\."
    return (
        (r"(?:model|backbone)\.embeddings\.weight", "embed", same),
        (r"(?:model|backbone)\.embed_tokens\.weight", "embed", same),
        (r"(?:model|backbone)\.norm_f\.weight", "final_norm", same),
        (r"lm_head\.weight", "lm_head", transposed),
        (LAYER + r"norm\.weight", "norm", same),
        (mixer + r"q_proj\.weight", "wq", heads_in),
        (mixer + r"k_proj\.weight", "wk", heads_in),
        (mixer + r"v_proj\.weight", "wv", heads_in),
        (mixer + r"o_proj\.weight", "wo", o_in),
        (mixer + r"up_proj\.weight", "w_up", transposed),
        (mixer + r"down_proj\.weight", "w_down", transposed),
        (mixer + r"gate\.weight", "router", transposed),
        (mixer + r"gate\.e_score_correction_bias", "router_bias", same),
        (LAYER + r"mixer" + EXPERT + r"up_proj\.weight", "we_up", transposed),
        (LAYER + r"mixer" + EXPERT + r"down_proj\.weight", "we_down", transposed),
        (mixer + r"shared_experts\.up_proj\.weight", "ws_up", transposed),
        (mixer + r"shared_experts\.down_proj\.weight", "ws_down", transposed),
        (mixer + r"fc1_latent_proj\.weight", "w_latent_in", transposed),
        (mixer + r"fc2_latent_proj\.weight", "w_latent_out", transposed),
        (r"mtp\..*", (), same),  # the multi-token-prediction layers: not run
    ) + mamba2.mixer_rules(mixer)


def block_types(hf: dict[str, Any]) -> list[str]:
    """Each block's type from `layers_block_type` / `layer_types` (transformers 5, or the older
    "mamba" / "attention" names) or the published `hybrid_override_pattern`.

    Raises:
      ValueError: a pattern character or block type Nemotron-H does not have.
    """
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if not types:
        pattern = hf.get("hybrid_override_pattern") or ""
        if not pattern or set(pattern) - set(_PATTERN):
            raise ValueError(f"nemotron_h hybrid_override_pattern {pattern!r}: expected "
                             "characters M (Mamba2), * (attention), - (MLP), E (MoE)")
        types = [_PATTERN[c] for c in pattern]
    types = [_LEGACY.get(t, t) for t in types]
    unknown = set(types) - set(_PATTERN.values())
    if unknown:
        raise ValueError(f"nemotron_h block types {sorted(unknown)} not supported")
    return types


def _normalized(hf: dict[str, Any]) -> dict[str, Any]:
    """The keys the shared reader expects: the layer count from the block types (the config
    class derives it so), the norm epsilon under its usual name, the head width from
    `head_dim`, the published `attention_head_dim`, or HF's default 128 (not hidden / heads:
    Nemotron-H 4B's heads are 128 wide at hidden 3072 and 32 heads)."""
    types = block_types(hf)
    return {**hf, "layers_block_type": types, "num_hidden_layers": len(types),
            "rms_norm_eps": hf.get("layer_norm_epsilon", hf.get("rms_norm_eps", 1e-5)),
            "head_dim": _first(hf, "head_dim", "attention_head_dim", default=128)}


def _first(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The block kinds, the Mamba2 widths and the MoE.

    Raises:
      ValueError: an activation, bias or sliding window this network does not run.
    """
    types = hf["layers_block_type"]
    if hf.get("mlp_hidden_act", "relu2") != "relu2" or hf.get("mamba_hidden_act",
                                                               "silu") != "silu":
        raise ValueError("nemotron_h runs relu2 MLPs and silu Mamba2 layers only")
    if hf.get("mlp_bias") or hf.get("attention_bias") or hf.get("sliding_window"):
        raise ValueError("nemotron_h with MLP / attention biases or a sliding window is not "
                         "supported")
    out = {
        "linear_layers": tuple(t == "linear_attention" for t in types),
        "mlp_only_layers": tuple(t if t in ("mlp", "moe") else "" for t in types),
        "rope_layers": (False,) * len(types),
        **mamba2.mamba2_fields(
            int(hf.get("mamba_num_heads", 128)), int(hf.get("mamba_head_dim", 64)),
            int(_first(hf, "mamba_n_groups", "n_groups", default=8)),
            int(hf.get("ssm_state_size", 128)),
            int(_first(hf, "mamba_d_conv", "conv_kernel", default=4)),
            conv_bias=_first(hf, "mamba_conv_bias", "use_conv_bias", default=True),
            proj_bias=hf.get("use_bias") or hf.get("mamba_proj_bias"),
            dt_limit=_first(hf, "mamba_dt_limit", "time_step_limit")),
    }
    if "moe" in types:
        out.update(
            num_experts=int(hf["n_routed_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(hf["moe_shared_expert_intermediate_size"]),
            shared_expert_gate=False, router_scoring="sigmoid",
            expert_groups=int(hf.get("n_group", 1)), topk_groups=int(hf.get("topk_group", 1)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_latent_size=int(hf.get("moe_latent_size") or 0))
    return out


NEMOTRON_H = Family(
    name="nemotron_h",
    network=NETWORK,
    model_types=(
        ModelType(name="nemotron_h", features="hybrid: Mamba2 / attention (no rope) / ReLU² MLP "
                  "/ MoE blocks (`hybrid_override_pattern`); DeepSeek-V3 routing, latent "
                  "experts", parity_test="test_nemotron_h_logits_match_hf"),
    ),
    unwrap_hf=_normalized,
    hf_fields=_fields,
    hf_weights_for=_weight_rules,
)
