"""The HTTP edge, as one plain ASGI middleware: request ids, API-key auth, access log.

- `X-Request-Id`: taken from the request (`clean_request_id`: at most 128 characters, no spaces)
  or made up, put in `request.state.request_id`, echoed on the response, and written in every
  log line about it.
- `--api-key`: a route the route table (routes.py) marks `auth` (every `/v1` route, and any
  other `/v1` path) needs the key, as `Authorization: Bearer <key>` (OpenAI's SDK) or
  `x-api-key: <key>` (Anthropic's), on every such route alike: one rule, and a client of either
  SDK reaches every route; `/health`, `/metrics`, `/version` (and the other routes outside `/v1`)
  stay open. Checked before the body is read, so a request without the key gets 401 whatever
  its body.
- Errors answered here (401, 413, 503) have the body of the path's route (`error_shape`).
- Body size: a POST body over `max_body_bytes` is a 413 before anything parses it. Clients
  that send the whole body before reading any answer (Python's `urllib`) would see the
  connection reset instead, as the server closed it with their bytes unread: so the rest of the
  body is read and dropped before the 413, up to `DRAIN_MAX_BYTES` and `DRAIN_TIMEOUT_S` (a
  chunk at a time, never held). A body declared larger than that, or a client that sent
  `Expect: 100-continue` (it waits for the answer before sending), gets the 413 at once.
- `--limit-concurrency`: a request on a connection opened past the bound (marked so by
  `jengine.server.connections`) is a 503 once its body is read.
- `X-Jengine-Warmup`: a request that carries this process's secret `warmup_token` is one of the
  server's own start-up requests (`jengine.server.warmup`); `request.state.warmup` says so.

A plain ASGI middleware (not Starlette's `BaseHTTPMiddleware`) hands the app a `receive` that
replays the body and then is the client's own, so a streaming response still sees the client
disconnect.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jengine.server.connections import OVER_CONNECTION_LIMIT
from jengine.server.errors import APIError

log = logging.getLogger("jengine.server")

MAX_REQUEST_ID = 128
# How much of an oversized body is read (and dropped) so that the client gets to read the 413.
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_TIMEOUT_S = 10.0
QUIET_PATHS = ("/health", "/metrics")  # polled: logged at DEBUG only
WARMUP_HEADER = "x-jengine-warmup"


_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:~/+=@-]{{1,{MAX_REQUEST_ID}}}")


def clean_request_id(value: str | None) -> str | None:
    """A client's request id if it is one we can put in ids, headers and logs as it is: up to
    128 of letters, digits and `._:~/+=@-` (no spaces, quotes or control characters)."""
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return None


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, needs_key: Callable[[str], bool],
                 error_shape: Callable[[str], str] = lambda path: "openai",
                 max_body_bytes: int = 4 * 2**20,
                 log_requests: bool = True, warmup_token: str | None = None,
                 on_connection_limit: Callable[[], None] | None = None):
        self.app = app
        self.on_connection_limit = on_connection_limit  # counts the 503s of the bound
        self.api_key = api_key.encode() if api_key else None
        self.needs_key = needs_key  # path -> whether it needs the key (routes.needs_key)
        self.error_shape = error_shape  # path -> its errors' body (routes.error_shape)
        self.warmup_token = warmup_token.encode() if warmup_token else None
        self.max_body_bytes = max_body_bytes
        self.log_level = logging.INFO if log_requests else logging.DEBUG

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = clean_request_id(headers.get("x-request-id")) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        scope["state"]["warmup"] = self._is_warmup(headers.get(WARMUP_HEADER))
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        start = time.perf_counter()
        try:
            denied = self._check_key(scope["path"], headers)
            if denied is None and scope["method"] in ("POST", "PUT", "PATCH"):
                denied, receive = await self._read_body(headers, receive)
            if denied is None:
                denied = self._over_connection_limit(scope["state"])
            if denied is not None:
                shape = self.error_shape(scope["path"])
                await denied.response(shape)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else self.log_level
            log.log(level, "%s %s %s %d %.3fs", request_id, scope["method"], scope["path"],
                    status, time.perf_counter() - start)

    async def _read_body(self, headers: dict[str, str],
                         receive: Receive) -> tuple[APIError | None, Receive]:
        """Reads the body, at most `max_body_bytes` of it, before the app parses any: a larger
        one (by its Content-Length, or counted as it arrives) is a 413. Returns the error or a
        `receive` that replays the body and then goes on to the client's (disconnects)."""
        too_large = APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                             code="request_too_large")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            if length.isdigit() and int(length) <= DRAIN_MAX_BYTES and \
                    headers.get("expect", "").lower() != "100-continue":
                await _drain(receive, 0)
            return too_large, receive
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await _drain(receive, size)
                return too_large, receive
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        return None, replay

    def _over_connection_limit(self, state: dict) -> APIError | None:
        """The 503 for a request on a connection opened past `--limit-concurrency`
        (`jengine.server.connections`); the connection closes after it."""
        limit = state.get(OVER_CONNECTION_LIMIT)
        if limit is None:
            return None
        if self.on_connection_limit is not None:
            self.on_connection_limit()
        return APIError(503, f"too many open connections (the limit is {limit}); retry later",
                        type="server_error", code="connection_limit",
                        headers={"Retry-After": "1", "Connection": "close"})

    def _is_warmup(self, token: str | None) -> bool:
        return bool(self.warmup_token and token) and hmac.compare_digest(
            token.encode("latin-1"), self.warmup_token)

    def _check_key(self, path: str, headers: dict[str, str]) -> APIError | None:
        if self.api_key is None or not self.needs_key(path):
            return None
        authorization, api_key = headers.get("authorization"), headers.get("x-api-key")
        if not authorization and api_key is None:
            return _auth_error("You didn't provide an API key. Pass it in the Authorization "
                               "header as 'Bearer <key>', or in the x-api-key header.")
        tokens = [api_key or ""]
        if authorization:
            scheme, _, token = authorization.partition(" ")
            tokens.append(token if scheme.lower() == "bearer" else "")
        # every token compared (no early exit): the time taken says nothing about which matched
        matched = [hmac.compare_digest(t.strip().encode("latin-1"), self.api_key) for t in tokens]
        if not any(matched):
            return _auth_error("Incorrect API key provided.")
        return None


async def _drain(receive: Receive, size: int) -> None:
    """Reads and drops the rest of a refused body (`size` bytes of it read so far), up to
    `DRAIN_MAX_BYTES` in all and `DRAIN_TIMEOUT_S`: a client that sends more, or too slowly,
    has its connection closed under it, as before."""
    async def read() -> None:
        nonlocal size
        while size <= DRAIN_MAX_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    try:
        await asyncio.wait_for(read(), DRAIN_TIMEOUT_S)
    except asyncio.TimeoutError:  # (TimeoutError from 3.11 on; Python 3.10 is supported)
        return


def _auth_error(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
