"""The packed-bf16 kernel off AMX (jengine.cpu_kernels.packed_bf16): each instruction-set path
forced (AVX-512-BF16, AVX-512F, AVX2, portable) against a float64 NumPy oracle of the
bf16-rounded operands, the fused SwiGLU and the tied head ([V, E] packed as its transpose);
the routing with AMX hidden (`cpu_info.hiding`: the AMD EPYC's and an AVX2-only CPU's
choices on this Xeon); and SmolLM2's greedy tokens in bf16 on it against XLA's dots."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from shared_load import loads_shared  # tests/shared_load.py

from jengine import Engine, SamplingParams, cpu_info
from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.cpu_kernels import packed_bf16
from jengine.models import matmul

pytestmark = pytest.mark.skipif(not (cpu_matmul.available() and packed_bf16.available()),
                                reason="native library not built")

AMX = ("amx_bf16", "amx_tile", "amx_int8")  # the EPYC: AVX-512 with BF16, no AMX
AVX2_ONLY = (*AMX, "avx512f", "avx512_bf16")
RUNS_HERE = [isa for isa in packed_bf16.ISAS if packed_bf16.available()
             and packed_bf16.supports(isa)]
SHAPES = [(1, 64, 32), (2, 70, 45), (7, 33, 100), (8, 96, 64), (9, 576, 17), (70, 64, 130)]
BF16 = ml_dtypes.bfloat16


def _operands(r: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((r, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(BF16)
    return x, w


def _oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x rounded to bf16, then the float64 product with the bf16 weight."""
    return x.astype(BF16).astype(np.float64) @ w.astype(np.float64)


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """An f32 sum's error bound: K ulps of the sum of |terms|."""
    mag = np.abs(x.astype(BF16).astype(np.float64)) @ np.abs(w.astype(np.float64))
    return mag * x.shape[1] * 2.0**-24 + 1e-30


@pytest.mark.parametrize("isa", RUNS_HERE)
@pytest.mark.parametrize("r,k,n", SHAPES)
def test_matmul_each_path_matches_float64(isa, r, k, n):
    x, w = _operands(r, k, n)
    tiles = jnp.asarray(cpu_matmul.amx_tiles(w))
    got = np.asarray(packed_bf16.packed_matmul(jnp.asarray(x), tiles, n, isa=isa))
    assert got.shape == (r, n) and got.dtype == np.float32
    assert np.all(np.abs(got - _oracle(x, w)) <= _bound(x, w))
    # bf16 x reads the same values; bf16 out is the f32 sums rounded, bit for bit
    rounded = packed_bf16.packed_matmul(jnp.asarray(x, jnp.bfloat16), tiles, n, isa=isa,
                                        out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rounded), got.astype(BF16))


@pytest.mark.parametrize("isa", RUNS_HERE)
@pytest.mark.parametrize("scale", [1.0, 40.0])  # 40: gates past +-88, the exp's range ends
def test_swiglu_each_path(isa, scale):
    r, k, n = 19, 96, 70
    x, wg = _operands(r, k, n, seed=1)
    x *= scale
    _, wu = _operands(r, k, n, seed=2)
    tg, tu = (jnp.asarray(cpu_matmul.amx_tiles(w)) for w in (wg, wu))
    got = np.asarray(packed_bf16.packed_swiglu(jnp.asarray(x, jnp.bfloat16), tg, tu, n,
                                               isa=isa)).astype(np.float64)
    gate = _oracle(x, wg).astype(BF16).astype(np.float64)
    up = _oracle(x, wu).astype(BF16).astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-gate) = inf: the sigmoid's 0
        act = (gate / (1 + np.exp(-gate))).astype(BF16).astype(np.float64)
    want = (act * up).astype(BF16).astype(np.float64)
    # each rounding may land one bf16 ulp off where an f32 sum sits on its edge
    np.testing.assert_allclose(got, want, rtol=3 * 2.0**-8, atol=1e-3)


def test_bad_operands_are_value_errors():
    x, w = _operands(4, 64, 32)
    tiles = jnp.asarray(cpu_matmul.amx_tiles(w))
    with pytest.raises(ValueError, match="isa"):
        packed_bf16.packed_matmul(jnp.asarray(x), tiles, 32, isa="neon")
    with pytest.raises(ValueError, match="amx_tiles"):
        packed_bf16.packed_matmul(jnp.asarray(x[:, :20]), tiles, 32)
    with pytest.raises(ValueError, match="one shape"):
        packed_bf16.packed_swiglu(jnp.asarray(x), tiles, tiles[:, :1], 32)


def _program_text(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.skipif("avx512_bf16" not in cpu_info.flags(), reason="no AVX-512-BF16 here")
def test_routing_without_amx():
    """AMX hidden: `auto` resolves to `native`, which packs bf16 weights, and a packed dot and
    SwiGLU lower to the packed-bf16 kernel on its AVX-512-BF16 path where VDPBF16PS measured
    faster than FMA, else on AVX-512F; AVX2-only takes AVX2; with neither vector path the
    weights stay unpacked (portable C++ loses to XLA's dot)."""
    x, w = _operands(5, 64, 48)
    with cpu_info.hiding(*AMX):
        assert matmul.resolve_matmul_backend("auto", "cpu", 1) == "native"
        want = "avx512_bf16" if packed_bf16.dp_bf16_pays() else "avx512"
        assert matmul.packs_bf16("native") and packed_bf16.best_isa() == want
        packed = matmul._packed(jnp.asarray(w), 1)
        text = _program_text(lambda a, p: matmul.dot("te,ef->tf", a, p), jnp.asarray(x), packed)
        assert "jengine_packed_bf16_matmul" in text and "jengine_amx_matmul" not in text
        text = _program_text(lambda a, p: matmul.swiglu(a, p, p), jnp.asarray(x, jnp.bfloat16),
                             packed)
        assert "jengine_packed_bf16_swiglu" in text
    with cpu_info.hiding(*AVX2_ONLY):
        assert packed_bf16.best_isa() == "avx2" and matmul.packs_bf16("native")
    with cpu_info.hiding(*AVX2_ONLY, "avx2"):
        assert not matmul.packs_bf16("native")
    assert not matmul.packs_bf16("xla")


@pytest.mark.parametrize("hide", [AMX, AVX2_ONLY], ids=["avx512_bf16", "avx2"])
def test_tied_head_transposed(hide):
    """A tied embedding [V, E] packed as the tiles of its transpose: `te,ve->tv` on it."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((77, 64)).astype(BF16)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    with cpu_info.hiding(*hide):
        packed = matmul._packed(jnp.asarray(table), 1, transposed=True)
        got = np.asarray(jax.jit(lambda a, p: matmul.dot("te,ve->tv", a, p))(
            jnp.asarray(x), packed))
    want = _oracle(x, np.ascontiguousarray(table.T))
    assert np.all(np.abs(got - want) <= _bound(x, np.ascontiguousarray(table.T)))


ONE_BUCKET = Path(__file__).parents[1] / "one_bucket.yaml"


def _config(tmp_path: Path, backend: str) -> str:
    preset = yaml.safe_load(ONE_BUCKET.read_text())
    preset["model"].update(dtype="bfloat16", matmul_backend=backend)
    path = tmp_path / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return str(path)


@pytest.mark.skipif("avx512_bf16" not in cpu_info.flags(), reason="no AVX-512-BF16 here")
@pytest.mark.parametrize("isa", [  # VDPBF16PS forced: slow (~13 s; CI: its kernel per shape)
    pytest.param("avx512_bf16", marks=pytest.mark.slow), "avx512"])
def test_engine_greedy_tokens_without_amx(tmp_path, monkeypatch, isa):
    """SmolLM2 in bf16 with AMX hidden: the projections and tied head packed and run on
    VDPBF16PS, or on FMA over the widened pairs (what `auto` picks where VDPBF16PS is slow; each
    path forced), give XLA's greedy tokens up to XLA's first near tie (top two logprobs under
    0.05 apart: the kernel's and XLA's sums, and the native norms, add in other orders)."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    prompt = ["The capital of France is"]
    monkeypatch.setattr(packed_bf16, "best_isa", lambda: isa)
    with cpu_info.hiding(*AMX), loads_shared():
        engines = {b: Engine(config=_config(tmp_path, b), progress=False)
                   for b in ("xla", "native")}
        native = engines["native"]
        leaves = jax.tree.leaves(native.core.replicas[0].runner.params,
                                 is_leaf=lambda w: isinstance(w, matmul.AmxPacked))
        assert sum(isinstance(w, matmul.AmxPacked) for w in leaves) == \
            7 * native.core.model_config.num_layers + 1
        got, want = (e.generate(prompt, params)[0].outputs[0] for e in
                     (native, engines["xla"]))
    margins = [abs(a.logprob - b.logprob) for a, b in
               (sorted(lp.values(), key=lambda v: -v.logprob)[:2] for lp in want.logprobs)]
    n = next((i for i, m in enumerate(margins) if m < 0.05), len(margins))
    assert n >= 4
    assert got.token_ids[:n] == want.token_ids[:n]
