"""The session's `jengine serve` (tests/server/test_server.py says which) on bad input: 400s in
OpenAI's error shape for malformed bodies, 404 for unknown models and routes, 401 without the
key, and request ids echoed and logged."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai_shapes import assert_error  # tests/openai_shapes.py
from serve_process import KEY, MODEL  # tests/serve_process.py

BAD_REQUESTS = [
    ("/v1/completions", b"this is not json", None),
    ("/v1/completions", b'["a list"]', None),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "unknown_arg": 1}, "unknown_arg"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 600}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 600}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [  # a
        {"type": "text", "text": "t"}, {"type": "image_url", "image_url": {  # text-only model
            "url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, "messages.0.content.1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_p": 0}, "top_p"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_requests_are_400_in_openai_shape(server, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    err = assert_error(server.post(path, **kw), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_sdk_raises_bad_request_for_invalid_value(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x", top_p=1.5)
    assert "top_p" in str(info.value)


def test_unknown_model_is_404(server):
    for path, body in [("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
                       ("/v1/chat/completions",
                        {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})]:
        err = assert_error(server.post(path, json=body), 404, "model_not_found")
        assert err["param"] == "model"
    assert_error(server.post("/v1/no-such-route", json={}), 404)


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {KEY}", "Bearer"])
def test_v1_routes_need_the_key(server, auth):
    headers = {"Authorization": auth} if auth else {}
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/completions", b"not json"),
                               ("POST", "/v1/chat/completions", b'{"messages": []}')]:
        r = httpx.request(method, server.url + path, headers=headers, content=body)
        assert_error(r, 401, "invalid_api_key")
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path, headers=headers).status_code == 200


def test_sdk_with_wrong_key_gets_authentication_error(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_request_id_is_echoed_and_logged(server):
    r = server.post("/v1/completions", headers={"X-Request-Id": "trace-abc-123"},
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-abc-123"
    assert r.json()["id"] == "cmpl-trace-abc-123"
    generated = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                     "max_tokens": 2})
    assert len(generated.headers["x-request-id"]) >= 16
    deadline = time.monotonic() + 10
    while "trace-abc-123" not in server.log.read_text():
        assert time.monotonic() < deadline, "request id missing from the server log"
        time.sleep(0.1)
    lines = [ln for ln in server.log.read_text().splitlines() if "trace-abc-123" in ln]
    assert any("POST /v1/completions 200" in ln for ln in lines)
    assert any("prompt_tokens=" in ln for ln in lines)
