"""What benchmark clients and SDKs send unasked, against the session's real server (conftest's
`server`): vLLM's `stream_options.continuous_usage_stats` (guidellm streams with it on every
request), OpenAI's `stream_options.include_obfuscation`, and the vLLM and OpenAI fields that
are honoured as no-ops at their default value and refused, naming the field, otherwise.

guidellm itself is not a test dependency: installing it downgrades click and adds httptools
(which changes the HTTP parser of every uvicorn server in the environment), sanic, pandas and
pyarrow. The official SDK sends guidellm's stream options here instead.
"""

from __future__ import annotations

import json

import pytest
from openai_shapes import assert_error, sse_payloads  # tests/openai_shapes.py
from serve_process import MODEL  # tests/serve_process.py

from jengine.server.protocol import CompletionRequest
from jengine.server.reply_json import OBFUSCATION_BLOCK

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}  # what guidellm sends
GREEDY = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "Name three colors."}]}


def test_sdk_chat_stream_with_continuous_usage(server):
    """Every chunk carries the usage so far: the prompt's tokens and the tokens generated up
    to it, growing one per content chunk, as vLLM reports them to guidellm."""
    stream = server.client().chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stream_options": CONTINUOUS})
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    prompt_tokens = last.usage.prompt_tokens
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt_tokens for c in body)
    generated = [c.usage.completion_tokens for c in body]
    assert generated[0] == 0  # the role chunk comes before any token
    assert generated == sorted(generated) and generated[-1] == 8
    content = [c.usage.completion_tokens for c in body if c.choices[0].delta.content]
    assert content[0] >= 1 and all(a < b for a, b in zip(content, content[1:]))
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in body)
    full = server.client().chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in body) == \
        full.choices[0].message.content


def test_completion_stream_with_continuous_usage_counts_each_choice(server):
    body = {**GREEDY, "prompt": ["Count: one, two,", "Hi"], "n": 2, "temperature": 0.8,
            "seed": 1, "stream": True, "stream_options": CONTINUOUS}
    chunks = sse_payloads(server.post("/v1/completions", json=body).text)[:-1]
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * 2 * 8
    seen: dict[int, int] = {}  # choice -> its tokens so far
    for c in content:
        (choice,) = c["choices"]
        index, usage = choice["index"], c["usage"]
        assert usage["completion_tokens"] > seen.get(index, 0), (index, usage)
        seen[index] = usage["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert seen == {0: 8, 1: 8, 2: 8, 3: 8}
    prompts = {c["choices"][0]["index"] // 2: c["usage"]["prompt_tokens"] for c in content}
    assert sum(prompts.values()) == last["usage"]["prompt_tokens"]  # once per prompt
    # continuous_usage_stats without include_usage: no usage, as in vLLM
    alone = {**body, "prompt": "Hi", "n": 1, "stream_options": {"continuous_usage_stats": True}}
    chunks = sse_payloads(server.post("/v1/completions", json=alone).text)[:-1]
    assert chunks and all("usage" not in c for c in chunks)


@pytest.mark.parametrize("path, request_body", [
    ("/v1/chat/completions", CHAT), ("/v1/completions", {**GREEDY, "prompt": "Colors:"})])
def test_obfuscation_pads_every_chunk_only_when_asked(server, path, request_body):
    def stream(options: dict | None) -> list[str]:
        body = {**request_body, "stream": True}
        if options is not None:
            body["stream_options"] = options
        r = server.post(path, json=body)
        assert r.status_code == 200, r.text
        return [e[len("data: "):] for e in r.text.split("\n\n") if e][:-1]

    padded = stream({"include_obfuscation": True, "include_usage": True})
    for event in padded:
        assert len(event.encode()) % OBFUSCATION_BLOCK == 0, event
        assert isinstance(json.loads(event)["obfuscation"], str)
    text = "".join(_text(json.loads(e)) for e in padded)
    for options in (None, {"include_obfuscation": False, "include_usage": True}):
        plain = [json.loads(e) for e in stream(options)]
        assert all("obfuscation" not in c for c in plain)
        assert "".join(_text(c) for c in plain) == text


def _text(chunk: dict) -> str:
    choices = chunk["choices"]
    if not choices:
        return ""
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


# vLLM's fields at the values clients send unasked; OpenAI's chat verbosity at its default
ACCEPTED = [{"spaces_between_special_tokens": True}, {"spaces_between_special_tokens": False},
            {"use_beam_search": False}, {"length_penalty": 1.0}, {"length_penalty": 1},
            {"vllm_xargs": {}}, {"kv_transfer_params": None}, {"thinking_token_budget": None},
            {"cache_salt": None}]
REFUSED = [({"use_beam_search": True}, "use_beam_search"),
           ({"length_penalty": 0.6}, "length_penalty"),
           ({"thinking_token_budget": 64}, "thinking_token_budget"),
           ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
           ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
           ({"cache_salt": "tenant-1"}, "cache_salt")]  # the test server shares its cache


@pytest.mark.parametrize("path, request_body", [
    ("/v1/chat/completions", CHAT), ("/v1/completions", {**GREEDY, "prompt": "Colors:"})])
def test_extras_at_their_defaults_are_no_ops_and_others_are_refused(server, path, request_body):
    reference = server.post(path, json=request_body).json()["choices"][0]
    for extra in ACCEPTED:
        r = server.post(path, json={**request_body, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0] == reference, extra
    for extra, param in REFUSED:
        err = assert_error(server.post(path, json={**request_body, **extra}), 400)
        assert err["param"] == param and param in err["message"], err


def test_chat_verbosity_only_at_openais_default(server):
    ok = server.post("/v1/chat/completions", json={**CHAT, "verbosity": "medium"})
    assert ok.status_code == 200, ok.text
    for value, status in (("low", 400), ("high", 400), ("loud", 400)):
        err = assert_error(server.post("/v1/chat/completions",
                                       json={**CHAT, "verbosity": value}), status)
        assert err["param"] == "verbosity", err


def test_cache_salt_is_honoured_where_nothing_is_shared():
    """With prefix caching off no request reads another's pages: the salt asks for no more."""
    body = CompletionRequest(prompt="x", cache_salt="tenant-1")
    body.check_cache_salt(prefix_caching=False)
    with pytest.raises(Exception, match="cache_salt"):
        body.check_cache_salt(prefix_caching=True)
