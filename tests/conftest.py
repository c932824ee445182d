"""Test set-up: 8 fake CPU devices (so sharding runs), the persistent compilation cache, one parse
of the bundled SmolLM2 GGUF per session, and one engine per session on it with the small `test`
bucket preset."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

# Must happen before JAX initialises its backend. The suite is compile-bound (a cold cache in
# CI), so XLA:CPU's backend runs LLVM without its optimisation passes here: test_engine.py
# took 72 s instead of 105 s, a parity subset 42 s instead of 55 s (2026-12-02, cold). The
# numbers do not change (XLA:CPU compiles without fast-math at any level); benchmarks, the
# servers users start and the subprocesses of tests that replace XLA_FLAGS keep the default.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0")

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

from jengine.runtime.compilation import enable_persistent_cache  # noqa: E402

enable_persistent_cache()


@pytest.fixture(scope="session", autouse=True)
def _default_gguf_parsed_once():
    """One `gguf.GGUFReader` per session for the bundled SmolLM2 file, which the HF transformers
    oracles open (jengine itself reads GGUF with `converters.gguf_reader`, in a fraction of a
    second). gguf-py's parse takes seconds (a numpy view per vocabulary string, 49k of them),
    and transformers opens the file for its config, its tokenizer and its weights. A reader
    opened with mode "r" is read-only, so sharing it changes nothing that is read; other files
    (the tests' own GGUFs, Gemma, a truncated copy) and other modes still get a fresh parse."""
    import gguf

    from converters.errors import ModelLoadError
    from converters.source import default_model_path

    try:
        target = default_model_path().resolve()
    except ModelLoadError:  # not installed: the tests that need it say so
        yield
        return
    real = gguf.GGUFReader
    cache: dict[tuple, object] = {}
    lock = threading.Lock()

    def reader(path, mode="r"):
        resolved = Path(path).resolve()
        if mode != "r" or resolved != target:
            return real(path, mode)
        st = resolved.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)  # a changed file is parsed again
        with lock:
            if key not in cache:
                cache.clear()
                cache[key] = real(path, mode)
            return cache[key]

    gguf.GGUFReader = reader
    yield
    gguf.GGUFReader = real


def pytest_addoption(parser):
    parser.addoption(
        "--accelerator-on-cpu", action="store_true",
        help="run tests/accelerator on this CPU (Pallas in interpret mode, the smallest cases): "
             "a dry run of the GPU suite before a device lease",
    )
    parser.addoption(
        "--chromium", metavar="PATH",
        help="the Chromium the `browser` tests drive (default: chromium on PATH; none: skipped)",
    )


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default run): one worker per core, as many as memory allows. A worker's
    peak is ~8 GB (a full run in one process peaked at 8.2 GB), so one per 10 GiB."""
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(len(os.sched_getaffinity(0)), int(gib // 10)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names each item's group
def pytest_collection_modifyitems(items):
    """Tests marked `stops_server` run right after the last other test that uses `server`.

    For pytest-xdist (`--dist loadgroup`), every test gets a group that one worker runs in
    order: the users of the session's `server` and its stoppers together (one server, stopped
    last), every other test with its module (its module fixtures built once)."""
    for item in items:
        shared = "server" in item.fixturenames or item.get_closest_marker("stops_server")
        item.add_marker(pytest.mark.xdist_group("server" if shared else item.path.stem))
    stoppers = [item for item in items if item.get_closest_marker("stops_server")]
    if not stoppers:
        return
    rest = [item for item in items if not item.get_closest_marker("stops_server")]
    users = [i for i, item in enumerate(rest) if "server" in item.fixturenames]
    at = users[-1] + 1 if users else len(rest)
    items[:] = rest[:at] + stoppers + rest[at:]


@pytest.fixture(scope="module", autouse=True)
def _release_programs():
    """After each module, its engines collected and JAX's cached executables dropped: every
    XLA:CPU program maps its code, and a full run that kept them reached the kernel's
    vm.max_map_count (65,530 maps) at ~93%, where a compile segfaulted (sessions 19-20)."""
    yield
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """test_sharding's random Llama (16 q / 8 kv heads, untied lm_head, word-level tokenizer),
    built once for the test files that only read it."""
    from tiny_models import llama_16x8

    path = tmp_path_factory.mktemp("tiny_llama")
    llama_16x8(path)
    return path


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """`jengine serve` as a real process (tests/serve_process.py), shared by the test_server*.py
    modules that take it (test_server.py's docstring lists them): one start for all."""
    from serve_process import running_server

    with running_server(tmp_path_factory.mktemp("server") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="session")
def smol_engine():
    """The default model (SmolLM2-135M-Instruct, f32) behind the real Engine, test buckets."""
    from jengine import Engine

    return Engine(config="test", progress=False, warmup=True)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_engine):
    return smol_engine.tokenizer
