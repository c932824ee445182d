"""The native W4A16 matmul (`jengine.cpu_kernels.w4_matmul`) against a float64 NumPy oracle of
the dequantized weight, on every instruction-set path this CPU runs (forced), for odd shapes:
N not a multiple of the 64-column tile, 1 to 17 rows, K a multiple of 32; and the packed
layout's jnp `dequantize` (the reference path) against the same oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.cpu_kernels import w4_matmul as w4

pytestmark = pytest.mark.skipif(not w4.available(), reason="native w4 matmul not built")
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    not (w4.available() and w4.supports(isa)), reason=f"no {isa} on this CPU"))
    for isa in ("portable", "avx2", "avx512")]
# (R, K, N): one row, a few, more than any path's register rows; ragged and whole tiles.
SHAPES = [(1, 32, 1), (1, 64, 70), (2, 96, 64), (3, 128, 130), (5, 32, 200), (8, 576, 192),
          (17, 160, 77)]


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


def test_isas_agree_and_threads_do_not_change_the_sums():
    rng = np.random.default_rng(3)
    parts, _ = _weight(rng, 256, 300)
    packed = w4.pack(*parts)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    one = np.asarray(jax.jit(lambda x: w4.w4_matmul(x, *packed, 300, max_threads=1))(x))
    many = np.asarray(jax.jit(lambda x: w4.w4_matmul(x, *packed, 300))(x))
    np.testing.assert_array_equal(one, many)  # each column is one thread's, in one order


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
