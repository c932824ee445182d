"""The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next and Granite-MoE.

Routing is HF's, step for step: router logits [T, X] -> softmax in float32 -> the top
`num_experts_per_tok` probabilities (`lax.top_k`: exactly k, ties broken towards the lower
expert index; `torch.topk` on CPU follows no index rule for exact ties, so under an exact tie
the two may keep different, equally weighted experts) -> renormalised to sum 1 where the
family does (`norm_topk_prob`: always for Mixtral; Granite-MoE's softmax over the top-k
logits is the same weights; a config switch for Qwen2/3-MoE). Each token's
output is the weighted sum of its chosen experts' SwiGLU MLPs, plus (Qwen2-MoE) a shared
expert's MLP that every token runs, scaled by sigmoid(h . `ws_router`).

DeepSeek-V2 routes its own way (`route_deepseek`, which its network passes to `moe_mlp`): the
router logits in float32, softmax, then either the top k (greedy) or, with `expert_groups` > 0,
the top k among the experts of the `topk_groups` groups whose best expert scores highest
(group-limited greedy); the chosen probabilities are scaled by `routed_scaling_factor`, never
renormalised (HF's DeepSeek-V2 ignores `norm_topk_prob`). Its shared experts are one MLP every
token runs, without a gate. Its first `first_dense_layers` layers have a dense MLP instead, so
the MoE weights stack only the layers after them. DeepSeek-V3's router (`router_scoring`
"sigmoid") scores by sigmoid and lets a per-expert bias pick the groups and experts but not
weigh them (`_route_sigmoid`).

The experts are three stacked weights with a logical `experts` axis, `we_gate`/`we_up`
[L, X, E, F] and `we_down` [L, X, F, E]. Two exact ways compute them, picked statically from the
bucket's token count T (both give HF's sums; only float32 rounding differs):
- `gather` (T * k <= X, decode-sized steps): each of the T * k (token, expert) pairs gathers its
  expert's weights and runs one small matmul: reads T * k experts instead of all X.
- `dense` (larger steps): every token through every expert, [T, X, F], combined with a [T, X]
  weight matrix that is zero off the chosen experts. It does X / k times the useful work, but
  it is plain batched matmuls. A sort by expert + grouped matmul (`lax.ragged_dot`) would do
  only the useful work, but XLA:CPU lowers `ragged_dot` to a masked dot over all experts.
Measured on XLA:CPU (`experiments/moe_bench.py`, X=64, k=8, E=1024, F=384, median ms per layer,
2 shared cores): T=1 gather 69 / dense 403 / ragged 468; T=4 152 / 353 / 409; T=8 (T*k = X)
692 / 682 / 644; T=16 641 / 501 / 738; T=64 2386 / 755 / 1841. Gather wins while T*k < X,
the three meet at T*k = X, dense wins beyond; ragged never wins there.

Under tensor parallelism the experts shard on their MLP axis (`mlp` -> tp): every device holds
every expert's slice of columns, computes its part of each expert's MLP for all tokens, and the
`we_down` contraction over the sharded F axis ends in one all-reduce, as the dense MLP does.
The router is replicated, so every device routes identically. (An `ep` mesh axis would shard
`experts` instead; not built.)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec
from jengine.models.matmul import dot


def param_specs(cfg: ModelConfig, *, gated_shared: bool = True) -> dict[str, ParamSpec]:
    """The router and the stacked experts of every layer; the shared expert's gate vector with
    `gated_shared` (Qwen2-MoE gates its shared expert per token; DeepSeek's are not gated)."""
    n, e, x = cfg.num_layers - cfg.first_dense_layers, cfg.hidden_size, cfg.num_experts
    f = cfg.moe_intermediate_size
    specs = {
        "router": ParamSpec((n, e, x), ("layers", "embed", "experts")),
        "we_gate": ParamSpec((n, x, e, f), ("layers", "experts", "embed", "mlp")),
        "we_up": ParamSpec((n, x, e, f), ("layers", "experts", "embed", "mlp")),
        "we_down": ParamSpec((n, x, f, e), ("layers", "experts", "mlp", "embed")),
    }
    shared = cfg.shared_expert_intermediate_size
    if shared:
        specs.update({
            "ws_gate": ParamSpec((n, e, shared), ("layers", "embed", "mlp")),
            "ws_up": ParamSpec((n, e, shared), ("layers", "embed", "mlp")),
            "ws_down": ParamSpec((n, shared, e), ("layers", "mlp", "embed")),
        })
        if gated_shared:
            specs["ws_router"] = ParamSpec((n, e), ("layers", "embed"))
    if cfg.router_scoring in ("sigmoid", "gpt_oss"):
        specs["router_bias"] = ParamSpec((n, x), ("layers", "experts"), "zeros")
    if cfg.swiglu_limit:  # gpt-oss: gate and up in one weight, columns interleaved; biases
        del specs["we_gate"], specs["we_up"]
        specs["we_gate_up"] = ParamSpec((n, x, e, 2 * f), ("layers", "experts", "embed", "mlp"))
        specs["be_gate_up"] = ParamSpec((n, x, 2 * f), ("layers", "experts", "mlp"), "zeros")
        specs["be_down"] = ParamSpec((n, x, e), ("layers", "experts", "embed"), "zeros")
    return specs


LAYER_KEYS = ("router", "router_bias", "we_gate", "we_up", "we_down", "ws_router", "ws_gate",
              "ws_up", "ws_down", "we_gate_up", "be_gate_up", "be_down")


def layer_offsets(cfg: ModelConfig, dense_keys: tuple[str, ...]) -> dict[str, int]:
    """The first layer of each weight that stacks only some layers when the first
    `first_dense_layers` layers are dense (DeepSeek, GLM-4.5): the dense MLP's `dense_keys` from
    0, the MoE's from `first_dense_layers`; {} when every layer is of one kind (see
    `layers.unstack_layers`, `converters.tables.lookup`)."""
    if cfg.first_dense_layers in (0, cfg.num_layers):
        return {}
    offsets = dict.fromkeys(dense_keys, 0)
    offsets.update(dict.fromkeys(LAYER_KEYS, cfg.first_dense_layers))
    return offsets


def router_of(cfg: ModelConfig):
    """The routing function `moe_mlp` takes for `cfg`: DeepSeek's (and GLM-4.5's, which is
    DeepSeek-V3's) where the scores are sigmoid, Llama 4's, HF's softmax top-k otherwise."""
    return {"sigmoid": route_deepseek, "llama4": route_llama4,
            "gpt_oss": route_gpt_oss}.get(cfg.router_scoring, route)


def route_gpt_oss(h: jax.Array, router: jax.Array, cfg: ModelConfig, bias: jax.Array):
    """gpt-oss's router: the top k of the biased logits (in the model dtype, as HF's Linear),
    their weights the softmax over those k alone."""
    logits = (dot("te,ex->tx", h, router) + bias.astype(jnp.float32)).astype(h.dtype)
    top, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    return experts, jax.nn.softmax(top.astype(jnp.float32), axis=-1)


def route_llama4(h: jax.Array, router: jax.Array, cfg: ModelConfig):
    """Llama 4's router: the top k of the logits (in the model dtype, as HF's Linear), each
    weighted by the sigmoid of its logit; `moe_mlp` scales the expert's input by it."""
    logits = dot("te,ex->tx", h, router).astype(h.dtype)
    top, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    return experts, jax.nn.sigmoid(top.astype(jnp.float32)).astype(h.dtype)


def route(h: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """[T, E] -> (chosen experts [T, k] int32, their weights [T, k] float32), as HF routes."""
    logits = dot("te,ex->tx", h, router).astype(h.dtype)  # HF's router runs in the model dtype
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights


def route_deepseek(h: jax.Array, router: jax.Array, cfg: ModelConfig, bias=None):
    """DeepSeek-V2's router: float32 logits and softmax; greedy or group-limited top k; the
    weights scaled by `routed_scaling_factor`. With `router_scoring` "sigmoid", V3's
    (`_route_sigmoid`)."""
    logits = dot("te,ex->tx", h.astype(jnp.float32), router.astype(jnp.float32))
    if cfg.router_scoring == "sigmoid":
        return _route_sigmoid(logits, bias, cfg)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, X]
    if cfg.expert_groups:
        groups = probs.reshape(probs.shape[0], cfg.expert_groups, -1)  # [T, G, X/G]
        _, best = jax.lax.top_k(jnp.max(groups, axis=-1), cfg.topk_groups)  # [T, topk_groups]
        keep = jnp.sum(jax.nn.one_hot(best, cfg.expert_groups, dtype=jnp.bool_), axis=1)  # [T, G]
        probs = jnp.where(keep[:, :, None], groups, 0.0).reshape(probs.shape)  # HF's 0 fill
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    return experts, weights * cfg.routed_scaling_factor


def _route_sigmoid(logits: jax.Array, bias: jax.Array, cfg: ModelConfig):
    """DeepSeek-V3's `noaux_tc` routing over float32 logits [T, X]: the bias steers which experts
    are chosen (groups ranked by the sum of their two best biased scores, the others masked to
    -inf), never how much they weigh."""
    scores = jax.nn.sigmoid(logits)  # [T, X]
    choice = scores + bias.astype(jnp.float32)[None, :]
    if cfg.expert_groups > 1:
        groups = choice.reshape(choice.shape[0], cfg.expert_groups, -1)  # [T, G, X/G]
        group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, G]
        _, best = jax.lax.top_k(group_scores, cfg.topk_groups)
        keep = jnp.sum(jax.nn.one_hot(best, cfg.expert_groups, dtype=jnp.bool_), axis=1)
        choice = jnp.where(keep[:, :, None], groups, -jnp.inf).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts, weights * cfg.routed_scaling_factor


def moe_mlp(h: jax.Array, p: dict[str, jax.Array], cfg: ModelConfig, *,
            router: Callable[[jax.Array, jax.Array, ModelConfig], tuple[jax.Array, jax.Array]]
            = route) -> jax.Array:
    """[T, E] -> [T, E]: the routed experts' SwiGLU MLPs, weighted and summed per token, chosen
    by `router` (`route`, or `route_deepseek`)."""
    with jax.named_scope("moe"):
        if "router_bias" in p:
            experts, weights = router(h, p["router"], cfg, p["router_bias"])
        else:
            experts, weights = router(h, p["router"], cfg)
        num_tokens, k = experts.shape
        gather = num_tokens * k <= cfg.num_experts
        if cfg.swiglu_limit:
            out = _clamped_experts(h, p, experts, weights, cfg, gather)
        elif cfg.router_scoring == "llama4":
            out = _experts_of_scaled_inputs(h, p, experts, weights, cfg.num_experts, gather)
        elif gather:
            out = _gather_experts(h, p, experts, weights)
        else:
            out = _dense_experts(h, p, experts, weights, cfg.num_experts)
        if "ws_gate" in p:
            out = out + _shared_expert(h, p)
        return out


def _shared_expert(h, p) -> jax.Array:
    """The shared expert: a SwiGLU MLP, gated per token by sigmoid(h . ws_router) where the
    family has that gate (Qwen2-MoE)."""
    gate = dot("te,ef->tf", h, p["ws_gate"]).astype(h.dtype)
    up = dot("te,ef->tf", h, p["ws_up"]).astype(h.dtype)
    mlp = dot("tf,fe->te", jax.nn.silu(gate) * up, p["ws_down"]).astype(h.dtype)
    if "ws_router" not in p:
        return mlp
    scale = jax.nn.sigmoid(dot("te,e->t", h, p["ws_router"]).astype(h.dtype))
    return mlp * scale[:, None]


def _gather_experts(h, p, experts, weights) -> jax.Array:
    """Each (token, chosen expert) pair through that expert's gathered weights."""
    gate = dot("te,tkef->tkf", h, p["we_gate"][experts])  # [T, k, F]
    up = dot("te,tkef->tkf", h, p["we_up"][experts])
    act = jax.nn.silu(gate.astype(h.dtype)) * up.astype(h.dtype)
    out = dot("tkf,tkfe->tke", act, p["we_down"][experts])  # [T, k, E]
    return jnp.einsum("tke,tk->te", out, weights).astype(h.dtype)


def _experts_of_scaled_inputs(h, p, experts, weights, num_experts: int, gather: bool):
    """Llama 4's experts: each runs on the token scaled by its routing weight, and their
    outputs add up unweighted (an unchosen expert's input is zero, and so is its output)."""
    if gather:
        x = h[:, None, :] * weights[:, :, None]  # [T, k, E]
        gate = dot("tke,tkef->tkf", x, p["we_gate"][experts])
        up = dot("tke,tkef->tkf", x, p["we_up"][experts])
        act = jax.nn.silu(gate.astype(h.dtype)) * up.astype(h.dtype)
        return jnp.sum(dot("tkf,tkfe->tke", act, p["we_down"][experts]), axis=1).astype(h.dtype)
    combine = jnp.einsum("tk,tkx->tx", weights.astype(jnp.float32),
                         jax.nn.one_hot(experts, num_experts, dtype=jnp.float32))
    x = h[:, None, :] * combine[:, :, None].astype(h.dtype)  # [T, X, E]
    gate = dot("txe,xef->txf", x, p["we_gate"])
    up = dot("txe,xef->txf", x, p["we_up"])
    act = jax.nn.silu(gate.astype(h.dtype)) * up.astype(h.dtype)
    return dot("txf,xfe->te", act, p["we_down"]).astype(h.dtype)


def _dense_experts(h, p, experts, weights, num_experts: int) -> jax.Array:
    """Every token through every expert; the [T, X] combine matrix is zero off the chosen ones."""
    gate = dot("te,xef->txf", h, p["we_gate"])  # [T, X, F]
    up = dot("te,xef->txf", h, p["we_up"])
    act = jax.nn.silu(gate.astype(h.dtype)) * up.astype(h.dtype)
    combine = jnp.einsum("tk,tkx->tx", weights,
                         jax.nn.one_hot(experts, num_experts, dtype=jnp.float32))
    act = act * combine[:, :, None].astype(h.dtype)  # unchosen experts contribute exact zeros
    return dot("txf,xfe->te", act, p["we_down"]).astype(h.dtype)


def clamped_swiglu(gate_up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """gpt-oss's activation of [..., 2F] interleaved (gate, up) columns -> [..., F]: the gate
    clamped above at `swiglu_limit`, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate_up[..., 0::2], cfg.swiglu_limit)
    up = jnp.clip(gate_up[..., 1::2], -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def _clamped_experts(h, p, experts, weights, cfg: ModelConfig, gather: bool) -> jax.Array:
    """gpt-oss's experts, with biases: each chosen expert's clamped-SwiGLU MLP, weighted by its
    routing weight. The dense way weighs the activations before the down projection and adds
    the down biases through the same combine matrix (sum_x w_x (a_x W_x + b_x))."""
    if gather:
        gate_up = dot("te,tkef->tkf", h, p["we_gate_up"][experts]).astype(h.dtype)
        act = clamped_swiglu(gate_up + p["be_gate_up"][experts], cfg)  # [T, k, F]
        out = dot("tkf,tkfe->tke", act, p["we_down"][experts]).astype(h.dtype)
        out = out + p["be_down"][experts]  # [T, k, E]
        return jnp.einsum("tke,tk->te", out, weights.astype(out.dtype)).astype(h.dtype)
    combine = jnp.einsum("tk,tkx->tx", weights,
                         jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.float32))
    gate_up = dot("te,xef->txf", h, p["we_gate_up"]).astype(h.dtype)  # [T, X, 2F]
    act = clamped_swiglu(gate_up + p["be_gate_up"][None], cfg)
    act = act * combine[:, :, None].astype(h.dtype)
    out = dot("txf,xfe->te", act, p["we_down"]).astype(h.dtype)
    return out + jnp.einsum("tx,xe->te", combine.astype(h.dtype), p["be_down"])
