"""An app served by uvicorn in a thread on 127.0.0.1, for in-process server tests, with the
connection bounds `jengine serve` gives it (its `ServerConfig`'s `limit_concurrency` and
`timeout_keep_alive`, jengine/server/connections.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from jengine.server.connections import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, port: int | None = None) -> Iterator[str]:
    """Serves `app` on `port` (default: a free one) of the loopback interface until the block
    ends; yields its base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn_config(app, app.state.server.config, host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
