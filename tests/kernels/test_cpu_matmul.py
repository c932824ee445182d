"""The native small-row matmul (`jengine.cpu_kernels.matmul`) against a float64 oracle
and `jnp.dot`, on every instruction-set path this CPU runs, for f32, bf16 and int8 weights, and
the engine's greedy tokens with it on and off (`matmul_backend`); the AMX kernel over packed
bf16 weights (`amx_tiles`, `amx_matmul`) against the oracle where the CPU has AMX-BF16, and
SmolLM2's projections packed as the engine packs them."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jengine import Engine, SamplingParams, cpu_info
from jengine.cpu_kernels import library
from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.models import matmul, quant

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="native matmul not built")
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    not (cpu_matmul.available() and cpu_matmul.supports(isa)), reason=f"no {isa} on this CPU"))
    for isa in ("portable", "avx2", "avx512")]


def _check_all(cases: list[tuple[np.ndarray, np.ndarray, dict]], isa: str) -> None:
    """`_check` of every (x, w, kwargs) case, all products (both forms, and XLA's f32 dot of
    each) computed by one compiled program: compiling a tiny program costs ~0.1 s here, so a
    program per product made this file's time (121 s of CI) while the kernel ran microseconds.
    Each call in the program is the kernel's own call with its own shapes, and its threads are
    fixed by the pool size and `max_threads` alone (csrc/parallel_for.h), so the products are
    those of separate programs; every case is checked as before."""
    calls = []
    for x, w, kw in cases:
        calls.append((x, w, kw))
        calls.append((x, np.ascontiguousarray(w.T), {**kw, "transpose_w": True}))
    # a bf16 / int8 weight widens exactly
    wides = [np.asarray(w.T if kw.get("transpose_w") else w).astype(np.float32)
             for _, w, kw in calls]

    def products(xs, ws, wides):
        native = [cpu_matmul.small_matmul(x, w, isa=isa, **kw)
                  for x, w, (_, _, kw) in zip(xs, ws, calls)]
        return native, [jnp.dot(x, w) for x, w in zip(xs, wides)]

    got, dots = jax.jit(products)([x for x, _, _ in calls], [w for _, w, _ in calls], wides)
    for (x, _, kw), g, w, dot in zip(calls, got, wides, dots):
        got = np.asarray(g)
        want = x.astype(np.float64) @ w.astype(np.float64)
        # f32 sums of K products: within K ulps of the largest partial sum, relative to |x| |w|.
        bound = 1e-6 * x.shape[1] * (np.abs(x).astype(np.float64) @ np.abs(w)) + 1e-30
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.all(np.abs(got - want) <= bound), (kw, np.max(np.abs(got - want) / bound))
        np.testing.assert_allclose(got, np.asarray(dot), rtol=1e-4,
                                   atol=1e-4 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("isa", ISAS)
def test_rows_against_oracle(isa):
    """Every row count the engine sends (1..17 crosses each ISA's row groups: the streamed
    rows, each register tile height up to kMaxRows, then 2-3 groups), a ragged N."""
    cases = []
    for rows in range(1, 18):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, 70), np.float32)
        w = rng.standard_normal((70, 300), np.float32)  # 300 = 9 x 32 + 12 ragged columns
        # (and K = 70 = 8 x 8 + 6 ragged for the transposed form's vectors along K)
        cases.append((x, w, {}))
    _check_all(cases, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_row_is_summed_alike_in_any_row_count(isa, dtype):
    """Row r of an R-row product equals the same row's product alone, to the bit, for every R
    the native ranges take: a speculative verification's rows then equal plain decoding's
    (the one-to-few-row calls split k over the threads; more rows split it the same way). Both
    forms; SmolLM2's shapes, with K large enough for the k split. (All calls of a form in one
    program: see `_check_all`.)"""
    rng = np.random.default_rng(7)
    counts = (2, 3, 4, 5, 8, 13, 16, 33, 64)
    for k, n in ((576, 1536), (1536, 576)):
        x = rng.standard_normal((64, k), np.float32)
        w = rng.standard_normal((k, n), np.float32)
        w = jnp.asarray(w if dtype == "float32" else _narrow(w, dtype))
        for transpose_w in (False, True):
            operand = w.T if transpose_w else w

            def calls(x, operand, t=transpose_w):
                def call(a):
                    return cpu_matmul.small_matmul(a, operand, isa=isa, transpose_w=t)
                return ([call(x[r:r + 1]) for r in range(8)],
                        [call(x[:rows]) for rows in counts])

            singles, many = jax.jit(calls)(x, operand)
            alone = np.stack([np.asarray(s)[0] for s in singles])
            for rows, got in zip(counts, many):
                np.testing.assert_array_equal(np.asarray(got)[:8], alone[:rows],
                                              err_msg=f"{rows} rows")


def _narrow(w: np.ndarray, dtype: str) -> np.ndarray:
    """w as a bf16 array, or as int8 values (a w8a16 weight before its scale)."""
    if dtype == "int8":
        return np.clip(np.round(w * 40), -127, 127).astype(np.int8)
    return np.asarray(jnp.asarray(w).astype(jnp.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_narrow_weights_against_oracle(isa, dtype):
    """bf16 and int8 weights, widened to f32 in registers: every path (the 1-4 row streams,
    the register tiles and their row groups, the transposed form), ragged N and K."""
    cases = []
    for rows in (1, 2, 3, 4, 7, 13, 40, 64):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, 70), np.float32)
        cases.append((x, _narrow(rng.standard_normal((70, 300), np.float32), dtype), {}))
        cases.append((x[:, :1], _narrow(rng.standard_normal((1, 5), np.float32), dtype), {}))
        if rows <= 4:  # K split over the threads (3-4 rows: AVX-512 only)
            cases.append((rng.standard_normal((rows, 1001), np.float32),
                          _narrow(rng.standard_normal((1001, 75), np.float32), dtype), {}))
    _check_all(cases, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k, n", [(1, 1), (3, 7), (576, 192), (200, 1000), (1001, 75),
                                  (1536, 48)])
def test_shapes_and_threads(isa, k, n):
    """Tiny and model-sized K (several k-blocks), N below one tile and spread over panels, one
    thread and all of them; up to two rows (four with AVX-512), which split K over the threads
    from K = 128 on (each thread's partial sums added at the end; K = 1001 splits off the 8-row
    grid)."""
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n), np.float32)
    cases = []
    for rows in (1, 2, 3, 4, 5):
        x = rng.standard_normal((rows, k), np.float32)
        cases += [(x, w, {"max_threads": threads}) for threads in (0, 1)]
    _check_all(cases, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_zeros_negatives_and_large_values(isa):
    rng = np.random.default_rng(7)
    x = np.zeros((6, 96), np.float32)
    w = rng.standard_normal((96, 80), np.float32)
    x2 = -np.abs(rng.standard_normal((6, 96), np.float32)) * 1e17
    w2 = np.abs(rng.standard_normal((96, 80), np.float32)) * 1e17  # products ~1e34: finite
    _check_all([(x, w, {}), (x2, w2, {})], isa)  # exact zeros; large values
    got = np.asarray(cpu_matmul.small_matmul(jnp.asarray(x2), jnp.asarray(w2), isa=isa))
    assert np.all(got < 0) and np.all(np.isfinite(got))


def test_zero_rows_and_bad_operands():
    """No rows: an empty result; a bf16 x or a float16 w: a ValueError before anything is
    built."""
    w = jnp.ones((4, 8), jnp.float32)
    assert cpu_matmul.small_matmul(jnp.ones((0, 4), jnp.float32), w).shape == (0, 8)
    with pytest.raises(ValueError, match="float32"):
        cpu_matmul.small_matmul(jnp.ones((2, 4), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="bfloat16 or int8 w"):
        cpu_matmul.small_matmul(jnp.ones((2, 4), jnp.float32), w.astype(jnp.float16))


def _narrow_limit(weight, x_dtype) -> int:
    """The most rows the kernel takes for a bf16 or w8a16 weight: fewer with bf16 activations
    on an AMX-BF16 CPU, where XLA's bf16 dot runs on the tiles."""
    if x_dtype == jnp.bfloat16 and "amx_bf16" in cpu_info.flags():
        rows = (matmul.AMX_BF16_NATIVE_ROWS if weight.dtype == jnp.bfloat16
                else matmul.AMX_INT8_WEIGHT_NATIVE_ROWS)
        return rows[1]
    return matmul.NARROW_NATIVE_ROWS[1]


# This CPU's flags, and the routing as it would be with and without AMX (the kernel and XLA's
# dot both run for real either way; only the choice between them follows the flags).
CPU_FLAGS = [pytest.param(None, id="this-cpu"), pytest.param({"amx_bf16", "amx_int8"}, id="amx"),
             pytest.param(set(), id="no-amx")]


@pytest.mark.parametrize("flags", CPU_FLAGS)
def test_dot_routes_only_the_shapes_it_fits(flags, monkeypatch):
    """`matmul.dot` with `native` runs the kernel for f32 x [R, K] against w's leading axis
    (a 3-D weight through its [K, N] view) at 1..32 rows or a 2-D w's last axis at 2..32, and
    XLA's einsum otherwise."""
    if flags is not None:
        monkeypatch.setattr(cpu_info, "flags", lambda: frozenset(flags))
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((64, 4, 8), np.float32))  # wq [E, H, D]
    for rows in (1, 2, 16, 32, 33):
        x = jnp.asarray(rng.standard_normal((rows, 64), np.float32))
        text = jax.jit(lambda a, b: matmul.dot("te,ehd->thd", a, b, "native")).lower(
            x, w).as_text()
        assert ("jengine_small_matmul" in text) == (rows <= 32), rows
        got = matmul.dot("te,ehd->thd", x, w, "native")
        np.testing.assert_allclose(got, jnp.einsum("te,ehd->thd", x, w), rtol=1e-5, atol=1e-5)
    # A tied embedding as the output head: w [V, E] contracted over its last axis, from two
    # rows on (XLA's one-row dot streams that form as fast).
    table = jnp.asarray(rng.standard_normal((19, 8), np.float32))
    for rows in (1, 2, 4):
        x = jnp.asarray(rng.standard_normal((rows, 8), np.float32))
        lowered = jax.jit(lambda a, b: matmul.dot("te,ve->tv", a, b, "native")).lower(x, table)
        assert ("jengine_small_matmul" in lowered.as_text()) == (rows > 1), rows
    np.testing.assert_allclose(matmul.dot("te,ve->tv", x, table, "native"), x @ table.T,
                               rtol=1e-5, atol=1e-5)
    # Narrow weights from one row on: a bf16 weight (under a bf16 or f32 x) and a w8a16 one,
    # whose scale applies after the kernel; W8A8 int8 keeps its int8 x int8 dot.
    w16 = w.astype(jnp.bfloat16)
    q = quant.quantize_weight(w, (0,), "w8a16")
    for rows in (1, 4, 5, 16, 17, 64, 65):
        for xdt in (jnp.float32, jnp.bfloat16):
            xn = jnp.asarray(rng.standard_normal((rows, 64), np.float32)).astype(xdt)
            for weight, want in ((w16, jnp.einsum("te,ehd->thd", xn.astype(jnp.float32),
                                                  w16.astype(jnp.float32))),
                                 (q, quant.einsum("te,ehd->thd", xn, q))):
                text = jax.jit(lambda a, b: matmul.dot("te,ehd->thd", a, b, "native")).lower(
                    xn, weight).as_text()
                assert ("jengine_small_matmul" in text) == (rows <= _narrow_limit(
                    weight, xdt)), (rows, xdt)
                np.testing.assert_allclose(matmul.dot("te,ehd->thd", xn, weight, "native"),
                                           want, rtol=1e-4, atol=1e-4)
    text = jax.jit(lambda a, b: matmul.dot("te,ehd->thd", a, b, "native")).lower(
        xn[:4].astype(jnp.float32), quant.quantize_weight(w, (0,), "int8")).as_text()
    assert "jengine_small_matmul" not in text
    # Neither form (w's middle axis contracted): XLA's einsum.
    text = jax.jit(lambda a, b: matmul.dot("te,hed->thd", a, b, "native")).lower(
        x, jnp.ones((2, 8, 3), jnp.float32)).as_text()
    assert "jengine_small_matmul" not in text


def test_resolve_matmul_backend():
    here = "amx" if cpu_matmul.amx_available() else "native"
    assert matmul.resolve_matmul_backend("auto", "cpu", 1) == here
    assert matmul.resolve_matmul_backend("auto", "cpu", 2) == "xla"
    assert matmul.resolve_matmul_backend("auto", "gpu", 1) == "xla"
    assert matmul.resolve_matmul_backend("xla", "cpu", 1) == "xla"
    for backend in ("native", "amx"):
        with pytest.raises(ValueError, match="tensor parallelism"):
            matmul.resolve_matmul_backend(backend, "cpu", 2)
    with pytest.raises(ValueError, match="unknown matmul_backend"):
        matmul.resolve_matmul_backend("blas", "cpu", 1)


def test_auto_keeps_xla_without_the_library(monkeypatch):
    monkeypatch.setattr(library, "_LIB", None)
    monkeypatch.setattr(library, "_LOAD_ERROR", "no _cpu_kernels library")
    assert matmul.resolve_matmul_backend("auto", "cpu", 1) == "xla"
    with pytest.raises(RuntimeError, match="pip install -e .*matmul_backend 'xla'"):
        matmul.resolve_matmul_backend("native", "cpu", 1)


def test_engine_greedy_tokens_equal_with_kernel_on_and_off(tiny_llama, tmp_path):
    """A random tiny Llama, two step shapes (8 and 16 tokens, both the kernel's) over a batch
    of mixed prompts: the same greedy tokens with `matmul_backend` native and xla."""
    preset = yaml.safe_load((Path(__file__).parents[1] / "two_buckets.yaml").read_text())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, n).tolist() for n in (3, 9, 20, 31)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "native"):
        preset["model"]["matmul_backend"] = backend
        config = tmp_path / f"{backend}.yaml"
        config.write_text(yaml.safe_dump(preset))
        engine = Engine(str(tiny_llama), config=str(config), progress=False)
        assert engine.core.model_config.matmul_backend == backend
        tokens[backend] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert tokens["native"] == tokens["xla"]


def test_engine_w8a16_greedy_tokens_equal_with_kernel_on_and_off(tiny_llama, tmp_path):
    """w8a16 (int8 weights, float activations): the native kernel from one row on gives the
    same greedy tokens as XLA's converted-weight dot."""
    preset = yaml.safe_load((Path(__file__).parents[1] / "one_bucket.yaml").read_text())
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 96, n).tolist() for n in (4, 11)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "native"):
        preset["model"]["matmul_backend"] = backend
        config = tmp_path / f"{backend}.yaml"
        config.write_text(yaml.safe_dump(preset))
        engine = Engine(str(tiny_llama), config=str(config), quantization="w8a16", progress=False)
        tokens[backend] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert tokens["native"] == tokens["xla"]


# -- the AMX kernel over packed bf16 weights (cpu_matmul.amx_matmul) ------------------------------

needs_amx = pytest.mark.skipif(
    not (cpu_matmul.available() and cpu_matmul.amx_available()),
    reason="no AMX-BF16 here (or Linux gave this process no tile state)")


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16))


def _check_amx(cases: list[tuple[np.ndarray, np.ndarray, dict]]) -> None:
    """amx_matmul of bf16-valued x (f32 and bf16) and bf16 w against a float64 oracle, for
    every (x, w, kwargs) case; with a bf16 output, the f32 output rounded. All products in one
    compiled program (see `_check_all`)."""
    tiles = [jnp.asarray(cpu_matmul.amx_tiles(w)) for _, w, _ in cases]

    def products(xs, tiles):
        out = []
        for x, t, (_, w, kw) in zip(xs, tiles, cases):
            for xd in (jnp.float32, jnp.bfloat16):
                a = x.astype(xd)
                out.append((cpu_matmul.amx_matmul(a, t, w.shape[1], **kw),
                            cpu_matmul.amx_matmul(a, t, w.shape[1], out_dtype=jnp.bfloat16,
                                                  **kw)))
        return out

    results = iter(jax.jit(products)([jnp.asarray(x) for x, _, _ in cases], tiles))
    for x, w, _ in cases:
        want = x.astype(np.float64) @ w.astype(np.float64)
        # f32 sums of K exact products: within K ulps of the largest partial sum, relative to
        # |x| |w|.
        bound = 1e-6 * x.shape[1] * (np.abs(x).astype(np.float64) @
                                     np.abs(w).astype(np.float64))
        for xd in (jnp.float32, jnp.bfloat16):
            got, rounded = next(results)
            got = np.asarray(got)
            assert got.shape == want.shape and got.dtype == np.float32
            assert np.all(np.abs(got - want) <= bound + 1e-30), (xd, np.max(np.abs(got - want)))
            assert rounded.dtype == jnp.bfloat16  # the f32 sums' own rounding, bit for bit
            np.testing.assert_array_equal(np.asarray(rounded),
                                          np.asarray(jnp.asarray(got).astype(jnp.bfloat16)))


@needs_amx
def test_amx_rows_against_oracle():
    """Rows below, at and past one A tile (16) and one block (32), and prefill chunks past 512
    and kPanelRows (1,024); K = 70 and N = 300 are not multiples of 32 (zero-padded)."""
    cases = []
    for rows in (1, 5, 16, 17, 33, 64, 520, 1030):
        rng = np.random.default_rng(rows)
        cases.append((_bf16(rng.standard_normal((rows, 70), np.float32)),
                      _bf16(rng.standard_normal((70, 300), np.float32)), {}))
    _check_amx(cases)


@needs_amx
@pytest.mark.parametrize("k, n", [(1, 1), (31, 33), (576, 192), (1536, 576), (100, 1000)])
def test_amx_shapes_and_threads(k, n):
    """Tiny and model-sized K and N, one thread and all of them; exact zeros stay zero."""
    rng = np.random.default_rng(k + n)
    w = _bf16(rng.standard_normal((k, n), np.float32))
    cases = []
    for rows in (3, 48):
        x = _bf16(rng.standard_normal((rows, k), np.float32))
        cases += [(x, w, {"max_threads": threads}) for threads in (0, 1)]
    _check_amx(cases)
    zeros = np.asarray(cpu_matmul.amx_matmul(jnp.zeros((4, k), jnp.bfloat16),
                                             jnp.asarray(cpu_matmul.amx_tiles(w)), n))
    assert not zeros.any()


def test_amx_tiles_layout():
    """Strip s, k step ks, half h, pair row p, column c, word i hold w[32 ks + 2p + i,
    32 s + 16 h + c]; zeros past K and N."""
    rng = np.random.default_rng(5)
    k, n = 70, 45
    w = _bf16(rng.standard_normal((k, n), np.float32))
    tiles = cpu_matmul.amx_tiles(w)
    assert tiles.shape == (2, 3, *cpu_matmul.AMX_TILE) and tiles.dtype == w.dtype
    padded = np.zeros((96, 64), w.dtype)
    padded[:k, :n] = w
    for s, ks, h, p, c, i in np.ndindex(2, 3, 2, 16, 16, 2):
        assert tiles[s, ks, h, p, 2 * c + i] == padded[32 * ks + 2 * p + i, 32 * s + 16 * h + c]
    with pytest.raises(ValueError, match="2-D bfloat16"):
        cpu_matmul.amx_tiles(w.astype(np.float32))
    with pytest.raises(ValueError, match="2-D bfloat16"):
        cpu_matmul.amx_tiles(w[None])


@needs_amx
def test_amx_zero_rows_and_bad_operands():
    w = _bf16(np.ones((64, 40), np.float32))
    tiles = jnp.asarray(cpu_matmul.amx_tiles(w))
    assert cpu_matmul.amx_matmul(jnp.ones((0, 64), jnp.bfloat16), tiles, 40).shape == (0, 40)
    for x, n in ((jnp.ones((2, 64), jnp.float16), 40),  # dtype
                 (jnp.ones((2, 96), jnp.bfloat16), 40),  # K beyond the tiles
                 (jnp.ones((2, 64), jnp.bfloat16), 70),  # N beyond them
                 (jnp.ones((64,), jnp.bfloat16), 40)):  # not 2-D
        with pytest.raises(ValueError, match="amx_matmul takes"):
            cpu_matmul.amx_matmul(x, tiles, n)


@needs_amx
def test_pack_projections_and_dot_on_smollm2():
    """SmolLM2's bf16 weights packed as the engine packs them: every layer projection becomes
    an `AmxPacked` (wo with its head axes merged into K) and so does the tied embedding (as
    its transpose), the rest stays as it was, and the model's own projection, output head and
    embedding calls give the float64 oracle's products and the table's rows."""
    from converters import load_source
    from jengine.models import family_module, layers

    loaded = load_source(None, dtype="bfloat16", progress=False)
    cfg = loaded.config
    specs = family_module(cfg).param_specs(cfg)
    host = {name: np.asarray(loaded.params[name]) for name in specs if name in loaded.params}
    params = jax.device_put(layers.unstack_layers(host, family_module(cfg).layer_keys,
                                                  cfg.num_layers))
    first = params["layers"][0]
    originals = {name: np.asarray(w) for name, w in first.items()}
    table = np.asarray(params["embed"])
    packed = matmul.pack_projections(params, specs)
    assert len(packed["layers"]) == cfg.num_layers
    got = packed["layers"][0]
    assert {n for n, w in got.items() if isinstance(w, matmul.AmxPacked)} == set(
        matmul.AMX_PROJECTIONS)
    assert got["attn_norm"] is first["attn_norm"]
    assert got["wo"].shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    rng = np.random.default_rng(0)
    for rows in (1, 7, 64):
        x = _bf16(rng.standard_normal((rows, cfg.hidden_size), np.float32))
        attn = _bf16(rng.standard_normal((rows, cfg.num_heads, cfg.head_dim), np.float32))
        h = _bf16(rng.standard_normal((rows, cfg.intermediate_size), np.float32))
        cases = [(x, name, "te,ehd->thd") for name in ("wq", "wk", "wv")]
        cases += [(x, name, "te,ef->tf") for name in ("w_gate", "w_up")]
        cases += [(h, "w_down", "tf,fe->te")]
        for inp, name, eq in cases:
            text = jax.jit(lambda a, w, eq=eq: matmul.dot(eq, a, w, "amx")).lower(
                inp, got[name]).as_text()
            assert "jengine_amx_matmul" in text, name
            y = np.asarray(matmul.dot(eq, jnp.asarray(inp), got[name], "amx"))
            want = np.einsum(eq, inp.astype(np.float64), originals[name].astype(np.float64))
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=name)
        y = np.asarray(layers.project_heads(jnp.asarray(attn), got["wo"], backend="amx"))
        want = np.einsum("thd,hde->te", attn.astype(np.float64),
                         originals["wo"].astype(np.float64))
        np.testing.assert_allclose(y.astype(np.float64), want, rtol=1e-2, atol=1e-2)
        # The tied embedding, packed as its transpose: the output head, and its rows.
        head = packed["embed"]
        assert head.transposed and head.shape == table.shape
        y = np.asarray(layers.lm_head(jnp.asarray(x), packed, True, "amx"))
        want = x.astype(np.float64) @ table.T.astype(np.float64)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([0, 7, 31, 32, 48, cfg.vocab_size - 1], jnp.int32)
    rows = layers.embed_tokens(packed["embed"], ids, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rows), table[np.asarray(ids)])
    for w, eq in ((got["wq"], "te,hed->thd"), (packed["embed"], "te,ev->tv")):
        with pytest.raises(ValueError, match="only as the product it was packed for"):
            matmul.dot(eq, jnp.asarray(x), w, "amx")
    # Only bf16 float weights are packed: f32 and quantized ones stay as they are.
    wq = jnp.asarray(originals["wq"])
    for w in (wq.astype(jnp.float32), quant.quantize_weight(wq, (0,), "w8a16")):
        assert matmul.pack_projections({"layers": ({"wq": w},)}, specs)["layers"][0]["wq"] is w


@needs_amx
def test_amx_from_concurrent_callers():
    """Several host threads calling one-row-tile products at once (the calls XLA runs side by
    side): each takes the spinning helper thread or, while another holds it, runs alone."""
    import threading

    rng = np.random.default_rng(11)
    w = _bf16(rng.standard_normal((576, 1536), np.float32))
    x = _bf16(rng.standard_normal((5, 576), np.float32))
    want = x.astype(np.float64) @ w.astype(np.float64)
    run = jax.jit(lambda a, t: cpu_matmul.amx_matmul(a, t, w.shape[1]))
    tiles = jnp.asarray(cpu_matmul.amx_tiles(w))
    worst = []

    def calls():
        worst.append(max(float(np.abs(np.asarray(run(x, tiles)) - want).max())
                         for _ in range(100)))

    threads = [threading.Thread(target=calls) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(worst) == 3 and max(worst) < 1e-3


@needs_amx
@pytest.mark.parametrize("rows, k, n", [(1, 576, 1536), (5, 70, 300), (33, 576, 1536),
                                        (520, 64, 100)])
def test_amx_swiglu_equals_the_unfused_activation(rows, k, n):
    """One call's silu(x @ g) * (x @ u) against the two bf16 products and XLA's f32 silu: the
    same bf16 values but where the two sigmoids' last f32 bit puts an activation on the other
    side of a rounding edge (one bf16 ulp, rarely)."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(_bf16(rng.standard_normal((rows, k), np.float32)))
    g, u = (_bf16(rng.standard_normal((k, n), np.float32) / np.sqrt(k)) for _ in range(2))
    gt, ut = jnp.asarray(cpu_matmul.amx_tiles(g)), jnp.asarray(cpu_matmul.amx_tiles(u))
    got = np.asarray(jax.jit(lambda *a: cpu_matmul.amx_swiglu(*a, n))(x, gt, ut), np.float32)

    def unfused(x, gt, ut):
        gate = cpu_matmul.amx_matmul(x, gt, n, out_dtype=jnp.bfloat16)
        up = cpu_matmul.amx_matmul(x, ut, n, out_dtype=jnp.bfloat16)
        return jax.nn.silu(gate.astype(jnp.float32)).astype(jnp.bfloat16) * up

    want = np.asarray(jax.jit(unfused)(x, gt, ut), np.float32)
    assert got.shape == (rows, n)
    off = got != want
    assert off.mean() < 0.01
    np.testing.assert_allclose(got[off], want[off], rtol=2 ** -7)
    with pytest.raises(ValueError, match="two weights of one shape"):
        cpu_matmul.amx_swiglu(x, gt, jnp.asarray(cpu_matmul.amx_tiles(g[:, :32])), n)
