"""The `cpu` attention kernel's AMX path (`isa="amx"`, csrc/amx_attention.h): prefill blocks over
a bf16 cache with bf16 queries, their products on the AMX tiles, against the float64 oracle.

Queries, keys and values are rounded to bf16 first, so the oracle on those values is exact; the
AMX path also rounds the probabilities to bf16 (as flash attention does on bf16 hardware), which
moves each output by a few bf16 ulps of its scale: within 1e-2 of outputs of size ~3 (the
vector path's f32 probabilities stay within 1e-5, tests/kernels/test_cpu_attention.py). Decode rows
take the AVX-512 path inside the same call, bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from shared_load import loads_shared  # tests/shared_load.py
from test_cpu_attention import _round_to_bf16, kernel, run
from test_reference_attention import Case

from jengine import Engine, SamplingParams
from jengine.cpu_kernels import attention as cpu

pytestmark = pytest.mark.skipif(
    not (cpu.available() and cpu.supports("amx")),
    reason="no AMX-BF16 here (or Linux gave this process no tile state)")

TOL = 1e-2


def _bf16_case(seqs, *, num_heads, num_kv_heads, page_size=16, head_dim=64, seed=0):
    case = Case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                seed=seed, head_dim=head_dim)
    _round_to_bf16(case)
    case.q = [np.asarray(jnp.asarray(q).astype(jnp.bfloat16).astype(jnp.float32)) for q in case.q]
    return case


def _check(case, isa="amx", **kw):
    """The path's output against the oracle; also returns the AVX-512 path's on the same call."""
    out = run(case, kernel(isa, **{k: kw.pop(k) for k in ("block_q", "max_threads") if k in kw}),
              cache_dtype=jnp.bfloat16, **kw)
    expected = case.expected(window=kw.get("window"), soft_cap=kw.get("soft_cap"))
    np.testing.assert_allclose(out, expected, rtol=TOL, atol=TOL)
    return out, run(case, kernel("avx512"), cache_dtype=jnp.bfloat16, **kw)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1)])  # GQA 1, 3, 8
def test_prefill_and_decode_in_one_batch(num_heads, num_kv_heads):
    """Fresh and chunked prefills (blocks of 16+ query vectors take the tiles), decodes and
    bucket padding in one call; the decode rows are the AVX-512 path's bit for bit."""
    seqs = [(0, 40), (9, 1), (3, 17), (70, 33), (13, 1)]
    case = _bf16_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_heads)
    amx, avx512 = _check(case, num_pad=3)
    starts = np.cumsum([0] + [n for _, n in seqs])
    for i, (_, n) in enumerate(seqs):
        rows = slice(starts[i], starts[i + 1])
        if n == 1:
            np.testing.assert_array_equal(amx[rows], avx512[rows])
        else:  # bf16 probabilities: not the vector path's bits
            assert not np.array_equal(amx[rows], avx512[rows])


def test_windows_soft_cap_and_page_sizes():
    """Sliding windows with edges inside chunks and pages, soft-capping, pages of 4 keys (a
    chunk of 64 keys spans 16 of them) and blocks of 8 and 64 rows."""
    case = _bf16_case([(20, 40), (3, 70), (0, 1)], num_heads=9, num_kv_heads=3, seed=14)
    for window in (None, 10, 37, 100):
        _check(case, window=window)
    for block_q in (8, 64):
        _check(case, block_q=block_q, window=21)
    case.q = [q * 8 for q in case.q]
    _check(case, soft_cap=5.0, window=21)
    case = _bf16_case([(50, 30), (0, 20)], num_heads=6, num_kv_heads=2, page_size=4, seed=3)
    _check(case)
    _check(case, window=7)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
def test_head_dims(head_dim):
    """Every multiple of 32: two, six, eight and sixteen 16-dim column tiles of P V."""
    case = _bf16_case([(10, 33), (0, 20)], num_heads=8, num_kv_heads=2, head_dim=head_dim,
                      seed=head_dim)
    _check(case)
    _check(case, window=9)


def test_long_context_splits_keys_across_threads():
    """One 24-token chunk over 300 cached keys: too few items for the threads, so each block's
    keys are split and the partial softmax states merged, as on one thread within the bf16
    rounding of the probabilities (each split rounds them against its own running max)."""
    case = _bf16_case([(300, 24)], num_heads=6, num_kv_heads=2, page_size=4, seed=15)
    for window in (None, 50):
        split, _ = _check(case, window=window)
        single, _ = _check(case, window=window, max_threads=1)
        assert not np.array_equal(split, single)  # the split did happen
        np.testing.assert_allclose(split, single, rtol=TOL, atol=TOL)


def test_explicit_kv_head_map():
    """Tensor-parallel layout: 3 kv heads replicated, q heads padded 6 -> 8 with a head map."""
    case = _bf16_case([(5, 20), (0, 18)], num_heads=8, num_kv_heads=3, seed=5)
    head_map = (0, 0, 1, 1, 2, 2, 0, 0)
    amx = run(case, kernel("amx"), kv_head_map=head_map, window=6, cache_dtype=jnp.bfloat16)
    vector = run(case, kernel("avx512"), kv_head_map=head_map, window=6,
                 cache_dtype=jnp.bfloat16)
    np.testing.assert_allclose(amx, vector, rtol=TOL, atol=TOL)


def test_auto_takes_the_tiles_for_bf16_queries_only():
    """`auto` runs the AMX path for bf16 q over a bf16 cache (a bf16 model), the AVX-512 path for
    f32 q (an f32 model with a bf16 cache: rounding its queries would lose precision) and for
    f32 and int8 caches (whose products the AMX path does not take: same bits as avx512)."""
    case = _bf16_case([(0, 40), (9, 1)], num_heads=9, num_kv_heads=3, seed=7)
    as_bf16 = lambda q, *a, **kw: cpu.ragged_paged_attention_cpu(  # noqa: E731
        q.astype(jnp.bfloat16), *a, **kw).astype(jnp.float32)
    auto_bf16 = run(case, as_bf16, cache_dtype=jnp.bfloat16)
    amx_bf16 = run(case, lambda q, *a, **kw: as_bf16(q, *a, isa="amx", **kw),
                   cache_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(auto_bf16, amx_bf16)
    for dtype in (jnp.bfloat16, jnp.float32, jnp.int8):
        auto = run(case, kernel("auto"), cache_dtype=dtype)
        np.testing.assert_array_equal(auto, run(case, kernel("avx512"), cache_dtype=dtype))
    np.testing.assert_array_equal(run(case, kernel("amx"), cache_dtype=jnp.float32),
                                  run(case, kernel("avx512"), cache_dtype=jnp.float32))


@pytest.mark.slow  # the tiles against the reference kernel by kernel in CI; whole engine ~40 s
def test_bf16_engine_greedy_tokens_equal_the_reference_backend():
    """SmolLM2 in bf16: prompts long enough for tile blocks (one over several 64-key chunks
    and prefill chunks), greedy tokens equal to the reference backend's up to the first near
    tie of the reference (top two logprobs under 0.05 apart: the tiles' bf16 probabilities
    may turn it, as the haiku prompt's 10th token, 0.012 apart, does), each prompt alone (in
    one batch their prefill chunks end elsewhere). Short prompts, whose blocks never reach the
    tiles, are left to the f32 engine tests."""
    prompts = ["Write a haiku about the sea. " * 3,
               "Count: " + ", ".join(str(i % 10) for i in range(90))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outs = {}
    with loads_shared():  # one read of the weights for both engines
        for backend in ("cpu", "reference"):
            engine = Engine(config="tests/one_bucket.yaml", dtype="bfloat16",
                            attention_backend=backend, progress=False)
            outs[backend] = [engine.generate(p, greedy)[0].outputs[0] for p in prompts]
    compared = 0
    for got, want in zip(outs["cpu"], outs["reference"]):
        margins = [abs(a.logprob - b.logprob) for a, b in
                   (sorted(lp.values(), key=lambda x: -x.logprob)[:2] for lp in want.logprobs)]
        n = next((i for i, m in enumerate(margins) if m < 0.05), len(margins))
        assert got.token_ids[:n] == want.token_ids[:n]
        compared += n
    assert compared >= 16


def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    """The same query rows over the same keys, once as the last 17 of a 49-row chunk (blocks of
    32 and 17 rows) and once alone (a 17-row block: still a prefill block), so their tiles
    hold other rows (16 query vectors a tile, 3 a
    token): bit-equal. Rows that see all of keys 64-127 share tiles with rows that do
    not, which must not change their values (a scale that is not a power of two: scaling the
    scores is not exact; with a fully-visible-chunk path of its own, seed 23 moved 13 values)."""
    rng = np.random.default_rng(23)
    pages, page, heads, kv_heads, dim, end = 10, 16, 9, 3, 64, 141
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((1, kv_heads, pages, page, dim)),
                                    jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((49, heads, dim)) * 2, jnp.bfloat16)
    table = jnp.asarray(rng.permutation(pages)[None, :], jnp.int32)

    def attend(rows):
        n = rows.shape[0]
        return np.asarray(cpu.ragged_paged_attention_cpu(
            rows, k_cache, v_cache, jnp.int32(0), jnp.zeros(n, jnp.int32),
            jnp.arange(end - n, end, dtype=jnp.int32), table, sm_scale=0.1, isa="amx",
            max_threads=1).astype(jnp.float32))

    np.testing.assert_array_equal(attend(q)[-17:], attend(q[-17:]))
