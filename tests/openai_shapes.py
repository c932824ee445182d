"""What OpenAI's HTTP API promises of every response, checked: server-sent events' framing and
the error body's shape (tests of the server modules share them)."""

from __future__ import annotations

import json

import httpx


def sse_payloads(body: str) -> list:
    """The data of each server-sent event, checking OpenAI's framing on the way."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    out = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out.count("[DONE]") == 1
    return out


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err
