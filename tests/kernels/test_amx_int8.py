"""The AMX-INT8 projection kernel (`cpu_int8.amx_int8_matmul`, csrc/amx_int8.h): an `int8`
(W8A8) weight packed once into the tiles' layout, against XLA's int8 dot and rescale
(`quant._einsum`), to the bit; and the engine with it (tests/kernels/test_amx_projections.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.cpu_kernels import int8_matmul as cpu_int8
from jengine.models import quant
from jengine.models.quant import QArray

pytestmark = pytest.mark.skipif(not cpu_int8.amx_int8_available(),
                                reason="no AMX-INT8 on this CPU (or the library is missing)")


def _weight(rng, k: int, n: int) -> QArray:
    """Full-range int8 values (-128 too) and positive column scales."""
    q = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 2e-2, (1, n)), jnp.float32)
    return QArray(q=q, scale=scale, mode="int8")


@pytest.mark.parametrize(("rows", "k", "n"), [
    (1, 576, 192), (3, 576, 1536), (16, 1536, 576), (33, 100, 50), (64, 576, 960),
    (130, 64, 33), (512, 192, 64)])
def test_equals_xlas_int8_dot_and_rescale(rows, k, n):
    """Edge tiles in every direction (K not a multiple of 64, N of 32, R of 16), one and two
    row tiles per block; f32 sums to the bit, and bf16 output as the f32 result rounded."""
    rng = np.random.default_rng(rows * 7 + k)
    w = _weight(rng, k, n)
    x = jnp.asarray(rng.standard_normal((rows, k)) * 3, jnp.bfloat16)
    want = jax.jit(lambda x: quant._einsum("tk,kn->tn", x, w))(x)
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))

    def kernel(x, out_dtype=jnp.float32):
        xq, sx = quant.quantize_rows(x)
        return cpu_int8.amx_int8_matmul(xq, sx, tiles, w.scale, n, out_dtype=out_dtype)

    np.testing.assert_array_equal(jax.jit(kernel)(x), want)
    got16 = jax.jit(lambda x: kernel(x, jnp.bfloat16))(x)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got16, np.float32),
                                  np.asarray(want.astype(jnp.bfloat16), np.float32))


def test_one_thread_and_all_agree():
    rng = np.random.default_rng(3)
    w = _weight(rng, 576, 1536)
    xq = jnp.asarray(rng.integers(-128, 128, (40, 576)), jnp.int8)
    sx = jnp.asarray(rng.uniform(0.01, 0.1, (40, 1)), jnp.float32)
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))
    one, every = (cpu_int8.amx_int8_matmul(xq, sx, tiles, w.scale, 1536, max_threads=t)
                  for t in (1, 0))
    np.testing.assert_array_equal(one, every)
    sums = np.asarray(xq, np.int64) @ np.asarray(w.q, np.int64)  # exact
    want = (sums.astype(np.float32) * np.asarray(sx)) * np.asarray(w.scale)
    np.testing.assert_array_equal(np.asarray(one), want)


def test_tiles_hold_the_weight():
    """amx_int8_tiles' documented layout: tile (s, ks, h) row p, bytes 4c..4c+3 are
    w[64 ks + 4p + (0..3), 32 s + 16 h + c]; zeros pad K and N."""
    rng = np.random.default_rng(4)
    w = rng.integers(-128, 128, (70, 40)).astype(np.int8)
    t = cpu_int8.amx_int8_tiles(w)
    assert t.shape == (2, 2, 2, 16, 64)
    for kk, nn in ((0, 0), (5, 17), (63, 31), (64, 32), (69, 39)):
        s, h, c = nn // 32, (nn % 32) // 16, nn % 16
        ks, p, q = kk // 64, (kk % 64) // 4, kk % 4
        assert t[s, ks, h, p, 4 * c + q] == w[kk, nn]
    assert t[1, 1, 1, 15, 63] == 0  # k 127, n 63: padding


def test_bad_operands_are_errors():
    rng = np.random.default_rng(5)
    w = _weight(rng, 64, 32)
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))
    xq = jnp.zeros((2, 64), jnp.int8)
    sx = jnp.ones((2, 1), jnp.float32)
    with pytest.raises(ValueError, match="int8 xq"):
        cpu_int8.amx_int8_matmul(xq.astype(jnp.float32), sx, tiles, w.scale, 32)
    with pytest.raises(ValueError, match="int8 xq"):
        cpu_int8.amx_int8_matmul(xq, sx, tiles, w.scale, 64)  # wrong N
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_int8.amx_int8_matmul(xq, sx, tiles, w.scale, 32, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="2-D int8"):
        cpu_int8.amx_int8_tiles(np.zeros((4, 4), np.float32))


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 576, 1536), (20, 100, 50), (37, 576, 96)])
def test_swiglu_equals_the_unfused_activation(rows, k, n):
    """silu(x @ g) * (x @ u) for int8 gate and up in one call, against the two bf16-rounded
    kernel products and XLA's f32 silu (`matmul.swiglu`'s unfused rule): the same bf16 values
    but where the two sigmoids' last f32 bit puts an activation across a rounding edge."""
    rng = np.random.default_rng(rows + k)
    g, u = _weight(rng, k, n), _weight(rng, k, n)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    xq, sx = quant.quantize_rows(x)
    packed = [(jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q))), w.scale) for w in (g, u)]
    got = np.asarray(jax.jit(lambda: cpu_int8.amx_int8_swiglu(xq, sx, *packed, n))(),
                     np.float32)

    def unfused():
        gate, up = (cpu_int8.amx_int8_matmul(xq, sx, *w, n, out_dtype=jnp.bfloat16)
                    for w in packed)
        return jax.nn.silu(gate.astype(jnp.float32)).astype(jnp.bfloat16) * up

    want = np.asarray(jax.jit(unfused)(), np.float32)
    assert got.shape == (rows, n)
    off = got != want
    assert off.mean() < 0.01
    np.testing.assert_allclose(got[off], want[off], rtol=2 ** -7)
    with pytest.raises(ValueError, match="two int8"):
        cpu_int8.amx_int8_swiglu(xq, sx, packed[0], (packed[1][0][:1], packed[1][1]), n)


def test_the_library_checks_what_it_is_given():
    """The FFI targets check their operands themselves (the Python wrappers check first, so
    only a caller that skips them reaches these errors): a scale vector one short, or up's
    tiles for another width, is an error, not a read past the buffer."""
    rng = np.random.default_rng(3)
    k, n = 128, 64
    w = _weight(rng, k, n)
    xq, sx = quant.quantize_rows(jnp.asarray(rng.standard_normal((4, k)), jnp.bfloat16))
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))
    scale = w.scale.reshape(-1)
    matmul = jax.ffi.ffi_call("jengine_amx_int8_matmul",
                              jax.ShapeDtypeStruct((4, n), jnp.float32))
    args = dict(n=np.int64(n), max_threads=np.int32(0))
    np.testing.assert_array_equal(  # the same call, well formed, runs
        matmul(xq, sx.reshape(-1), tiles, scale, **args),
        cpu_int8.amx_int8_matmul(xq, sx, tiles, w.scale, n))
    with pytest.raises(jax.errors.JaxRuntimeError, match="amx int8 matmul: expected"):
        jax.block_until_ready(matmul(xq, sx.reshape(-1), tiles, scale[:-1], **args))
    swiglu = jax.ffi.ffi_call("jengine_amx_int8_swiglu",
                              jax.ShapeDtypeStruct((4, n), jnp.bfloat16))
    narrow = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q[:, :32])))
    with pytest.raises(jax.errors.JaxRuntimeError, match="amx int8 swiglu: expected"):
        jax.block_until_ready(swiglu(xq, sx.reshape(-1), tiles, scale, narrow, scale, **args))
