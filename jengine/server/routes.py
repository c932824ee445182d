"""The route table: every HTTP route the server answers, and the facts about it stated once.

`create_app` registers the routes from `ROUTES` in its order; the OpenAPI document
(openapi.py) derives each route's error responses and its event-stream body from the same rows;
the edge middleware asks `needs_key` whether a path needs the API key, and the middleware and
the app's error handlers ask `error_shape` what body its errors have. The generating routes'
handlers live in their protocol's module (completions.py, chat.py, responses.py, messages.py:
views over the generation pipeline, pipeline.py; the pooling routes of an embedding server
in embeddings.py); OpenAI's Files and Batch API is files.py and batches.py (a batch's lines
run through the generating handlers, batch_runner.py); the other routes that do not generate
are the small handlers below.
gRPC (grpc_service.py) serves the same engine on its own port.

A new route is a row here (and its handler); docs/design.md, "Add a route", lists the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import compile_path

import jengine
from jengine.server import web_ui
from jengine.server.batches import cancel_batch, create_batch, list_batches, retrieve_batch
from jengine.server.chat import create_chat_completion
from jengine.server.completions import create_completion
from jengine.server.embeddings import create_embedding, create_rerank, create_score
from jengine.server.errors import bad_request
from jengine.server.files import delete_file, file_content, list_files, retrieve_file, upload_file
from jengine.server.loras import load_lora_adapter, unload_lora_adapter
from jengine.server.messages import count_message_tokens, create_message
from jengine.server.pipeline import accept
from jengine.server.protocol import DetokenizeRequest, TokenizeRequest
from jengine.server.responses import create_response
from jengine.server.state import ServerState
from jengine.text.chat import render_chat
from jengine.vision.chat import has_images

# The body of a route's errors (`APIError.body`, errors.py; the document's schema, openapi.py).
ErrorShape = Literal["openai", "anthropic"]
API_PREFIX = "/v1"  # a path under it that no route matches still needs the key (a 401, not 404)


@dataclass(frozen=True)
class Route:
    path: str  # Starlette's syntax: `{model:path}` takes the rest, slashes included
    method: str
    handler: Callable[..., Any]
    auth: bool  # needs the key (`Authorization: Bearer` or `x-api-key`) when the server has one
    streams: bool = False  # generates: may answer server-sent events, bounded by the timeout
    errors: ErrorShape = "openai"  # the body its errors have (the document's error schema)
    documented: bool = True  # in /openapi.json (not the HEAD probe, not the chat page)


# -- the routes that do not generate ------------------------------------------------------------

def _state(request: Request) -> ServerState:
    return request.app.state.server


async def health(request: Request) -> Response:
    status, body = _state(request).health()
    return JSONResponse(body, status_code=status)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


async def version() -> dict:
    return {"version": jengine.__version__}


def _card(state: ServerState, name: str) -> dict:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "jengine",
            "root": state.model_name}
    lora = state.loras.get(name)
    if lora is not None:  # vLLM's adapter card: its directory as root, the base as parent
        card.update(root=lora.lora_path, parent=state.model_name)
    if state.engine is not None:
        card["max_model_len"] = state.engine.core.model.max_model_len
    return card


async def models(request: Request) -> dict:
    state = _state(request)
    names = [*state.model_names, *(lora.lora_name for lora in state.loras.all())]
    return {"object": "list", "data": [_card(state, name) for name in names]}


async def model(model: str, request: Request) -> dict:
    state = _state(request)
    state.check_model(model)
    return _card(state, model)


async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = accept(request, body)
    engine = state.ready_engine()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("pass exactly one of prompt and messages")
    if body.messages is not None:
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        if has_images(messages):  # the count would leave out each image's placeholders
            raise bad_request("/tokenize does not take image content parts", "messages")
        tokens = await asyncio.to_thread(render_chat, engine.tokenizer, messages,
                                         chat_template=state.chat_template)
    else:
        tokens = await asyncio.to_thread(
            lambda: list(engine.tokenizer(
                body.prompt, add_special_tokens=body.add_special_tokens).input_ids))
    return {"count": len(tokens), "max_model_len": engine.core.model.max_model_len,
            "tokens": tokens}


async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = accept(request, body)
    engine = state.ready_engine()
    vocab = engine.core.model.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens)}


# -- the table ----------------------------------------------------------------------------------

ROUTES: tuple[Route, ...] = (
    Route("/v1/completions", "POST", create_completion, auth=True, streams=True),
    Route("/v1/chat/completions", "POST", create_chat_completion, auth=True, streams=True),
    Route("/v1/responses", "POST", create_response, auth=True, streams=True),
    Route("/v1/messages", "POST", create_message, auth=True, streams=True, errors="anthropic"),
    Route("/v1/messages/count_tokens", "POST", count_message_tokens, auth=True,
          errors="anthropic"),
    Route("/v1/embeddings", "POST", create_embedding, auth=True),
    Route("/v1/rerank", "POST", create_rerank, auth=True),
    Route("/v1/score", "POST", create_score, auth=True),
    Route("/health", "HEAD", health, auth=False, documented=False),  # load balancers' probe
    Route("/health", "GET", health, auth=False),
    Route("/metrics", "GET", metrics, auth=False),
    Route("/version", "GET", version, auth=False),
    Route("/v1/models", "GET", models, auth=True),
    Route("/v1/models/{model:path}", "GET", model, auth=True),
    Route("/v1/files", "POST", upload_file, auth=True),
    Route("/v1/files", "GET", list_files, auth=True),
    Route("/v1/files/{file_id}", "GET", retrieve_file, auth=True),
    Route("/v1/files/{file_id}", "DELETE", delete_file, auth=True),
    Route("/v1/files/{file_id}/content", "GET", file_content, auth=True),
    Route("/v1/batches", "POST", create_batch, auth=True),
    Route("/v1/batches", "GET", list_batches, auth=True),
    Route("/v1/batches/{batch_id}", "GET", retrieve_batch, auth=True),
    Route("/v1/batches/{batch_id}/cancel", "POST", cancel_batch, auth=True),
    Route("/v1/load_lora_adapter", "POST", load_lora_adapter, auth=True),
    Route("/v1/unload_lora_adapter", "POST", unload_lora_adapter, auth=True),
    Route("/tokenize", "POST", tokenize, auth=False),
    Route("/detokenize", "POST", detokenize, auth=False),
    Route("/", "GET", web_ui.page, auth=False, documented=False),  # the chat page (web_ui.py)
    Route("/static/{name}", "GET", web_ui.asset, auth=False, documented=False),
)

_PATTERNS = [(compile_path(r.path)[0], r) for r in ROUTES]


def _route(path: str) -> Route | None:
    for pattern, route in _PATTERNS:
        if pattern.match(path):
            return route
    return None


def needs_key(path: str) -> bool:
    """Whether a request for `path` must carry the API key (when the server has one)."""
    route = _route(path)
    if route is not None:
        return route.auth
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")


def error_shape(path: str) -> ErrorShape:
    """The body of the errors answered for `path` (OpenAI's where no route matches)."""
    route = _route(path)
    return route.errors if route is not None else "openai"


def document_path(route: Route) -> str:
    """The route's path as the OpenAPI document writes it (`{model}`, no converter)."""
    return compile_path(route.path)[1]
