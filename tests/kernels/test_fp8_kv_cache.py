"""The fp8 KV cache (`kv_cache_dtype="fp8"`: float8_e4m3fn rows, one f32 scale per token and kv
head, `pallas_kernels.kv_quant`): its quantization, the backends that read it, and the engine's
choice of it.

As in `test_int8_kv_cache.py`, each case's K/V are replaced by their fp8 round trip, so the
float64 oracle on those values is what an exact kernel would give on the cache; the reference
and the Pallas kernels (interpret mode, TPU emulation) stay within 2e-5 of it.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_cpu_attention import run
from test_int8_kv_cache import _cache_config, _round_trip
from test_reference_attention import MIXED, Case

from jengine.core.build import resolve_kv_cache_dtype
from jengine.cpu_kernels.attention import ragged_paged_attention_cpu
from jengine.models import KVCache
from jengine.pallas_kernels import (
    KV_FP8,
    quantize_rows,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
)

TOL = 2e-5  # the Pallas kernels' online softmax against the oracle (test_pallas_attention)
FP8 = dict(cache_dtype=KV_FP8, cpu_write=False)  # written by XLA's scatter, as the engine does
KERNELS = {
    "reference": ragged_paged_attention,
    "pallas_gpu": functools.partial(ragged_paged_attention_gpu, interpret=True, block_q=4,
                                    num_kv_splits=2),
    "pallas_tpu": functools.partial(ragged_paged_attention_tpu,
                                    interpret=pltpu.InterpretParams(), block_q=4,
                                    pages_per_chunk=2),
}


def numpy_quantize(x):
    """The fp8 quantization in NumPy (ml_dtypes' e4m3fn, round to nearest even)."""
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(-1, keepdims=True) * np.float32(1 / 448)
    q = np.clip(x / np.where(scale > 0, scale, np.float32(1)), -448, 448)
    return q.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def _fp8_round_trip(case):
    """The case's K/V as the fp8 cache holds them."""
    return _round_trip(case, numpy_quantize)


def test_quantize_rows_matches_numpy():
    rng = np.random.default_rng(3)
    # Rows of very different magnitudes: the scale, not the format's range, must absorb them.
    x = (rng.normal(size=(50, 3, 64)) * rng.uniform(1e-3, 1e3, size=(50, 3, 1))).astype(np.float32)
    x[4, 2] = 0.0  # an all-zero row: scale 0, rows 0
    q, scale = quantize_rows(jnp.asarray(x), KV_FP8)
    want_q, want_scale = numpy_quantize(x)
    assert q.dtype == KV_FP8 and scale.shape == (50, 3, 1)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    assert np.abs(np.asarray(q).astype(np.float32)).max() == 448
    # e4m3 keeps 3 mantissa bits: a normal element within 2^-4 of itself, rounded; below 2^-6
    # (subnormal) the spacing is 2^-9, so within 2^-10, in units of the row's scale.
    back = np.asarray(q).astype(np.float32) * want_scale
    assert (np.abs(back - x) <= np.maximum(np.abs(x) * 2.0 ** -4, want_scale * 2.0 ** -10)).all()


@pytest.mark.parametrize("backend", list(KERNELS))
def test_backends_read_an_fp8_cache(backend):
    """A mixed batch (decodes, fresh and chunked prefills) with bucket padding and 3 q heads per
    kv head; then 8 per kv head with a window and a soft cap. Each backend equals the oracle
    on the round-tripped K/V."""
    kernel = KERNELS[backend]
    case = _fp8_round_trip(Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=31))
    out = run(case, kernel, num_pad=3, **FP8)
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)
    case = _fp8_round_trip(Case([(9, 1), (0, 7), (13, 1), (6, 12)], num_heads=8, num_kv_heads=1,
                            page_size=8, seed=32))
    case.q = [q * 8 for q in case.q]  # into the cap's non-linear range
    out = run(case, kernel, window=5, soft_cap=10.0, **FP8)
    np.testing.assert_allclose(out, case.expected(window=5, soft_cap=10.0), rtol=TOL, atol=TOL)


def test_cpu_kernel_refuses_an_fp8_cache():
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=33)
    with pytest.raises(ValueError, match="'cpu' reads float32, bfloat16 and int8 KV caches, "
                       "not float8_e4m3fn"):
        run(case, ragged_paged_attention_cpu, **FP8)


def test_pool_size_and_dtype_choice():
    """1 byte an element plus a 4-byte scale a row: 2 D / (D + 4) times bf16's tokens."""
    cfg = _cache_config(head_dim=64)
    fp8 = KVCache.zeros(cfg, 5, 4, KV_FP8)
    assert fp8.quantized and fp8.k.dtype == KV_FP8
    assert fp8.k_scale.shape == fp8.v_scale.shape == fp8.k.shape[:-1] + (1,)
    per_page = {d: KVCache.bytes_per_page(cfg, 4, d) for d in ("bfloat16", "float8_e4m3fn")}
    assert per_page["float8_e4m3fn"] == sum(a.nbytes for a in (fp8.k, fp8.v, fp8.k_scale,
                                                                fp8.v_scale)) // 5
    assert per_page["bfloat16"] / per_page["float8_e4m3fn"] == pytest.approx(2 * 64 / 68)
    assert resolve_kv_cache_dtype("fp8", "bfloat16") == "float8_e4m3fn"
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"  # fp8 is opt-in
