"""The native 4-bit matmul (`jengine.cpu_kernels.w4_matmul`) against float64 NumPy oracles, on
every instruction-set path this CPU runs (forced), for odd shapes: N not a multiple of the
64-column tile, 1 to 17 rows, K a multiple of 32. The float (W4A16) paths against the product
with the dequantized weight; the VNNI (W4A8) path against the same scheme computed in float64
(x rounded to int8 per row and group of 32, exact integer sums), and within the int8 rounding of
the float product; the packed layout's jnp `dequantize` (the reference path) against the
dequantized weight; `auto`'s choice steered by `cpu_info.hiding`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine import cpu_info
from jengine.cpu_kernels import w4_matmul as w4

pytestmark = pytest.mark.skipif(not w4.available(), reason="native w4 matmul not built")
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    not (w4.available() and w4.supports(isa)), reason=f"no {isa} on this CPU"))
    for isa in ("portable", "avx2", "avx512")]
# (R, K, N): one row, a few, more than any path's register rows; ragged and whole tiles.
SHAPES = [(1, 32, 1), (1, 64, 70), (2, 96, 64), (3, 128, 130), (5, 32, 200), (8, 576, 192),
          (17, 160, 77)]
VNNI = pytest.mark.skipif(not (w4.available() and w4.supports("avx512_vnni")),
                          reason="no AVX-512 VNNI on this CPU")
# The W4A8 paths: VPDPBUSD on 512-bit (AVX-512 VNNI) and 256-bit (AVX-VNNI) vectors.
W4A8 = [pytest.param(isa, marks=pytest.mark.skipif(
    not (w4.available() and w4.supports(isa)), reason=f"no {isa} on this CPU"))
    for isa in ("avx512_vnni", "avx_vnni")]


def _weight(rng, k: int, n: int):
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    s = rng.uniform(0.001, 0.05, (k // 32, n)).astype(np.float32)
    m = rng.uniform(-0.4, 0.0, (k // 32, n)).astype(np.float32)
    dense = np.repeat(s.astype(np.float64), 32, 0) * q + np.repeat(m.astype(np.float64), 32, 0)
    return (q, s, m), dense


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_the_float64_oracle(isa):
    rng = np.random.default_rng(7)
    cases = []
    for r, k, n in SHAPES:
        parts, dense = _weight(rng, k, n)
        x = rng.standard_normal((r, k)).astype(np.float32)
        cases.append((x, w4.pack(*parts), n, x.astype(np.float64) @ dense))

    def products(xs, packs):  # one program for every case: compiles cost more than the runs
        return [w4.w4_matmul(x, *p, n, isa=isa) for x, p, (_, _, n, _) in zip(xs, packs, cases)]

    got = jax.jit(products)([c[0] for c in cases], [c[1] for c in cases])
    for (x, _, n, want), y in zip(cases, got):
        y = np.asarray(y)
        assert y.shape == (x.shape[0], n)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _w4a8_oracle(x: np.ndarray, q, s, m) -> np.ndarray:
    """The VNNI path's scheme in float64: x [R, K] rounded to int8 per group of 32 as the kernel
    rounds it (f32 x * (127 / max|x|), to nearest even), exact integer sums, then per group
    s * d * sum(q * xq) + m * sum(x)."""
    r, k = x.shape
    xg = x.reshape(r, k // 32, 32)
    amax = np.abs(xg).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xg * inv[..., None]).astype(np.int64)  # [R, G, 32]
    d = (amax / np.float32(127)).astype(np.float64)
    qg = q.reshape(k // 32, 32, -1).astype(np.int64)  # [G, 32, N]
    dots = np.einsum("rgk,gkn->rgn", xq, qg).astype(np.float64)
    sums = xg.astype(np.float64).sum(-1)
    return np.einsum("rgn,gn,rg->rn", dots, s.astype(np.float64), d) + sums @ m.astype(np.float64)


@pytest.mark.parametrize("isa", W4A8)
def test_vnni_path_matches_its_scheme_and_the_float_product(isa):
    rng = np.random.default_rng(11)
    shapes = SHAPES + [(9, 64, 64), (24, 96, 130)]  # past the 8-row (4 on AVX-VNNI) blocks
    cases = []
    for r, k, n in shapes:
        parts, dense = _weight(rng, k, n)
        x = rng.standard_normal((r, k)).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero group: scale 0, not a division by zero
        cases.append((x, w4.pack(*parts), n, _w4a8_oracle(x, *parts), x.astype(np.float64) @ dense))

    def products(xs, packs):
        return [w4.w4_matmul(x, *p, c[2], isa=isa) for x, p, c in zip(xs, packs, cases)]

    got = jax.jit(products)([c[0] for c in cases], [c[1] for c in cases])
    for (x, _, n, scheme, exact), y in zip(cases, got):
        y = np.asarray(y)
        assert y.shape == (x.shape[0], n)
        np.testing.assert_allclose(y, scheme, rtol=1e-5, atol=1e-5 * np.abs(scheme).max())
        # int8 rounding of x: at most half a step of each group's 127 per element
        assert np.abs(y - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("isa", ["avx512", *W4A8])
def test_threads_do_not_change_the_sums(isa):
    if not w4.supports(isa):
        pytest.skip(f"no {isa} on this CPU")
    rng = np.random.default_rng(3)
    parts, _ = _weight(rng, 256, 300)
    packed = w4.pack(*parts)
    x = rng.standard_normal((11, 256)).astype(np.float32)
    one = np.asarray(jax.jit(lambda x: w4.w4_matmul(x, *packed, 300, isa=isa,
                                                    max_threads=1))(x))
    many = np.asarray(jax.jit(lambda x: w4.w4_matmul(x, *packed, 300, isa=isa))(x))
    np.testing.assert_array_equal(one, many)  # each column is one thread's, in one order


@VNNI
def test_auto_takes_vnni_unless_hidden():
    assert w4.best_isa() == "avx512_vnni"
    with cpu_info.hiding("avx512_vnni"):
        assert w4.best_isa() == ("avx_vnni" if w4.supports("avx_vnni") else "avx512")
    with cpu_info.hiding("avx512_vnni", "avx_vnni"):
        assert w4.best_isa() == "avx512"
    with cpu_info.hiding("avx512f"):  # an AVX2 CPU: its 256-bit VNNI where it has one
        assert w4.best_isa() == ("avx_vnni" if w4.supports("avx_vnni") else "avx2")
    with cpu_info.hiding("avx512f", "avx_vnni"):
        assert w4.best_isa() == "avx2"


def test_dequantize_undoes_pack():
    rng = np.random.default_rng(5)
    for _, k, n in SHAPES:
        parts, dense = _weight(rng, k, n)
        got = np.asarray(w4.dequantize(*(jnp.asarray(a) for a in w4.pack(*parts)), n))
        np.testing.assert_allclose(got, dense, rtol=1e-6, atol=1e-7)


def test_bad_shapes_are_value_errors():
    rng = np.random.default_rng(1)
    (q, s, m), _ = _weight(rng, 64, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        w4.pack(q[:40], s, m)
    with pytest.raises(ValueError, match="0..15"):
        w4.pack(q + 16, s, m)
    packed = w4.pack(q, s, m)
    with pytest.raises(ValueError, match="w4_matmul takes"):
        w4.w4_matmul(jnp.zeros((1, 32), jnp.float32), *packed, 64)
    with pytest.raises(ValueError, match="unknown isa 'avx9'"):
        w4.w4_matmul(jnp.zeros((1, 64), jnp.float32), *packed, 64, isa="avx9")
