"""The app's `/openapi.json`, made to say what the server really answers.

FastAPI documents a 422 for every route with a body, which this server never sends (validation
errors are 400s in the route's error shape, errors.py), and nothing of the
400/401/404/413/500/503/504 it does send. `install_openapi` rewrites the generated document
once: the error responses each route can give, with its error shape's body, and server-sent
events as a streaming route's other 200 body (all read from the route's row in the table,
routes.py), and `/metrics` as Prometheus text. The request schemas carry the bounds the server
checks (non-empty `messages` and choices, token ids in the vocabulary, value ranges): a body the
document accepts is one the server does not refuse for those reasons.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from jengine.server.routes import ROUTES, Route, document_path

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}
_REASONS = {
    400: "Invalid request (bad JSON, types, values or unsupported features)",
    401: "Missing or wrong API key (only with --api-key)",
    404: "Unknown model, file or batch",
    409: "The batch cannot be cancelled in its status",
    413: "Request body over the size limit",
    500: "The engine failed",
    503: "Loading, draining, or the waiting queue is full (Retry-After)",
    504: "The request timeout passed",
}
# a route's error shape -> its component
_ERROR_SCHEMAS = {"openai": "ErrorResponse", "anthropic": "AnthropicErrorResponse"}


def _query_parameters(route: Route) -> list[str]:
    """The handler's parameters that are neither the request, a body nor in the path."""
    return [name for name, p in inspect.signature(route.handler).parameters.items()
            if name not in ("request", "body") and name not in re.findall(r"{(\w+)", route.path)]


def _error_codes(route: Route) -> list[int]:
    """The errors a route can answer with, from its row in the route table."""
    codes = {400, 404, 413, 500, 503} if route.method == "POST" else set()
    if _query_parameters(route):  # a GET's query values are checked: a bad one is a 400
        codes.add(400)
    if route.path.startswith(("/v1/files", "/v1/batches")):  # another server holds the store
        codes.add(503)
    if route.auth:
        codes.add(401)
    if "{model" in route.path or "_id}" in route.path:  # names a model, file or batch
        codes.add(404)
    if route.path.endswith("/cancel"):
        codes.add(409)
    if route.streams:  # generating: --request-timeout applies
        codes.add(504)
    return sorted(codes)


def _bound_token_ids(node: Any, vocab_size: int | None) -> None:
    """Replaces protocol.py's token-id marker with the vocabulary's bound (none while the
    engine loads), everywhere in the document."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and vocab_size is not None:
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def _vocab_size(app: FastAPI) -> int | None:
    engine = getattr(app.state, "server", None) and app.state.server.engine
    return engine.core.model.vocab_size if engine is not None else None


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _bound_token_ids(schema, _vocab_size(app))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = _ERROR_SCHEMA
    components["AnthropicErrorResponse"] = _ANTHROPIC_ERROR_SCHEMA
    paths = schema.get("paths", {})
    for route in ROUTES:
        op = paths.get(document_path(route), {}).get(route.method.lower())
        if op is None:  # not documented (HEAD /health)
            continue
        responses = op.setdefault("responses", {})
        responses.pop("422", None)
        ref = {"$ref": f"#/components/schemas/{_ERROR_SCHEMAS[route.errors]}"}
        for code in _error_codes(route):
            responses[str(code)] = {"description": _REASONS[code],
                                    "content": {"application/json": {"schema": ref}}}
        if route.streams and "200" in responses:  # `stream: true` answers SSE
            responses["200"].setdefault("content", {})["text/event-stream"] = {
                "schema": {"type": "string"}}
    metrics = schema.get("paths", {}).get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"]["200"] = {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serves `build_openapi`'s document (built on first request, then kept once the engine
    is loaded: the token-id bounds need its vocabulary)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build_openapi(app)
        if _vocab_size(app) is not None:
            app.openapi_schema = schema
        return schema

    app.openapi = openapi
