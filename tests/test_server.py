"""`jengine serve` as a real process on 127.0.0.1, driven by the official `openai` SDK and httpx:
routes, streaming format, errors, auth, request ids, concurrency, disconnects, metrics, SIGTERM.

The session's one server (conftest's `server`: SmolLM2, `--config test`, `--api-key`; see
tests/serve_process.py) serves this module, test_server_responses.py and
test_server_structured.py; the SIGTERM test stops it, after all of them. Engine failures, the
queue limit and timeouts are in test_server_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from serve_process import KEY, MODEL, grpc  # tests/serve_process.py


@pytest.fixture(scope="module")
def tokenizer():
    from converters.gguf_file import GGUFModel
    from converters.source import default_model_path

    return GGUFModel(default_model_path()).tokenizer()


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


# -- start-up, discovery ---------------------------------------------------------------------------

def same_usage(streamed: dict, full) -> bool:
    """Equal token counts. The later of two identical requests may find more of its prompt in
    the prefix cache, so only its cached-token count may be larger."""
    streamed, full = dict(streamed), full.model_dump(exclude_none=True)
    later = streamed.pop("prompt_tokens_details")["cached_tokens"]
    earlier = full.pop("prompt_tokens_details")["cached_tokens"]
    return streamed == full and later >= earlier


def test_health_is_503_while_loading_then_200(server):
    statuses = [s for s, _ in server.health_seen]
    assert statuses[-1] == 200
    assert 503 in statuses, "warm-up should be visible as /health 503"
    assert {"status": "loading"} in [b for s, b in server.health_seen if s == 503]
    assert "step programs (load/compile)" in server.log.read_text()  # the warm-up's bar


def test_models_list_and_retrieve(server):
    client = server.client()
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_version_tokenize_detokenize(server, tokenizer):
    assert httpx.get(server.url + "/version").json()["version"]
    text = "Hello world, this is jengine."
    r = httpx.post(server.url + "/tokenize", json={"prompt": text})
    assert r.json()["tokens"] == list(tokenizer(text).input_ids)
    back = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert back.json()["prompt"] == text


# -- completions -------------------------------------------------------------------------------

def test_completion_usage_is_exact(server, tokenizer):
    client = server.client()
    prompt = "The three primary colors are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    [choice] = r.choices
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert r.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_prompt_forms_and_n(server, tokenizer):
    client = server.client()
    ids = list(tokenizer("Once upon a time").input_ids)
    r = client.completions.create(model=MODEL, prompt=["Once upon a time", "1, 2, 3,"],
                                  max_tokens=5, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples agree
    assert r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens == len(ids) + len(tokenizer("1, 2, 3,").input_ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == r.choices[0].text
    nested = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in nested.choices] == [r.choices[0].text] * 2


def test_completion_default_max_tokens_is_16(server):
    r = server.client().completions.create(model=MODEL, prompt="Count: one, two,",
                                           temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completion_echo_and_logprobs(server, tokenizer):
    prompt = "The capital of France is"
    num_prompt = len(tokenizer(prompt).input_ids)
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                           temperature=0, echo=True, logprobs=3,
                                           extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 6
    assert "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    for token, logprob, top in zip(lp.tokens[1:num_prompt], lp.token_logprobs[1:num_prompt],
                                   lp.top_logprobs[1:num_prompt]):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
    generated = lp.tokens[num_prompt:]
    assert "".join(generated) == choice.text[len(prompt):]
    assert lp.text_offset[num_prompt] == len(prompt)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(generated, lp.token_logprobs[num_prompt:],
                                   lp.top_logprobs[num_prompt:]):
        assert logprob <= 0
        assert 3 <= len(top) <= 4
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the top token
    plain = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert choice.text == prompt + plain.choices[0].text and plain.choices[0].logprobs is None


def test_completion_stream_equals_non_stream(server):
    kwargs = {"model": MODEL, "prompt": "Write a list of fruits:", "max_tokens": 12,
              "temperature": 0, "logprobs": 1}
    full = server.client().completions.create(**kwargs)
    r = server.post("/v1/completions", json={**kwargs, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r.text)[:-1]
    *content, last = chunks
    assert last["choices"] == [] and same_usage(last["usage"], full.usage)
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in content)
    assert "".join(c["choices"][0]["text"] for c in content) == full.choices[0].text
    tokens = [t for c in content for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == full.choices[0].logprobs.tokens
    finals = [c for c in content if c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is content[-1]
    assert finals[0]["choices"][0]["finish_reason"] == full.choices[0].finish_reason


def test_completion_stream_echo_without_usage(server):
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                             "echo": True, "stream": True, "temperature": 0})
    chunks = sse_payloads(r.text)[:-1]
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["text"].startswith("Hello")


def test_stop_strings(server):
    client = server.client()
    prompt = "1, 2, 3, 4,"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text.strip()[2:5]
    assert stop and stop in text
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                    stop=[stop, "never-generated"])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and text.startswith(cut.choices[0].text)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10."}],
        max_tokens=16, temperature=0)
    word = chat.choices[0].message.content.split()[2]
    stopped = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10."}],
        max_tokens=16, temperature=0, stop=word)
    assert stopped.choices[0].finish_reason == "stop"
    assert word not in stopped.choices[0].message.content


def test_seed_reproducible(server):
    client = server.client()

    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", seed=seed,
                                      max_tokens=16, temperature=1.0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_vllm_extras_and_penalties_accepted(server):
    r = server.client().completions.create(
        model=MODEL, prompt="Say something", max_tokens=8, temperature=0.7, seed=3,
        presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"28": -100},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 8,
                    "ignore_eos": False, "stop_token_ids": [2], "skip_special_tokens": True,
                    "include_stop_str_in_output": False})
    assert r.usage.completion_tokens == 8  # min_tokens == max_tokens


# -- chat --------------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": "Answer in English."},
    {"role": "user", "content": [{"type": "text", "text": "Name a planet."}]},
    {"role": "assistant", "content": "Mars."},
    {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    {"role": "user", "content": "Another one?"},
]


def test_bench_serve_loads_the_server(server):
    """`jengine bench serve` (the peer-comparison load script) drives a real server."""
    import argparse

    from jengine.bench.serve import run_serve_bench

    args = argparse.Namespace(url=server.url, api_key=KEY, served_model=None, concurrency=3,
                              num_prompts=4, output_len=5, temperature=0.8)
    result = run_serve_bench(args)
    assert result["requests"] == 4 and result["output_tokens"] == 20  # exactly output_len each
    assert result["temperature"] == 0.8
    assert result["output_tok_per_s"] > 0 and 0 < result["ttft_median_s"] < result["seconds"]


def test_chat_usage_and_roles(server, tokenizer):
    from jengine.text.chat import render_chat

    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    as_template = [dict(m, role="system") if m["role"] == "developer" else m for m in MESSAGES]
    as_template[2] = {"role": "user", "content": "Name a planet."}
    assert r.usage.prompt_tokens == len(render_chat(tokenizer, as_template))
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


def test_chat_max_completion_tokens_wins(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_completion_tokens=5, max_tokens=50, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_logprobs(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.bytes == list(entry.token.encode())
    if r.choices[0].finish_reason == "length":
        assert "".join(e.token for e in content) == r.choices[0].message.content


def test_chat_stream_equals_non_stream(server):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}],
              "max_tokens": 20, "temperature": 0}
    full = server.client().chat.completions.create(**kwargs)
    r = server.post("/v1/chat/completions",
                    json={**kwargs, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_payloads(r.text)[:-1]
    *content, usage = chunks
    assert usage["choices"] == [] and same_usage(usage["usage"], full.usage)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == content[0]["id"]
               for c in content)
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in content[1:])
    finals = [c for c in content if c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is content[-1]
    assert finals[0]["choices"][0]["delta"] == {}
    assert finals[0]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == full.choices[0].message.content


def test_chat_stream_n2_with_sdk(server):
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a random word."}],
        max_tokens=8, temperature=1.0, seed=11, n=2, stream=True)
    roles: dict[int, int] = {}
    finishes: dict[int, list] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = roles.get(c.index, 0) + 1
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert roles == {0: 1, 1: 1}
    assert all(len(f) == 1 and f[0] in ("stop", "length") for f in finishes.values())
    full = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a random word."}],
        max_tokens=8, temperature=1.0, seed=11, n=2)
    assert [c.message.content for c in full.choices] == [texts[0], texts[1]]


# -- errors, auth, request ids ------------------------------------------------------------------

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
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content"),
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


# -- gRPC ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpc_stub(server):
    if server.grpc_target is None:
        pytest.skip("grpcio is not installed")
    from jengine.server.proto import jengine_pb2_grpc

    with grpc.insecure_channel(server.grpc_target) as channel:
        yield jengine_pb2_grpc.JengineStub(channel)


AUTH = [("authorization", f"Bearer {KEY}")]


def test_grpc_streams_the_same_text_as_http(server, grpc_stub):
    from jengine.server.grpc_client import generate_stream

    prompt = "Write a list of fruits, one per line, with the colour and the month each ripens:"
    http = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                              temperature=0)
    msgs = list(generate_stream(server.grpc_target, prompt, api_key=KEY, request_id="g-1",
                                max_tokens=12, temperature=0))
    assert len(msgs) > 1 and all(m.request_id == "g-1" for m in msgs)
    assert "".join(m.text for m in msgs) == http.choices[0].text
    assert [m.finish_reason for m in msgs if m.finish_reason] == [http.choices[0].finish_reason]
    assert msgs[-1].usage.completion_tokens == http.usage.completion_tokens
    assert msgs[-1].usage.prompt_tokens == http.usage.prompt_tokens
    # The HTTP request left the prompt's whole pages in the prefix cache.
    whole_pages = (http.usage.prompt_tokens - 1) // 16 * 16
    assert msgs[-1].usage.cached_tokens == whole_pages > 0


def test_grpc_health_models_and_errors(server, grpc_stub):
    from jengine.server.proto import jengine_pb2 as pb

    assert grpc_stub.Health(pb.HealthRequest()).status == "ok"
    models = grpc_stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    assert [(m.id, m.max_model_len) for m in models] == [(MODEL, 512)]
    cases = [
        (pb.GenerateRequest(text="x"), None, grpc.StatusCode.UNAUTHENTICATED),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(temperature=-1)), AUTH,
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(text="word " * 600), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(text="x", model="gpt-4"), AUTH, grpc.StatusCode.NOT_FOUND),
    ]
    for request, metadata, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(grpc_stub.Generate(request, metadata=metadata, timeout=60))
        assert info.value.code() == code, info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ListModels(pb.ListModelsRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_cancel_frees_pages(server, grpc_stub):
    from jengine.server.proto import jengine_pb2 as pb

    request = pb.GenerateRequest(text="A long tale:", sampling=pb.SamplingOptions(
        max_tokens=300, ignore_eos=True))
    call = grpc_stub.Generate(request, metadata=AUTH)
    next(call)
    assert server.metrics()["jengine_kv_pages_used"] > 0
    call.cancel()
    deadline = time.monotonic() + 30
    while server.metrics()["jengine_kv_pages_used"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


# -- load: concurrency, disconnects, metrics ----------------------------------------------------

PROMPTS = [f"Write one sentence about {topic}." for topic in (
    "rivers", "mountains", "owls", "bread", "trains", "the moon", "glass", "chess")]


def test_32_concurrent_streams_complete_correctly(server):
    params = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    # the reference: one non-streamed batch (greedy outputs do not depend on the batch)
    batch = server.client().completions.create(model=MODEL, prompt=PROMPTS, **params)
    expected = {p: c.text for p, c in zip(PROMPTS, batch.choices)}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, list, int]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True},
            **params)
        text, finishes, usage = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                if c.finish_reason:
                    finishes.append(c.finish_reason)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finishes, usage

    async def all_of_them():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % 8]) for i in range(32)))

    results = asyncio.run(all_of_them())
    for i, (text, finishes, usage) in enumerate(results):
        assert finishes == ["length"] and usage == 12
        assert text == expected[PROMPTS[i % 8]]


def test_100_disconnecting_clients_free_every_kv_page(server):
    before = server.metrics()

    async def hang_up_streaming(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def hang_up_waiting(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": MODEL, "prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True}
        try:
            await client.post("/v1/completions", json=body, timeout=1.0)
        except httpx.TimeoutException:
            return True
        return False

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=300,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            jobs = [hang_up_streaming(client, i) for i in range(80)]
            jobs += [hang_up_waiting(client, i) for i in range(20)]
            return await asyncio.gather(*jobs)

    assert all(asyncio.run(run()))
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        idle = (m["jengine_kv_pages_used"] == 0 and m["jengine_num_requests_running"] == 0
                and m["jengine_num_requests_waiting"] == 0
                and m["jengine_num_requests_queued"] == 0)
        if idle:
            break
        assert time.monotonic() < deadline, f"pages still in use: {m}"
        time.sleep(0.2)
    aborted = m["jengine_requests_total{finish_reason=abort}"] - before.get(
        "jengine_requests_total{finish_reason=abort}", 0)
    assert aborted == 100
    r = server.client().completions.create(model=MODEL, prompt="Still there?", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_metrics_parse_and_move(server):
    before = server.metrics()
    for name in ("jengine_num_requests_running", "jengine_num_requests_waiting",
                 "jengine_kv_pages_used", "jengine_kv_pages_total", "jengine_compiles_since_ready",
                 "jengine_compiles_after_ready_total",
                 "jengine_time_to_first_token_seconds_count",
                 "jengine_inter_token_latency_seconds_count", "jengine_prompt_tokens_total",
                 "jengine_generation_tokens_total", "jengine_spec_decode_num_drafts_total",
                 "jengine_spec_decode_num_draft_tokens_total",
                 "jengine_spec_decode_num_accepted_tokens_total",
                 "jengine_spec_decode_acceptance_rate"):
        assert name in before, name
    assert before["jengine_kv_pages_total"] > 0
    r = server.client().completions.create(model=MODEL, prompt="One two three", max_tokens=5,
                                           extra_body={"ignore_eos": True})
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert moved("jengine_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("jengine_generation_tokens_total") == 5
    assert moved("jengine_time_to_first_token_seconds_count") == 1
    assert moved("jengine_inter_token_latency_seconds_count") == 4
    assert moved("jengine_requests_total{finish_reason=length}") == 1
    assert moved("jengine_e2e_request_latency_seconds_count") == 1
    assert moved("jengine_compiles_after_ready_total") == 0  # warm-up built the base programs


def test_repeated_prefix_reports_cached_tokens_and_metrics(server):
    """The second chat with the same long system prompt reuses its pages: the SDK sees
    `prompt_tokens_details.cached_tokens`, and /metrics counts the hit tokens."""
    client = server.client()
    system = "You answer in one short sentence and never use lists. " * 8
    before = server.metrics()
    usages = []
    for question in ("What is rain?", "What is snow?"):
        r = client.chat.completions.create(
            model=MODEL, max_tokens=3, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}])
        usages.append(r.usage)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert 64 <= cached < usages[1].prompt_tokens and cached % 16 == 0
    after = server.metrics()
    for name in ("jengine_prefix_cache_hit_rate", "jengine_prefix_cache_pages"):
        assert name in after, name
    assert after["jengine_prefix_cache_queries_total"] - before[
        "jengine_prefix_cache_queries_total"] == 2
    assert after["jengine_prefix_cache_hit_tokens_total"] - before[
        "jengine_prefix_cache_hit_tokens_total"] == cached
    assert after["jengine_prefix_cache_query_tokens_total"] > before[
        "jengine_prefix_cache_query_tokens_total"]
    assert "jengine_prefix_cache_evicted_pages_total" in after
    assert "jengine_prefix_cache_duplicate_pages_total" in after


# -- shutdown (conftest runs it after every other user of the server: it stops it) ---------------

@pytest.mark.stops_server
def test_sigterm_lets_the_stream_finish_then_exits(server):
    # short enough to finish within the 30 s drain bound even on a busy CPU
    body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 30,
            "ignore_eos": True, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                break
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        try:  # admission is closed: refused at the socket, or 503 on a kept-alive connection
            late = httpx.post(server.url + "/v1/completions", headers=headers, timeout=10,
                              json={"model": MODEL, "prompt": "late", "max_tokens": 2})
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        after_signal = [line for line in lines if line.startswith("data: ")]
    assert len(after_signal) > 2 and after_signal[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events + after_signal[:-1]]
    assert sum(len(p["choices"][0]["text"]) for p in payloads) > 30
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert server.proc.wait(timeout=60) == 0
    assert "draining" in server.log.read_text()

