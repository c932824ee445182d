"""JAX's persistent compilation cache, which every jengine process uses.

The first engine built in a process (or `enable_persistent_cache()` called directly) sets three
process-wide JAX options, once:
- `jax_compilation_cache_dir`: `$XDG_CACHE_HOME/jengine/xla` (`~/.cache/jengine/xla`), unless
  the program set a directory of its own before;
- `jax_persistent_cache_min_compile_time_secs` and `jax_persistent_cache_min_entry_size_bytes`:
  0, so every program is kept, however quick to compile or small (JAX's defaults skip programs
  under a second, which are most of a small model's step programs).
Later engines leave them as they are. Step programs are also kept whole by
`jengine.runtime.executables`, which the persistent cache cannot do on its own (it still traces
and lowers each program before looking it up).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

_lock = threading.Lock()
_enabled: Path | None = None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jengine" / "xla"


def enable_persistent_cache(path: str | Path | None = None) -> Path:
    """Turns on JAX's persistent compilation cache for every compile, however small or quick.
    Sets the options once per process; returns the cache directory in use."""
    global _enabled
    with _lock:
        if _enabled is not None:
            return _enabled
        chosen = jax.config.jax_compilation_cache_dir
        if path is not None or not chosen:
            chosen = str(Path(path) if path else default_cache_dir())
            jax.config.update("jax_compilation_cache_dir", chosen)
        Path(chosen).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _enabled = Path(chosen)
        return _enabled
