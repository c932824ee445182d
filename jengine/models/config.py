"""`ModelConfig`: one model's architecture, from an HF `config.json` dict (read by
`jengine.models.hf_config`) or a GGUF header.

One frozen dataclass covers every supported family; the family's record
(`jengine.models.registry`, by `model_type`) picks the network (`llama.py`, `gemma3.py`,
`deepseek.py`) and the switches pick the features (rope scaling,
partial and per-layer rope, attention/MLP biases, tied embeddings, per-layer sliding windows,
q/k norms, norm placement, Gemma's extra norms, the MoE MLP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# "freq_factors": explicit per-frequency divisors, as llama.cpp stores llama3 scaling in GGUF.
# "longrope" (Phi-3 / Phi-4-mini; "su" is its old name) and "dynamic" (NTK) depend on the
# position: a token at position p turns with the frequencies HF uses for a sequence of p + 1
# tokens (the long factors from `original_max_position_embeddings` on; the NTK base of p + 1),
# so a cached key never needs turning again (`layers.rope_token_inv_freq`; docs/models.md says
# where this equals HF).
# "yarn": static YaRN (HF's `_compute_yarn_parameters`), attention factor included.
# "mrope" (Qwen2-VL's older spelling of "default" with an `mrope_section`): three positions
# per token, each turning its section of the frequencies (`layers.mrope_tables`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope", "su", "yarn",
                        "dynamic", "mrope")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding parameters (HF's `rope_parameters` for one layer type)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None  # [D/2] divisors of inv_freq ("freq_factors")
    # longrope: the divisors from `original_max_position_embeddings` on (None: short only).
    long_factors: tuple[float, ...] | None = None
    attention_factor: float = 1.0  # scales the rotated dims of q and k (longrope's, yarn's)
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated dims
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the ramp's bounds outwards (HF's default)
    # Multimodal rope (Qwen2.5-VL): how many of the D/2 frequencies the time, row and column
    # positions each turn, in that order (cycled); None: one position per token.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: the row and column positions turn every third frequency (1, 4, ... and 2, 5,
    # ...) within 3 x their section, the time position the rest; False: contiguous runs.
    mrope_interleaved: bool = False

    @property
    def by_position(self) -> bool:
        """Whether the frequencies depend on the token's position (dynamic NTK, longrope with
        its long factors): `jengine.models.layers.rope_token_inv_freq` computes them per token."""
        return self.rope_type == "dynamic" or self.long_factors is not None

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, theta: float | None = None) -> RopeConfig:
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; "
                f"jengine supports {SUPPORTED_ROPE_TYPES}"
            )
        if rope_type in ("longrope", "su"):
            return cls._longrope(params, theta)
        if rope_type == "yarn":
            return cls._yarn(params, theta)
        if rope_type == "dynamic":  # HF grows the NTK base past max_position_embeddings
            params["original_max_position_embeddings"] = params["max_position_embeddings"]
        section = params.get("mrope_section")
        if rope_type == "mrope":
            rope_type = "default"
        return cls(
            mrope_section=tuple(int(s) for s in section) if section else None,
            mrope_interleaved=bool(params.get("mrope_interleaved", False)),
            theta=float(params.get("rope_theta", theta if theta is not None else 10000.0)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
            freq_factors=(
                tuple(float(f) for f in params["freq_factors"])
                if params.get("freq_factors") is not None else None
            ),
        )


    @classmethod
    def _longrope(cls, params: dict[str, Any], theta: float | None) -> RopeConfig:
        """HF's longrope: inv_freq divided by `short_factor` (by `long_factor` from
        `original_max_position_embeddings` on), cos/sin scaled by `attention_factor` (given, or
        HF's sqrt(1 + ln(factor) / ln(original)) with factor = max / original positions; the
        caller puts `max_position_embeddings` into `params` for that)."""
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or params["max_position_embeddings"] / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(
                1 + math.log(factor) / math.log(original))
        return cls(
            theta=float(params.get("rope_theta", theta if theta is not None else 10000.0)),
            rope_type="longrope",
            original_max_position_embeddings=original,
            freq_factors=tuple(float(f) for f in params["short_factor"]),
            long_factors=(tuple(float(f) for f in params["long_factor"])
                          if params.get("long_factor") else None),
            attention_factor=float(attention),
        )


    @classmethod
    def _yarn(cls, params: dict[str, Any], theta: float | None) -> RopeConfig:
        """HF's static YaRN: its attention factor given, or from `mscale` / `mscale_all_dim`,
        or 0.1 * ln(factor) + 1."""
        original = int(params.get("original_max_position_embeddings")
                       or params["max_position_embeddings"])
        factor = float(params.get("factor") or params["max_position_embeddings"] / original)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = params.get("attention_factor")
        if attention is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        return cls(
            theta=float(params.get("rope_theta", theta if theta is not None else 10000.0)),
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=float(attention),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture hyper-parameters shared by every family (names follow HF's config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    local_rope: RopeConfig | None = None  # rope of sliding-window layers when it differs (Gemma 3)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm (weight x, over head_dim) on each q and k head
    # OLMo 2: RMSNorm over the whole projected q (H*D) and k (K*D) width, before rope; and the
    # layer norms on the attention / MLP outputs instead of their inputs.
    qk_norm_full: bool = False
    post_norms: bool = False
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * this dims (Phi-4-mini)
    rope_layers: tuple[bool, ...] = ()  # per layer: False where no rope applies (NoPE); () = all
    # Llama 4: a weightless RMSNorm on q and k after the rope, on the rope layers only; on the
    # NoPE layers q scaled by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1
    # (`attn_temperature` = (floor_scale, attn_scale)); the rope layers attend within
    # `attention_chunk_size`-token chunks (key // chunk == query // chunk), the NoPE layers to
    # everything. The engine drops the chunk where the context fits in one (`core.build`).
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    attention_chunk_size: int | None = None
    # Sparse MoE MLP (Mixtral, Qwen3-MoE) on every layer when num_experts > 0: each token runs
    # the `num_experts_per_tok` experts of highest softmax router probability, weighted by
    # those probabilities (renormalised to sum 1 with `norm_topk_prob`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # width of one expert's MLP
    norm_topk_prob: bool = False
    # Qwen2-MoE: one more MLP every token runs, scaled by sigmoid(h . shared gate vector);
    # GLM-4.5's and DeepSeek's run it un-gated (`shared_expert_gate` False).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True
    # Qwen3-Next (`models/qwen3_next.py`): per layer, True where the MLP is dense among sparse
    # ones (HF's `mlp_only_layers` / `decoder_sparse_step`); () when every layer is sparse.
    dense_mlp_layers: tuple[bool, ...] = ()
    # DeepSeek-V2's multi-head latent attention (`kv_lora_rank` > 0; models/deepseek.py): the
    # cache holds one row per token, the latent (kv_lora_rank) and the shared rope key
    # (qk_rope_head_dim), as one kv head of width `head_dim` = their sum. q_lora_rank 0: no
    # low-rank q. Its MoE: the first `first_dense_layers` layers dense, then routed experts
    # (weights x routed_scaling_factor; `expert_groups` > 0: group-limited greedy, the experts of
    # the best `topk_groups` groups only) plus un-gated shared experts.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_dense_layers: int = 0
    routed_scaling_factor: float = 1.0
    expert_groups: int = 0
    topk_groups: int = 0
    # DeepSeek-V3's router ("sigmoid", its `noaux_tc`): sigmoid scores; the experts and groups
    # are chosen by score + a per-expert bias (`router_bias`), a group ranked by its two best,
    # and the chosen experts weighted by their unbiased scores (renormalised with
    # `norm_topk_prob`). "softmax": DeepSeek-V2's. "llama4": the top k of the logits, each
    # expert's input scaled by sigmoid(its logit) (not its output).
    router_scoring: str = "softmax"
    # gpt-oss: a learned sink logit per q head in every attention softmax's denominator
    # (`attention_sinks`); its router ("gpt_oss": softmax over the top k of the biased logits)
    # feeds experts with biases and the clamped SwiGLU (`swiglu_limit` > 0): gate clamped above
    # at the limit, up within +-limit, (up + 1) * gate * sigmoid(`swiglu_alpha` * gate), from one
    # fused gate/up weight whose columns interleave gate and up as the checkpoint stores them.
    attention_sinks: bool = False
    swiglu_limit: float = 0.0  # 0: Llama's SwiGLU experts
    swiglu_alpha: float = 1.0
    # DeepSeek-V3's multi-token-prediction layers after the last layer: their weights skipped.
    mtp_layers: int = 0
    # Granite's scalars: embeddings x embedding_multiplier, each residual branch x
    # residual_multiplier, softmax scale = attention_multiplier, logits / logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where the sliding window applies
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale is this ** -0.5
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gated DeltaNet hybrids (Qwen3.5, `models/qwen3_5.py`): True for each layer whose token
    # mixer is a linear-attention layer (its recurrent state in `KVCache.conv` / `.ssm`, no KV
    # pages); its causal conv width, key / value heads and head widths. `attn_output_gate`:
    # the full-attention layers' output x sigmoid(a gate projected beside q).
    linear_layers: tuple[bool, ...] = ()
    linear_conv_kernel: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    attn_output_gate: bool = False
    # Mamba2 hybrids (Granite 4, Nemotron-H; `models/mamba2.py`): `linear_mixer` "mamba2" makes
    # the linear layers Mamba2 mixers, whose widths the fields above hold as: linear_k_heads =
    # n_groups, linear_k_dim = d_state (B and C), linear_v_heads / linear_v_dim = the SSM heads
    # and their width (x), so the conv's channels and the [Dk, Dv] state per head keep their
    # shapes. `mamba_conv_bias`: the conv adds a bias; `mamba_dt_limit`: the time step clamped
    # to it (None: not clamped). `mlp_only_layers`: per layer, Nemotron-H's "mlp" or "moe" for
    # a layer that is only an MLP (no token mixer: neither pages nor state), "" for the others;
    # its experts' inputs go through a `moe_latent_size`-wide projection where that is > 0.
    linear_mixer: str = "gated_deltanet"  # gated_deltanet | mamba2
    mamba_conv_bias: bool = False
    mamba_dt_limit: tuple[float, float] | None = None
    mlp_only_layers: tuple[str, ...] = ()
    moe_latent_size: int = 0
    # Set only under tensor parallelism with replicated kv heads (jengine.sharding): num_heads
    # is then padded to a multiple of tp and this names the kv head of every q head.
    kv_head_map: tuple[int, ...] | None = None
    padded_heads: int = 0  # how many of num_heads are those zero heads (OLMo 2's norm skips them)
    # Gemma 4's global layers: `head_dim` and `num_kv_heads` are the cache's, the widest; the
    # sliding layers' narrower heads (0: head_dim) and the global layers' fewer KV heads (0:
    # num_kv_heads) are zero-padded / repeated into it; `global_values_are_keys`: no v_proj.
    sliding_head_dim: int = 0
    global_kv_heads: int = 0
    global_values_are_keys: bool = False
    # The attention implementation the forward pass calls (resolved by the engine, never auto).
    attention_backend: str = "reference"  # reference | cpu | pallas_tpu | pallas_gpu
    # The projections' implementation (resolved by the engine, never auto): xla | native (the
    # small-row kernel, one CPU device) | amx (native + bf16 projections on the AMX tiles);
    # jengine.models.matmul.resolve_matmul_backend.
    matmul_backend: str = "xla"
    # The platform the step programs are built for: None is JAX's default backend (where the
    # engine runs). Lowering for another one on this machine (`jax.export` to cuda or tpu from a
    # CPU: tests/runtime/test_step_lowering.py, scripts/gpu_step_profile.py --dump) names it,
    # so the Pallas kernels are built for it rather than interpreted, and `branches` is its own.
    platform: str | None = None

    @property
    def branches(self) -> bool:
        """Whether the step may branch on data (`lax.cond` / `lax.switch`): on XLA:CPU only,
        where skipping unused work pays and a conditional costs nothing. On a GPU each one
        copies its predicate to the host and waits, stalling the asynchronous dispatch, so the
        accelerators' steps hold none: the host picks program variants (`step_io.Variant`)
        and the rest is selects."""
        import jax  # noqa: PLC0415 - the config module stays importable without a backend

        return (self.platform or jax.default_backend()) == "cpu"

    @property
    def sm_scale(self) -> float:
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        scalar = self.query_pre_attn_scalar or self.head_dim
        return float(scalar) ** -0.5

    @property
    def num_linear_layers(self) -> int:
        """The Gated DeltaNet layers (0 for a pure-attention model)."""
        return sum(self.linear_layers)

    @property
    def num_kv_layers(self) -> int:
        """The layers that keep KV pages: all but the linear-attention and MLP-only ones."""
        return self.num_layers - self.num_linear_layers - sum(map(bool, self.mlp_only_layers))

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: its q, k and v side by side."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention: the cache stores latent rows, no separate values."""
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_params(self) -> int:
        e, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n, dense = self.num_layers, 3 * e * f
        mlps = n * dense
        if self.num_experts:
            sparse = _sparse_mlp_params(self)
            if self.swiglu_limit:  # gpt-oss: the experts' biases and the router's
                sparse += self.num_experts * (2 * self.moe_intermediate_size + e + 1)
            mlps = self.first_dense_layers * dense + (n - self.first_dense_layers) * sparse
        attn = e * (q + 2 * kv) + q * e + 2 * e
        attn += (q + 2 * kv if self.qkv_bias else 0) + (e if self.o_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        attn += self.num_heads if self.attention_sinks else 0
        head = 0 if self.tie_word_embeddings else e * v
        if self.latent_attention:
            return v * e + _mla_layers_params(self) + e + head
        if self.linear_mixer == "mamba2":
            return v * e + _mamba2_layers_params(self) + e + head
        if self.num_linear_layers:
            return v * e + _hybrid_layers_params(self) + e + head
        return v * e + n * attn + mlps + e + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        for key in ("rope", "local_rope"):
            if d.get(key) is not None:
                rope = dict(d[key])
                for factors in ("freq_factors", "long_factors"):
                    if rope.get(factors) is not None:
                        rope[factors] = tuple(rope[factors])
                d[key] = RopeConfig(**rope)
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        d["rope_layers"] = tuple(d.get("rope_layers", ()))
        d["linear_layers"] = tuple(d.get("linear_layers", ()))
        d["dense_mlp_layers"] = tuple(d.get("dense_mlp_layers", ()))
        d["mlp_only_layers"] = tuple(d.get("mlp_only_layers", ()))
        if d.get("mamba_dt_limit") is not None:
            d["mamba_dt_limit"] = tuple(d["mamba_dt_limit"])
        if d.get("attn_temperature") is not None:
            d["attn_temperature"] = tuple(d["attn_temperature"])
        if d.get("kv_head_map") is not None:
            d["kv_head_map"] = tuple(d["kv_head_map"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _mla_layers_params(cfg: ModelConfig) -> int:
    """DeepSeek-V2's parameters in all layers (attention, norms, dense and MoE MLPs)."""
    e, h, c, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + r
    q = e * h * qk if not cfg.q_lora_rank else cfg.q_lora_rank * (e + 1 + h * qk)
    attn = q + e * (c + r) + c + c * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attn += h * cfg.v_head_dim * e + 2 * e
    dense = 3 * e * cfg.intermediate_size
    sparse = cfg.num_experts * (3 * e * cfg.moe_intermediate_size + e)
    sparse += 3 * e * cfg.shared_expert_intermediate_size
    moe_layers = cfg.num_layers - cfg.first_dense_layers
    return cfg.num_layers * attn + cfg.first_dense_layers * dense + moe_layers * sparse


def _sparse_mlp_params(cfg: ModelConfig) -> int:
    """One MoE layer's weights: router and experts, the shared expert and its gate."""
    e, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
    sparse = cfg.num_experts * (3 * e * cfg.moe_intermediate_size + e) + 3 * e * shared
    return sparse + (e if shared and cfg.shared_expert_gate else 0)


def _hybrid_layers_params(cfg: ModelConfig) -> int:
    """Weights of a Gated DeltaNet hybrid's layers (Qwen3.5, Qwen3-Next): norms and an MLP or
    MoE on every layer, the gated attention on the others, the linear-attention mixer on the
    linear ones."""
    e, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn = e * (2 * q + 2 * kv) + q * e + 2 * d
    hv, vd = cfg.linear_v_heads, cfg.linear_v_heads * cfg.linear_v_dim
    conv = cfg.linear_conv_dim
    linear = e * (conv + vd + 2 * hv) + conv * cfg.linear_conv_kernel + 2 * hv
    linear += cfg.linear_v_dim + vd * e
    sparse = cfg.num_layers - sum(cfg.dense_mlp_layers) if cfg.num_experts else 0
    mlps = (cfg.num_layers - sparse) * 3 * e * cfg.intermediate_size  # the dense MLPs
    if sparse:  # Qwen3-Next's MoE layers
        mlps += sparse * _sparse_mlp_params(cfg)
    n_lin = cfg.num_linear_layers
    return (cfg.num_layers * 2 * e + mlps + n_lin * linear
            + (cfg.num_layers - n_lin) * attn)


def _mamba2_layers_params(cfg: ModelConfig) -> int:
    """Weights of a Mamba2 hybrid's layers (Granite 4: a norm + mixer and a norm + MLP each;
    Nemotron-H: a norm + one of Mamba2, attention, MLP or MoE each)."""
    e, d, h = cfg.hidden_size, cfg.head_dim, cfg.linear_v_heads
    inner, conv = h * cfg.linear_v_dim, cfg.linear_conv_dim
    mamba = e * (inner + conv + h) + conv * cfg.linear_conv_kernel + 3 * h + inner + inner * e
    mamba += conv if cfg.mamba_conv_bias else 0
    attn = 2 * e * (cfg.num_heads + cfg.num_kv_heads) * d
    n_lin, n_attn = cfg.num_linear_layers, cfg.num_kv_layers
    mixers = n_lin * mamba + n_attn * attn
    x, shared = cfg.num_experts, cfg.shared_expert_intermediate_size
    if cfg.mlp_only_layers:  # Nemotron-H: ReLU² MLPs (up, down), latent experts
        kinds = cfg.mlp_only_layers
        lat = cfg.moe_latent_size or e
        experts = x * (e + 2 * lat * cfg.moe_intermediate_size) + 2 * e * shared
        experts += 2 * e * cfg.moe_latent_size
        mlps = kinds.count("mlp") * 2 * e * cfg.intermediate_size + kinds.count("moe") * experts
        return cfg.num_layers * e + mixers + mlps
    if x:  # Granite 4: SwiGLU experts + the shared expert
        mlp = x * (e + 3 * e * cfg.moe_intermediate_size) + 3 * e * shared
    else:
        mlp = 3 * e * cfg.intermediate_size
    return cfg.num_layers * (2 * e + mlp) + mixers
