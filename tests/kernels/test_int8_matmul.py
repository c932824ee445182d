"""The native W8A8 matmul (`cpu_kernels.int8_matmul`) against XLA's int8 dot with jengine's
rescale: equal bit for bit on every instruction-set path this CPU runs, over shapes that cross
its tiles, k chunks and thread splits; and `matmul.dot`'s routing of `int8` projections to it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine import cpu_info
from jengine.cpu_kernels import int8_matmul as cpu_int8
from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.models import matmul, quant

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="native matmul not built")


def _runs(isa: str) -> bool:
    return cpu_matmul.available() and (isa == "portable" or cpu_int8.int8_isa() == isa)


ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not _runs(isa), reason=f"no {isa} here"))
        for isa in ("portable", "avx512_vnni")]


def _operands(rng, r: int, k: int, n: int, transpose_w: bool):
    """Full-range int8 operands (-128 included, which per-row quantization never makes but the
    kernel's u8 shift must still get right) and positive scales of several magnitudes."""
    xq = rng.integers(-128, 128, (r, k), dtype=np.int8)
    w = rng.integers(-128, 128, (n, k) if transpose_w else (k, n), dtype=np.int8)
    sx = rng.uniform(1e-3, 2.0, (r, 1)).astype(np.float32)
    sw = rng.uniform(1e-4, 0.1, n).astype(np.float32)
    return xq, sx, w, sw


def _want(xq, sx, w, sw, transpose_w: bool) -> np.ndarray:
    """What `quant.einsum` computes for an `int8` weight: XLA's int32 dot, then the rescale."""
    eq = "tk,nk->tn" if transpose_w else "tk,kn->tn"
    acc = jnp.einsum(eq, xq, w, preferred_element_type=jnp.int32)
    return np.asarray(quant._rescale(acc.astype(jnp.float32), jnp.asarray(sx), jnp.asarray(sw)))


def _check(rng, r, k, n, isa, transpose_w=False, max_threads=0):
    xq, sx, w, sw = _operands(rng, r, k, n, transpose_w)
    got = jax.jit(lambda *a: cpu_int8.int8_matmul(
        *a, transpose_w=transpose_w, isa=isa, max_threads=max_threads))(xq, sx, w, sw)
    got = np.asarray(got)
    assert got.shape == (r, n) and got.dtype == np.float32
    np.testing.assert_array_equal(got, _want(xq, sx, w, sw, transpose_w))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("r, k, n", [
    (1, 1, 1), (1, 5, 3), (3, 70, 300),  # below one 4-k group / one 64-column block; ragged
    (6, 64, 64), (7, 64, 65),            # one full row tile; one row and one column over
    (16, 576, 192),                      # R <= 16: K split over the threads
    (40, 1024, 4096),                    # several k chunks of the packed panel
    (130, 576, 200),                     # few column blocks: rows split over the threads
])
def test_projection_form_is_exact(isa, r, k, n):
    rng = np.random.default_rng(r * 7 + k * 3 + n)
    for threads in (0, 1):
        _check(rng, r, k, n, isa, max_threads=threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("r, k, n", [(1, 4, 1), (5, 64, 70), (16, 576, 300), (33, 128, 700),
                                     (64, 576, 2000)])
def test_transposed_form_is_exact(isa, r, k, n):
    """w given as [N, K] (a tied int8 embedding as the output head): K divisible by 4."""
    rng = np.random.default_rng(r + k + n)
    _check(rng, r, k, n, isa, transpose_w=True)


def test_zero_rows_and_bad_operands():
    w = jnp.ones((8, 4), jnp.int8)
    sw = jnp.ones(4, jnp.float32)
    empty = cpu_int8.int8_matmul(jnp.ones((0, 8), jnp.int8), jnp.ones((0, 1)), w, sw)
    assert empty.shape == (0, 4)
    with pytest.raises(ValueError, match="int8 xq and w"):
        cpu_int8.int8_matmul(jnp.ones((2, 8), jnp.float32), jnp.ones((2, 1)), w, sw)
    with pytest.raises(ValueError, match="3 channel scales for 4 columns"):
        cpu_int8.int8_matmul(jnp.ones((2, 8), jnp.int8), jnp.ones((2, 1)), w, sw[:3])
    with pytest.raises(ValueError, match="K not divisible by 4"):
        cpu_int8.int8_matmul(jnp.ones((2, 6), jnp.int8), jnp.ones((2, 1)),
                               jnp.ones((4, 6), jnp.int8), sw, transpose_w=True)


@pytest.mark.parametrize("amx", [False, True])
def test_dot_routes_int8_prefill_projections_to_the_kernel(amx, monkeypatch):
    """`matmul.dot` with `native` sends an `int8` projection of INT8_NATIVE_ROWS rows or more
    to the kernel on a VNNI CPU without AMX-INT8 (XLA's int8 dot below that, and everywhere on
    other CPUs), with the same floats either way. `amx`: as routed on this CPU with AMX-INT8
    added to its flags (XLA's int8 dot runs on the tiles there), or taken out of them."""
    flags = cpu_info.flags() | {"amx_int8"} if amx else cpu_info.flags() - {"amx_int8"}
    monkeypatch.setattr(cpu_info, "flags", lambda: flags)
    rng = np.random.default_rng(5)
    w = quant.quantize_weight(jnp.asarray(rng.standard_normal((64, 4, 8), np.float32)), (0,),
                              "int8")
    vnni = (cpu_int8.int8_isa() == "avx512_vnni"
            and "amx_int8" not in cpu_info.flags())
    rows_at = matmul.INT8_NATIVE_ROWS
    for rows in (rows_at - 1, rows_at, rows_at + 70):
        x = jnp.asarray(rng.standard_normal((rows, 64), np.float32))
        fn = jax.jit(lambda a, b: matmul.dot("te,ehd->thd", a, b, "native"))
        assert ("jengine_int8_matmul" in fn.lower(x, w).as_text()) == (vnni and rows >= rows_at)
        np.testing.assert_array_equal(fn(x, w), quant.einsum("te,ehd->thd", x, w))
