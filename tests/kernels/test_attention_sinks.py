"""gpt-oss's attention sinks (a learned logit per q head in the softmax's denominator) in every
backend that takes them, against a float64 oracle: the reference's per-token and per-block
layouts and the native `cpu` kernel on each instruction-set path, over a mixed batch (decodes,
fresh and chunked prefills, a sliding window) and a long context whose keys the kernel splits
across threads and merges. Sinks of +-3 move the outputs far past the tolerance (checked)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_attention import ISAS
from test_reference_attention import HEAD_DIM, LAYER, MIXED, Case

from jengine.cpu_kernels import attention as cpu
from jengine.pallas_kernels import (
    blocked_paged_attention,
    num_query_blocks,
    query_blocks,
    ragged_paged_attention,
    write_kv,
)

TOL = 1e-5
SCALE = HEAD_DIM ** -0.5


def dense_with_sinks(case: Case, sinks: np.ndarray, window: int | None) -> np.ndarray:
    """[N, H, D] float64: each query over its visible keys plus its head's sink logit."""
    rows = []
    for i, (c, n) in enumerate(case.seqs):
        q, k, v = (np.asarray(x[i], np.float64) for x in (case.q, case.k, case.v))
        group = q.shape[1] // k.shape[1]
        out = np.zeros(q.shape)
        for t, p in enumerate(range(c, c + n)):
            keys = np.arange(k.shape[0])
            seen = (keys <= p) & (keys > p - (window or 10**9))
            for h in range(q.shape[1]):
                s = np.append(k[seen, h // group] @ q[t, h] * SCALE, sinks[h])
                w = np.exp(s - s.max())
                out[t, h] = (w[:-1] / w.sum()) @ v[seen, h // group]
        rows.append(out)
    return np.concatenate(rows)


def _written(case: Case):
    x = case.step_inputs()
    layer, slots = jnp.int32(LAYER), jnp.asarray(x["slots"])
    k = write_kv(case.k_cache, layer, slots, jnp.asarray(x["new_k"]))
    v = write_kv(case.v_cache, layer, slots, jnp.asarray(x["new_v"]))
    return x, k, v


def _ragged(case, sinks, window, kernel=ragged_paged_attention):
    x, k, v = _written(case)
    out = jax.jit(functools.partial(kernel, sm_scale=SCALE))(
        jnp.asarray(x["q"]), k, v, jnp.int32(LAYER), jnp.asarray(x["token_seq"]),
        jnp.asarray(x["positions"]), jnp.asarray(case.page_table),
        sliding_window=None if window is None else jnp.int32(window),
        sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32))
    return np.asarray(out)


def _blocked(case, sinks, window, block=4, kv_head_map=None):
    x, k, v = _written(case)
    q_lens = [n for _, n in case.seqs]
    tokens, seqs = query_blocks(q_lens, len(x["slots"]),
                                num_query_blocks(len(x["slots"]), len(q_lens), block), block)
    blocked = jax.jit(functools.partial(blocked_paged_attention, sm_scale=SCALE,
                                        kv_head_map=kv_head_map, pages_per_chunk=2))
    out = blocked(
        jnp.asarray(x["q"]), k, v, jnp.int32(LAYER), jnp.asarray(x["positions"]),
        jnp.asarray(case.page_table), jnp.asarray(tokens), jnp.asarray(seqs),
        sliding_window=None if window is None else jnp.int32(window),
        sinks=jnp.asarray(sinks, jnp.float32))
    return np.asarray(out)


def _sinks(num_heads: int) -> np.ndarray:
    return 3.0 * np.random.default_rng(7).standard_normal(num_heads).astype(np.float32)


def test_reference_layouts_with_sinks():
    window = 5
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=3)
    sinks = _sinks(6)
    expected = dense_with_sinks(case, sinks, window)
    ragged = _ragged(case, sinks, window)
    np.testing.assert_allclose(ragged, expected, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(_blocked(case, sinks, window), expected, rtol=TOL, atol=TOL)
    assert np.abs(_ragged(case, None, window) - expected).max() > 100 * TOL
    mapped = _blocked(case, sinks, window, kv_head_map=(0, 0, 0, 1, 1, 1))
    np.testing.assert_allclose(mapped, expected, rtol=TOL, atol=TOL)


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernel not built")
@pytest.mark.parametrize("isa", ISAS)
def test_cpu_kernel_with_sinks(isa):
    kernel = functools.partial(cpu.ragged_paged_attention_cpu, isa=isa)
    for seqs, window in ((MIXED, None), (MIXED, 5), ([(300, 1), (0, 40)], 50)):
        case = Case(seqs, num_heads=6, num_kv_heads=2, page_size=4, seed=3)
        sinks = _sinks(6)
        np.testing.assert_allclose(_ragged(case, sinks, window, kernel),
                                   dense_with_sinks(case, sinks, window), rtol=TOL, atol=TOL)
