"""XLA compilation: the persistent cache, and a count of compiles taken from JAX's own events.

The count comes from `jax.monitoring` (one `/jax/core/compile/jaxpr_to_mlir_module_duration`
event per program JAX lowers, whether XLA then compiles it or loads it from the persistent cache),
so a step shape that was not warmed up shows up here however the engine is driven. Programs that
`jengine.runtime.executables` loads without lowering them are added by `record_program_load`: a load
after ready stalls the batch as surely as a compile does.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jengine" / "xla"


def enable_persistent_cache(path: str | Path | None = None) -> Path:
    """Turns on JAX's persistent compilation cache for every compile, however small or quick."""
    path = Path(path) if path else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    install_compile_counter()
    return path


def _on_duration(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _LOWER_EVENT:
        with _lock:
            _count += 1


def install_compile_counter() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def record_program_load() -> None:
    """Counts a compiled program obtained without lowering (a stored executable)."""
    global _count
    with _lock:
        _count += 1


def compile_count() -> int:
    """Programs lowered or loaded in this process since the counter was installed."""
    return _count
