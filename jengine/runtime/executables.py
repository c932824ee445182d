"""`ExecutableStore`: compiled step programs on disk, loaded on a warm start without retracing.

JAX's persistent compilation cache already skips XLA's compile on a warm start, but its key is a
hash of the lowered module, so every start still traces and lowers each program in Python
(most of the ~1.4 s per SmolLM2 bucket on a 2-core CPU) before it can look the entry up. This
store keys a serialized executable (`jax.experimental.serialize_executable`) by everything that
decides the program *without* tracing it: the caller's description (model config, parameter and
KV shapes/dtypes/shardings, input shapes, variant) plus this process's environment (jax/jaxlib
versions, platform and its version, device kinds and ids, CPU model and flags, XLA flags, the
sources the step is traced from and the native kernels). A changed part means a different key,
never a stale program.

Why a fresh compile is needed before saving: XLA:CPU does not keep the object code of an
executable it *deserialized* (a persistent-cache hit), so serializing that one again gives a blob
that loads but fails at dispatch with "Function <first kernel> not found" (`wrapped_iota` in the
earlier report). `compile_fresh` names the module after the store key, so the persistent cache
cannot hit for a program this store has not saved, and it checks JAX's cache-hit event anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import pickle
import platform
import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax._src import config as jax_config  # the cache's thread-local settings
from jax.experimental import serialize_executable

from jengine import cpu_info

log = logging.getLogger("jengine")

FORMAT = 1  # bump when what a file holds changes
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()
_listener_lock = threading.Lock()
_listening = False


def default_store_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jengine" / "executables"


# The parts of the package that step programs are traced from (a program is only as current
# as the code that traced it). An edit elsewhere (server, scheduler) keeps the stored programs;
# code that starts running inside a jitted step must be listed here.
# Paths are relative to the `jengine` package.
TRACED_SOURCES = ("runtime/runner.py", "runtime/step_program.py", "runtime/sampler.py",
                  "runtime/step_io.py", "runtime/step_tail.py", "runtime/pick.py",
                  "runtime/packed_inputs.py", "runtime/lora_slots.py", "models",
                  "pallas_kernels", "cpu_kernels", "sharding",
                  "sampling_params.py")  # GREEDY_TEMPERATURE is traced into the sampler


def traced_files() -> list[Path]:
    """TRACED_SOURCES' Python, C++ and native library files, in a fixed order."""
    root = Path(__file__).parent.parent
    files = []
    for name in TRACED_SOURCES:
        top = root / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.suffix in (".py", ".so", ".cc", ".h") and "__pycache__" not in path.parts:
                files.append(path)
    return files


@cache
def _sources_digest() -> str:
    """A digest of `traced_files()` (milliseconds to hash)."""
    root = Path(__file__).parent.parent
    h = hashlib.sha256()
    for path in traced_files():
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@cache
def _cpu_description() -> dict[str, str]:
    """XLA:CPU compiles for the host's instruction set; a program built with AVX-512 must not
    load on a machine without it."""
    info = {"machine": platform.machine(), "processor": platform.processor()}
    host = cpu_info.fields()
    for key in ("model name", "flags", "Features"):
        if key in host:
            info[key] = host[key] if key == "model name" else " ".join(sorted(host[key].split()))
    return info


def environment(devices: Sequence[jax.Device]) -> dict[str, Any]:
    """Everything outside the program's own description that decides the executable."""
    backend = devices[0].client
    return {
        "format": FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": backend.platform,
        "platform_version": backend.platform_version,
        "devices": [(d.id, d.device_kind, d.process_index) for d in devices],
        "num_devices": jax.device_count(),
        "cpu": _cpu_description(),
        "cpu_hidden": sorted(cpu_info.hidden()),  # kernels chosen as on a CPU without these
        "env": {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "x64": jax.config.jax_enable_x64,
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "sources": _sources_digest(),
    }


def store_key(description: Any, devices: Sequence[jax.Device]) -> str:
    """A hex digest of `description` (anything `repr`-able: dataclasses, tuples, shapes) and the
    environment. `repr` of frozen dataclasses and dtypes is stable across processes."""
    text = json.dumps({"program": description, "environment": environment(devices)},
                      default=repr, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT_EVENT:
        _hits.count = getattr(_hits, "count", 0) + 1


def _listen_for_cache_hits() -> None:
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True


class _SerializeGate:
    """Compiles may run side by side, a serialization only alone. Added when full test runs
    crashed inside `executable.serialize()` in JAX's cache write while a warm-up's compile
    threads built step programs (sessions 19-20). Those crashes were later traced to the test
    process running out of memory maps, not to the overlap (docs/engine.md, "Start-up: stored
    step programs"); the gate stays because nothing documents serializing beside a compile as
    safe, and it costs little: a waiting serialization goes first."""

    def __init__(self):
        self._cond = threading.Condition()
        self._compiling = 0
        self._serializing = False
        self._waiting = 0  # serializations waiting: no new compile starts meanwhile

    @contextlib.contextmanager
    def compiling(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._serializing and not self._waiting)
            self._compiling += 1
        try:
            yield
        finally:
            with self._cond:
                self._compiling -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def serializing(self):
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._serializing and not self._compiling)
            self._waiting -= 1
            self._serializing = True
        try:
            yield
        finally:
            with self._cond:
                self._serializing = False
                self._cond.notify_all()


_GATE = _SerializeGate()


def compile_fresh(fun: Callable, name: str, args: tuple, kwargs: dict, *,
                  persistent_cache: bool = True, **jit_kwargs
                  ) -> tuple[jax.stages.Compiled, bool]:
    """AOT-compiles `fun` for `args` as a module called `name` (a store key's prefix keeps the
    persistent cache from serving it). Returns the executable and whether it is safe to
    serialize (False when the persistent cache served it anyway). `persistent_cache=False`:
    JAX's cache does not write it either (a caller that stores it itself, which spares the
    second copy and JAX's serialization racing other compiles: `_SerializeGate`)."""
    _listen_for_cache_hits()

    def program(*a, **k):
        return fun(*a, **k)

    program.__signature__ = inspect.signature(fun)  # donate/static argnames find their args
    program.__name__ = program.__qualname__ = name
    before = getattr(_hits, "count", 0)
    if persistent_cache:  # JAX serializes it for its cache inside compile(): alone, then
        gate = _GATE.serializing()
    else:  # a thread-local minimum compile time no program reaches: JAX skips its write
        gate = contextlib.ExitStack()
        gate.enter_context(_GATE.compiling())
        gate.enter_context(jax_config.persistent_cache_min_compile_time_secs(math.inf))
    with gate:
        compiled = jax.jit(program, **jit_kwargs).lower(*args, **kwargs).compile()
    return compiled, getattr(_hits, "count", 0) == before


_reasons_logged: set[str] = set()


def _not_stored(error: Exception) -> None:
    """Logs why a program was not stored: a warning the first time for each kind of error (the
    same reason holds for every program of an engine), debug after that."""
    kind = type(error).__name__
    level = logging.DEBUG if kind in _reasons_logged else logging.WARNING
    _reasons_logged.add(kind)
    log.log(level, "a compiled step program is not stored (it compiles again next start): "
            "%s: %s", kind, error)


class ProgramsNotStoredError(ValueError):
    """A start that must not compile (`serve --require-warm`) found programs missing."""


@dataclasses.dataclass
class ExecutableStore:
    """One file per program, `<dir>/<key>.jex`: the pickled (executable, in/out trees)."""

    path: Path
    _queue: list | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.path = Path(self.path)

    @contextlib.contextmanager
    def deferred(self):
        """Saves asked for inside are written when it ends: a warm-up's compile threads keep
        compiling instead of waiting for each other's serializations (`_SerializeGate`)."""
        self._queue = []
        try:
            yield
        finally:
            queue, self._queue = self._queue, None
            for key, compiled in queue:
                self.save(key, compiled)

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.jex"

    def load(self, key: str, devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
        """The stored executable for `key` on `devices`, or None (absent or unreadable; an
        unreadable file is removed so that the next save replaces it)."""
        file = self._file(key)
        try:
            blob = file.read_bytes()
        except FileNotFoundError:
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(blob)
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client,
                execution_devices=list(devices))
        except Exception as e:  # noqa: BLE001 - a bad entry costs a compile, never a start
            log.warning("dropping unreadable compiled program %s: %s: %s", file.name,
                        type(e).__name__, e)
            file.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> int:
        """Writes atomically (a reader never sees half a file); returns the bytes written, 0
        where the backend cannot serialize (the program then compiles again next start) or
        inside `deferred` (written at its end)."""
        if self._queue is not None:
            self._queue.append((key, compiled))
            return 0
        try:
            with _GATE.serializing():
                blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # noqa: BLE001 - storing only saves a compile; never fail on it
            # Backends that cannot serialize (ValueError, NotImplementedError), and programs
            # that hold a host callback (a Pallas kernel in interpret mode, `jax.debug`,
            # `pure_callback`): the callback is a local Python function, which pickle refuses
            # (AttributeError). The compiled program in memory serves on.
            _not_stored(e)
            return 0
        tmp = self.path / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(blob)
            os.replace(tmp, self._file(key))
        except OSError as e:  # a full or read-only disk: the next start compiles again
            tmp.unlink(missing_ok=True)
            _not_stored(e)
            return 0
        return len(blob)

    def size(self, key: str) -> int | None:
        """The stored file's bytes, or None when `key` has no file."""
        try:
            return self._file(key).stat().st_size
        except FileNotFoundError:
            return None

    def entries(self) -> list[Path]:
        return sorted(self.path.glob("*.jex")) if self.path.exists() else []


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """How one replica obtained its step programs, and what the store holds afterwards: what
    `jengine compile` prints, without the command line reaching into the store itself."""

    keys: list[str | None]  # executable-store key of each warm-up program (None: not storable)
    loaded: int  # loaded from the store
    compiled: int  # compiled in this process
    stored_bytes: list[int | None]  # each warm-up program's stored file (None: not stored)
    store: Path | None  # the store's directory (None: multi-process runs keep no store)
    store_files: int  # programs in the store, every model's together
    store_bytes: int

    @classmethod
    def of(cls, store: ExecutableStore | None, keys: list[str | None], *, loaded: int,
           compiled: int) -> ProgramReport:
        entries = store.entries() if store is not None else []
        return cls(keys=keys, loaded=loaded, compiled=compiled,
                   stored_bytes=[store.size(k) if store is not None and k is not None else None
                                 for k in keys],
                   store=store.path if store is not None else None, store_files=len(entries),
                   store_bytes=sum(p.stat().st_size for p in entries))
