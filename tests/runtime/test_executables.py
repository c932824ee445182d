"""Compiled step programs on disk (jengine/runtime/executables.py): they survive a restart, a start
that must not compile (`--require-warm`) refuses an empty store, a changed model, dtype, mesh or
jax version never loads a stale one, an executable that XLA's persistent cache served is never
stored (XLA:CPU drops its code: "Function ... not found" at dispatch), and offline engines build
only the buckets they use while a program built after ready is counted."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import llama_16x8

import jengine.core.engine_core
import jengine.core.startup
from jengine import Engine, SamplingParams
from jengine.core.engine_core import EngineCore
from jengine.engine import build_config
from jengine.runtime import executables
from jengine.runtime.executables import (
    ExecutableStore,
    ProgramsNotStoredError,
    compile_fresh,
    store_key,
    traced_files,
)
from jengine.runtime.step_io import VARIANTS, SamplingRows, Variant
from jengine.runtime.warmup_plan import dummy_batch

REPO = Path(__file__).resolve().parents[2]
ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
TWO_BUCKETS = str(Path(__file__).parents[1] / "two_buckets.yaml")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

# One engine start in a fresh interpreter: how its programs were obtained, and its tokens.
START = """
import json, sys
from jengine import Engine, SamplingParams
engine = Engine(sys.argv[1], config=sys.argv[2], warmup=True, progress=False)
out = engine.generate([[5, 9, 17, 33]], SamplingParams(max_tokens=6, temperature=0,
                                                       ignore_eos=True))
runner = engine.core.runner
print(json.dumps({"loaded": runner.programs_loaded, "compiled": runner.programs_compiled,
                  "tokens": out[0].outputs[0].token_ids}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    llama_16x8(path)
    return str(path)


def _start(model: str, cache_home: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache_home)}
    run = subprocess.run([sys.executable, "-c", START, model, ONE_BUCKET], capture_output=True,
                         text=True, timeout=600, cwd=REPO, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _unseen_model(tiny: str, path: Path) -> str:
    """A copy of `tiny` that XLA's persistent cache has never seen (its norm epsilon is unique
    to this run), so that its program compiles fresh and can be stored."""
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] *= 1 + uuid.uuid4().int % 10**6 / 10**7
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_programs_survive_a_restart(tiny, tmp_path, monkeypatch):
    """`--require-warm` refuses an empty store before anything is built; a warm-up stores the
    programs (the bucket's three variants); then a second process (native attention kernel
    included: its FFI target is registered before anything is deserialized) and
    `--require-warm` load them and give the same tokens."""
    store = tmp_path / "jengine" / "executables"  # where the second process's store lives
    monkeypatch.setattr(jengine.core.startup, "default_store_dir", lambda: store)
    model = _unseen_model(tiny, tmp_path / "model")
    cfg = build_config(model, ONE_BUCKET)
    with pytest.raises(ProgramsNotStoredError, match="3 of 3 step programs are not stored"):
        EngineCore(cfg, progress=False, require_warm=True)
    assert not store.exists()  # it failed before compiling anything
    cold = Engine(model, config=ONE_BUCKET, warmup=True, progress=False)
    n = len(VARIANTS)
    assert (cold.core.runner.programs_compiled, cold.core.runner.programs_loaded) == (n, 0)
    tokens = cold.generate([[5, 9, 17, 33]], GREEDY)[0].outputs[0].token_ids
    keys = cold.core.runner.warmup_keys()
    assert len(set(keys)) == n and all(ExecutableStore(store).size(k) > 0 for k in keys)
    [report] = cold.core.program_reports()  # what `jengine compile` prints
    assert report.stored_bytes == [ExecutableStore(store).size(k) for k in keys]
    assert (report.store, report.store_files) == (store, n)
    assert report.store_bytes == sum(report.stored_bytes)
    again = EngineCore(cfg, progress=False, require_warm=True)
    assert (again.runner.programs_loaded, again.runner.programs_compiled) == (n, 0)
    warm = _start(model, tmp_path)
    assert (warm["compiled"], warm["loaded"]) == (0, n)
    assert warm["tokens"] == tokens
    assert len(list(store.glob("*.jex"))) == n


def _key(model: str, **kwargs) -> str:
    core = EngineCore(build_config(model, ONE_BUCKET, **kwargs), progress=False, warmup=False)
    return core.runner.program_key(dummy_batch(16, 16, 32), SamplingRows.empty(16))


def test_the_key_changes_with_model_dtype_mesh_and_jax_version(tiny, tmp_path, monkeypatch):
    base = _key(tiny)
    assert _key(tiny) == base  # a restart finds its programs
    # The same shapes with another norm epsilon: only the config tells the programs apart.
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 10 * config["rms_norm_eps"]
    (other / "config.json").write_text(json.dumps(config))
    changed = {
        "model": _key(str(other)),
        "dtype": _key(tiny, dtype="bfloat16"),
        "kv dtype": _key(tiny, kv_cache_dtype="bfloat16"),
        "kv int8": _key(tiny, kv_cache_dtype="int8"),
        "mesh": _key(tiny, mesh="tp=2"),
        "backend": _key(tiny, attention_backend="reference"),
    }
    monkeypatch.setattr(jax, "__version__", jax.__version__ + ".post1")
    changed["jax version"] = _key(tiny)
    assert len(set(changed.values()) | {base}) == len(changed) + 1, changed


def test_the_key_covers_the_devices():
    devices = jax.devices()
    assert store_key("p", devices[:1]) != store_key("p", devices[1:2])
    assert store_key("p", devices[:2]) != store_key("p", devices[:1])
    assert store_key("p", devices[:1]) != store_key("q", devices[:1])


def test_the_key_covers_every_traced_source():
    """A program is only as current as the code it was traced from: an edit to a model, a
    kernel (its C++ too), the sharding rules or the step's inputs must change every key."""
    package = Path(jengine.core.engine_core.__file__).parents[1]
    files = {str(p.relative_to(package)) for p in traced_files()}
    for name in ("runtime/runner.py", "runtime/sampler.py", "runtime/step_io.py",
                 "models/llama.py", "models/attention.py", "pallas_kernels/reference.py",
                 "cpu_kernels/attention.py", "cpu_kernels/csrc/paged_attention.cc",
                 "cpu_kernels/csrc/registry.h", "sharding/rules.py",
                 "sampling_params.py"):
        assert name in files, name
    assert not any(p.startswith(("server/", "scheduling/")) for p in files)


def _program(x, *, scale: int):
    return x * scale + jnp.arange(x.shape[0], dtype=x.dtype)


def test_a_program_the_persistent_cache_served_is_not_stored(tmp_path):
    """conftest turns the persistent cache on: a second compile of one module is served by it,
    and XLA:CPU cannot serialize what it deserialized, so only the fresh one may be stored."""
    name = f"probe_{uuid.uuid4().hex[:12]}"  # a module the cache has never seen
    x = jnp.ones((64,), jnp.float32)
    first, fresh = compile_fresh(_program, name, (x,), {"scale": 3}, static_argnames=("scale",))
    again, fresh_again = compile_fresh(_program, name, (x,), {"scale": 3},
                                       static_argnames=("scale",))
    assert fresh and not fresh_again
    store = ExecutableStore(tmp_path)
    assert store.save("k", first) > 0
    loaded = ExecutableStore(tmp_path).load("k", jax.devices()[:1])
    np.testing.assert_array_equal(loaded(x), first(x))
    np.testing.assert_array_equal(again(x), first(x))


def test_a_program_its_caller_stores_is_not_written_to_the_persistent_cache():
    """`persistent_cache=False` (the runner's step programs, which its store keeps): compiled
    twice, both are fresh, since JAX's cache never got the first."""
    name = f"probe_{uuid.uuid4().hex[:12]}"
    x = jnp.ones((32,), jnp.float32)
    results = [compile_fresh(_program, name, (x,), {"scale": 2}, persistent_cache=False,
                             static_argnames=("scale",)) for _ in range(2)]
    assert all(fresh for _, fresh in results)
    np.testing.assert_array_equal(results[1][0](x), results[0][0](x))


def test_a_serialization_never_overlaps_a_compile():
    """The gate: a serialization waits for the compile in flight, and a compile asked for
    while a serialization waits starts after it (XLA:CPU crashed serializing beside a compile)."""
    gate, log = executables._SerializeGate(), []
    compiling, release = threading.Event(), threading.Event()

    def compile_a():
        with gate.compiling():
            log.append("compile a")
            compiling.set()
            release.wait(5)
            log.append("compile a done")

    def serialize():
        with gate.serializing():
            log.append("serialize")

    def compile_b():
        with gate.compiling():
            log.append("compile b")

    a = threading.Thread(target=compile_a)
    a.start()
    compiling.wait(5)
    s = threading.Thread(target=serialize)
    s.start()
    while not gate._waiting:  # the serialization is queued
        time.sleep(0.001)
    b = threading.Thread(target=compile_b)
    b.start()
    time.sleep(0.05)
    assert log == ["compile a"]  # neither the serialization nor compile b ran beside it
    release.set()
    for t in (a, s, b):
        t.join(5)
    assert log == ["compile a", "compile a done", "serialize", "compile b"]


def test_an_unreadable_entry_is_dropped(tmp_path):
    store = ExecutableStore(tmp_path)
    (tmp_path / "bad.jex").write_bytes(b"not a program")
    assert store.load("bad", jax.devices()[:1]) is None
    assert not (tmp_path / "bad.jex").exists()
    assert store.load("absent", jax.devices()[:1]) is None


def _with_host_callbacks(x):
    doubled = jax.pure_callback(lambda a: np.asarray(a) * 2,
                                jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    jax.debug.callback(lambda a: None, x)
    return doubled + 1


def test_a_program_holding_a_host_callback_is_not_stored(tmp_path, caplog, monkeypatch):
    """A host callback (as Pallas' interpret mode, `jax.debug` and `pure_callback` put in a
    program) is a local Python function that pickle refuses: the program is not stored, a
    warning says so once, and the compiled program still runs (the engine that built it
    used to fail the request with pickle's AttributeError)."""
    monkeypatch.setattr(executables, "_reasons_logged", set())
    x = jnp.arange(8, dtype=jnp.float32)
    compiled, fresh = compile_fresh(_with_host_callbacks, f"probe_{uuid.uuid4().hex[:12]}",
                                    (x,), {}, persistent_cache=False)
    assert fresh
    store = ExecutableStore(tmp_path / "store")
    with caplog.at_level(logging.DEBUG, logger="jengine"):
        assert store.save("k", compiled) == 0
        with store.deferred():  # a warm-up's saves, written when it ends
            store.save("k2", compiled)
    assert store.entries() == [] and not list(tmp_path.rglob("*.tmp"))
    notes = [r for r in caplog.records if "not stored" in r.getMessage()]
    assert [r.levelno for r in notes] == [logging.WARNING, logging.DEBUG]
    assert "AttributeError" in notes[0].getMessage()
    np.testing.assert_array_equal(compiled(x), np.arange(8) * 2 + 1)


@pytest.mark.kernel_sweep  # interpret-mode Pallas on CPU: about a minute for one token
def test_an_engine_whose_step_holds_a_host_callback_serves(tiny, tmp_path, monkeypatch):
    """The pallas_tpu backend on CPU runs in interpret mode, whose step program holds host
    callbacks: the engine serves, and nothing is stored."""
    store = tmp_path / "store"
    monkeypatch.setattr(jengine.core.startup, "default_store_dir", lambda: store)
    engine = Engine(tiny, config=ONE_BUCKET, attention_backend="pallas_tpu", progress=False)
    [out] = engine.generate([[5, 9, 17, 33]], SamplingParams(max_tokens=1, temperature=0,
                                                             ignore_eos=True))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    assert engine.core.runner.programs_compiled == 1
    assert not list(store.glob("*.jex"))


def test_an_offline_engine_builds_only_the_buckets_it_uses(tiny):
    lazy = Engine(tiny, config=TWO_BUCKETS, progress=False)
    runner = lazy.core.runner
    assert runner.programs_loaded + runner.programs_compiled == 0
    prompts = [[5, 9, 17], [40, 41, 42, 43]]
    tokens = [o.outputs[0].token_ids for o in lazy.generate(prompts, GREEDY)]
    built = runner.programs_loaded + runner.programs_compiled
    assert built == 1 < len(runner.buckets.shapes())  # decodes and a 7-token prefill: T=8
    warm = Engine(tiny, config=TWO_BUCKETS, progress=False, warmup=True)
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, GREEDY)] == tokens


def test_a_program_built_after_ready_is_counted_and_logged(tiny, caplog):
    """Warm-up builds every variant of every bucket, so a request with any sampling feature
    builds nothing after ready; a program missing then (here: dropped from the runner, as a
    missed warm-up would leave it) is built on demand, counted and logged with its shape."""
    engine = Engine(tiny, config=ONE_BUCKET, progress=False, warmup=True)
    runner = engine.core.runner
    assert runner.programs_loaded + runner.programs_compiled == len(VARIANTS)
    featured = SamplingParams(max_tokens=2, temperature=0, logprobs=2, presence_penalty=0.5,
                              logit_bias={7: -3.0}, min_tokens=1)
    first = engine.generate([[5, 9, 17]], featured)
    assert engine.core.compiles_since_ready == 0
    [signature] = [sig for sig in runner._programs if sig[0] == Variant(features=True)]
    del runner._programs[signature]
    with caplog.at_level(logging.WARNING, logger="jengine"):
        again = engine.generate([[5, 9, 17]], featured)
    assert engine.core.compiles_since_ready == 1
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    [record] = [r for r in caplog.records if "after ready" in r.getMessage()]
    assert "T=16 S=16 P=32" in record.getMessage()
    assert "features=True" in record.getMessage()

