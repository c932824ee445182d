"""The one generation pipeline: every generating route runs the same three steps and is only
a protocol view over them (chat.py, completions.py, responses.py; grpc_service.py for 1-2).

1. The route checks its body's fields (a 400 before admission) and makes a `Job`: the
   `SamplingParams`, a function from the admitted engine's tokenizer to the prompts, and the
   field names its errors use.
2. `start(state, request, job)` does all that comes before the first byte of an answer: the
   admission (`QueueSlot`: 503 loading, draining or queue full; 500 engine dead), the
   per-request bounds, the prompts rendered and tokenized off the event loop, the output
   constraint compiled, one engine request per prompt, and the first delta awaited, so that bad
   input is an error response, never a broken stream. It returns the output view, an
   `EngineStream` of `(prompt index, RequestOutput delta)` pairs (per-choice text, token ids
   and logprobs in `outputs[k]`, the finish reason on a choice's last delta, the usage on a
   prompt's last), which watches for disconnects, the timeout and a dead engine.
3. `reply(stream, view, streaming)` collects the view's JSON body, or frames its events as
   server-sent events; an error after the stream began becomes the protocol's error events
   (the view's `Framing`), and the engine requests are aborted however the answer ends.

A new route plugs in the same way: a request model, a handler `body -> Job -> start -> view
-> reply`, a view (`framing`, `response`, `events`) and a row in the route table (routes.py).
Anthropic's messages (messages.py) are chat's `Job` with a view of their own and a `Framing`
of `error` events without `[DONE]`, as responses.py does; a batch runs a `start` per line;
embeddings (the engine's embed task) reuse admission, bounds and prompts with a view over
their vectors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from typing_extensions import Self

from jengine.lora_request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.pooling_params import PoolingParams
from jengine.sampling_params import SamplingParams
from jengine.server.errors import APIError, bad_request, engine_failed, invalid_value
from jengine.server.protocol import check_text_fields

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine
    from jengine.server.metrics import ServerMetrics
    from jengine.server.state import QueueSlot, ServerState

log = logging.getLogger("jengine.server")

WATCHDOG_PERIOD_S = 0.25

Prompt = str | list[int]


@dataclass(frozen=True)
class Job:
    """What a route asks of the engine, in the engine's terms."""

    params: SamplingParams
    prompts: Callable[[Any], list[Prompt]]  # tokenizer -> one prompt per engine request
    num_prompts: int  # len(prompts(...)), known before tokenizing (for the bounds)
    request_id: str  # the id the answer carries; engine ids are made unique from it
    max_tokens_field: str = "max_tokens"  # the field the client bounded the output with
    constraint_param: str | None = None  # the field a bad output constraint came from
    check: Callable[[AsyncEngine], None] | None = None  # checks that need the engine
    # The params once the engine is known: a constraint that reads the vocabulary (chat's
    # structured output after the reasoning block, jengine/structured/after_reasoning.py).
    adapt: Callable[[AsyncEngine, SamplingParams], SamplingParams] | None = None
    # An embedding job (embeddings.py): what the engine requests carry instead of `params`,
    # which then only bound the request (one "token" per prompt).
    pooling: PoolingParams | None = None
    # The adapter of a job without an HTTP request (gRPC); HTTP routes' comes from `accept`.
    lora: LoRARequest | None = None


def accept(request: Request, body: Any) -> ServerState:
    """The app's state, once the body names a model this server serves (404) in text that
    can be encoded (400): the checks every route's body gets first."""
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    check_text_fields(body)
    request.state.lora = state.loras.get(body.model)  # the adapter `model` names, if any
    return state


async def start(state: ServerState, request: Request | None, job: Job) -> EngineStream:
    """Admits `job` and starts its engine requests (step 2 of the module docstring).

    `request`: the HTTP request (its disconnect is watched; a start-up request is let in
    before the server is ready), or None (gRPC). The caller owns the returned stream: `reply`,
    or `async with`."""
    with state.admit(request) as slot:  # an exception before the stream exists frees the slot
        engine = slot.engine
        if job.check is not None:
            job.check(engine)
        params = job.params
        state.check_limits(params, job.num_prompts, engine.core.model.max_model_len,
                           job.max_tokens_field)
        # Rendering and tokenizing a long prompt takes a while: not in the event loop's thread.
        prompts = await asyncio.to_thread(job.prompts, engine.tokenizer)
        try:
            if job.adapt is not None:
                params = job.adapt(engine, params)
            await engine.compile_grammar(params)
        except ValueError as e:
            raise bad_request(str(e), job.constraint_param) from None
        stream = EngineStream(state, slot, prompts, job.pooling or params,
                              state.new_request_id(job.request_id),
                              request.is_disconnected if request is not None else None,
                              state.metrics_for(request),
                              getattr(request.state, "lora", None) if request else job.lora)
    try:
        await stream.first()
    except BaseException:
        stream.close()
        raise
    return stream


# -- the output view ----------------------------------------------------------------------------

class ClientGone(APIError):
    """The client closed the connection; there is nobody left to answer (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", code="client_closed")


class RequestTimeout(APIError):
    def __init__(self, seconds: float):
        super().__init__(504, f"the request did not finish within {seconds:g} s",
                         type="server_error", code="timeout")


class EngineStream:
    """The output view: merged deltas of one request's engine requests (one per prompt).

    One `AsyncEngine.generate` per prompt runs in its own task, and the deltas come out as
    `(prompt index, RequestOutput)` pairs in arrival order. A watchdog task turns what a route
    must not wait on forever into errors: the engine thread dying, the request timeout, the
    client going away. `close()` cancels the tasks, which aborts the engine requests and frees
    their KV pages. It keeps the request's books: the `QueueSlot` it was admitted with (given
    back at the first token, or when the stream closes first), the latency and token metrics,
    the log line. Usage: `async with stream: async for i, delta in stream: ...`.
    """

    def __init__(
        self,
        state: ServerState,
        slot: QueueSlot,
        prompts: list[str | list[int]],
        params: SamplingParams | PoolingParams,
        request_id: str,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        metrics: ServerMetrics | None = None,
        lora: LoRARequest | None = None,
    ):
        self.state = state
        self.lora = lora  # the LoRA adapter every prompt runs under (None: the base model)
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
            async for delta in self.engine.generate(prompt, self.params, engine_rid,
                                                    lora_request=self.lora):
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


# -- answers ------------------------------------------------------------------------------------

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Framing:
    """How a protocol's event stream reports an error after it began, and how it ends."""

    failed: Callable[[APIError], Iterable[str]]
    done: str | None  # the last line (OpenAI's `[DONE]`), or None


OPENAI_FRAMING = Framing(lambda error: [error.sse_event()], DONE)


class View(Protocol):
    """A route's protocol view of the output stream."""

    framing: Framing

    async def response(self, stream: EngineStream) -> dict[str, Any]: ...

    def events(self, stream: EngineStream) -> AsyncIterator[str]: ...


async def reply(stream: EngineStream, view: View, streaming: bool) -> Response:
    """The HTTP answer: the view's events as SSE, or its whole body as JSON."""
    if streaming:
        return StreamingResponse(sse_stream(stream, view.events(stream), view.framing),
                                 media_type="text/event-stream")
    async with stream:
        return JSONResponse(await view.response(stream))


async def sse_stream(stream: EngineStream, events: AsyncIterator[str],
                     framing: Framing = OPENAI_FRAMING) -> AsyncIterator[str]:
    """Frames a view's events; an error mid-stream becomes `framing`'s error events.

    The response owns `stream` from here on: however the response ends (completed, client gone,
    server shut down), the engine requests are aborted and their pages freed.
    """
    try:
        async for event in events:
            yield event
    except ClientGone:
        return
    except APIError as e:
        log.warning("request %s failed mid-stream: %s", stream.request_id, e.message)
        for event in framing.failed(e):
            yield event
    except Exception as e:
        log.exception("request %s failed mid-stream", stream.request_id)
        for event in framing.failed(APIError(500, f"internal server error: {e}",
                                             type="server_error")):
            yield event
    finally:
        stream.close()
    if framing.done is not None:
        yield framing.done
