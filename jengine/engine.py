"""jengine's public engine API: `Engine` (blocking) and `AsyncEngine` (asyncio, own thread).

The data flow of one step, and the type at each boundary:

    Request (prompt ids, SamplingParams, grammar) EngineCore.add_request -> Sequence(s), each
                                                   with its own grammar matcher when constrained
      -> Scheduler.schedule()                      host: decodes first, then prefill chunks
                                                   within the token budget; allocates KV pages;
                                                   preempts by recompute when pages run out
      -> ScheduledBatch                            host NumPy: tokens, positions, slots, q/kv
                                                   lens, page tables (jengine/scheduling/batch.py)
      -> StepMasks.build()                         host: allowed-token bitmask rows of the
                                                   constrained sequences (None if there are none)
      -> Runner.launch()                           pads to a declared bucket, one device_put,
                                                   dispatches without waiting
      -> step(params, kv_cache, metadata, sampling arrays, feed, previous tokens)
                                                   one jitted program: embed -> scanned layers
                                                   (paged attention writes new K/V) -> last-token
                                                   logits -> sampler; kv_cache donated
      -> Scheduler.advance()                       while it runs: counts move on, each sampling
                                                   sequence gets a PENDING token, and (async
                                                   scheduling) step N+1 is scheduled and launched,
                                                   its PENDING tokens read on the device
      -> StepResult (Runner.fetch)                 [S] token ids (+ logprobs) back to the host
      -> Scheduler.finalize()                      PENDING -> sampled token, eos/stop ids, free
                                                   pages of finished sequences; then each matcher
                                                   consumes its token (a complete grammar stops)
      -> IncrementalDetokenizer                    UTF-8 safe text deltas; stop strings cut
      -> RequestOutput deltas                      to Engine.generate / stream / AsyncEngine

A sequence that stops on a token (EOS, stop id or string) may already be in the step launched
ahead; that row's result is dropped. Steps whose sampled sequences need their token on the host
before the next step (grammars, penalties) run one at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tqdm import tqdm

from jengine.config import EngineConfig, load_config
from jengine.core.engine_core import EngineCore
from jengine.core.replicas import ReplicaSet, make_core
from jengine.core.request import merge_deltas
from jengine.core.stats import EngineStats
from jengine.outputs import RequestOutput
from jengine.sampling_params import SamplingParams, StructuredOutputs
from jengine.structured import Grammar
from jengine.text.chat import render_chat
from jengine.text.tools import constrain, split_tool_calls, tool_setup

log = logging.getLogger("jengine")

def build_config(model: str | None, config: str | None, **kwargs: Any) -> EngineConfig:
    """Engine kwargs (+ optional preset) -> EngineConfig. A keyword given (not None) always wins
    over the preset, even when it equals the default; the defaults themselves live only in the
    config dataclasses (`jengine.config`)."""
    return load_config(config, model=model, **kwargs)


class Engine:
    """Offline inference: `generate`, `chat` and `stream` in the caller's thread."""

    def __init__(
        self,
        model: str | None = None,
        *,
        mesh: str | None = None,  # None: the preset's, else the config default ("tp=1")
        dtype: str | None = None,  # "auto"
        attention_backend: str | None = None,  # "auto"
        kv_cache_dtype: str | None = None,  # "auto"
        quantization: str | None = None,  # "none"
        speculative: str | None = None,  # None (off) | "ngram"
        num_speculative_tokens: int | None = None,  # 3
        draft_model: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,  # 64
        max_num_batched_tokens: int | None = None,  # 512
        page_size: int | None = None,  # 16
        kv_cache_memory: str | None = None,  # "2GiB"
        enable_prefix_caching: bool | None = None,  # True
        config: str | None = None,
        progress: bool = True,
        coordinator: str | None = None,
        num_processes: int | None = None,  # 1
        process_id: int | None = None,  # 0
        seed: int | None = None,
        warmup: bool = False,
    ):
        """`seed` makes the sampling of requests that set no seed of their own reproducible
        from one engine start to the next (vLLM's `seed`). `warmup=True` builds every bucket's
        step program up front (what a benchmark wants); by default each is built by the first
        step that needs it, so a few prompts load or compile only the buckets they use.

        `quantization` ("none" | "int8" | "w8a16" | "fp8") quantizes the projections at load
        time (jengine/models/quant.py); an unknown mode, or fp8 on CPU, is a ValueError.

        `speculative="ngram"` proposes `num_speculative_tokens` tokens per decode by prompt
        lookup and verifies them in the same step (jengine/speculative.py); outputs are those
        of plain decoding, greedy or sampled. `"draft"` (a `draft_model` proposing) is not built
        yet and raises ValueError.

        Multi-host (`num_processes` > 1, one process per host, the same arguments on each
        but `process_id`): process 0 is the engine; on every other process this constructor
        runs process 0's step programs and returns only when process 0 exits."""
        cfg = build_config(
            model, config, mesh=mesh, dtype=dtype, attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype, quantization=quantization,
            speculative=speculative, num_speculative_tokens=num_speculative_tokens,
            draft_model=draft_model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
            kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
            coordinator=coordinator, num_processes=num_processes, process_id=process_id,
            seed=seed,
        )
        self.core = make_core(cfg, progress=progress, warmup=warmup)
        if cfg.parallel.process_id != 0:
            self.core.follow()
        self.tokenizer = self.core.tokenizer
        self.progress = progress
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order (tqdm bar on stderr)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty string or list")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError("need one SamplingParams per prompt")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for p in params:  # distinct grammars compile in parallel on the grammar pool
            if isinstance(p, SamplingParams) and p.structured_outputs is not None:
                self.core.grammars.submit(p.structured_outputs)
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.core.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.core.abort(rid)
            raise
        deltas: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        bar = tqdm(total=len(ids), desc="generating", disable=not self.progress,
                   file=sys.stderr, unit="req")
        pending = set(ids)
        while pending:
            for out in self.core.step():
                deltas[out.request_id].append(out)
                if out.finished:
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        outputs = [merge_deltas(deltas[rid]) for rid in ids]
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """`generate` over the model's chat template applied to each conversation.

        With `tools` (OpenAI function tools) and `tool_choice` ('auto' by default, 'none',
        'required' or {'type': 'function', 'function': {'name': ...}}), each completion's calls
        come out parsed in `tool_calls` (its `text` keeps the rest) and a completion that made
        calls finishes with "tool_calls"; `parallel_tool_calls=False` allows one call under
        'required'. See `jengine.tools`.
        """
        setup = tool_setup(tools, tool_choice, parallel_tool_calls)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        shown = tools if setup.active else None
        prompts = [self.render_chat(c, tools=shown) for c in conversations]
        if isinstance(sampling_params, list):
            params = [constrain(p or SamplingParams(), setup) for p in sampling_params]
        else:
            params = constrain(sampling_params or SamplingParams(), setup)
        outputs = self.generate(prompts, params)
        if setup.active:
            forced = setup.constraint() is not None
            for out in outputs:
                for completion in out.outputs:
                    split_tool_calls(completion, forced=forced)
        return outputs

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None) -> list[int]:
        return render_chat(self.tokenizer, messages, tools=tools)

    def stats(self) -> EngineStats:
        """Load and counters: requests, KV pages, preemptions, prefix-cache hits."""
        return self.core.stats()

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields deltas of one request as they are generated; the last has finished=True."""
        rid = f"stream-{next(self._ids)}"
        self.core.add_request(rid, prompt, sampling_params)
        try:
            while True:
                for out in self.core.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise RuntimeError(f"request {rid} failed: {out.error}")
                        yield out
                        if out.finished:
                            return
        finally:
            self.core.abort(rid)


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
        cfg = build_config(model, config, **kwargs)
        self._start(make_core(cfg, progress=progress, warmup=warmup, require_warm=require_warm))

    def _start(self, core: EngineCore | ReplicaSet) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self._lock = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._taken: list[tuple[str, Any]] = []  # taken off the queue by the engine thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._stopped = False
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
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas. Bad input raises ValueError before anything is queued."""
        rid = request_id or f"req-{next(self._ids)}"
        grammar = None
        spec = getattr(sampling_params, "structured_outputs", None)
        if spec is not None:
            # Compiled on the grammar pool, never in the engine thread; a bad spec raises here.
            grammar = await self._compile(spec)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = loop.create_future()
        with self._lock:  # the engine thread records a failure under this lock
            if self.error is not None:
                raise RuntimeError(f"engine failed: {self.error}")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (loop, queue)
            self._commands.append(("add", (rid, prompt, sampling_params, grammar, done)))
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

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._commands.append(("abort", request_id))
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
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
            log.exception("the engine thread died; requests in flight: %s",
                          ", ".join(_request_ids(self.core)[:20]) or "none")
            with self._lock:
                self.error = e
                streams = list(self._streams)
                pending, self._commands = self._commands, []
            failure = RuntimeError(f"engine failed: {e}")
            for kind, arg in self._taken + pending:  # adds not yet answered
                if kind == "add":
                    self._resolve(arg[0], arg[-1], failure)
            for rid in streams:
                self._deliver(rid, failure)

    def _run_command(self, kind: str, arg: Any) -> None:
        if kind == "abort":
            self.core.abort(arg)
            return
        rid, prompt, params, grammar, done = arg
        try:
            self.core.add_request(rid, prompt, params, grammar)
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


def _request_ids(core: EngineCore | ReplicaSet) -> list[str]:
    return sorted(rid for replica in core.replicas for rid in replica.requests)
