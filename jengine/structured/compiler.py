"""`GrammarCompiler`: compiles grammars on a small thread pool, with a cache.

Compiling runs off the engine thread: `AsyncEngine` awaits the future before it hands the request
to the engine, so a request joins the batch only when its grammar is ready, and an invalid spec
fails at admission (HTTP 400) without the engine thread ever waiting. The same spec asked for
again (every sample of an n > 1 request, every retry of a client) reuses the compiled grammar.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading

from jengine.sampling_params import StructuredOutputs
from jengine.structured.backend import Grammar, GrammarBackend

CACHE_SIZE = 128
NUM_THREADS = 2


def spec_key(spec: StructuredOutputs) -> str:
    """A canonical text for a spec, equal for equal constraints."""
    fields = {"json": spec.json, "regex": spec.regex, "choice": spec.choice,
              "grammar": spec.grammar, "json_object": spec.json_object}
    if isinstance(spec.json, str):
        fields["json"] = json.loads(spec.json)
    return json.dumps(fields, sort_keys=True)


class GrammarCompiler:
    """Thread-safe front of a `GrammarBackend`: `submit` from any thread."""

    def __init__(self, backend: GrammarBackend, *, cache_size: int = CACHE_SIZE):
        self.backend = backend
        self._pool = concurrent.futures.ThreadPoolExecutor(NUM_THREADS,
                                                           thread_name_prefix="jengine-grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future[Grammar]] = (
            collections.OrderedDict()
        )
        self._cache_size = cache_size

    def submit(self, spec: StructuredOutputs) -> concurrent.futures.Future[Grammar]:
        """The compiled grammar of `spec`, as a future (already done when cached). A failed
        compile raises its ValueError from `result()` and is not cached."""
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.backend.compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """Blocking `submit(spec).result()`; raises ValueError for an invalid spec."""
        return self.submit(spec).result()
