"""The W8A8 kernel over packed int8 weights on AVX-512 VNNI (`cpu_int8.vnni_int8_matmul`,
csrc/vnni_int8.cc), forced: against XLA's int8 dot and rescale (`quant._einsum`, the reference
backend) to the bit, and its exact sums against a NumPy int64 oracle; then the engine on a CPU
without AMX (`cpu_info.hiding`): `int8` projections packed for it and XLA's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jengine import Engine, SamplingParams, cpu_info
from jengine.cpu_kernels import int8_matmul as cpu_int8
from jengine.models import quant
from jengine.models.matmul import AmxPacked
from jengine.models.quant import QArray

pytestmark = pytest.mark.skipif(not cpu_int8.vnni_int8_available(),
                                reason="no AVX-512 VNNI on this CPU (or the library is missing)")
AMX = ("amx_tile", "amx_bf16", "amx_int8")
ONE_BUCKET = yaml.safe_load((Path(__file__).parents[1] / "one_bucket.yaml").read_text())


def _engine(tmp_path, backend: str) -> Engine:
    preset = {**ONE_BUCKET, "model": {**ONE_BUCKET["model"], "matmul_backend": backend}}
    config = tmp_path / f"int8-{backend}.yaml"
    config.write_text(yaml.safe_dump(preset))
    return Engine(config=str(config), quantization="int8", dtype="bfloat16", progress=False)


def _weight(rng, k: int, n: int) -> QArray:
    """Full-range int8 values (-128 too) and positive column scales."""
    q = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 2e-2, (1, n)), jnp.float32)
    return QArray(q=q, scale=scale, mode="int8")


@pytest.mark.parametrize(("rows", "k", "n"), [
    (1, 576, 192), (3, 576, 1536), (9, 1536, 576), (33, 100, 50), (64, 576, 960),
    (130, 64, 33)])
def test_equals_xlas_int8_dot_and_rescale(rows, k, n):
    """Edge tiles in every direction (K not a multiple of 64, N of 16, rows past the 8-row
    block); f32 to the bit, and bf16 output as the f32 result rounded to nearest even."""
    rng = np.random.default_rng(rows * 5 + k)
    w = _weight(rng, k, n)
    x = jnp.asarray(rng.standard_normal((rows, k)) * 3, jnp.bfloat16)
    want = jax.jit(lambda x: quant._einsum("tk,kn->tn", x, w))(x)
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))

    def kernel(x, out_dtype=jnp.float32):
        xq, sx = quant.quantize_rows(x)
        return cpu_int8.vnni_int8_matmul(xq, sx, tiles, w.scale, n, out_dtype=out_dtype)

    np.testing.assert_array_equal(jax.jit(kernel)(x), want)
    got16 = jax.jit(lambda x: kernel(x, jnp.bfloat16))(x)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got16, np.float32),
                                  np.asarray(want.astype(jnp.bfloat16), np.float32))


def test_exact_sums_and_threads_agree():
    rng = np.random.default_rng(3)
    w = _weight(rng, 576, 1536)
    xq = jnp.asarray(rng.integers(-128, 128, (40, 576)), jnp.int8)  # -128 rows too
    sx = jnp.asarray(rng.uniform(0.01, 0.1, (40, 1)), jnp.float32)
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))
    one, every = (cpu_int8.vnni_int8_matmul(xq, sx, tiles, w.scale, 1536, max_threads=t)
                  for t in (1, 0))
    np.testing.assert_array_equal(one, every)
    sums = np.asarray(xq, np.int64) @ np.asarray(w.q, np.int64)
    want = (sums.astype(np.float32) * np.asarray(sx)) * np.asarray(w.scale)
    np.testing.assert_array_equal(np.asarray(one), want)


def test_bad_operands_are_errors():
    rng = np.random.default_rng(1)
    w = _weight(rng, 64, 32)
    tiles = jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q)))
    xq, sx = jnp.zeros((2, 64), jnp.int8), jnp.ones((2,), jnp.float32)
    with pytest.raises(ValueError, match="vnni_int8_matmul takes"):
        cpu_int8.vnni_int8_matmul(xq[:, :32], sx, tiles[:, :1], w.scale, 33)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_int8.vnni_int8_matmul(xq, sx, tiles, w.scale, 32, out_dtype=jnp.int32)
    with cpu_info.hiding("avx512_vnni"):
        assert not cpu_int8.vnni_int8_available()


@pytest.mark.slow
def test_engine_without_amx_packs_int8_for_vnni_and_gives_xlas_tokens(tmp_path):
    """AMX hidden (as on an AMD EPYC): `auto` resolves to `native`, the `int8` projections are
    packed for this kernel, and the engine's greedy tokens equal those of the same engine with
    VNNI hidden too, whose `int8` projections stay on XLA's int8 dot (everything else, the
    packed bf16 head included, the same): the kernel's products are XLA's to the bit and its
    SwiGLU is the unfused one."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    tokens = {}
    for hidden in (AMX, (*AMX, "avx512_vnni")):
        with cpu_info.hiding(*hidden):
            engine = _engine(tmp_path, "auto")
            assert engine.core.model_config.matmul_backend == "native"
            w_down = engine.core.runner.params["layers"][0]["w_down"]
            assert isinstance(w_down, AmxPacked if len(hidden) == len(AMX) else QArray)
            tokens[hidden] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
            del engine, w_down
    assert tokens[AMX] == tokens[(*AMX, "avx512_vnni")]
