"""`dtype: auto` on CPU (jengine.core.auto_dtype): measured only where the CPU runs bf16 dots
natively, decided by the timings (planted here, so that either answer can be forced), stored
and read back without measuring, logged, and never applied to a named dtype. The real probe
(jengine.runtime.dtype_probe) runs on a two-layer cut of SmolLM2's shapes on each kernel path
this CPU can take."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest

from converters.source import load_config
from jengine import cpu_info
from jengine.config import load_config as engine_config
from jengine.core import auto_dtype
from jengine.core.startup import model_dtype
from jengine.models.matmul import AmxPacked, packs_bf16, resolve_matmul_backend
from jengine.runtime import dtype_probe
from jengine.runtime.dtype_probe import Timings

AMX = ("amx_bf16", "amx_int8", "amx_tile")
EPYC = AMX  # Zen 5: AVX-512 with BF16 and VNNI, no AMX
AVX2_ONLY = (*AMX, "avx512f", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl", "avx512dq",
             "avx512cd")


@pytest.fixture(scope="module")
def smol_config():
    return load_config(None)


class PlantedTimer:
    """Per-token milliseconds per dtype, and every call it got."""

    def __init__(self, float32_ms: float, bfloat16_ms: float):
        self.ms = {"float32": float32_ms, "bfloat16": bfloat16_ms}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, config, dtype: str, backend: str) -> Timings:
        self.calls.append((dtype, backend))
        return Timings(decode={1: self.ms[dtype] / 1e3}, prefill=0.0)


def never(config, dtype, backend) -> Timings:
    raise AssertionError("nothing should be measured here")


def needs(*flags):
    missing = [f for f in flags if f not in cpu_info.flags()]
    return pytest.mark.skipif(bool(missing), reason=f"this CPU lacks {missing}")


@needs("amx_bf16")
@pytest.mark.parametrize(("f32", "bf16", "want"), [(50.0, 30.0, "bfloat16"),
                                                   (30.0, 50.0, "float32"),
                                                   (50.0, 49.0, "float32")])  # within MARGIN
def test_amx_cpu_takes_the_faster_dtype(smol_config, tmp_path, f32, bf16, want):
    timer = PlantedTimer(f32, bf16)
    choice = auto_dtype.choose(smol_config, "amx", tmp_path, timer=timer)
    assert choice.dtype == want
    assert "AMX-BF16" in choice.reason
    assert (choice.float32_ms, choice.bfloat16_ms) == (f32, bf16)
    assert timer.calls == [("float32", "amx"), ("bfloat16", "amx")]


@needs("avx512_bf16")
def test_hidden_amx_measures_on_avx512_bf16(smol_config, tmp_path):
    """The EPYC's path: no AMX, AVX-512-BF16, so measured (with the native kernels)."""
    with cpu_info.hiding(*EPYC):
        backend = resolve_matmul_backend("auto", "cpu", 1)
        faster_bf16 = auto_dtype.choose(smol_config, backend, tmp_path / "a",
                                        timer=PlantedTimer(40.0, 30.0))
        faster_f32 = auto_dtype.choose(smol_config, backend, tmp_path / "b",
                                       timer=PlantedTimer(30.0, 40.0))
    assert backend == "native"
    assert faster_bf16.dtype == "bfloat16" and "AVX-512-BF16" in faster_bf16.reason
    assert faster_f32.dtype == "float32"


def test_avx2_only_keeps_float32_unmeasured(smol_config, tmp_path):
    with cpu_info.hiding(*AVX2_ONLY):
        choice = auto_dtype.choose(smol_config, "native", tmp_path, timer=never)
        assert "neither" in auto_dtype.describe(smol_config, "native", tmp_path)
    assert choice.dtype == "float32" and choice.float32_ms is None
    assert not list(tmp_path.iterdir())  # nothing to store


@needs("avx512_bf16")
def test_second_start_reads_the_decision(smol_config, tmp_path):
    first = PlantedTimer(50.0, 30.0)
    measured = auto_dtype.choose(smol_config, "native", tmp_path, timer=first)
    again = PlantedTimer(30.0, 50.0)  # would choose float32 if it were asked
    read = auto_dtype.choose(smol_config, "native", tmp_path, timer=again)
    assert len(first.calls) == 2 and again.calls == []
    assert read.stored and not measured.stored
    assert dataclasses.replace(read, stored=False) == measured
    assert auto_dtype.describe(smol_config, "native", tmp_path) == read.summary()
    # What keys the decision: other hidden flags, another backend or model measure again.
    with cpu_info.hiding("amx_int8"):
        auto_dtype.choose(smol_config, "native", tmp_path, timer=again)
    auto_dtype.choose(smol_config, "xla", tmp_path, timer=again)
    auto_dtype.choose(dataclasses.replace(smol_config, num_layers=2), "native", tmp_path,
                      timer=again)
    assert len(again.calls) == 6


@needs("avx512_bf16")
def test_a_damaged_decision_is_measured_again(smol_config, tmp_path):
    auto_dtype.choose(smol_config, "native", tmp_path, timer=PlantedTimer(50.0, 30.0))
    [file] = tmp_path.glob("auto-dtype-*.json")
    file.write_text("{not json")
    timer = PlantedTimer(30.0, 50.0)
    assert auto_dtype.choose(smol_config, "native", tmp_path, timer=timer).dtype == "float32"
    assert len(timer.calls) == 2 and "float32" in file.read_text()


@needs("avx512_bf16")
def test_one_info_line_with_both_timings(smol_config, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="jengine"):
        auto_dtype.choose(smol_config, "native", tmp_path, timer=PlantedTimer(52.5, 31.25))
    [record] = [r for r in caplog.records if "dtype auto" in r.getMessage()]
    line = record.getMessage()
    assert record.levelno == logging.INFO
    assert line.startswith("dtype auto -> bfloat16: bf16 projections took 0.60x f32's time")
    assert "float32 52.50 ms, bfloat16 31.25 ms" in line


@needs("avx512_bf16")
def test_start_up_resolves_auto_and_leaves_a_named_dtype(tmp_path):
    """`startup.model_dtype`, which EngineCore and ReplicaSet call before any weight is read:
    `auto` reads the model's config and measures (once per process group: none when several
    processes run one engine); a named dtype is never measured."""
    cfg = engine_config("test")  # dtype: float32
    assert model_dtype(cfg, None, "native", store_dir=tmp_path, timer=never) == "float32"
    bf16 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    assert model_dtype(bf16, None, "native", store_dir=tmp_path, timer=never) == "bfloat16"
    assert not list(tmp_path.iterdir())
    auto = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="auto"))
    timer = PlantedTimer(30.0, 50.0)
    assert model_dtype(auto, None, "native", store_dir=tmp_path, timer=timer) == "float32"
    assert len(timer.calls) == 2
    # Several processes would each measure, and might disagree: float32, measured by none.
    hosts = dataclasses.replace(auto, parallel=dataclasses.replace(
        auto.parallel, coordinator="127.0.0.1:1", num_processes=2, process_id=1))
    assert model_dtype(hosts, None, "native", store_dir=tmp_path / "h", timer=never) == "float32"


def test_the_session_engine_keeps_its_named_float32(smol_engine):
    assert smol_engine.core.cfg.model.dtype == "float32"
    assert smol_engine.core.dtype == "float32"


@pytest.mark.parametrize("hidden", [(), EPYC, AVX2_ONLY], ids=["host", "no-amx", "avx2"])
def test_the_probe_runs_each_kernel_path(smol_config, hidden):
    """The real timer on two layers of SmolLM2's shapes and a cut vocabulary: positive, finite
    timings for both dtypes, with the bf16 weights packed (for the AMX or, off AMX, the
    packed-bf16 kernel) exactly where the engine packs them."""
    cfg = dataclasses.replace(smol_config, num_layers=2, vocab_size=1024)
    with cpu_info.hiding(*hidden):
        backend = resolve_matmul_backend("auto", "cpu", 1)
        shapes, head, e, _ = dtype_probe.projection_shapes(cfg)
        weights = dtype_probe._weights(shapes, head, e, 64, 1, jax.numpy.bfloat16, backend)
        packed = isinstance(weights["layers"][0]["wq"], AmxPacked)
        packs = packs_bf16(backend)
        timings = [dtype_probe.time_projections(cfg, dt, backend)
                   for dt in ("float32", "bfloat16")]
    assert set(shapes) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    # packed wherever the engine packs: AMX, and off it for the packed-bf16 kernel's vector paths
    assert packed == packs == (backend == "amx" or "avx2" in cpu_info.flags())
    for t in timings:
        assert sorted(t.decode) == list(dtype_probe.DECODE_ROWS)
        assert np.isfinite(t.per_token) and t.per_token > 0
