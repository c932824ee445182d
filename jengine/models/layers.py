"""Building blocks shared by the model families: norms, rotary embeddings, parameter specs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.models import quant
from jengine.models.config import RopeConfig
from jengine.models.quant import QArray
from jengine.pallas_kernels import cpu_matmul


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


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32; Gemma scales by (1 + weight) (`offset=1`), Llama by weight."""
    with jax.named_scope("norm"):  # the scopes name the parts in profiles (scripts/)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
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
        cos = jnp.cos(angles)[:, None, :]
        sin = jnp.sin(angles)[:, None, :]
        if not (isinstance(scale, float) and scale == 1.0):  # a float, or a traced [] array
            cos, sin = cos * scale, sin * scale
        x32 = x.astype(jnp.float32)
        rotary = 2 * inv_freq.shape[-1]
        x1, x2 = jnp.split(x32[..., :rotary], 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary:]],
                              axis=-1)
        return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Observed:
    """A float weight whose dots report their input `x` [T, K] to `seen` (at trace time).

    Only calibration (`jengine.models.smoothing`) builds these, inside its own jitted function,
    to learn each projection's per-input-channel activation range; the step never sees one."""

    w: jax.Array
    seen: Callable[[jax.Array], None]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def reshape(self, *shape) -> Observed:
        return Observed(self.w.reshape(*shape), self.seen)


Weight = jax.Array | QArray  # a float weight, or its quantized form (jengine.models.quant)


MATMUL_BACKENDS = ("auto", "xla", "native")
# The row counts (the step's token bucket) the native kernel takes; XLA's dot keeps the rest.
# Measured in-program (docs/engine.md, "Small-row matmul"): for an f32 weight the kernel streams
# 1-2 rows faster than XLA (each thread a contiguous run of whole weight rows), except a tied
# embedding as the output head at one row ([N, K] contracted over K), which XLA's one-row dot
# streams as fast (NT_NATIVE_ROWS); from NATIVE_ROWS[1] + 1 rows on XLA's blocked GEMM wins.
# A bf16 or int8 (w8a16) weight is 2x / 4x fewer bytes for the kernel, while XLA:CPU converts
# it to f32 on every call (10x its f32 dot at one row), so the kernel takes those from one row
# up to NARROW_NATIVE_ROWS[1].
# On a CPU with AMX-BF16, XLA:CPU runs a bf16 x bf16 -> f32 dot on the tiles (2-4.5x its f32
# rate, measured 2026-12-03 on a Xeon), so with bf16 activations the kernel keeps only what it
# still streams faster: a bf16 weight up to AMX_BF16_NATIVE_ROWS[1] rows (alone XLA took
# 0.3x the kernel's time at 64 rows, 0.13x for the tied head, 0.6-1.0x at 8, yet the 8-row
# step ran 12% faster on the kernel), an int8 (w8a16) one up to AMX_INT8_WEIGHT_NATIVE_ROWS[1]
# (XLA 0.5x at 64, 1.7-1.8x at 8).
NATIVE_ROWS = (1, 32)
NT_NATIVE_ROWS = (2, 32)
NARROW_NATIVE_ROWS = (1, 64)
AMX_BF16_NATIVE_ROWS = (1, 8)
AMX_INT8_WEIGHT_NATIVE_ROWS = (1, 16)
INT8_NATIVE_ROWS = 128  # from this many rows an `int8` projection runs the native W8A8 kernel


def resolve_matmul_backend(backend: str, platform: str, tp: int) -> str:
    """`auto` -> `native` (jengine.pallas_kernels.cpu_matmul) on one CPU device when the
    library loaded, else `xla`. XLA cannot partition the custom call, so a tp mesh keeps XLA's
    dot, and so do accelerators; `native` there is an error."""
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"unknown matmul_backend {backend!r}; expected one of {MATMUL_BACKENDS}")
    if backend == "native":
        if platform != "cpu" or tp > 1:
            raise ValueError("matmul_backend 'native' runs on CPU without tensor parallelism "
                             f"(here: platform {platform}, tp={tp})")
        cpu_matmul.require()
        return backend
    if backend == "xla":
        return backend
    return "native" if platform == "cpu" and tp == 1 and cpu_matmul.available() else "xla"


def _native_operand(x: jax.Array, w: Weight, form: str
                    ) -> tuple[jax.Array, jax.Array | None] | None:
    """The weight array the native kernel reads for `x @ w` in `form` (`_native_form`) and the
    per-channel scale to apply to its f32 result (a w8a16 weight), or None where XLA's dot
    keeps the product."""
    if isinstance(w, QArray):
        if w.mode != "w8a16":
            return None
        operand, scale = w.q, w.scale
    else:
        operand, scale = w, None
    if x.dtype not in (jnp.float32, jnp.bfloat16) or x.ndim != 2:
        return None
    if operand.dtype == jnp.float32 and x.dtype == jnp.float32:
        lo, hi = NT_NATIVE_ROWS if form == "nk" else NATIVE_ROWS
    elif operand.dtype in (jnp.bfloat16, jnp.int8):
        lo, hi = NARROW_NATIVE_ROWS
        if x.dtype == jnp.bfloat16 and "amx_bf16" in cpu_info.flags():
            lo, hi = AMX_BF16_NATIVE_ROWS if operand.dtype == jnp.bfloat16 \
                else AMX_INT8_WEIGHT_NATIVE_ROWS
    else:
        return None
    return (operand, scale) if lo <= x.shape[0] <= hi else None


def _native_int8(x: jax.Array, w: Weight, form: str) -> bool:
    """Whether the native W8A8 kernel (cpu_matmul.int8_matmul) takes this `int8` product: a
    projection (`kn`) of at least INT8_NATIVE_ROWS rows on a VNNI CPU without AMX-INT8 (where
    XLA's int8 dot runs on the tiles at 1.4-2.1 TOP/s on two cores, 2-3x the kernel's rate:
    docs/kernels.md).

    Alone, with the weights streamed from DRAM, the kernel was 1.0-1.8x as fast as XLA's int8
    dot at 1 to 64 rows (scripts/int8_matmul_bench.py); inside a decode step it lost (steps
    1.4-1.8x as long at 1 and 8 rows, 1.03-1.24x at 64): each call hands half its work to a
    pool thread, while XLA runs its single-threaded small dots side by side (q/k/v, gate/up)
    with no handoff. Prefill
    chunks gain (0.89-0.97x the step). The tied output head (`nk`) stays on XLA: packing
    w^T costs more than the kernel saves there."""
    return (isinstance(w, QArray) and w.mode == "int8" and form == "kn" and x.ndim == 2
            and x.shape[0] >= INT8_NATIVE_ROWS and cpu_matmul.int8_isa() == "avx512_vnni"
            and "amx_int8" not in cpu_info.flags())


def _int8_dot(x: jax.Array, w: QArray) -> jax.Array:
    """`quant.einsum` of an `int8` projection by the native kernel: the same per-row quantized
    x, int32 sums and rescale, so the same floats."""
    xq, sx = quant.quantize_rows(x)
    y = cpu_matmul.int8_matmul(xq, sx, w.q.reshape(w.q.shape[0], -1), w.scale)
    return y.reshape(x.shape[0], *w.q.shape[1:])


def _native_form(eq: str) -> str | None:
    """How the native kernel takes `eq` for a 2-D x [R, K]: "kn" (w's leading axis contracted,
    `te,ehd->thd`), "nk" (w [N, K]'s last, `te,ve->tv`: a tied embedding as the output head),
    or None (XLA's einsum)."""
    lhs, rest = eq.split(",")
    rhs, out = rest.split("->")
    if len(lhs) != 2:
        return None
    if rhs[0] == lhs[1] and out == lhs[0] + rhs[1:]:
        return "kn"
    if len(rhs) == 2 and rhs[1] == lhs[1] and out == lhs[0] + rhs[0]:
        return "nk"
    return None


def dot(eq: str, x: jax.Array, w: Weight, backend: str = "xla") -> jax.Array:
    """`einsum(eq, x, w)` accumulated and returned in float32; a quantized `w` runs its
    int8 (or weight-only) dot. `backend="native"` sends the shapes it fits (`_native_operand`,
    `_native_form`) to the native small-row kernel, a 3-D weight over its free row-major
    [K, N] view, a bf16 x widened to f32 first (exact), a w8a16 weight's scale applied after."""
    if isinstance(w, Observed):
        w.seen(x)
        w = w.w
    form = _native_form(eq) if backend == "native" else None
    if form is not None and _native_int8(x, w, form):
        return _int8_dot(x, w)
    native = _native_operand(x, w, form) if form is not None else None
    if native is not None:
        operand, scale = native
        x32 = x.astype(jnp.float32)
        if form == "nk":
            y = cpu_matmul.small_matmul(x32, operand, transpose_w=True)
        else:
            y = cpu_matmul.small_matmul(x32, operand.reshape(operand.shape[0], -1))
            y = y.reshape(x.shape[0], *operand.shape[1:])
        return y if scale is None else y * scale.reshape(y.shape[1:])
    if isinstance(w, QArray):
        return quant.einsum(eq, x, w)
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)


def project(x: jax.Array, w: Weight, eq: str, bias: jax.Array | None = None, *,
            backend: str = "xla") -> jax.Array:
    """einsum projection with an optional bias, accumulating in float32 (`backend`: `dot`)."""
    with jax.named_scope("proj"):
        y = dot(eq, x, w, backend).astype(x.dtype)
        return y if bias is None else y + bias


def lm_head(x: jax.Array, params: dict, tied: bool, backend: str = "xla") -> jax.Array:
    """[T, E] -> float32 logits [T, V], through the tied embedding or the separate lm_head."""
    with jax.named_scope("lm_head"):
        if tied:
            return dot("te,ve->tv", x, params["embed"], backend)
        return dot("te,ev->tv", x, params["lm_head"], backend)


def first_rows_logits(head: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                      num_rows: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """[S, E] hidden rows -> [S, V] `head` logits of the first n rows, zeros after them: n the
    smallest of `sizes` and S that holds `num_rows`, chosen on device (`lax.switch` runs one
    branch). A lone prefill in a 64-row bucket so computes 1 row of logits, not 64 (19 of
    SmolLM2's 122 ms at T = 64 on CPU). The sampler stays outside: a copy of it per branch
    cost 70% more compile time for its last 8 ms."""
    s = hidden.shape[0]
    widths = sorted({n for n in sizes if n < s} | {s})

    def rows(n: int) -> Callable[[], jax.Array]:
        if n == s:
            return lambda: head(hidden)
        return lambda: jnp.pad(head(hidden[:n]), ((0, s - n), (0, 0)))

    if len(widths) == 1:
        return rows(s)()
    index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), num_rows)
    return jax.lax.switch(jnp.minimum(index, len(widths) - 1), [rows(n) for n in widths])


def embed_tokens(table: Weight, ids: jax.Array, dtype) -> jax.Array:
    """[T] ids -> [T, E] rows of the embedding table."""
    return quant.take_rows(table, ids).astype(dtype)


def project_heads(attn: jax.Array, wo: Weight, bias: jax.Array | None = None, *,
                  backend: str = "xla") -> jax.Array:
    """The output projection [T, H, D] x [H, D, E] -> [T, E], as one [T, H*D] x [H*D, E] dot.

    Both reshapes are free (row-major), while the 3-D einsum made XLA:CPU pick a [D, H] order
    for the contraction and copy `wo` (and the attention output) into it on every layer."""
    num_tokens = attn.shape[0]
    return project(attn.reshape(num_tokens, -1), quant.merge_input_axes(wo, 2), "tk,ke->te",
                   bias, backend=backend)


Activation = Callable[[jax.Array], jax.Array]


LAYER_LAYOUTS = ("auto", "stacked", "unstacked")


def resolve_layer_layout(layout: str, platform: str) -> str:
    """`auto` -> `unstacked` on CPU, `stacked` elsewhere.

    On XLA:CPU a `lax.scan` over stacked weights copies each layer's weights out of the stack on
    every step (a dynamic slice per weight per layer); separate per-layer arrays are read in
    place, which measured faster at every batch size there (docs/engine.md). On TPU/GPU the
    slices are fused into the loads, and the scan keeps compile time flat in depth.
    """
    if layout not in LAYER_LAYOUTS:
        raise ValueError(f"unknown layer_layout {layout!r}; expected one of {LAYER_LAYOUTS}")
    if layout != "auto":
        return layout
    return "unstacked" if platform == "cpu" else "stacked"


def unstack_layers(params: dict[str, Weight], keys: tuple[str, ...], num_layers: int, *,
                   delete_stacked: bool = False,
                   first_layer: dict[str, int] | None = None) -> dict[str, Weight | tuple]:
    """Stacked layer weights [L, ...] -> `params["layers"]`, a tuple of L dicts of [...] arrays
    (each keeps its shard layout minus the layer axis; a `QArray` splits its int8 values and
    scales alike). `delete_stacked` frees each stacked array once it is split (the caller must
    not use them again), so loading peaks at the weights plus one stacked tensor rather than
    twice the weights. NumPy arrays split into views (nothing is copied).

    A weight named in `first_layer` stacks only some layers, from that one on, as many as its
    leading axis holds (DeepSeek's dense MLPs, then its MoE layers): the per-layer dicts then
    differ in keys."""
    first_layer = first_layer or {}
    out = {k: v for k, v in params.items() if k not in keys}
    names = [k for k in keys if k in params]
    layers: list[dict[str, Weight]] = [{} for _ in range(num_layers)]
    for name in names:
        leaves, treedef = jax.tree.flatten(params[name])
        first = first_layer.get(name, 0)
        count = leaves[0].shape[0] if name in first_layer else num_layers
        parts = [_split_layers(leaf, count) for leaf in leaves]
        for i in range(count):
            layers[first + i][name] = treedef.unflatten([p[i] for p in parts])
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
