"""The app's `/openapi.json`, made to say what the server really answers.

FastAPI documents a 422 for every route with a body, which this server never sends (validation
errors are 400s in OpenAI's shape, errors.py), and nothing of the 400/401/404/413/500/503/504 it
does send. `install_openapi` rewrites the generated document once: the error responses each
route can give, with OpenAI's error body, server-sent events as the generation routes' other
200 body, and `/metrics` as Prometheus text. The request schemas carry the bounds the server
checks (non-empty `messages` and choices, token ids in the vocabulary, value ranges): a body the
document accepts is one the server does not refuse for those reasons.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

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
_REASONS = {
    400: "Invalid request (bad JSON, types, values or unsupported features)",
    401: "Missing or wrong API key (only with --api-key)",
    404: "Unknown model",
    413: "Request body over the size limit",
    500: "The engine failed",
    503: "Loading, draining, or the waiting queue is full (Retry-After)",
    504: "The request timeout passed",
}
_GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _error_codes(path: str, method: str) -> list[int]:
    if not path.startswith("/v1") and method == "get":
        return []
    codes = [400] if method == "post" else []
    if path.startswith("/v1"):
        codes.append(401)
    if path.startswith("/v1/models/") or method == "post":
        codes.append(404)
    if method == "post":
        codes += [413, 500, 503]
    if path in _GENERATION:
        codes.append(504)
    return sorted(set(codes))


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
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code in _error_codes(path, method):
                responses[str(code)] = {"description": _REASONS[code], "content": ref}
            if path in _GENERATION and "200" in responses:  # `stream: true` answers SSE
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
