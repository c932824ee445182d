"""Building blocks shared by the model families: norms, rotary embeddings, parameter specs,
projections (their dots: jengine.models.matmul), layer layouts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels.rms_norm import rms_norm as native_rms_norm
from jengine.models import quant
from jengine.models.config import RopeConfig
from jengine.models.matmul import AmxPacked, Weight, dot, packed_rows


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight, declared once: shape, logical axis names and initializer.

    The NNX module, the abstract tree, the shardings and the checkpoint layout all derive from it.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"  # normal | zeros | ones
    # The axes a projection contracts with the activations (e.g. (1,) for wq [L, E, H, D]);
    # set on the weights `quantization` may store as int8, one scale per remaining index.
    contract: tuple[int, ...] = ()


def random_params(specs: dict[str, ParamSpec], dtype, shardings: dict | None = None, *,
                  seed: int = 0) -> dict[str, jax.Array]:
    """Random weights of the declared shapes, made on their devices (each shard where it lives,
    nothing on the host): `normal` weights N(0, 0.02), `ones` and `zeros` as named. What
    `load_format="dummy"` serves, for timing a model whose weights are not at hand."""
    out = {}
    for i, (name, spec) in enumerate(specs.items()):
        def make(key, spec=spec):
            if spec.init == "ones":
                return jnp.ones(spec.shape, dtype)
            if spec.init == "zeros":
                return jnp.zeros(spec.shape, dtype)
            return (jax.random.normal(key, spec.shape, jnp.float32) * 0.02).astype(dtype)

        sharding = shardings[name] if shardings is not None else None
        out[name] = jax.jit(make, out_shardings=sharding)(jax.random.key(seed + i))
    return out


def row_sum(v: jax.Array, axis: int = -1) -> jax.Array:
    """The sum over `axis` (kept, as size 1), in an order that depends on that axis' length
    alone: zero-padded to a power of two, then halves added elementwise until one is left.

    XLA:CPU's reduce sums a row in another order once there are 8 or more rows (it vectorises
    across them), so a token's norm came out a bit different in an 8-row step than alone
    (2026-12-04: 33 of 80 rows at 576 wide), enough to change later bf16 tokens where a
    speculative verification recomputes decodes 8 at a time. Elementwise adds have one order."""
    v = jnp.moveaxis(v, axis, -1)
    n = v.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:  # zeros add nothing, exactly
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        v = v[..., :width] + v[..., width:]
    return jnp.moveaxis(v, -1, axis)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: float = 0.0,
             backend: str = "xla") -> jax.Array:
    """RMSNorm in float32; Gemma scales by (1 + weight) (`offset=1`), Llama by weight. The mean
    of squares is `row_sum`'s, so a row normalises to the same bits in any batch. With the
    native CPU kernels (`backend` "native" or "amx", the matmul backend's) the native norm
    computes it in one call, also batch-invariant (`cpu_kernels.rms_norm`)."""
    with jax.named_scope("norm"):  # the scopes name the parts in profiles (scripts/)
        if backend in ("native", "amx"):
            return native_rms_norm(x, weight, eps, offset)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(row_sum(x32 * x32) / x.shape[-1] + eps)
        if offset:
            return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
        return weight * normed.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[D/2] inverse frequencies, with linear or llama3 scaling applied (as HF computes them)."""
    # float32 throughout, as HF computes it, so positions far out round the same way.
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
    if rope.rope_type in ("freq_factors", "longrope"):
        inv = inv / np.asarray(rope.freq_factors, np.float32)
    elif rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv = _yarn_inv_freq(inv, rope, head_dim)
    return inv.astype(np.float32)


def rope_token_inv_freq(rope: RopeConfig, head_dim: int, positions: jax.Array) -> jax.Array:
    """[T, R/2] frequencies of a rope whose frequencies depend on the position
    (`RopeConfig.by_position`): a token at position p turns as HF turns every token of a
    sequence p + 1 long. longrope: the short factors below `original_max_position_embeddings`,
    the long ones from there on; dynamic NTK: HF's base for p + 1 tokens,
    theta * (factor * n / original - (factor - 1)) ** (R / (R - 2)), n = max(p + 1, original),
    in float32 as HF computes it. A key's rotation so depends on its position alone."""
    if rope.rope_type != "dynamic":
        short = jnp.asarray(rope_inv_freq(rope, head_dim))
        long = jnp.asarray(rope_inv_freq(dataclasses.replace(rope, freq_factors=rope.long_factors),
                                         head_dim))
        past = positions >= rope.original_max_position_embeddings
        return jnp.where(past[:, None], long[None, :], short[None, :])
    original = rope.original_max_position_embeddings
    n = jnp.maximum(positions + 1, original).astype(jnp.float32)  # [T]
    base = rope.theta * ((rope.factor * n / original) - (rope.factor - 1)) ** (
        head_dim / (head_dim - 2))
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # [R/2]
    return 1.0 / (base[:, None] ** exponent[None, :])


def _yarn_inv_freq(inv: np.ndarray, rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN: frequencies below the ramp interpolated (divided by `factor`), above it kept,
    blended linearly across it; the ramp's bounds are the dims that turn `beta_fast` and
    `beta_slow` times over the original context (HF's `find_correction_range`)."""
    def turns_dim(turns: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = turns_dim(rope.beta_fast), turns_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp
    pos = np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    interpolated = np.float32(1.0) / (np.float32(rope.factor) * pos)
    return interpolated * (np.float32(1) - keep) + inv * keep


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scale: float | jax.Array = 1.0) -> jax.Array:
    """Rotates [T, H, D] by position, HF's rotate-half layout (first half / second half).

    `inv_freq` is [R/2], or [T, R/2] for frequencies that depend on the position
    (`rope_token_inv_freq`). With fewer frequencies than D / 2 (partial rotary, R < D) only the
    first R dims turn and the rest pass through, as HF's Phi-3 does. `scale` multiplies cos and
    sin (longrope's attention factor): the rotated dims grow by it, the others do not."""
    with jax.named_scope("rope"):
        per_token = inv_freq if inv_freq.ndim == 2 else inv_freq[None, :]
        angles = positions.astype(jnp.float32)[:, None] * per_token  # [T, R/2]
        return rotate(x, jnp.cos(angles), jnp.sin(angles), scale)


def rope_rows(inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows [U, R/2] of per-layer rope frequencies [L, R/2], and each layer's
    index among them [L] int32: the rows `rope_tables` turns into cos and sin once a step."""
    rows, index = np.unique(inv_freq, axis=0, return_inverse=True)
    return rows, index.reshape(-1).astype(np.int32)


def rope_tables(positions: jax.Array, inv_freq_rows: jax.Array, *,
                barrier: bool = True) -> tuple[jax.Array, jax.Array]:
    """cos and sin [U, T, R/2] of each row of frequencies [U, R/2] at the step's positions [T],
    for `rotate`: made once a step for all layers that share frequencies.

    XLA:CPU fuses an elementwise producer into each of its consumers, so left to itself it
    computes the same sines and cosines again inside every layer's rope (~0.9 ms a layer of a
    512-token chunk on CPU, a tenth of the step; an optimization barrier is gone before fusion
    runs). With `barrier` (`ModelConfig.branches`: XLA:CPU) the tables come out of a
    conditional, whose result is a buffer its consumers read; the predicate is always true but
    is data, so the conditional is not folded away. Elsewhere the tables are plain values: on a
    GPU a conditional waits on the host for its predicate, and XLA:GPU's fusion decides alone."""
    def tables():
        angles = positions.astype(jnp.float32)[None, :, None] * inv_freq_rows[:, None, :]
        return jnp.cos(angles), jnp.sin(angles)

    with jax.named_scope("rope"):
        if not barrier:
            return tables()
        shape = (inv_freq_rows.shape[0], positions.shape[0], inv_freq_rows.shape[1])
        zeros = lambda: (jnp.zeros(shape, jnp.float32),) * 2  # noqa: E731
        return jax.lax.cond(positions[0] > jnp.iinfo(jnp.int32).min, tables, zeros)


def mrope_axes(section: tuple[int, ...], interleaved: bool, half: int) -> np.ndarray:
    """[R/2] which of a token's (time, row, column) positions turns each rope frequency: runs
    of `section` cycling through the three (Qwen2.5-VL), or, `interleaved`, every third one
    within 3 x its section for rows (from 1) and columns (from 2), time elsewhere (Qwen3-VL)."""
    if interleaved:
        axis = np.zeros(half, np.int64)
        axis[1:section[1] * 3:3] = 1
        axis[2:section[2] * 3:3] = 2
    else:
        axis = np.concatenate([np.full(n, i % 3) for i, n in enumerate(section)])
    if len(axis) != half:
        raise ValueError(f"mrope_section {section} gives {len(axis)} rope frequencies, not "
                         f"{half}")
    return axis


def mrope_tables(positions: jax.Array, inv_freq_rows: jax.Array,
                 axis: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """`rope_tables` for multimodal rope: positions [3, T] (time, row, column per token), and
    frequency j turned by position `axis[j]` (`mrope_axes`) -> cos and sin [U, T, R/2]."""
    with jax.named_scope("rope"):
        chosen = positions.astype(jnp.float32)[axis].T  # [T, R/2]
        angles = chosen[None] * inv_freq_rows[:, None, :]
        return jnp.cos(angles), jnp.sin(angles)


def add_deepstack(x: jax.Array, rows: jax.Array | None, at: jax.Array | None,
                  layer: jax.Array | int) -> jax.Array:
    """Qwen3-VL's DeepStack: after layer `layer` < K, the image placeholders' hidden states
    [T, E] gain that layer's extra image rows (`rows` [K, M, E], row `at[t]` for token t)."""
    if rows is None:
        return x
    picked = rows[jnp.minimum(layer, rows.shape[0] - 1)][jnp.clip(at, 0, rows.shape[1] - 1)]
    hit = (at >= 0) & (layer < rows.shape[0])
    return x + jnp.where(hit[:, None], picked.astype(x.dtype), 0)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array,
           scale: float | jax.Array = 1.0) -> jax.Array:
    """`apply_rope` from its cos and sin [T, R/2] (`rope_tables`): x [T, H, D] turned, the same
    arithmetic."""
    with jax.named_scope("rope"):
        cos, sin = cos[:, None, :], sin[:, None, :]
        if not (isinstance(scale, float) and scale == 1.0):  # a float, or a traced [] array
            cos, sin = cos * scale, sin * scale
        x32 = x.astype(jnp.float32)
        rotary = 2 * cos.shape[-1]
        x1, x2 = jnp.split(x32[..., :rotary], 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary:]],
                              axis=-1)
        return out.astype(x.dtype)


def project(x: jax.Array, w: Weight, eq: str, bias: jax.Array | None = None, *,
            backend: str = "xla") -> jax.Array:
    """einsum projection with an optional bias, accumulating in float32 (`backend`: `dot`)."""
    with jax.named_scope("proj"):
        y = dot(eq, x, w, backend, rounded_to=x.dtype).astype(x.dtype)
        return y if bias is None else y + bias


def lm_head(x: jax.Array, params: dict, tied: bool, backend: str = "xla") -> jax.Array:
    """[T, E] -> float32 logits [T, V], through the tied embedding or the separate lm_head."""
    with jax.named_scope("lm_head"):
        if tied:
            return dot("te,ve->tv", x, params["embed"], backend)
        return dot("te,ev->tv", x, params["lm_head"], backend)


def embed_tokens(table: Weight, ids: jax.Array, dtype) -> jax.Array:
    """[T] ids -> [T, E] rows of the embedding table (packed for the AMX kernel when it is
    also the output head: `matmul_backend` amx)."""
    if isinstance(table, AmxPacked):
        return packed_rows(table, ids).astype(dtype)
    return quant.take_rows(table, ids).astype(dtype)


def splice_embeds(x: jax.Array, rows: jax.Array | None, at: jax.Array | None) -> jax.Array:
    """[T, E] token embeddings with row `at[t]` of `rows` [M, E] written over token t wherever
    `at[t] >= 0` (an image's placeholder tokens take its encoded rows); x itself without rows."""
    if rows is None:
        return x
    picked = rows[jnp.clip(at, 0, rows.shape[0] - 1)].astype(x.dtype)  # [T, E]
    return jnp.where((at >= 0)[:, None], picked, x)


def project_heads(attn: jax.Array, wo: Weight, bias: jax.Array | None = None, *,
                  backend: str = "xla") -> jax.Array:
    """The output projection [T, H, D] x [H, D, E] -> [T, E], as one [T, H*D] x [H*D, E] dot.

    Both reshapes are free (row-major), while the 3-D einsum made XLA:CPU pick a [D, H] order
    for the contraction and copy `wo` (and the attention output) into it on every layer."""
    num_tokens = attn.shape[0]
    if not isinstance(wo, AmxPacked):  # packed with its input axes merged already
        wo = quant.merge_input_axes(wo, 2)
    return project(attn.reshape(num_tokens, -1), wo, "tk,ke->te",
                   bias, backend=backend)


Activation = Callable[[jax.Array], jax.Array]


LAYER_LAYOUTS = ("auto", "stacked", "unstacked")


def resolve_layer_layout(layout: str, platform: str) -> str:
    """`auto` -> `unstacked` on CPU and GPU, `stacked` on TPU.

    On XLA:CPU a `lax.scan` over stacked weights copies each layer's weights out of the stack on
    every step (a dynamic slice per weight per layer); separate per-layer arrays are read in
    place, which measured faster at every batch size there (docs/engine.md). On an H200 the
    unstacked layers ran Llama-3-8B's decode steps at 0.68x (1 sequence) and 0.62x (32) the
    scanned ones' time, for ~20% more compile time (docs/kernels.md, "On a GPU"). TPU keeps the
    scan (compile time flat in depth) until it is measured there.
    """
    if layout not in LAYER_LAYOUTS:
        raise ValueError(f"unknown layer_layout {layout!r}; expected one of {LAYER_LAYOUTS}")
    if layout != "auto":
        return layout
    return "stacked" if platform == "tpu" else "unstacked"


def unstack_layers(params: dict[str, Weight], keys: tuple[str, ...], num_layers: int, *,
                   delete_stacked: bool = False,
                   first_layer: dict[str, int | tuple[int, ...]] | None = None,
                   ) -> dict[str, Weight | tuple]:
    """Stacked layer weights [L, ...] -> `params["layers"]`, a tuple of L dicts of [...] arrays
    (each keeps its shard layout minus the layer axis; a `QArray` splits its int8 values and
    scales alike). `delete_stacked` frees each stacked array once it is split (the caller must
    not use them again), so loading peaks at the weights plus one stacked tensor rather than
    twice the weights. NumPy arrays split into views (nothing is copied).

    A weight named in `first_layer` stacks only some layers, from that one on, as many as its
    leading axis holds (DeepSeek's dense MLPs, then its MoE layers): the per-layer dicts then
    differ in keys. A tuple there names the layers it stacks, in order (a hybrid's attention
    and linear-attention weights, each on the layers of its kind)."""
    first_layer = first_layer or {}
    out = {k: v for k, v in params.items() if k not in keys}
    names = [k for k in keys if k in params]
    layers: list[dict[str, Weight]] = [{} for _ in range(num_layers)]
    for name in names:
        leaves, treedef = jax.tree.flatten(params[name])
        held = first_layer.get(name, 0)
        count = leaves[0].shape[0] if name in first_layer else num_layers
        if isinstance(held, int):
            held = tuple(range(held, held + count))
        parts = [_split_layers(leaf, count) for leaf in leaves]
        for i in range(count):
            layers[held[i]][name] = treedef.unflatten([p[i] for p in parts])
        if delete_stacked:
            for leaf in leaves:
                if isinstance(leaf, jax.Array):
                    leaf.delete()
    out["layers"] = tuple(layers)
    return out


def _split_layers(stacked: jax.Array | np.ndarray, num_layers: int) -> list[jax.Array]:
    if isinstance(stacked, np.ndarray):  # host weights: views, placed later
        return list(stacked)
    shardings = None
    if isinstance(stacked.sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(*tuple(stacked.sharding.spec)[1:])
        shardings = [jax.sharding.NamedSharding(stacked.sharding.mesh, spec)] * num_layers
    split = jax.jit(lambda w: [w[i] for i in range(num_layers)], out_shardings=shardings)
    return split(stacked)


def run_layers(
    layer: Callable,  # (carry, (p, index, extras)) -> (carry, None)
    carry,
    params: dict,
    keys: tuple[str, ...],
    extras,  # pytree of [L, ...] per-layer values (windows, rope frequencies)
    num_layers: int,
):
    """Applies `layer` to every layer in order: a Python loop over `params["layers"]` (per-layer
    weights, see `unstack_layers`), else `lax.scan` over the stacked weights with the carry (the
    KV cache travels there, updated in place)."""
    indices = jnp.arange(num_layers, dtype=jnp.int32)
    if "layers" in params:
        for i, p in enumerate(params["layers"]):
            carry, _ = layer(carry, (p, indices[i], jax.tree.map(lambda a, i=i: a[i], extras)))
        return carry
    stacked = {name: params[name] for name in keys if name in params}
    carry, _ = jax.lax.scan(layer, carry, (stacked, indices, extras))
    return carry
