"""Errors in the route's protocol shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`
by default, Anthropic's `{"type": "error", "error": {"type", "message"}}` on the routes the route
table marks `anthropic` (routes.py; the Anthropic type follows from the status, `ANTHROPIC_TYPES`).

Every failure the server reports goes through `APIError` or one of the handlers installed by
`install_error_handlers`, so that clients written for either API parse them unchanged:

    invalid JSON, wrong types, unknown fields, ValueError  -> 400 invalid_request_error
    missing / wrong API key                                 -> 401 invalid_request_error
    body over the size limit                                -> 413 invalid_request_error
    unknown model, unknown route                            -> 404 invalid_request_error
    waiting queue full, engine loading, server draining     -> 503 server_error + Retry-After
    the engine failed                                       -> 500 server_error

FastAPI's own 422 is never sent: request validation errors are rewritten as 400.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jengine.sampling_params import SamplingParams

log = logging.getLogger("jengine.server")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# Anthropic's error types by HTTP status (others: invalid_request_error below 500, else
# api_error). A full queue or a loading engine is Anthropic's overloaded_error; the status stays
# jengine's 503 with Retry-After (Anthropic's own is 529), which the SDK retries the same way.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   504: "timeout_error"}


class APIError(Exception):
    """An error the server answers with; `status` is the HTTP status code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, shape: str = "openai") -> dict[str, Any]:
        """The error's JSON body in `shape` (a route's error shape, routes.py)."""
        if shape == "anthropic":
            return {"type": "error", "error": {"type": self.anthropic_type,
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @property
    def anthropic_type(self) -> str:
        default = INVALID_REQUEST if self.status < 500 else "api_error"
        return ANTHROPIC_TYPES.get(self.status, default)

    def response(self, shape: str = "openai") -> JSONResponse:
        return JSONResponse(self.body(shape), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as a server-sent event, for failures after a stream has begun."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ValueErrors from SamplingParams and the engine start with the name of the offending field.
_PARAMS = {f.name for f in dataclasses.fields(SamplingParams)} | {
    "prompt", "messages", "tools", "chat_template", "chat_template_kwargs"}
_LEADING_NAME = re.compile(r"([a-z_]+)\b")


def invalid_value(error: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine, as a 400 naming the parameter."""
    message = str(error)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in _PARAMS else None
    return APIError(400, message, param=param)


def rename_param(error: APIError, name: str) -> APIError:
    """`error` naming the field as the client spelled it (`max_completion_tokens` for the
    engine's `max_tokens`): its param, and its message when it starts with the old name (as
    `SamplingParams`' messages do)."""
    if error.param is not None:
        if error.message.startswith(error.param):
            error.message = name + error.message.removeprefix(error.param)
        error.param = name
    return error


@contextlib.contextmanager
def renamed_params(rename: Callable[[str], str]) -> Iterator[None]:
    """Errors raised inside, with `param` (and a message that starts with it) renamed by
    `rename`: for a route that runs another route's checks under its own field names."""
    try:
        yield
    except (APIError, ValueError) as e:
        error = e if isinstance(e, APIError) else invalid_value(e)
        if error.param is not None:
            rename_param(error, rename(error.param))
        raise error from None


def engine_failed(error: BaseException | str) -> APIError:
    return APIError(500, f"the engine failed: {error}", type=SERVER_ERROR, code="engine_error")


def unavailable(message: str, code: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code=code,
                    headers={"Retry-After": str(retry_after)})


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first pydantic error as (message, param), worded as OpenAI words them."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = list(err.get("loc", ()))
    if loc[:1] == ["query"]:  # a query parameter (a body field may be named `query`: rerank)
        loc = loc[1:]
    loc = [str(p) for p in loc if p != "body"]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        return ("We could not parse the JSON body of your request. The body must be valid JSON.",
                None)
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing" and not loc:
        return "The request body is empty; it must be a JSON object.", None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return "The request body must be a JSON object.", None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"Invalid value for '{param}': {msg}." if param else msg), param


ShapeOf = Callable[[str], str]  # a request path -> its route's error shape (routes.error_shape)


def install_error_handlers(app: FastAPI, shape_of: ShapeOf = lambda path: "openai") -> None:
    """Every error the app answers, in the shape `shape_of` gives the request's path."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        return error.response(shape_of(request.scope["path"]))

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if message == "The request body must be a JSON object." and kind != "application/json":
            message = (f"The request body must be JSON sent as Content-Type: application/json "
                       f"(got {kind or 'no content type'!r}).")
        return answer(request, bad_request(message, param))

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return answer(request, invalid_value(exc))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            message = ("We could not parse the JSON body of your request. The body must be "
                       "valid JSON in UTF-8.")
        headers = getattr(exc, "headers", None)
        return answer(request, APIError(exc.status_code, message, type=kind, headers=headers))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return answer(request, APIError(500, f"internal server error: {exc}",
                                        type=SERVER_ERROR))

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ValueError, on_value_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
