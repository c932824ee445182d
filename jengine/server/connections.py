"""Bounds on the HTTP connections themselves: how long one may hold the server without sending a
whole request header, and how many may be open at once.

uvicorn arms its keep-alive timer only after a response, and any byte that arrives disarms it:
a connection that never sends anything, or sends a header a byte at a time, is held for ever
(issue 44: 0 of 500 idle connections closed after 40 s). `BoundedH11Protocol` is uvicorn's h11
protocol with two of uvicorn's own settings made to bound that:

- `timeout_keep_alive` (seconds): from the moment a connection opens, or its last response
  ends, a whole request header must arrive within it, or the connection is closed. Bytes that
  arrive do not move the deadline; a request being handled (a long stream) has none.
- `limit_concurrency` (open connections): a connection opened while that many are open
  already is answered, request by request, with a 503 in OpenAI's error shape
  (`connection_limit`, `Retry-After`, `Connection: close`; the edge middleware writes it after
  reading the body, so the client is not reset mid-send), then closed. uvicorn's own check of
  the same setting (a plain-text 503, counting the asking connection and the running tasks)
  is switched off in its favour.

h11 rather than httptools: the pure-Python parser is uvicorn's always-present one, and parsing
headers is not what an LLM server spends its time on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jengine.config import ServerConfig

log = logging.getLogger("jengine.server")

# Set in a request's ASGI `scope["state"]` when its connection is over `limit_concurrency`.
OVER_CONNECTION_LIMIT = "jengine_over_connection_limit"


class BoundedH11Protocol(H11Protocol):
    """One HTTP/1.1 connection, with a header deadline and the open-connection bound."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.max_connections = config.limit_concurrency
        self.limit_concurrency = None  # uvicorn's own check: replaced by connection_made's
        self.header_timeout = config.timeout_keep_alive
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            log.warning("%d connections open (limit %d): answering 503", len(self.connections),
                        self.max_connections)
            self.app_state = {**self.app_state, OVER_CONNECTION_LIMIT: self.max_connections}
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a whole request header arrived: it is being handled
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # before uvicorn reads a pipelined request (handle_events disarms)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        """No whole request header within the timeout: idle, or sending one too slowly."""
        self._deadline = None
        if self.transport.is_closing():
            return
        with contextlib.suppress(h11.LocalProtocolError):  # (mid-response: never while armed)
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def uvicorn_config(app: Any, config: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's settings for `app` under `config`: the bounded protocol and its two bounds
    (`limit_concurrency` None: unbounded); `kwargs` are uvicorn's other settings."""
    return uvicorn.Config(app, http=BoundedH11Protocol,
                          timeout_keep_alive=config.timeout_keep_alive,
                          limit_concurrency=config.limit_concurrency, **kwargs)


def raise_open_file_limit(connections: int | None, headroom: int = 1024) -> None:
    """Raises the soft limit on open files to fit `connections` sockets and `headroom` more
    (the model's files, JAX's), up to the hard limit, as vLLM does: at the common default of
    1024, accepting fails before the connection bound is reached. Warns when it cannot."""
    if connections is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + headroom
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("open files limited to %d (hard limit): fewer than the %d connections "
                        "--limit-concurrency allows and %d more", new, connections, headroom)
