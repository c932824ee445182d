"""`EngineStream`: the engine side of one request, the output view of the generation pipeline
(pipeline.py), which starts it.

An OpenAI request may carry several prompts (completions) and ask for `n` completions each; the
engine takes one prompt per request. `EngineStream` runs one `AsyncEngine.generate` per prompt in
its own task and hands the handler `(prompt_index, RequestOutput delta)` pairs in arrival order.
A watchdog task turns the things a handler must not wait on forever into errors: the engine
thread dying, the request timeout, the client going away. `close()` cancels the tasks, which
closes the engine streams, which aborts the engine requests and frees their KV pages.

It also keeps the request's books: the `QueueSlot` it was admitted with (a request is queued
until its first token; the slot goes back then, or when the stream closes first), and the
latency and token metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

from jengine.outputs import RequestOutput
from jengine.sampling_params import SamplingParams
from jengine.server.errors import APIError, engine_failed, invalid_value

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine
    from jengine.server.metrics import ServerMetrics
    from jengine.server.state import QueueSlot, ServerState

log = logging.getLogger("jengine.server")

WATCHDOG_PERIOD_S = 0.25


class ClientGone(APIError):
    """The client closed the connection; there is nobody left to answer (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", code="client_closed")


class RequestTimeout(APIError):
    def __init__(self, seconds: float):
        super().__init__(504, f"the request did not finish within {seconds:g} s",
                         type="server_error", code="timeout")


class EngineStream:
    """Merged deltas of one HTTP request's engine requests (one per prompt).

    Usage: `async with EngineStream(...) as stream: async for i, delta in stream: ...`.
    """

    def __init__(
        self,
        state: ServerState,
        slot: QueueSlot,
        prompts: list[str | list[int]],
        params: SamplingParams,
        request_id: str,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        metrics: ServerMetrics | None = None,
    ):
        self.state = state
        self.metrics = metrics or state.metrics  # (a scratch set for the start-up requests)
        self.slot = slot
        self.engine: AsyncEngine = slot.engine
        self.request_id = request_id
        self.params = params
        self.num_prompts = len(prompts)
        self.arrival = time.perf_counter()
        self.prompt_token_ids: list[list[int] | None] = [None] * len(prompts)
        self.usage_completion_tokens = 0
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._open = len(prompts)
        self._first_at: float | None = None
        self._last_at = [0.0] * len(prompts)
        self._finish: dict[tuple[int, int], str] = {}
        self._ended: str | None = None  # why the request ended early, for the books
        self._closed = False
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._tasks = [
            asyncio.create_task(self._pump(i, p, f"{request_id}-{i}"))
            for i, p in enumerate(prompts)
        ]
        self._tasks.append(asyncio.create_task(self._watchdog(is_disconnected)))

    # -- producing ---------------------------------------------------------------------------------

    async def _pump(self, index: int, prompt: str | list[int], engine_rid: str) -> None:
        try:
            async for delta in self.engine.generate(prompt, self.params, engine_rid):
                self._queue.put_nowait((index, delta))
        except asyncio.CancelledError:
            raise
        except ValueError as e:
            self._queue.put_nowait((index, invalid_value(e)))
        except Exception as e:  # noqa: BLE001 - a dead engine thread (RuntimeError) or a bug:
            # either way the handler must get an error, never wait forever
            self._queue.put_nowait((index, engine_failed(e)))
        else:
            self._queue.put_nowait((index, None))

    async def _watchdog(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> None:
        timeout = self.state.request_timeout
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            if not self.engine.is_alive:
                error = self.engine.error or "the engine thread stopped"
                self._queue.put_nowait((-1, engine_failed(error)))
                return
            if timeout is not None and time.perf_counter() - self.arrival > timeout:
                self._queue.put_nowait((-1, RequestTimeout(timeout)))
                return
            if is_disconnected is not None and await is_disconnected():
                self._queue.put_nowait((-1, ClientGone()))
                return

    # -- consuming ---------------------------------------------------------------------------------

    async def first(self) -> tuple[int, RequestOutput]:
        """Waits for the first delta, so that bad input is known before a response starts."""
        item = await self.__anext__()
        self._buffer.append(item)
        return item

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._buffer:
            return self._buffer.pop(0)
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self._ended = _ended_by(item)
                raise item
            self._account(index, item)
            return index, item
        raise StopAsyncIteration

    def _account(self, index: int, delta: RequestOutput) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        if self._first_at is None:
            self._first_at = now
            self.slot.release()
            metrics.ttft.observe(now - self.arrival)
        if self.prompt_token_ids[index] is None:
            self.prompt_token_ids[index] = delta.prompt_token_ids
            metrics.prompt_tokens.inc(len(delta.prompt_token_ids))
        elif self._last_at[index]:
            metrics.inter_token.observe(now - self._last_at[index])
        self._last_at[index] = now
        new_tokens = sum(len(o.token_ids) for o in delta.outputs)
        metrics.generation_tokens.inc(new_tokens)
        self.usage_completion_tokens += new_tokens
        for o in delta.outputs:
            if o.finish_reason is not None:
                self._finish[(index, o.index)] = o.finish_reason

    # -- closing -----------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind, error, tb) -> None:
        self.close()

    def close(self) -> None:
        """Aborts whatever is still running and settles the books (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self.slot.release()
        total = self.num_prompts * self.params.n
        unfinished = total - len(self._finish)
        reasons = list(self._finish.values())
        if self._ended != REJECTED:  # a refused request is no engine request, as any 4xx
            reasons += [self._ended or "abort"] * unfinished
        for reason in reasons:
            self.metrics.requests.labels(finish_reason=reason).inc()
        elapsed = time.perf_counter() - self.arrival
        if reasons:
            self.metrics.e2e.observe(elapsed)
        ttft = f"{self._first_at - self.arrival:.3f}s" if self._first_at else "-"
        log.log(self.state.request_log_level,
                "request %s done: finish=%s prompt_tokens=%d completion_tokens=%d ttft=%s "
                "total=%.3fs", self.request_id, ",".join(sorted(set(reasons))) or self._ended,
                 sum(len(p or ()) for p in self.prompt_token_ids), self.usage_completion_tokens,
                 ttft, elapsed)


REJECTED = "rejected"  # the engine refused the input (a 400): the client's error, not counted


def _ended_by(error: BaseException) -> str:
    if isinstance(error, ClientGone):
        return "abort"
    if isinstance(error, RequestTimeout):
        return "timeout"
    if isinstance(error, APIError) and 400 <= error.status < 500:
        return REJECTED
    return "error"
