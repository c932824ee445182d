"""Activation smoothing for `int8` (W8A8): SmoothQuant-style per-channel migration, folded into
the float weights before they are quantized.

Why: per-token int8 activations share one scale across a token's channels, so a few outlier
channels (the post-norm hidden states and the MLP product carry channels 10-100x the median)
leave the others a handful of int8 steps. Dividing input channel j of a projection by s_j and
multiplying row j of its weight by s_j changes nothing in float, and with
`s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)` it moves part of the activation range into the
weights, which are quantized per output channel and tolerate it better.

The division is folded into whatever produces X, so the step's program does not change:
- a norm followed by projections (`NormFold`): the norm's weight / s, the projections' rows * s
  (q/k/v after the attention norm, gate/up after the MLP norm);
- a projection whose output channels, through an operation that maps channel j to channel j
  only, are the next projection's input channels (`ChannelFold`): up's columns / s, down's rows
  * s (the gated product scales with up); v's columns / s, wo's rows * s (attention mixes v rows
  per head; with GQA the q heads that read one kv head share its factors).
Each family declares its folds (`smoothing_folds(cfg)`); a family or layer kind without a safe
fold is left as is.

`max|X_j|` comes from a calibration pass of the float model (`activation_maxima`) over a text
that is not the accuracy script's evaluation text (`calibration.txt`, public domain). Factors
are rounded to powers of two: the fold is then exact in float (up to the rounding of Gemma's
(1 + w) / s - 1), and a calibration that differs in the last bits (tp=2's sharded sums vs
tp=1's) gives the same factors unless a value sits at a rounding boundary.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jengine.config import ModelSection
from jengine.models.attention import AttentionMetadata, KVCache
from jengine.models.config import ModelConfig
from jengine.models.family import Network
from jengine.models.matmul import Observed

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
DEFAULT_ALPHA = ModelSection.smoothing_alpha  # the one default, in jengine/config.py
# Two windows of 512 tokens of `calibration.txt` (~1,000 tokens): four gave the same factors'
# accuracy on SmolLM2, and each window costs a forward pass at start-up.
CALIBRATION_WINDOWS = 2
CALIBRATION_WINDOW = 512
_PAGE = 16


@dataclasses.dataclass(frozen=True)
class NormFold:
    """`norm`'s output feeds `consumers` ([L, E, ...] weights contracting axis 1)."""

    norm: str  # [L, E]
    consumers: tuple[str, ...]
    offset: float = 0.0  # the norm scales by (offset + weight): Gemma's 1


@dataclasses.dataclass(frozen=True)
class ChannelFold:
    """`producer`'s output channels are `consumer`'s input channels."""

    producer: str  # [L, E, C] (w_up), or [L, E, K, D] with `heads` (wv)
    consumer: str  # [L, C, E] (w_down), or [L, H, D, E] with `heads` (wo)
    bias: str | None = None  # the producer's bias [L, C] / [L, K, D], scaled with its columns
    heads: bool = False  # producer kv heads -> consumer q heads through the model's head map


Fold = NormFold | ChannelFold


def observed_name(fold: Fold) -> str:
    """The weight whose input the calibration records for `fold`."""
    return fold.consumers[0] if isinstance(fold, NormFold) else fold.consumer


# -- calibration -----------------------------------------------------------------------------------

def calibration_windows(tokenizer, window: int, count: int,
                        text_path: Path = CALIBRATION_TEXT) -> np.ndarray:
    """[N, window] token ids of the calibration text, N <= count (at least one window)."""
    ids = np.asarray(tokenizer(text_path.read_text(), add_special_tokens=False).input_ids,
                     np.int32)
    num = max(1, min(count, len(ids) // window))
    ids = np.resize(ids, num * window)  # a short text repeats to fill its one window
    return ids.reshape(num, window)


def activation_maxima(params: dict, cfg: ModelConfig, forward, layer_keys: tuple[str, ...],
                      names: tuple[str, ...], windows: np.ndarray) -> dict[str, np.ndarray]:
    """max |x| per input channel of the weights `names`, over every token of `windows` [N, W]
    run through the float model (each window a fresh sequence): name -> [L, K] float32, K the
    weight's (merged) contracted size.

    `params` are stacked (as loaded); the pass runs the layers as a Python loop so that each
    layer's inputs are values of one jitted program, with `cfg.attention_backend` (on sharded
    params, pass the reference one: `smooth_for_int8` does).
    """
    width = windows.shape[1]
    pages = -(-width // _PAGE)
    positions = np.arange(width, dtype=np.int32)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]  # page 0 is the scratch page
    slots = table[0, positions // _PAGE] * _PAGE + positions % _PAGE
    kv = KVCache.zeros(cfg, pages + 1, _PAGE, params[names[0]].dtype)
    run = _observer(cfg, forward, layer_keys, names)
    total = None
    for ids in windows:
        md = AttentionMetadata(
            token_ids=jnp.asarray(ids), positions=jnp.asarray(positions),
            slot_mapping=jnp.asarray(slots), token_seq=jnp.zeros(width, jnp.int32),
            page_table=jnp.asarray(table), logits_indices=jnp.asarray([width - 1], jnp.int32),
        )
        got = jax.device_get(run(params, kv, md))
        total = got if total is None else jax.tree.map(np.maximum, total, got)
    return total


@functools.lru_cache(maxsize=8)
def _observer(cfg: ModelConfig, forward, layer_keys: tuple[str, ...], names: tuple[str, ...]):
    """The jitted calibration pass (one per model; a test builds several of the same)."""
    return jax.jit(functools.partial(_observe, cfg=cfg, forward=forward, layer_keys=layer_keys,
                                     names=names))


def _observe(params, kv, md, *, cfg, forward, layer_keys, names):
    seen: dict[tuple[str, int], jax.Array] = {}

    def keep(key, x):  # x [T, K]: its per-channel max, a value of this trace
        seen[key] = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0)

    flat = {k: v for k, v in params.items() if k not in layer_keys}
    flat["layers"] = tuple(
        {k: (Observed(params[k][i], functools.partial(keep, (k, i))) if k in names
             else params[k][i]) for k in layer_keys if k in params}
        for i in range(cfg.num_layers))
    forward(flat, cfg, kv, md)
    return {name: jnp.stack([seen[(name, i)] for i in range(cfg.num_layers)]) for name in names}


# -- the factors and the fold ----------------------------------------------------------------------

def _factors(act: np.ndarray, wmax: np.ndarray, alpha: float) -> np.ndarray:
    """s = act^alpha / wmax^(1 - alpha), rounded to a power of two; 1 where either is 0."""
    act, wmax = np.asarray(act, np.float64), np.asarray(wmax, np.float64)
    ok = (act > 0) & (wmax > 0)
    s = np.where(ok, np.power(np.where(ok, act, 1), alpha)
                 / np.power(np.where(ok, wmax, 1), 1 - alpha), 1.0)
    return np.exp2(np.round(np.log2(s))).astype(np.float32)


def _row_max(w: jax.Array, axis: int) -> np.ndarray:
    """max |w| over every axis but the layer axis and `axis` ([L, C])."""
    other = tuple(a for a in range(1, w.ndim) if a != axis)
    return np.asarray(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=other))


def _head_map(cfg: ModelConfig) -> np.ndarray:
    """[H] the kv head each (possibly padded) q head reads."""
    if cfg.kv_head_map is not None:
        return np.asarray(cfg.kv_head_map)
    return np.arange(cfg.num_heads) // (cfg.num_heads // cfg.num_kv_heads)


def fold_factors(params: dict, cfg: ModelConfig, fold: Fold, act: np.ndarray,
                 alpha: float) -> np.ndarray:
    """`fold`'s factors from its input's maxima `act` [L, K] and the current weights: [L, E]
    (`NormFold`), [L, C] or [L, K, D] (`ChannelFold`)."""
    if isinstance(fold, NormFold):
        wmax = np.max([_row_max(params[c], 1) for c in fold.consumers], axis=0)
    elif not fold.heads:
        wmax = _row_max(params[fold.consumer], 1)
    else:  # per (q head, dim) -> per (kv head, dim): the q heads of one kv head share
        heads = _head_map(cfg)
        act_h = act.reshape(act.shape[0], cfg.num_heads, cfg.head_dim)
        w_h = np.asarray(jnp.max(jnp.abs(params[fold.consumer].astype(jnp.float32)),
                                 axis=3))  # [L, H, D]
        groups = range(cfg.num_kv_heads)
        act = np.stack([act_h[:, heads == g].max(1) for g in groups], 1)
        wmax = np.stack([w_h[:, heads == g].max(1) for g in groups], 1)
    return _factors(act, wmax, alpha)


def apply_fold(params: dict, cfg: ModelConfig, fold: Fold, s: np.ndarray, *,
               delete_float: bool = False) -> dict:
    """`params` with `fold`'s factors `s` folded in (the float model computes the same).

    `delete_float` frees each replaced projection weight, as `quant.quantize_params` would
    once it quantized it (the caller must not use them again); norms and biases are left to
    the garbage collector."""
    out = dict(params)

    def scale(name: str, factors: np.ndarray, *, projection: bool = True, **kw) -> None:
        old = out[name]
        out[name] = _scaled(old, factors, **kw)
        if delete_float and projection and isinstance(old, jax.Array):
            old.delete()

    if isinstance(fold, NormFold):
        scale(fold.norm, s, projection=False, divide=True, offset=fold.offset)
        for name in fold.consumers:  # [L, E, ...] rows
            scale(name, s.reshape(s.shape + (1,) * (out[name].ndim - 2)))
        return out
    scale(fold.producer, s[:, None], divide=True)  # wv [L, E, K, D] / w_up [L, E, C] columns
    if fold.heads:  # s [L, K, D] -> wo [L, H, D, E] rows, per q head its kv head's
        scale(fold.consumer, s[:, _head_map(cfg), :, None])
    else:  # s [L, C] -> w_down [L, C, E] rows
        scale(fold.consumer, s[..., None])
    if fold.bias and fold.bias in out:
        scale(fold.bias, s, projection=False, divide=True)
    return out


def _scaled(w: jax.Array, s: np.ndarray, *, divide: bool = False, offset: float = 0.0):
    """w * s (or (offset + w) / s - offset), on w's sharding, in w's dtype."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        sharding = None
    return _scale_fn(sharding, divide, offset)(w, jnp.asarray(s))


@functools.cache
def _scale_fn(sharding, divide: bool, offset: float):
    def scale(w, s):
        w32 = w.astype(jnp.float32)
        return ((offset + w32) / s - offset if divide else w32 * s).astype(w.dtype)

    return jax.jit(scale, out_shardings=sharding)


def smooth_for_int8(params: dict, cfg: ModelConfig, family: Network, tokenizer,
                    alpha: float = DEFAULT_ALPHA, *, delete_float: bool = False) -> dict:
    """The default calibration (`CALIBRATION_WINDOWS` windows of `calibration.txt`) and fold,
    as the engine runs it at load time and `jengine convert --quantization int8` before it
    stores the weights (the same, so both give the same int8 weights).

    The calibration runs the model's own attention backend when the params sit on one device,
    else the reference (pure jnp) one, which the partitioner can split.
    """
    if alpha <= 0 or not _folds(family, cfg):
        return params
    window = min(CALIBRATION_WINDOW, cfg.max_position_embeddings)
    windows = calibration_windows(tokenizer, window, CALIBRATION_WINDOWS)
    devices = getattr(next(iter(params.values())), "sharding", None)
    if devices is not None and len(devices.device_set) > 1:
        cfg = dataclasses.replace(cfg, attention_backend="reference")
    return smooth(params, cfg, family, windows, alpha, delete_float=delete_float)


def _folds(family: Network, cfg: ModelConfig) -> tuple[Fold, ...]:
    return tuple(family.smoothing_folds(cfg)) if family.smoothing_folds else ()


def smooth(params: dict, cfg: ModelConfig, family: Network, windows: np.ndarray,
           alpha: float = DEFAULT_ALPHA, *, delete_float: bool = False) -> dict:
    """Calibrates the float model on `windows` [N, W] and folds in the factors of `family`'s
    folds (`params` stacked, as loaded). A family without `smoothing_folds`, or one that
    declares none for `cfg`, is returned as is."""
    folds = _folds(family, cfg)
    if not folds or alpha <= 0:
        return params
    names = tuple(dict.fromkeys(observed_name(f) for f in folds))
    maxima = activation_maxima(params, cfg, family.forward, family.layer_keys, names, windows)
    # One fold at a time, each from the weights the folds before it left (a channel fold
    # rescales wv / w_up columns, which the norm fold after it reads): every fold's input
    # maxima stay those calibrated, since no fold changes another's input.
    for fold in folds:
        s = fold_factors(params, cfg, fold, maxima[observed_name(fold)], alpha)
        params = apply_fold(params, cfg, fold, s, delete_float=delete_float)
    return params


def outlier_ratio(maxima: np.ndarray) -> float:
    """Mean over layers of max / median of the per-channel maxima [L, K]: how far the largest
    channel stands out (what a per-token scale must cover)."""
    m = np.asarray(maxima, np.float64)
    return float(np.mean(m.max(-1) / np.maximum(np.median(m, -1), 1e-30)))
