"""The int8 KV cache (`kv_cache_dtype="int8"`, `pallas_kernels.kv_quant`): the kernels that read
it, its write, and the cache's layout.

Batches are `test_reference_attention.Case`s. Each case's K/V are replaced by their int8
round trip (quantized per token and kv head, dequantized), so the float64 oracle on those
values is what an exact kernel would give: the `cpu` kernel on every instruction-set path, the
reference backend (per token and per query block) and the Pallas kernels in interpret mode stay
within 1e-5 of it and of each other.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_cpu_attention import ISAS, TOL, check, kernel, run
from test_reference_attention import HEAD_DIM, LAYER, MIXED, NUM_LAYERS, SHAPES, Case

from jengine.core.build import resolve_kv_cache_dtype
from jengine.cpu_kernels import attention as cpu
from jengine.models import AttentionMetadata, KVCache
from jengine.models.attention import attend
from jengine.pallas_kernels import (
    num_query_blocks,
    quantize_rows,
    query_blocks,
    ragged_paged_attention,
    ragged_paged_attention_tpu,
)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernel not built")
INT8 = dict(cache_dtype=jnp.int8)


def numpy_quantize(x):
    """The reference quantization in NumPy: absmax * f32(1 / 127) per row, round half to even."""
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(-1, keepdims=True) * np.float32(1 / 127)
    q = np.clip(np.round(x / np.where(scale > 0, scale, np.float32(1))), -127, 127)
    return q.astype(np.int8), scale.astype(np.float32)


def _round_trip(case, quantize=numpy_quantize):
    """The case's K/V as the cache holds them (int8, or `quantize`'s format)."""
    def through_cache(a):
        q, scale = quantize(a)
        return q.astype(np.float32) * scale
    case.k = [through_cache(k) for k in case.k]
    case.v = [through_cache(v) for v in case.v]
    return case


def _check_both(case, kern, **kw):
    """The kernel against the oracle and against the reference on the same int8 cache."""
    out = check(case, kern, **INT8, **kw)
    ref = run(case, ragged_paged_attention, cpu_write=False, **INT8, **kw)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_mixed_batch_gqa(isa, num_heads, num_kv_heads):
    case = _round_trip(Case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, page_size=4,
                            seed=2))
    check(case, kernel(isa), num_pad=3, **INT8)
    _check_both(case, kernel(isa))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_batch_shapes(isa, shape):
    """Decode only, prefill only, chunked prefills: the page boundaries of `SHAPES`."""
    case = _round_trip(Case(SHAPES[shape], num_heads=3, num_kv_heads=1, page_size=4, seed=3))
    _check_both(case, kernel(isa))


@pytest.mark.parametrize("isa", ISAS)
def test_windows_soft_cap_and_long_context(isa):
    case = _round_trip(Case(MIXED, num_heads=8, num_kv_heads=1, page_size=4, seed=6))
    for window in (1, 8):
        _check_both(case, kernel(isa), window=window)
    case.q = [q * 8 for q in case.q]  # into the cap's non-linear range
    _check_both(case, kernel(isa), window=5, soft_cap=10.0)
    case = _round_trip(Case([(300, 1), (0, 2)], num_heads=6, num_kv_heads=2, page_size=4,
                            seed=10))  # keys split over the threads
    _check_both(case, kernel(isa), window=50)
    check(case, kernel(isa, max_threads=1), **INT8)


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_blocks_as_tiles(isa):
    """The tiled prefill path: SmolLM2's group of 3 over pages of 16, blocks of 8 and 32."""
    case = _round_trip(Case([(20, 40), (3, 17), (0, 1)], num_heads=9, num_kv_heads=3,
                            page_size=16, seed=14))
    for block_q, window in ((8, None), (32, 37)):
        _check_both(case, kernel(isa, block_q=block_q), window=window)


@pytest.mark.parametrize("isa", ISAS)
def test_kv_head_map_and_head_dims(isa):
    """The tensor-parallel head map; head dims of whole vectors (64) and with tails (13, 24)."""
    case = _round_trip(Case(MIXED, num_heads=8, num_kv_heads=3, page_size=4, seed=5))
    head_map = (0, 0, 1, 1, 2, 2, 0, 0)
    out = run(case, kernel(isa), kv_head_map=head_map, window=6, **INT8)
    ref = run(case, ragged_paged_attention, kv_head_map=head_map, window=6, cpu_write=False,
              **INT8)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)
    for head_dim in (13, 24, 64):
        case = _round_trip(Case([(9, 1), (0, 7), (21, 1)], num_heads=6, num_kv_heads=2,
                                page_size=4, seed=head_dim, head_dim=head_dim))
        check(case, kernel(isa), **INT8)


def test_quantize_rows_matches_numpy():
    x = np.random.default_rng(1).normal(size=(7, 3, HEAD_DIM)).astype(np.float32) * 5
    x[2, 1] = 0.0  # an all-zero row: scale 0, rows 0
    q, scale = quantize_rows(jnp.asarray(x))
    want_q, want_scale = numpy_quantize(x)
    assert q.dtype == jnp.int8 and scale.shape == (7, 3, 1)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    assert np.abs(np.asarray(q)).max() == 127


def test_ffi_write_of_rows_and_scales_is_numpy_quantization_in_place():
    rng = np.random.default_rng(12)
    shape = (NUM_LAYERS, 3, 6, 4, HEAD_DIM)
    rows = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    scales = jnp.asarray(rng.uniform(size=shape[:-1] + (1,)), jnp.float32)
    want_rows, want_scales = np.asarray(rows).copy(), np.asarray(scales).copy()
    slots = np.asarray([5, 0, 23, 9, 22], np.int32)
    new = rng.normal(size=(5, 3, HEAD_DIM)).astype(np.float32)
    pointers = rows.unsafe_buffer_pointer(), scales.unsafe_buffer_pointer()

    @jax.jit
    def write(rows, scales, new):
        q, s = quantize_rows(new)
        layer, where = jnp.int32(LAYER), jnp.asarray(slots)
        return cpu.write_kv_cpu(rows, layer, where, q), cpu.write_kv_cpu(scales, layer, where, s)

    write = jax.jit(write, donate_argnums=(0, 1))
    got_rows, got_scales = write(rows, scales, jnp.asarray(new))
    assert (got_rows.unsafe_buffer_pointer(), got_scales.unsafe_buffer_pointer()) == pointers
    q, s = numpy_quantize(new)
    want_rows[LAYER, :, slots // 4, slots % 4] = q
    want_scales[LAYER, :, slots // 4, slots % 4] = s
    np.testing.assert_array_equal(np.asarray(got_rows), want_rows)
    np.testing.assert_array_equal(np.asarray(got_scales), want_scales)


def _cache_config(head_dim=HEAD_DIM):
    """What `KVCache` reads of a `ModelConfig`."""
    return SimpleNamespace(num_layers=NUM_LAYERS, num_kv_layers=NUM_LAYERS, num_kv_heads=2,
                           head_dim=head_dim, latent_attention=False, num_linear_layers=0,
                           linear_conv_kernel=0, linear_conv_dim=0, linear_v_heads=0,
                           linear_k_dim=0, linear_v_dim=0, model_type="llama")


def _attend(case, backend, *, blocked=False, window=None):
    """`attend` as the model runs it, on an int8 `KVCache` holding the case's cache."""
    x = case.step_inputs()
    (k, k_scale), (v, v_scale) = quantize_rows(case.k_cache), quantize_rows(case.v_cache)
    none = jnp.zeros((0, 1, 0, 0, 0), jnp.float32)  # no recurrent state (not a hybrid)
    kv = KVCache(k=k, v=v, k_scale=k_scale, v_scale=v_scale, conv=none, ssm=none)
    num_tokens = len(x["slots"])
    blocks = {}
    if blocked:
        num_blocks = num_query_blocks(num_tokens, len(case.seqs), 4)
        tokens, seqs = query_blocks([n for _, n in case.seqs], num_tokens, num_blocks, 4)
        blocks = dict(block_tokens=jnp.asarray(tokens), block_seq=jnp.asarray(seqs))
    md = AttentionMetadata(
        token_ids=jnp.zeros(num_tokens, jnp.int32), positions=jnp.asarray(x["positions"]),
        slot_mapping=jnp.asarray(x["slots"]), token_seq=jnp.asarray(x["token_seq"]),
        page_table=jnp.asarray(case.page_table), logits_indices=jnp.zeros(1, jnp.int32),
        **blocks)
    fn = jax.jit(lambda kv, q, k, v: attend(q, k, v, kv, jnp.int32(LAYER), md,
                                           sm_scale=HEAD_DIM ** -0.5, sliding_window=window,
                                           soft_cap=None, backend=backend))
    out, kv = fn(kv, *(jnp.asarray(x[n]) for n in ("q", "new_k", "new_v")))
    return np.asarray(out), kv


def test_attend_on_every_backend_layout():
    """Through `attend` (quantize, write, read): the `cpu` backend, the reference per token and
    per query block, and the Pallas GPU and TPU kernels (interpret mode, TPU emulation) all
    equal the oracle on the round-tripped K/V, and write the same cache."""
    case = _round_trip(Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=21))
    want = case.expected(window=6)
    outs = {}
    for backend, blocked in (("cpu", False), ("reference", False), ("reference", True),
                             ("pallas_gpu", False), ("pallas_tpu", False)):
        outs[backend, blocked], kv = _attend(case, backend, blocked=blocked, window=6)
        np.testing.assert_allclose(outs[backend, blocked], want, rtol=TOL, atol=TOL)
        assert kv.quantized and kv.k.dtype == jnp.int8 and kv.k_scale.dtype == jnp.float32
        if backend == "cpu":
            cpu_kv = kv
        else:
            for a, b in zip(jax.tree.leaves(kv), jax.tree.leaves(cpu_kv), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pallas_tpu_reads_an_int8_cache():
    """The TPU kernel (TPU emulation) over an int8 cache, its scales DMA'd with the pages in
    chunks of 2: a mixed batch with bucket padding and 3 q heads per kv head, then 8 per kv
    head with a window and a soft cap; the oracle on the round-tripped K/V and the reference
    on the same cache both agree with it."""
    tpu = functools.partial(ragged_paged_attention_tpu, interpret=pltpu.InterpretParams(),
                            block_q=4, pages_per_chunk=2)
    case = _round_trip(Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=22))
    _check_both(case, tpu, num_pad=3)
    case = _round_trip(Case([(9, 1), (0, 7), (13, 1), (6, 12)], num_heads=8, num_kv_heads=1,
                            page_size=8, seed=23))
    case.q = [q * 8 for q in case.q]  # into the cap's non-linear range
    _check_both(case, tpu, window=5, soft_cap=10.0)


def test_reference_int8_write_touches_only_its_rows():
    """XLA's scatter into the int8 cache (and its f32 scales) is in place: no op of the compiled
    write produces a whole cache (bf16 had converted it all to f32 and back)."""
    from jengine.pallas_kernels import write_kv

    shape = (NUM_LAYERS, 2, 16, 4, HEAD_DIM)

    def step(rows, scales, new, slots):
        q, s = quantize_rows(new)
        return write_kv(rows, jnp.int32(1), slots, q), write_kv(scales, jnp.int32(1), slots, s)

    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(
        jax.ShapeDtypeStruct(shape, jnp.int8), jax.ShapeDtypeStruct(shape[:-1] + (1,), jnp.float32),
        jax.ShapeDtypeStruct((5, 2, HEAD_DIM), jnp.float32),
        jax.ShapeDtypeStruct((5,), jnp.int32)).compile().as_text()
    whole = "s8[" + ",".join(map(str, shape)) + "]"
    producers = [line for line in hlo.splitlines()
                 if re.search(rf"= {re.escape(whole)}\S* (?!scatter|fusion)[\w-]+\(", line)
                 and "parameter(" not in line and "get-tuple-element" not in line
                 and "bitcast(" not in line]
    assert not producers, producers
    assert "convert" not in " ".join(line for line in hlo.splitlines() if whole in line
                                     and "fusion" not in line)


def test_cache_layout_pool_size_and_dtype_choice():
    cfg = _cache_config()
    int8 = KVCache.zeros(cfg, 5, 4, jnp.int8)
    assert int8.k.shape == (NUM_LAYERS, 2, 5, 4, HEAD_DIM) and int8.k.dtype == jnp.int8
    assert int8.k_scale.shape == int8.v_scale.shape == (NUM_LAYERS, 2, 5, 4, 1)
    bf16 = KVCache.zeros(cfg, 5, 4, jnp.bfloat16)
    assert not bf16.quantized and bf16.k_scale.shape == (NUM_LAYERS, 2, 5, 4, 0)
    assert jax.tree.structure(bf16) == jax.tree.structure(int8)
    per_page = {d: KVCache.bytes_per_page(cfg, 16, d) for d in ("bfloat16", "int8")}
    assert per_page["int8"] == sum(a.nbytes for a in jax.tree.leaves(int8)) // 5 * 4
    d64 = _cache_config(head_dim=64)
    ratio = KVCache.bytes_per_page(d64, 16, "bfloat16") / KVCache.bytes_per_page(d64, 16, "int8")
    assert ratio == pytest.approx(2 * 64 / (64 + 4))  # 1.88x the tokens of bf16
    assert resolve_kv_cache_dtype("int8", "float32") == "int8"
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"  # int8 is opt-in
    with pytest.raises(ValueError, match="int8"):
        resolve_kv_cache_dtype("int4", "float32")


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_pallas_tpu_quantized_kernel_lowers_for_tpu(dtype):
    """The int8 and fp8 reads (each page's scales a DMA beside its rows) lower to a Mosaic
    custom call without a TPU; their numbers are the emulated runs here and in
    `test_fp8_kv_cache.py`."""
    shape = (2, 3, 32, 16, 64)  # SmolLM2's kv heads and head dim, pages of 16
    cache = jax.ShapeDtypeStruct(shape, dtype)
    scale = jax.ShapeDtypeStruct(shape[:-1] + (1,), jnp.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)

    def fn(q, k, v, ks, vs, layer, token_seq, positions, page_table, window):
        return ragged_paged_attention_tpu(q, k, v, layer, token_seq, positions, page_table,
                                          sm_scale=0.125, sliding_window=window, soft_cap=30.0,
                                          k_scale=ks, v_scale=vs)

    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(
        jax.ShapeDtypeStruct((16, 9, 64), jnp.bfloat16), cache, cache, scale, scale, i32(()),
        i32((16,)), i32((16,)), i32((4, 8)), i32(()))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_pallas_gpu_quantized_kernel_lowers_for_cuda(dtype):
    """The int8 and fp8 reads (scales gathered with their pages) lower to Triton without a GPU;
    their numbers are the interpret-mode runs (`test_attend_on_every_backend_layout`,
    `test_fp8_kv_cache.py`)."""
    from jengine.pallas_kernels import ragged_paged_attention_gpu

    shape = (2, 3, 32, 16, 64)  # SmolLM2's kv heads and head dim, pages of 16
    cache = jax.ShapeDtypeStruct(shape, dtype)
    scale = jax.ShapeDtypeStruct(shape[:-1] + (1,), jnp.float32)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)

    def fn(q, k, v, ks, vs, layer, token_seq, positions, page_table):
        return ragged_paged_attention_gpu(q, k, v, layer, token_seq, positions, page_table,
                                          sm_scale=0.125, k_scale=ks, v_scale=vs)

    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(
        jax.ShapeDtypeStruct((16, 9, 64), jnp.bfloat16), cache, cache, scale, scale, i32(()),
        i32((16,)), i32((16,)), i32((4, 8)))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
