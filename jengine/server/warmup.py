"""The server's start-up requests: before `/health` turns 200, `jengine serve` sends itself a
streamed chat completion and a whole completion, a few tokens each, so that the first pass of
Python through the request path is paid at start-up and not by the first client. Measured on a
fresh server before this existed: first content after 223 ms for the first streamed chat request
and 91-102 ms for the next ones; its step launched 45 ms after it arrived (6 ms later on) and its
first chunk left 43 ms after the token was sampled (10 ms later on). docs/engine.md, session 16.

Why a real connection to the listening socket rather than an in-process ASGI transport: the
first-request cost is spread over uvicorn's HTTP parser and socket writes, the event loop's
default thread pool (made on the first `asyncio.to_thread`: chat templates and tokenizing run
there), the edge middleware, pydantic, the chat template, the engine's admission, the
detokenizer and the SSE framing. Only a request that comes in through the socket and is served
on uvicorn's own event loop pays all of it; an ASGI transport would run the app on another loop
and skip uvicorn. The requests use the standard library's `http.client` from the loading thread
(no client dependency; the server's event loop is not blocked).

How they stay out of sight: each carries the process's secret token in `X-Jengine-Warmup`
(`EdgeMiddleware` turns it into `request.state.warmup`). Admission lets only such requests in
while the server is loading (others still get 503), and their latencies and token counts go to
a scratch set of metrics that is never served. Their KV pages are freed when they finish, and
afterwards the prefix cache is emptied and its counters zeroed: the chat prompt's first page
(the template's system prompt) would otherwise be cached, and the first client's request would
find it, which no fresh server without a warm-up gives. So `/metrics` at ready counts no
requests, tokens, queued or running requests, used pages or cached pages. What does count them:
the engine's step count (`EngineStats.num_steps`, not served), and the access log, which shows
them as `warmup-chat` and `warmup-completion`.

A start-up request that fails (no answer, a status other than 200, an error event, no `[DONE]`,
not the tokens asked for) fails the start: the server exits with the error, as when the model
fails to load. Not warmed: `/v1/responses` and the gRPC service (their own first passes). An
embedding server (`--task embed` / `score`) sends one `/v1/embeddings` request of two inputs
instead (`warmup-embedding`); it caches nothing.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import ssl
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jengine.server.middleware import WARMUP_HEADER

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine

log = logging.getLogger("jengine.server")

MAX_TOKENS = 4  # a prefill and a few decode steps: every stage of the path runs
MIN_CONTEXT = 64  # room for the prompts below, templated, and their tokens
TIMEOUT_S = 120.0  # every program is built by now: seconds at most, even on a busy CPU
CHAT_PROMPT = "Write a short, friendly greeting."
COMPLETION_PROMPT = "The three primary colours are"


class WarmupError(ValueError):
    """A start-up request failed; the server does not start. (A ValueError, as `ModelLoadError`
    is: `jengine serve` prints it on one line and exits with status 2.)"""


def loopback_url(sock: socket.socket, tls: bool) -> str:
    """The URL at which this process reaches its own listening socket (a wildcard address is
    reached through the loopback interface)."""
    host, port = sock.getsockname()[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def warm_up(engine: AsyncEngine, url: str, *, token: str, model: str, api_key: str | None,
            chat_template: str | None, max_tokens: int = MAX_TOKENS) -> None:
    """Sends the start-up requests to the server at `url` and empties the prefix cache after
    them. Raises `WarmupError` when one fails.

    Args:
      engine: the engine the server is about to serve (admission hands it to these requests).
      url: the server's own address (`loopback_url`).
      token: the secret that marks these requests (`ServerState.warmup_token`).
      model: the model name clients send.
      api_key: the server's `--api-key`, sent as clients send it.
      chat_template: the server's `--chat-template`; without it and without a template of the
        model's, no chat request is sent (the server would answer 400).
      max_tokens: tokens each request generates (at most the server's per-request limit).
    """
    if engine.core.model.max_model_len < MIN_CONTEXT:
        log.info("no start-up requests: the context (%d tokens) is too short for them",
                 engine.core.model.max_model_len)
        return
    start = time.perf_counter()
    send = _Sender(url, token, api_key)
    if engine.core.model.task != "generate":  # an embedding server generates nothing
        body = send("warmup-embedding", "/v1/embeddings", {
            "model": model, "input": [COMPLETION_PROMPT, CHAT_PROMPT]})
        if len(json.loads(body).get("data", ())) != 2:
            raise WarmupError(f"the start-up embedding request failed: {body[:500]}")
        log.info("start-up request served in %.2f s", time.perf_counter() - start)
        return
    if chat_template or getattr(engine.tokenizer, "chat_template", None):
        body = send("warmup-chat", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": CHAT_PROMPT}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True, "min_tokens": max_tokens})  # as `jengine bench serve` asks
        _check_chat_stream(body, max_tokens)
    body = send("warmup-completion", "/v1/completions", {
        "model": model, "prompt": COMPLETION_PROMPT, "max_tokens": max_tokens})  # sampled
    _check_completion(body)
    freed = asyncio.run(engine.reset_prefix_cache())
    log.info("start-up requests served in %.2f s (%d cached pages dropped after them)",
             time.perf_counter() - start, freed)


class _Sender:
    """POSTs one JSON body at a time to the server and returns the response text when the
    status is 200 (a `WarmupError` otherwise)."""

    def __init__(self, url: str, token: str, api_key: str | None):
        parts = urlsplit(url)
        self.host, self.port, self.tls = parts.hostname, parts.port, parts.scheme == "https"
        self.headers = {"Content-Type": "application/json", WARMUP_HEADER: token}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _connection(self) -> http.client.HTTPConnection:
        if not self.tls:
            return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
        # Our own socket, by its IP address: the certificate names a host, not this address.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(self.host, self.port, timeout=TIMEOUT_S,
                                           context=context)

    def __call__(self, request_id: str, path: str, body: dict[str, Any]) -> str:
        conn = self._connection()
        try:
            conn.request("POST", path, body=json.dumps(body),
                         headers={**self.headers, "X-Request-Id": request_id})
            response = conn.getresponse()
            text = response.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as e:
            raise WarmupError(f"start-up request {path} got no answer: {e}") from None
        finally:
            conn.close()
        if response.status != 200:
            raise WarmupError(f"start-up request {path} failed: HTTP {response.status}: "
                              f"{text[:500]}")
        return text


def _check_chat_stream(body: str, max_tokens: int) -> None:
    """A whole chat stream: data events, content, the usage of `max_tokens` tokens, [DONE]."""
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    if not events or events[-1] != "[DONE]":
        raise WarmupError(f"the start-up chat stream did not end with [DONE]: {body[-500:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        raise WarmupError(f"the start-up chat stream failed: {errors[0]}")
    usage = chunks[-1].get("usage") if chunks else None
    if not usage or usage.get("completion_tokens") != max_tokens:
        raise WarmupError(f"the start-up chat stream did not make {max_tokens} tokens: "
                          f"{body[-500:]}")


def _check_completion(body: str) -> None:
    answer = json.loads(body)
    if not answer.get("choices") or not answer.get("usage", {}).get("completion_tokens"):
        raise WarmupError(f"the start-up completion made no tokens: {body[:500]}")
