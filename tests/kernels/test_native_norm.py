"""The native RMSNorm (`jengine.cpu_kernels.rms_norm`, csrc/rms_norm.cc) against
`layers.rms_norm`'s XLA formula, for every dtype pairing a model uses and Gemma's
(1 + weight), and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.cpu_kernels import rms_norm as native_norm
from jengine.models import layers

pytestmark = pytest.mark.skipif(not cpu_matmul.available(),
                                reason="the native CPU kernels are not built")


@pytest.mark.parametrize("x_dtype,w_dtype,offset", [
    (jnp.bfloat16, jnp.bfloat16, 0.0),  # a bf16 Llama
    (jnp.float32, jnp.float32, 0.0),  # an f32 model
    (jnp.bfloat16, jnp.bfloat16, 1.0),  # Gemma
    (jnp.float32, jnp.float32, 1.0),
    (jnp.bfloat16, jnp.float32, 0.0),  # mixed: the result promotes as jnp's does
    (jnp.float32, jnp.bfloat16, 0.0),
])
def test_native_norm_matches_the_xla_formula(x_dtype, w_dtype, offset):
    rng = np.random.default_rng(0)
    # 577 wide: a row that is not a whole number of the kernel's sixteen running sums.
    for shape in ((5, 576), (3, 4, 577), (1, 64)):
        x = jnp.asarray(rng.standard_normal(shape) * 3, x_dtype)
        w = jnp.asarray(rng.standard_normal(shape[-1]), w_dtype)
        native = jax.jit(lambda x, w: layers.rms_norm(x, w, 1e-6, offset=offset,
                                                      backend="native"))(x, w)
        xla = jax.jit(lambda x, w: layers.rms_norm(x, w, 1e-6, offset=offset))(x, w)
        assert native.dtype == xla.dtype and native.shape == xla.shape
        # The sum of squares in another order: a last-bit difference of the scale, which a bf16
        # result shows as one bf16 step at most.
        step = 2.0 ** -7 if native.dtype == jnp.bfloat16 else 2.0 ** -20
        np.testing.assert_allclose(np.asarray(native, np.float32), np.asarray(xla, np.float32),
                                   rtol=step, atol=step)


def test_native_norm_refuses_what_it_cannot_take():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native_norm.rms_norm(x.astype(jnp.float16), jnp.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        native_norm.rms_norm(x, jnp.ones(4), 1e-6)
