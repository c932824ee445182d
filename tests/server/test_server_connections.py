"""The server's bounds on connections (jengine/server/connections.py), with raw sockets against a
real uvicorn on 127.0.0.1: a connection that sends nothing, or sends its header too slowly, is
closed after `timeout_keep_alive`; connections past `limit_concurrency` get a 503 in OpenAI's
error shape and are closed; `HEAD /health` answers as GET does, without a body.

The app is the real server over the real engine thread and `EngineCore` on the fake runner
(tests/fake_runner.py): nothing here depends on what a model computes.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fake_runner import fake_async_engine
from local_server import serving

from jengine.config import ServerConfig
from jengine.server.app import create_app

TIMEOUT_S = 1.0
LIMIT = 4
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(scope="module")
def url():
    engine = fake_async_engine()
    config = ServerConfig(timeout_keep_alive=TIMEOUT_S, limit_concurrency=LIMIT)
    with serving(create_app(engine, config)) as base:
        yield base
    engine.shutdown()


def connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (reading what it sends)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read off `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(4096)
    return int(status_line.split()[1]), headers, body


def test_an_idle_connection_is_closed(url):
    with connect(url) as never_sends, connect(url) as sent_one:
        sent_one.sendall(GET_HEALTH)
        status, _, _ = response(sent_one)
        assert status == 200
        # the deadline is a second; ten would mean it is not there
        assert closed_by_server(never_sends, 10 * TIMEOUT_S)
        assert closed_by_server(sent_one, 10 * TIMEOUT_S)  # kept alive, then idle


def test_a_header_sent_a_byte_at_a_time_is_closed(url):
    """Slowloris: every byte arrives well within the timeout, the header never ends."""
    with connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        deadline = time.monotonic() + 10 * TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                break
            if closed_by_server(sock, TIMEOUT_S / 4):
                break
        else:
            pytest.fail("a header that never ends kept its connection open")


def test_connections_past_the_limit_get_503_and_are_closed(url):
    holders = [connect(url) for _ in range(LIMIT)]
    try:
        with connect(url) as extra:
            extra.sendall(GET_HEALTH)
            status, headers, body = response(extra)
            assert status == 503, body
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            error = json.loads(body)["error"]
            assert error["code"] == "connection_limit" and error["type"] == "server_error"
            assert str(LIMIT) in error["message"]
            assert closed_by_server(extra, 10 * TIMEOUT_S)
        # the held connections are served (they are within the limit)
        holders[0].sendall(GET_HEALTH)
        assert response(holders[0])[0] == 200
    finally:
        for sock in holders:
            sock.close()
    # once they are gone, a new connection is served again
    deadline = time.monotonic() + 10
    while (r := httpx.get(url + "/health", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'jengine_requests_rejected_total{reason="connection_limit"}' in text


def test_head_health_answers_like_get_without_a_body(url):
    get = httpx.get(url + "/health", timeout=10)
    head = httpx.head(url + "/health", timeout=10)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
