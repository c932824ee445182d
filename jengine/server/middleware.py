"""The HTTP edge, as one plain ASGI middleware: request ids, API-key auth, access log.

- `X-Request-Id`: taken from the request (printable, at most 128 characters) or made up, put in
  `request.state.request_id`, echoed on the response, and written in every log line about it.
- `--api-key`: every `/v1` route needs `Authorization: Bearer <key>`; `/health`, `/metrics`,
  `/version` (and the other routes outside `/v1`) stay open. Checked before the body is read,
  so a request without the key gets 401 whatever its body.

A plain ASGI middleware (not Starlette's `BaseHTTPMiddleware`) leaves `receive` untouched, so a
streaming response still sees the client disconnect.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jengine.server.errors import APIError

log = logging.getLogger("jengine.server")

MAX_REQUEST_ID = 128
QUIET_PATHS = ("/health", "/metrics")  # polled: logged at DEBUG only


def _client_request_id(value: str | None) -> str | None:
    if value and len(value) <= MAX_REQUEST_ID and value.isprintable():
        return value
    return None


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = _client_request_id(headers.get("x-request-id")) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
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
            denied = self._check_key(scope["path"], headers.get("authorization"))
            if denied is not None:
                await denied.response()(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            log.log(level, "%s %s %s %d %.3fs", request_id, scope["method"], scope["path"],
                    status, time.perf_counter() - start)

    def _check_key(self, path: str, authorization: str | None) -> APIError | None:
        if self.api_key is None or not (path == "/v1" or path.startswith("/v1/")):
            return None
        if not authorization:
            return _auth_error("You didn't provide an API key. Pass it in the Authorization "
                               "header as 'Bearer <key>'.")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("latin-1"), self.api_key):
            return _auth_error("Incorrect API key provided.")
        return None


def _auth_error(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
