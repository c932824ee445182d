"""The engine end to end with each attention backend: the native `cpu` kernel and the Pallas
kernels (interpret mode on CPU: plain interpret for the GPU kernel, TPU emulation for the TPU
kernel) give the reference backend's greedy tokens, on a tiny random Llama (also under tp=2) and
on the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from jengine import Engine, SamplingParams
from jengine.cpu_kernels import attention as cpu
from jengine.runtime.buckets import QUERY_BLOCK
from jengine.runtime.step_io import SamplingRows
from jengine.runtime.warmup_plan import dummy_batch

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
TEST_PRESET = Path(__file__).parents[2] / "configs" / "test.yaml"
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(),
                                                   reason="native CPU kernel not built"))


def _greedy(engine, prompts, n):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    path = tiny_llama
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 96, n).tolist() for n in (3, 19, 37)]
    expected = _greedy(Engine(str(path), config=ONE_BUCKET, attention_backend="reference",
                              progress=False), prompts, 6)
    return str(path), prompts, expected


@pytest.mark.parametrize(
    "backend",
    [CPU, "pallas_gpu", pytest.param("pallas_tpu", marks=pytest.mark.kernel_sweep)],  # TPU ~2 min
)
def test_tiny_llama_kernel_backend_matches_reference(tiny, backend):
    path, prompts, expected = tiny
    engine = Engine(path, config=ONE_BUCKET, attention_backend=backend, progress=False)
    assert engine.core.model_config.attention_backend == backend
    assert _greedy(engine, prompts, 6) == expected


@pytest.mark.parametrize("backend", [CPU, "pallas_gpu"])
def test_tiny_llama_kernel_under_tensor_parallelism(tiny, backend):
    path, prompts, expected = tiny
    engine = Engine(path, config=ONE_BUCKET, mesh="tp=2", attention_backend=backend,
                    progress=False)
    assert _greedy(engine, prompts, 6) == expected


@pytest.mark.parametrize("backend", [CPU, pytest.param("reference", marks=pytest.mark.slow)])
def test_test_preset_prefills_in_blocks_without_recompiling(tiny, backend, tmp_path):
    """The test preset's 64-token bucket is prefill-heavy (T > S = 16): the reference backend
    runs it through `blocked_paged_attention` (host-built blocks, a bound per bucket), the
    kernels block on device and get no host blocks. Same greedy tokens as ONE_BUCKET's
    per-token steps, over one page bucket (cpu) or two (reference), and no program compiled
    after warm-up. The preset without its 1-token bucket, which blocks nothing: warm-up builds
    every bucket's three variants, 12 programs on the reference backend instead of 18 (this
    module's slowest test, a third of its time)."""
    path, prompts, expected = tiny
    preset = yaml.safe_load(TEST_PRESET.read_text())
    preset["scheduler"]["token_buckets"] = [16, 64]
    config = tmp_path / "test_without_1.yaml"
    config.write_text(yaml.safe_dump(preset))
    engine = Engine(path, config=str(config), attention_backend=backend, progress=False,
                    warmup=True)
    runner = engine.core.runner
    assert runner.buckets.blocked(64) and not runner.buckets.blocked(16)
    # The native kernel reads pages by position: one page bucket; the reference gathers them.
    assert runner.buckets.pages == ((32,) if backend == "cpu" else (16, 32))
    assert _greedy(engine, prompts, 6) == expected  # the first step holds 59 prompt tokens
    assert engine.core.compiles_since_ready == 0
    batch = dummy_batch(64, 16, 8)
    host, _ = runner.host_inputs(batch, SamplingRows.empty(16))
    blocks = host.blocks
    if backend == "reference":
        assert blocks[0].shape == (runner.buckets.num_blocks(64), QUERY_BLOCK)
    else:
        assert blocks is None


@pytest.mark.parametrize(
    "backend",  # the Pallas kernels interpret 30 layers here (GPU ~35 s, TPU ~2 min); on CPU
    # the tiny Llama's tests above cover their engine path, and test_pallas_attention the shapes
    [CPU, pytest.param("pallas_gpu", marks=pytest.mark.kernel_sweep),
     pytest.param("pallas_tpu", marks=pytest.mark.kernel_sweep)],
)
def test_smollm2_kernel_backend_matches_reference(smol_engine, backend):
    prompts = ["The capital of France is", "def add(a, b):"]
    expected = _greedy(smol_engine, prompts, 3)
    engine = Engine(config=ONE_BUCKET, attention_backend=backend, progress=False)
    assert _greedy(engine, prompts, 3) == expected


@pytest.mark.parametrize("backend", [CPU, "reference"])
def test_bf16_kv_cache_halves_page_bytes(tiny, backend):
    """`kv_cache_dtype="bfloat16"`: the cache is bf16, the same budget holds twice the pages,
    and greedy decoding still works (bf16 K/V may change a random model's argmax, so the tokens
    are compared with the f32 cache's loosely: most of them agree)."""
    path, prompts, expected = tiny
    engine = Engine(path, config=ONE_BUCKET, attention_backend=backend, kv_cache_dtype="bfloat16",
                    progress=False)
    f32_pages = Engine(path, config=ONE_BUCKET, attention_backend="reference",
                       progress=False).core.allocator.num_pages
    assert str(engine.core.runner.kv.k.dtype) == "bfloat16"
    assert engine.core.allocator.num_pages in (2 * f32_pages, 2 * f32_pages + 1)
    got = _greedy(engine, prompts, 6)
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.75 * sum(len(e) for e in expected), (got, expected)


def test_int8_kv_cache_cpu_matches_reference(tiny):
    """`kv_cache_dtype="int8"`: int8 rows with one f32 scale per token and kv head; the budget
    holds 4 D / (D + 4) times the f32 pages (2.67x at the tiny model's D = 8); the `cpu` kernel
    gives the reference backend's greedy tokens on the same int8 cache, also under tp=2 (kv
    heads and their scales split over the devices)."""
    if not cpu.available():
        pytest.skip("native CPU kernel not built")
    path, prompts, expected = tiny
    got = {}
    for backend, mesh in (("reference", "tp=1"), ("cpu", "tp=1"), ("cpu", "tp=2")):
        engine = Engine(path, config=ONE_BUCKET, attention_backend=backend, mesh=mesh,
                        kv_cache_dtype="int8", progress=False)
        got[backend, mesh] = _greedy(engine, prompts, 6)
    kv = engine.core.runner.kv
    assert str(kv.k.dtype) == "int8" and kv.k_scale.shape == kv.k.shape[:-1] + (1,)
    assert tuple(kv.k_scale.sharding.spec)[1] == "tp"
    f32_pages = Engine(path, config=ONE_BUCKET, attention_backend="reference",
                       progress=False).core.allocator.num_pages
    assert engine.core.allocator.num_pages // f32_pages == 2  # 2.67x, one page rounding aside
    assert got["cpu", "tp=1"] == got["reference", "tp=1"] == got["cpu", "tp=2"]
    same = sum(a == b for g, e in zip(got["cpu", "tp=1"], expected) for a, b in zip(g, e))
    assert same >= 0.5 * sum(len(e) for e in expected), (got, expected)


def test_fp8_kv_cache_on_the_reference_backend(tiny):
    """`kv_cache_dtype="fp8"`: e4m3 rows with one f32 scale per token and kv head, int8's pool
    size (1 byte an element: 16 / 12 times bf16's pages at the tiny model's D = 8, 1.88x at
    D = 64); the reference backend's greedy tokens mostly agree with the f32 cache's (e4m3's 3
    mantissa bits may flip a random model's near-tied argmax; 18 of 18 agreed when written)."""
    path, prompts, expected = tiny
    engine = Engine(path, config=ONE_BUCKET, attention_backend="reference",
                    kv_cache_dtype="fp8", progress=False)
    kv = engine.core.runner.kv
    assert str(kv.k.dtype) == "float8_e4m3fn" and kv.k_scale.shape == kv.k.shape[:-1] + (1,)
    bf16_pages = Engine(path, config=ONE_BUCKET, attention_backend="reference",
                        kv_cache_dtype="bfloat16", progress=False).core.allocator.num_pages
    assert engine.core.allocator.num_pages == pytest.approx(bf16_pages * 16 / 12, abs=1)
    got = _greedy(engine, prompts, 6)
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.75 * sum(len(e) for e in expected), (got, expected)


def test_auto_dtype_on_cpu_is_what_the_measurement_says():
    """`dtype: auto` on CPU is what `measured()` decides (tests/core/test_auto_dtype.py covers
    the decision), float32 without one; a named dtype is taken as given (never measured),
    anything else refused."""
    from jengine.core.build import resolve_dtype

    def never() -> str:
        raise AssertionError("a named dtype must not be measured")

    assert resolve_dtype("auto", lambda: "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", lambda: "float32") == "float32"
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("float32", never) == "float32"
    assert resolve_dtype("bfloat16", never) == "bfloat16"
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int4", never)


def test_kv_cache_dtype_from_config_and_errors(tmp_path):
    from jengine.config import load_config
    from jengine.core.build import resolve_kv_cache_dtype

    preset = tmp_path / "bf16.yaml"
    preset.write_text("cache:\n  kv_cache_dtype: bfloat16\n")
    assert load_config(str(preset)).cache.kv_cache_dtype == "bfloat16"
    assert resolve_kv_cache_dtype("auto", "float32") == "float32"
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", "float32")
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype"):
        Engine(kv_cache_dtype="int4", progress=False)
    if cpu.available():  # `auto` on CPU is the native kernel, which reads no fp8
        for backend in ("auto", "cpu"):
            with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs attention_backend "
                               "reference, pallas_gpu or pallas_tpu, not 'cpu'"):
                Engine(kv_cache_dtype="fp8", attention_backend=backend, progress=False)
