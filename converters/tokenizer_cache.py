"""Tokenizers built from a model file's metadata, kept on disk for the next start.

Building SmolLM2's tokenizer from its GGUF vocabulary and merges costs ~1.2 s of a 2-core start
(transformers' GGUF converter and its import, then a deep copy of the Rust tokenizer), on the
path to the first token; unpickling the built one costs ~0.1 s. The key is a digest of all the
build reads (the metadata it is given and the source file of the function that builds it) and
of the transformers and tokenizers versions, so an edited model file, an edited converter or an
upgrade builds afresh. The files live in `$XDG_CACHE_HOME/jengine/tokenizers/`, beside the stored
step programs, and are trusted as those are: they are pickles, read only from this user's cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from converters.quiet_transformers import import_transformers

log = logging.getLogger("jengine")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jengine" / "tokenizers"


def cached_tokenizer(inputs: dict[str, Any], build: Callable[[], Any]) -> Any:
    """`build()`'s tokenizer, which reads nothing but `inputs`: unpickled from the cache when a
    previous build had the same inputs, else built and stored."""
    path = cache_dir() / f"{_key(inputs, build)}.pkl"
    try:
        import_transformers()  # (unpickling imports it, notice and all)
        return pickle.loads(path.read_bytes())
    except FileNotFoundError:
        pass
    except Exception as e:  # truncated or unreadable: built again and replaced
        log.warning("cached tokenizer %s is unreadable (%s); building it again", path.name, e)
    tokenizer = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)  # whole or absent, whoever else writes the same key
    except OSError as e:
        log.debug("tokenizer not cached in %s: %s", path.parent, e)
    return tokenizer


def _key(inputs: dict[str, Any], build: Callable[[], Any]) -> str:
    h = hashlib.sha256()
    for name in ("transformers", "tokenizers"):
        h.update(f"{name} {importlib.metadata.version(name)}\n".encode())
    h.update(Path(build.__code__.co_filename).read_bytes())
    h.update(repr(sorted(inputs.items())).encode())
    return h.hexdigest()[:32]
