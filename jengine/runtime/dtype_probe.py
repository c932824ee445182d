"""What `dtype: auto` measures on a CPU with AVX-512-BF16 or AMX: the model's projections timed
in float32 and in bfloat16, each through the kernels that dtype gets in the engine
(`jengine.models.matmul.dot` and `swiglu` under the resolved matmul backend, the bf16 weights
packed for the AMX kernel where the engine packs them).

Why the projections, and not a few steps of the model itself: they are most of a CPU step
(projections and output head were 73% + 17% of a SmolLM2 f32 decode step at one sequence, 56% +
16% at 64, attention most of the rest: docs/engine.md, "Where a step's time goes now"), and they
are where the two dtypes differ most. Timing them needs only the model's shapes, so the probe runs
before any weight is read (the weights are then loaded once, in the chosen dtype), compiles
small programs instead of every step bucket twice, and is deterministic enough: a fixed
pattern of weights, median of REPEATS runs. What it cannot see is the rest of a bf16 step
(norms, rope, attention and KV in bf16), which XLA:CPU runs slower than f32 without AMX.

What is timed, per dtype (each program chains its layers as the model does: every projection
reads the previous one's output, so XLA cannot overlap layers that the step runs in order):
- decode: one step's projections at 1 and at 8 rows (one and eight streams) over distinct
  weights of the model's layer shapes, as many layers as fit DECODE_BYTES of f32 (all of
  SmolLM2's 30: decode streams the weights from memory, so the probe must too), and the output
  head; scaled to the model's layer count and vocabulary where they were capped;
- prefill: one layer at PREFILL_ROWS rows (compute-bound: one layer's time, times the layers).
`Timings.per_token` weighs each regime as one token of its kind (a 1-row step per token, an
8-row step per 8 tokens, a chunk per PREFILL_ROWS tokens), the figure `auto` compares.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels.matmul import AMX_TILE
from jengine.models import family_module
from jengine.models.config import ModelConfig
from jengine.models.matmul import AMX_PROJECTIONS, AmxPacked, dot, packs_bf16, swiglu

DECODE_ROWS = (1, 8)
PREFILL_ROWS = 128
DECODE_BYTES = 512 * 2**20  # f32 bytes of layer weights (and, apart, of the head) streamed
REPEATS = 5


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds of the whole model's projections (scaled from what was timed), one dtype."""

    decode: dict[int, float]  # rows (DECODE_ROWS) -> one step's projections and output head
    prefill: float  # one PREFILL_ROWS chunk through every layer (no head: one row per sequence)

    @property
    def per_token(self) -> float:
        """Seconds per token, summed over the regimes (what `auto` compares)."""
        return sum(t / rows for rows, t in self.decode.items()) + self.prefill / PREFILL_ROWS


def projection_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, int]], str, int, int]:
    """Each layer projection the engine may pack ([K, N], its contracted axes merged), the
    output head's name (`lm_head` [E, V] or a tied `embed` [V, E]), E and V."""
    specs = family_module(cfg).param_specs(cfg)
    layer = {}
    for name in AMX_PROJECTIONS:
        spec = specs.get(name)
        if spec is None or not spec.contract or spec.contract != tuple(
                range(1, 1 + len(spec.contract))):
            continue
        n_in = len(spec.contract)
        layer[name] = (math.prod(spec.shape[1:1 + n_in]), math.prod(spec.shape[1 + n_in:]))
    head = "lm_head" if "lm_head" in specs else "embed"
    return layer, head, cfg.hidden_size, cfg.vocab_size


def time_projections(cfg: ModelConfig, dtype: str, matmul_backend: str) -> Timings:
    """Times `cfg`'s projections in `dtype` ("float32" or "bfloat16") under `matmul_backend`
    (as `resolve_matmul_backend` resolved it). Holds at most ~2 x DECODE_BYTES of weights."""
    shapes, head, e, v = projection_shapes(cfg)
    layer_bytes = 4 * sum(k * n for k, n in shapes.values()) or 1
    n_layers = max(1, min(cfg.num_layers, DECODE_BYTES // layer_bytes))
    cols = max(1, min(v, DECODE_BYTES // (4 * e)))
    dt = jnp.dtype(dtype)
    params = _weights(shapes, head, e, cols, n_layers, dt, matmul_backend)
    layers, head_w, tied = params["layers"], params[head], head == "embed"
    decode = {}
    for rows in DECODE_ROWS:
        t_layers = _median_seconds(_layers_program(matmul_backend, dt), _x(rows, e, dt), layers)
        t_head = _median_seconds(_head_program(matmul_backend, tied), _x(rows, e, dt), head_w)
        decode[rows] = t_layers * cfg.num_layers / n_layers + t_head * v / cols
    prefill = _median_seconds(_layers_program(matmul_backend, dt), _x(PREFILL_ROWS, e, dt),
                              layers[:1]) * cfg.num_layers
    return Timings(decode=decode, prefill=prefill)


def _weights(shapes: dict[str, tuple[int, int]], head: str, e: int, cols: int, n_layers: int,
             dt, backend: str) -> dict:
    """Distinct weights of the layer shapes and the head (a fixed pattern of a trained model's
    scale: no zeros or denormals for a kernel to take a shortcut on), laid out as the engine
    lays out a model of this dtype: where `packs_bf16(backend)` a bf16 model's projections and
    head are `AmxPacked` (`pack_projections`), made here straight in the tiles' shape (the
    values do not matter to the time, and packing on the host would double the probe's)."""
    base = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    packed = packs_bf16(backend) and dt == jnp.bfloat16

    def weight(k: int, n: int, seed: int, transposed: bool = False):
        pattern = (np.roll(base, seed) / np.float32(math.sqrt(k))).astype(dt)
        if not packed:
            return jax.device_put(np.resize(pattern, (n, k) if transposed else (k, n)))
        tiles = np.resize(pattern, (-(-n // 32), -(-k // 32), *AMX_TILE))
        return AmxPacked(tiles=jax.device_put(tiles), k=k, out_shape=(n,),
                         transposed=transposed)

    layers = tuple({name: weight(k, n, i * len(shapes) + j)
                    for j, (name, (k, n)) in enumerate(shapes.items())}
                   for i in range(n_layers))
    return {"layers": layers, head: weight(e, cols, -1, transposed=head == "embed")}


def _x(rows: int, width: int, dt) -> jax.Array:
    return jnp.asarray(np.linspace(-1.0, 1.0, rows * width, dtype=np.float32)
                       .reshape(rows, width), dt)


def _layers_program(backend: str, dt):
    """x [R, E] through each layer's projections in AMX_PROJECTIONS order, each reading the
    last output of its input width (q feeds o, the SwiGLU feeds down), the residual added and
    RMS-normalized per layer; k and v are summed into the result so that they are not
    dropped."""

    def run(x, layers):
        side = jnp.zeros((), jnp.float32)
        for layer in layers:
            acts = {x.shape[1]: x}
            names = [n for n in AMX_PROJECTIONS if n in layer]
            for name in names:
                w = layer[name]
                if name == "w_up" and "w_gate" in layer:
                    continue
                k = w.shape[0]  # [K, N], or packed for AMX as such
                inp = acts.get(k)
                if inp is None:  # no output of this width yet: a stand-in that depends on x
                    inp = jnp.broadcast_to(x[:, :1], (x.shape[0], k))
                if name == "w_gate" and "w_up" in layer:
                    out = swiglu(inp, w, layer["w_up"], backend)
                else:
                    out = dot("tk,kn->tn", inp, w, backend, rounded_to=dt).astype(dt)
                if name in ("wk", "wv"):
                    side = side + out.astype(jnp.float32).sum()
                else:
                    acts[out.shape[1]] = out
            h = (x + acts[x.shape[1]]).astype(jnp.float32)
            x = (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)).astype(dt)
        return x, side

    return jax.jit(run)


def _head_program(backend: str, tied: bool):
    eq = "te,ve->tv" if tied else "te,ev->tv"
    return jax.jit(lambda x, w: dot(eq, x, w, backend).max(axis=-1))


def _median_seconds(program, *args) -> float:
    """The median wall time of REPEATS calls, after one that compiles and warms up."""
    jax.block_until_ready(program(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
