"""`AsyncEngine`: the asyncio front end the server uses. One engine thread owns the core (the
engine contract, `jengine.core.contract`) and steps it; callers submit through a command queue
and read their deltas from asyncio queues on their own event loops. The step loop itself is
`jengine.engine`'s (its docstring tells the data flow)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from jengine.config import load_config
from jengine.core.contract import CoreContract
from jengine.core.replicas import make_core
from jengine.core.stats import EngineStats
from jengine.lora_request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.sampling_params import SamplingParams, StructuredOutputs
from jengine.structured import Grammar
from jengine.vision.inputs import ImagePrompt

log = logging.getLogger("jengine")


class AsyncEngine:
    """Asyncio front end: one engine thread steps the core; callers `async for` their deltas.

    Safe to use from any event loop (a notebook's included): the thread never touches asyncio
    except through `call_soon_threadsafe` on the caller's own loop.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        progress = kwargs.pop("progress", True)
        warmup = kwargs.pop("warmup", True)  # a server builds every program before it serves
        require_warm = kwargs.pop("require_warm", False)  # ... and may refuse to compile any
        config = kwargs.pop("config", None)
        cfg = load_config(config, model=model, **kwargs)  # as `jengine.engine.build_config`
        self._start(make_core(cfg, progress=progress, warmup=warmup, require_warm=require_warm))

    def _start(self, core: CoreContract) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self._lock = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._taken: list[tuple[str, Any]] = []  # taken off the queue by the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._stopped = False
        # Image towers run here, one prompt at a time, never on the engine thread.
        self._tower = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jengine-vision")
        self._thread = threading.Thread(target=self._loop, name="jengine-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        """As `Engine.stats`; callable from any thread while the engine runs."""
        return self.core.stats()

    async def generate(
        self,
        prompt: str | list[int] | dict | ImagePrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas. Bad input raises ValueError before anything is queued.
        `lora_request`: the LoRA adapter it runs under (an engine with `enable_lora`). A prompt
        with images: vLLM's dict (as `Engine.generate`) or an `ImagePrompt`."""
        rid = request_id or f"req-{next(self._ids)}"
        if isinstance(prompt, dict):
            prompt = ImagePrompt.of(prompt)
        grammar = None
        spec = getattr(sampling_params, "structured_outputs", None)
        if spec is not None:
            # Compiled on the grammar pool, never in the engine thread; a bad spec raises here.
            grammar = await self._compile(spec)
        if lora_request is not None:  # read from disk here, never in the engine thread
            await self.add_lora(lora_request)
        if isinstance(prompt, ImagePrompt) and prompt.images:
            # Encoded on the tower thread: the running requests keep stepping meanwhile (on
            # the engine thread it held every step for the tower's whole run).
            prompt = await asyncio.get_running_loop().run_in_executor(
                self._tower, self.core.encode_images, prompt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = loop.create_future()
        with self._lock:  # the engine thread records a failure under this lock
            if self.error is not None:
                raise RuntimeError(f"engine failed: {self.error}")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (loop, queue)
            self._commands.append(("add", (rid, prompt, sampling_params, grammar, lora_request,
                                           done)))
            self._lock.notify()
        try:
            await done  # raises the ValueError of a rejected request
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise RuntimeError(f"request {rid} failed: {item.error}")
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                if self._streams.pop(rid, None) is not None:
                    self._commands.append(("abort", rid))
                    self._lock.notify()

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles the request's output constraint on the grammar pool (cached for the request
        itself); raises ValueError when the constraint is invalid. Lets a caller reject a bad
        constraint, and name its field, before it streams anything."""
        if params.structured_outputs is not None:
            await self._compile(params.structured_outputs)

    async def _compile(self, spec: StructuredOutputs) -> Grammar:
        # The first use builds the backend (~0.5 s): not in the event loop's thread either.
        grammars = await asyncio.to_thread(getattr, self.core, "grammars")
        return await asyncio.wrap_future(grammars.submit(spec))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Reads and checks a LoRA adapter (on a worker thread) so that requests can name it;
        raises ValueError for a bad one or an engine without `enable_lora`."""
        await asyncio.to_thread(self.core.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> None:
        """Forgets an adapter's host copy. Requests already using it finish (its slot and
        directory stay theirs); no new request should name it."""
        await asyncio.to_thread(self.core.remove_lora, lora_id)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(("abort", request_id))
            self._lock.notify()

    async def reset_prefix_cache(self) -> int:
        """Drops the cached pages no request holds and zeroes the prefix-cache counters, between
        two steps of the engine thread (the cache is that thread's); returns the pages freed."""
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"engine failed: {self.error}")
            self._commands.append(("reset_prefix_cache", done))
            self._lock.notify()
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._tower.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=30)

    # -- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._commands and not self.core.has_unfinished and not self._stopped:
                        self._lock.wait()
                    if self._stopped:
                        return
                    commands, self._commands = self._commands, []
                self._taken = commands
                for kind, arg in commands:
                    self._run_command(kind, arg)
                self._taken = []
                if self.core.has_unfinished:
                    for out in self.core.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - the engine is dead: fail everyone waiting
            with self._lock:
                self.error = e
                streams = list(self._streams)
                pending, self._commands = self._commands, []
            log.exception("the engine thread died; requests in flight: %s",
                          ", ".join(sorted(streams)[:20]) or "none")
            failure = RuntimeError(f"engine failed: {e}")
            for kind, arg in self._taken + pending:  # commands not yet answered
                if kind == "add":
                    self._resolve(arg[0], arg[-1], failure)
                elif kind == "reset_prefix_cache" and not arg.done():
                    arg.set_exception(failure)
            for rid in streams:
                self._deliver(rid, failure)

    def _run_command(self, kind: str, arg: Any) -> None:
        if kind == "abort":
            self.core.abort(arg)
            return
        if kind == "reset_prefix_cache":
            arg.set_result(self.core.reset_prefix_cache())
            return
        rid, prompt, params, grammar, lora_request, done = arg
        try:
            self.core.add_request(rid, prompt, params, grammar, lora_request=lora_request)
        except ValueError as e:
            self._resolve(rid, done, e)
            return
        except Exception as e:  # noqa: BLE001 - a request the checks missed fails alone
            log.exception("request %s could not be added", rid)
            self._resolve(rid, done, RuntimeError(f"the request could not be added: {e}"))
            return
        self._resolve(rid, done, None)

    def _resolve(self, rid: str, done: asyncio.Future, error: Exception | None) -> None:
        with self._lock:
            entry = self._streams.get(rid)
        if entry is None:
            return
        loop, _ = entry

        def settle() -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        loop.call_soon_threadsafe(settle)

    def _deliver(self, rid: str, item: Any) -> None:
        with self._lock:
            entry = self._streams.get(rid)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)
