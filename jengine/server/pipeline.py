"""The one generation pipeline: every route that generates runs the same three steps, and is
itself only a protocol view over them.

1. The route turns its request into a `Job`: the `SamplingParams`, a function that makes the
   prompts (text or token ids) from the tokenizer of the engine it is admitted to, and the
   names its errors use. Field checks come first, so a bad body is a 400 before admission.
2. `start(state, request, job)` does everything else before the first byte of an answer, once:
   admission (a `QueueSlot`: 503 while loading, draining or with a full queue, 500 with the
   engine dead), the per-request bounds, the engine-dependent checks, the prompts rendered and
   tokenized off the event loop, the output constraint compiled (a bad one is a 400 naming
   `job.constraint_param`), one engine request per prompt, and the first delta awaited, so
   that bad input is a plain error response, never a broken stream. It returns the output
   view, an `EngineStream` (streams.py): `(prompt index, RequestOutput delta)` pairs, each
   delta holding the new text, token ids and logprobs of its choices (`outputs[k].index`), the
   finish reason on a choice's last and the usage on a prompt's last. The stream watches for
   the client leaving, the request timeout and a dead engine, and aborts the engine requests
   (freeing their KV pages) whenever it is closed, and keeps the metrics and the log line.
3. `reply(stream, view, streaming)` collects the stream into the view's JSON body, or frames
   the view's events as server-sent events (`sse_stream`): an error after the stream began
   becomes the protocol's error events (`Framing`), and the stream is closed however the
   response ends. gRPC (grpc_service.py) runs steps 1-2 and writes protobuf messages itself.

A new route plugs in the same way: a request model, a handler `body -> Job -> start -> view ->
reply`, a view with `framing`, `response(stream)` and `events(stream)`, and a row in the route
table (routes.py: path, auth, streaming, error shape). Anthropic's messages route is chat's
`Job` with its own view and a `Framing` of `error` events and no `[DONE]` (as responses.py does
for the Responses API); a batch runs one `start` per line; embeddings need the engine's embed
task and reuse admission, bounds and prompts with a view over its output.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jengine.sampling_params import SamplingParams
from jengine.server.errors import APIError, bad_request
from jengine.server.protocol import check_text_fields
from jengine.server.streams import ClientGone, EngineStream

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine
    from jengine.server.state import ServerState

log = logging.getLogger("jengine.server")

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


def accept(request: Request, body: Any) -> ServerState:
    """The app's state, once the body names a model this server serves (404) in text that
    can be encoded (400): the checks every route's body gets first."""
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    check_text_fields(body)
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
        state.check_limits(job.params, job.num_prompts, engine.core.model.max_model_len,
                           job.max_tokens_field)
        # Rendering and tokenizing a long prompt takes a while: not in the event loop's thread.
        prompts = await asyncio.to_thread(job.prompts, engine.tokenizer)
        try:
            await engine.compile_grammar(job.params)
        except ValueError as e:
            raise bad_request(str(e), job.constraint_param) from None
        stream = EngineStream(state, slot, prompts, job.params,
                              state.new_request_id(job.request_id),
                              request.is_disconnected if request is not None else None,
                              state.metrics_for(request))
    try:
        await stream.first()
    except BaseException:
        stream.close()
        raise
    return stream


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
