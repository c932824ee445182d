"""The native CPU kernels (`jengine.cpu_kernels.attention`, `kv_zeros`) against the float64
oracle and the reference, on each instruction-set path (portable; AVX2+FMA and AVX-512F where the
CPU has them).

Batches are `test_reference_attention.Case`s (shuffled pages, garbage in every unwritten slot).
The step writes this step's K/V with the kernel's own in-place write, then attends. f32 caches:
within 1e-5 of the oracle. bf16 caches: the case's K/V are rounded to bf16 first, so the oracle
on those values is exact and the kernel (f32 scores, probabilities and accumulation) stays
within 1e-5 of it; the reference, which rounds its probabilities to bf16, is within bf16
rounding (2e-2) of the kernel.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_reference_attention import HEAD_DIM, LAYER, MIXED, NUM_LAYERS, SHAPES, Case

from jengine.cpu_kernels import attention as cpu
from jengine.cpu_kernels import kv_zeros, library
from jengine.pallas_kernels import (
    is_quantized,
    quantize_rows,
    ragged_paged_attention,
    write_kv,
)

TOL = 1e-5
NO_WINDOW = int(jnp.iinfo(jnp.int32).max)
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    not (cpu.available() and cpu.supports(isa)), reason=f"no {isa} on this CPU"))
    for isa in ("portable", "avx2", "avx512")]

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernel not built")


@functools.partial(jax.jit, static_argnames=("kernel", "soft_cap", "kv_head_map", "cpu_write"))
def _step(caches, slots, new_k, new_v, q, token_seq, positions, page_table, window,
          *, kernel, soft_cap, kv_head_map=None, cpu_write=True):
    """`caches`: (k, v), or for an int8 or fp8 cache (k, v, k_scale, v_scale), whose new rows
    are quantized first, as the engine writes them."""
    layer = jnp.int32(LAYER)
    write = cpu.write_kv_cpu if cpu_write else write_kv
    k_cache, v_cache, *scales = caches
    kw = {}
    if scales:
        (new_k, k_scale), (new_v, v_scale) = (quantize_rows(new, k_cache.dtype)
                                              for new in (new_k, new_v))
        kw = dict(k_scale=write(scales[0], layer, slots, k_scale),
                  v_scale=write(scales[1], layer, slots, v_scale))
    k_cache = write(k_cache, layer, slots, new_k)
    v_cache = write(v_cache, layer, slots, new_v)
    out = kernel(q, k_cache, v_cache, layer, token_seq, positions, page_table,
                 sm_scale=q.shape[-1] ** -0.5, sliding_window=window, soft_cap=soft_cap,
                 kv_head_map=kv_head_map, **kw)
    return out, k_cache, v_cache


def _caches(case, cache_dtype):
    if not is_quantized(cache_dtype):
        return case.k_cache.astype(cache_dtype), case.v_cache.astype(cache_dtype)
    (k, k_scale), (v, v_scale) = (quantize_rows(c, cache_dtype)
                                  for c in (case.k_cache, case.v_cache))
    return k, v, k_scale, v_scale


def run(case, kernel, *, window=None, soft_cap=None, kv_head_map=None, num_pad=0,
        cache_dtype=jnp.float32, cpu_write=True):
    """The kernel's output for the case's real tokens (bucket padding rides along). An int8 or
    fp8 cache quantizes the case's cache (garbage and context) row by row."""
    x = case.step_inputs()
    if num_pad:
        rng = np.random.default_rng(99)
        x = {
            "slots": np.concatenate([x["slots"], np.arange(num_pad) % case.page_size]),
            "new_k": np.concatenate([x["new_k"], rng.normal(size=(num_pad, case.num_kv,
                                                                   case.head_dim))]),
            "new_v": np.concatenate([x["new_v"], rng.normal(size=(num_pad, case.num_kv,
                                                                   case.head_dim))]),
            "q": np.concatenate([x["q"], rng.normal(size=(num_pad, case.num_heads,
                                                           case.head_dim))]),
            "token_seq": np.concatenate([x["token_seq"], np.zeros(num_pad, int)]),
            "positions": np.concatenate([x["positions"], np.zeros(num_pad, int)]),
        }
        x = {k: a.astype(np.float32 if a.dtype.kind == "f" else np.int32) for k, a in x.items()}
    out, _, _ = _step(
        _caches(case, cache_dtype),
        *(jnp.asarray(x[k]) for k in ("slots", "new_k", "new_v", "q", "token_seq", "positions")),
        jnp.asarray(case.page_table), jnp.int32(NO_WINDOW if window is None else window),
        kernel=kernel, soft_cap=soft_cap, kv_head_map=kv_head_map, cpu_write=cpu_write,
    )
    out = np.asarray(out)
    assert np.isfinite(out).all()
    return out[: sum(n for _, n in case.seqs)]


def kernel(isa, **kw):
    return functools.partial(cpu.ragged_paged_attention_cpu, isa=isa, **kw)


def check(case, kern, **kw):
    out = run(case, kern, **kw)
    expected = case.expected(window=kw.get("window"), soft_cap=kw.get("soft_cap"))
    np.testing.assert_allclose(out, expected, rtol=TOL, atol=TOL)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_mixed_batch_gqa(isa, num_heads, num_kv_heads):
    case = Case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, page_size=4, seed=2)
    check(case, kernel(isa), num_pad=3)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_batch_shapes(isa, shape):
    case = Case(SHAPES[shape], num_heads=3, num_kv_heads=1, page_size=4, seed=3)
    check(case, kernel(isa))


@pytest.mark.parametrize("isa", ISAS)
def test_sliding_windows_and_soft_cap(isa):
    case = Case(MIXED, num_heads=8, num_kv_heads=1, page_size=4, seed=6)
    for window in (1, 4, 8, 64):
        check(case, kernel(isa), window=window)
    case.q = [q * 8 for q in case.q]  # into the cap's non-linear range
    check(case, kernel(isa), soft_cap=5.0)
    check(case, kernel(isa), window=5, soft_cap=10.0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("block_q", "page_size"), [(1, 4), (4, 1), (32, 16), (5, 3)])
def test_block_and_page_sizes(isa, block_q, page_size):
    """Blocks smaller than a chunk (a chunk spans several blocks) and odd page sizes."""
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=page_size, seed=4)
    check(case, kernel(isa, block_q=block_q), window=7)
    check(case, kernel(isa, block_q=block_q))


@pytest.mark.parametrize("isa", ISAS)
def test_long_context_splits_keys_across_threads(isa):
    """One sequence, few (block, kv head) items: the keys run in chunks of fixed positions and
    the partial softmax states are merged; on one thread the chunks, and so the bits, are the
    same."""
    case = Case([(300, 1)], num_heads=6, num_kv_heads=2, page_size=4, seed=10)
    split = check(case, kernel(isa))
    np.testing.assert_array_equal(split, check(case, kernel(isa, max_threads=1)))
    check(case, kernel(isa), window=50)


@pytest.mark.parametrize("isa", ISAS + ["auto"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_output_does_not_depend_on_its_block_or_batch(isa, dtype):
    """A speculative verification's first row gives the bits of a decode at its position, also
    where the block's later rows reach into another page or key chunk, and with other sequences
    in the batch: the key chunks a row is summed in are fixed positions, not a split of the
    block's extent over the threads (which had made bf16 greedy text differ under
    speculation). `auto` with bf16 takes the AMX path's choice (these blocks stay on vectors)."""
    if isa == "auto" and not cpu.available():
        pytest.skip("native CPU kernel not built")
    rng = np.random.default_rng(0)
    kv, heads, pages, page, dim = 3, 9, 48, 16, 64
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(1, kv, pages, page, dim)), dtype)
                        for _ in range(2))
    table = jnp.arange(pages, dtype=jnp.int32).reshape(2, pages // 2)
    q = jnp.asarray(rng.normal(size=(6, heads, dim)), dtype)
    attend = functools.partial(cpu.ragged_paged_attention_cpu, k_cache=k_cache, v_cache=v_cache,
                               layer=jnp.int32(0), page_table=table, sm_scale=0.125, isa=isa)
    for position in (126, 253, 300):  # the 4 rows cross a page and a 128-key chunk
        decode = attend(q[:1], token_seq=jnp.zeros(1, jnp.int32),
                        positions=jnp.full(1, position, jnp.int32))
        block = attend(q[:4], token_seq=jnp.zeros(4, jnp.int32),
                       positions=position + jnp.arange(4, dtype=jnp.int32))
        batch = attend(q, token_seq=jnp.asarray([0, 0, 0, 0, 1, 1], jnp.int32),
                       positions=jnp.asarray([position + i for i in range(4)] + [5, 200],
                                             jnp.int32))
        np.testing.assert_array_equal(block[0], decode[0])
        np.testing.assert_array_equal(batch[:4], block)


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_blocks_as_tiles(isa):
    """Prefill blocks take the tiled path (query vectors across the lanes): SmolLM2's group of
    3 over pages of 16, chunks whose rows straddle pages with window edges inside a page, blocks
    of 8 and 32 rows (a lane tail, several vector pairs), soft-capped; a long chunk's keys split
    over the threads (rows that see none of a split's keys) merge as one thread's result."""
    case = Case([(20, 40), (3, 17), (0, 1)], num_heads=9, num_kv_heads=3, page_size=16, seed=14)
    for block_q in (8, 32):
        for window in (None, 10, 37):
            check(case, kernel(isa, block_q=block_q), window=window)
    case.q = [q * 8 for q in case.q]
    check(case, kernel(isa), soft_cap=5.0, window=21)
    case = Case([(300, 24)], num_heads=6, num_kv_heads=2, page_size=4, seed=15)
    for window in (None, 50):
        split = check(case, kernel(isa), window=window)
        single = check(case, kernel(isa, max_threads=1), window=window)
        np.testing.assert_allclose(split, single, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("isa", ISAS)
def test_explicit_kv_head_map(isa):
    """Tensor-parallel layout: 3 kv heads replicated, q heads padded 6 -> 8 with a head map."""
    case = Case(MIXED, num_heads=8, num_kv_heads=3, page_size=4, seed=5)
    head_map = (0, 0, 1, 1, 2, 2, 0, 0)
    out = run(case, kernel(isa), kv_head_map=head_map, window=6)
    ref = run(case, ragged_paged_attention, kv_head_map=head_map, window=6, cpu_write=False)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


def _round_to_bf16(case):
    bf = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    case.k = [bf(k) for k in case.k]
    case.v = [bf(v) for v in case.v]
    case.k_cache, case.v_cache = jnp.asarray(bf(case.k_cache)), jnp.asarray(bf(case.v_cache))


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_cache(isa):
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=11)
    _round_to_bf16(case)
    out = check(case, kernel(isa), cache_dtype=jnp.bfloat16, num_pad=2)
    check(case, kernel(isa), cache_dtype=jnp.bfloat16, window=3)
    ref = run(case, ragged_paged_attention, cache_dtype=jnp.bfloat16, cpu_write=False)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_head_dims(isa):
    """Head dims past the cases' 16: whole vectors of 8 and 16 lanes (64, 128, 256), a half
    vector past whole 16-lane ones (24, 72) and ragged tails (13, 100); key counts that are not
    a multiple of the four-key score pass; bf16 caches at two of them."""
    seqs = [(9, 1), (0, 7), (6, 5), (21, 1)]
    for head_dim in (13, 24, 64, 72, 100, 128, 256):
        case = Case(seqs, num_heads=6, num_kv_heads=2, page_size=4, seed=head_dim,
                    head_dim=head_dim)
        check(case, kernel(isa), window=9 if head_dim == 72 else None)
        if head_dim in (24, 64):
            _round_to_bf16(case)
            check(case, kernel(isa), cache_dtype=jnp.bfloat16)


def test_auto_and_forced_instruction_sets(monkeypatch):
    """`auto` runs the best path here (AVX-512F, else AVX2+FMA, else portable): the same bits as
    forcing it. Forcing a path the CPU lacks (or an unknown code) is the kernel's error."""
    best = next(isa for isa in ("avx512", "avx2", "portable") if cpu.supports(isa))
    assert cpu.best_isa() == best
    assert cpu.has_avx2() == cpu.supports("avx2")
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=8)
    np.testing.assert_array_equal(run(case, kernel("auto")), run(case, kernel(best)))
    lacking = [isa for isa in ("avx2", "avx512") if not cpu.supports(isa)]
    for isa in lacking:
        with pytest.raises(jax.errors.JaxRuntimeError, match="instruction set unsupported"):
            run(case, kernel(isa))
    with pytest.raises(ValueError, match="no instruction set 'unknown'.*'avx512'"):
        run(case, kernel("unknown"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_matches_reference_write(dtype):
    rng = np.random.default_rng(12)
    cache = jnp.asarray(rng.normal(size=(NUM_LAYERS, 3, 6, 4, HEAD_DIM)), dtype)
    slots = jnp.asarray([5, 0, 23, 9, 22], jnp.int32)
    new = jnp.asarray(rng.normal(size=(5, 3, HEAD_DIM)), jnp.float32)
    got = cpu.write_kv_cpu(cache, jnp.int32(LAYER), slots, new)
    want = write_kv(cache, jnp.int32(LAYER), slots, new)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_kv_write_is_in_place_when_donated():
    cache = jnp.zeros((NUM_LAYERS, 2, 8, 4, HEAD_DIM), jnp.bfloat16)
    pointer = cache.unsafe_buffer_pointer()
    write = jax.jit(cpu.write_kv_cpu, donate_argnums=0)
    new = jnp.ones((3, 2, HEAD_DIM))
    out = write(cache, jnp.int32(1), jnp.asarray([1, 2, 31], jnp.int32), new)
    assert out.unsafe_buffer_pointer() == pointer
    assert float(out[1, :, 0, 1:3].astype(jnp.float32).sum()) == 2 * 2 * HEAD_DIM


def test_missing_library_names_the_fix(monkeypatch):
    monkeypatch.setattr(library, "_LIB", None)
    monkeypatch.setattr(library, "_LOAD_ERROR", "no _cpu_kernels library")
    with pytest.raises(RuntimeError, match="pip install -e .*--attention-backend reference"):
        cpu.require()


@pytest.mark.parametrize("head_map", [None, (0, 0, 1, 1, 2, 2, 0, 0)])
def test_shard_over_heads(head_map):
    """Per-shard kernels over 4 fake devices: kv heads split (4 kv / 8 q), or replicated with a
    map and the mesh taken from the tracing context, as `attend` runs it under tp."""
    from jengine.pallas_kernels import shard_for_context_mesh, shard_over_heads

    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    num_kv = 4 if head_map is None else 3
    case = Case(MIXED, num_heads=8, num_kv_heads=num_kv, page_size=4, seed=7)
    kern = kernel("auto")
    if head_map is None:
        out = run(case, shard_over_heads(kern, mesh), window=5, cpu_write=False)
    else:
        with jax.set_mesh(mesh):
            out = run(case, lambda *a, **k: shard_for_context_mesh(kern)(*a, **k), window=5,
                      kv_head_map=head_map, cpu_write=False)
    ref = run(case, ragged_paged_attention, window=5, kv_head_map=head_map, cpu_write=False)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


def test_auto_falls_back_to_reference_without_the_library(monkeypatch):
    from jengine.pallas_kernels import resolve_backend

    monkeypatch.setattr(library, "_LIB", None)
    assert resolve_backend("auto", "cpu") == "reference"
    with pytest.raises(RuntimeError, match="--attention-backend reference"):
        resolve_backend("cpu", "cpu")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_scan_keeps_the_cache_in_place(dtype):
    """Write + attend per layer in `lax.scan` with the donated caches in the carry, as the model
    runs: the compiled program has no op producing a whole cache other than the FFI writes."""
    layers, kv, pages, page, d, heads, t = 3, 2, 16, 4, HEAD_DIM, 4, 5

    def step(k_cache, v_cache, q, new, slots, token_seq, positions, page_table):
        def layer_fn(carry, layer):
            k_cache, v_cache, x = carry
            k_cache = cpu.write_kv_cpu(k_cache, layer, slots, new)
            v_cache = cpu.write_kv_cpu(v_cache, layer, slots, new)
            x = cpu.ragged_paged_attention_cpu(x, k_cache, v_cache, layer, token_seq, positions,
                                               page_table, sm_scale=0.25)
            return (k_cache, v_cache, x), None

        return jax.lax.scan(layer_fn, (k_cache, v_cache, q), jnp.arange(layers))[0]

    cache = jax.ShapeDtypeStruct((layers, kv, pages, page, d), dtype)
    ints = jax.ShapeDtypeStruct((t,), jnp.int32)
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(
        cache, cache, jax.ShapeDtypeStruct((t, heads, d), jnp.float32),
        jax.ShapeDtypeStruct((t, kv, d), jnp.float32), ints, ints, ints,
        jax.ShapeDtypeStruct((t, 4), jnp.int32)).compile().as_text()
    shape = f"{jnp.dtype(dtype).name.replace('float32', 'f32').replace('bfloat16', 'bf16')}" \
            f"[{layers},{kv},{pages},{page},{d}]"
    producers = [line for line in hlo.splitlines()
                 if re.search(rf"= {re.escape(shape)}\S* (?!custom-call)[\w-]+\(", line)
                 and "get-tuple-element" not in line and "parameter(" not in line]
    assert not producers, producers


@pytest.mark.parametrize("kv_replicated", [False, True])
def test_kv_write_per_shard_under_a_mesh(kv_replicated):
    """Under `jax.set_mesh` with tp=4 the FFI write runs per shard (kv heads split, or the whole
    replicated cache on each) and matches XLA's scatter."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jengine.pallas_kernels import shard_write_for_context_mesh

    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    rng = np.random.default_rng(13)
    num_kv = 3 if kv_replicated else 4
    cache = rng.normal(size=(NUM_LAYERS, num_kv, 6, 4, HEAD_DIM)).astype(np.float32)
    new = rng.normal(size=(5, num_kv, HEAD_DIM)).astype(np.float32)
    slots = jnp.asarray([5, 0, 23, 9, 22], jnp.int32)
    spec = PartitionSpec() if kv_replicated else PartitionSpec(None, "tp")
    with jax.set_mesh(mesh):
        sharded = jax.device_put(cache, NamedSharding(mesh, spec))

        @jax.jit
        def write(c, n):
            fn = shard_write_for_context_mesh(cpu.write_kv_cpu, kv_replicated=kv_replicated)
            return fn(c, jnp.int32(LAYER), slots, n)

        got = write(sharded, jnp.asarray(new))
    want = write_kv(jnp.asarray(cache), jnp.int32(LAYER), slots, jnp.asarray(new))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_untouched_zeros_are_zeros_in_reused_memory(dtype):
    """Every byte reads zero, also where the allocator hands back memory that held data: sizes
    from under a page (written) to several MiB (whole pages remapped, the ends written)."""
    bits = np.uint32 if dtype == jnp.float32 else np.uint16
    big = jnp.ones((8 << 20,), jnp.float32).block_until_ready()  # raises malloc's mmap threshold,
    del big  # so that buffers of a few MiB come from (dirty) heap memory too
    for n in (3, 1000, (1 << 18) + 5, (1 << 20) + 7, (3 << 20) + 1):
        struct = jax.ShapeDtypeStruct((n,), dtype)
        dirty = jnp.full((n,), -1.5, dtype).block_until_ready()  # freed just before the zeros
        del dirty
        (zeros,) = jax.jit(lambda s=struct: kv_zeros.untouched_zeros(s))()
        assert not np.asarray(zeros).view(bits).any(), n


def test_untouched_zeros_map_only_the_pages_written():
    """A 256 MiB cache adds almost nothing to resident memory: the pages a donated in-place
    step writes are mapped then, and reading the rest maps none."""
    struct = jax.ShapeDtypeStruct((64, 1 << 20), jnp.float32)
    make = jax.jit(lambda: kv_zeros.untouched_zeros(struct)).lower().compile()
    write = jax.jit(lambda c: c.at[3, :16].set(1.0), donate_argnums=0).lower(struct).compile()
    before = _resident_bytes()
    (cache,) = make()
    pointer = cache.unsafe_buffer_pointer()
    cache = write(cache)
    assert cache.unsafe_buffer_pointer() == pointer  # in place: no copy was faulted in
    assert float(cache.sum()) == 16.0
    assert _resident_bytes() - before < 32 << 20
