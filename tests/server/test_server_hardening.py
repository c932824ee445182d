"""The server against bad and hostile input: a schema fuzzer on its own OpenAPI document, and the
abuse cases that once killed or stalled it (lone surrogates, huge n, huge bodies, unbounded
max_tokens, malformed JSON, wrong content types, control characters, disconnect storms).

Every case checks the answer's status and OpenAI error shape, and then that the server is still
whole: `/health` 200, a greedy reference request gives the same text as before, and no KV page
or running request is left behind. In-process uvicorn on 127.0.0.1 over one real AsyncEngine.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import httpx
import jsonschema
import openai
import pytest
from local_server import serving
from prometheus_client.parser import text_string_to_metric_families

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app

MODEL = "SmolLM2-135M-Instruct"
REFERENCE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
             "temperature": 0, "ignore_eos": True}
# Small bounds, so that whatever the fuzzer sends is answered within seconds.
LIMITS = ServerConfig(max_queue=64, max_n=8, max_body_bytes=256 * 1024, default_max_tokens=16,
                      max_tokens_per_request=256, request_timeout=120)
SURROGATE = "\ud800"


class Local:
    def __init__(self, engine: AsyncEngine, url: str):
        self.engine = engine
        self.url = url
        self.reference_text: str | None = None

    def post(self, path: str, body, **kw) -> httpx.Response:
        if isinstance(body, (dict, list)):
            # json.dumps writes a lone surrogate as the escape "\ud800", as a client would
            kw["content"] = json.dumps(body)
            kw.setdefault("headers", {})["content-type"] = "application/json"
        else:
            kw["content"] = body
        return httpx.post(self.url + path, timeout=120, **kw)

    def reference(self) -> str:
        r = self.post("/v1/completions", REFERENCE)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def assert_whole(self) -> None:
        """Still serving, with the same greedy text and nothing leaked."""
        r = httpx.get(self.url + "/health", timeout=30)
        assert r.status_code == 200, r.text
        assert self.reference() == self.reference_text
        deadline = time.monotonic() + 30
        while True:
            stats = self.engine.stats()
            if stats.kv_pages_used == 0 and stats.num_requests_running == 0 \
                    and stats.num_requests_waiting == 0:
                return
            assert time.monotonic() < deadline, f"leaked: {stats}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def local():
    engine = AsyncEngine(config="test", progress=False)
    with serving(create_app(engine, LIMITS)) as url:
        srv = Local(engine, url)
        srv.reference_text = srv.reference()
        yield srv
    engine.shutdown()


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


# -- text that cannot be encoded ------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"model": SURROGATE, "prompt": "ok"}, "model"),
    ("/v1/chat/completions", {**CHAT, "model": "a" + SURROGATE}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": ["ok", "a" + SURROGATE]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "ok", "stop": [SURROGATE]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "ok", "bad_words": [SURROGATE]}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x" + SURROGATE}]}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "stop": SURROGATE}, "stop"),
    ("/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "function": {
        **TOOL["function"], "description": SURROGATE}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {SURROGATE: 1}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "user": SURROGATE}, "user"),
    ("/v1/responses", {"model": MODEL, "input": SURROGATE}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "instructions": "a" + SURROGATE},
     "instructions"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"model": SURROGATE, "prompt": "ok"}, "model"),
    ("/v1/responses", {"model": SURROGATE, "input": "hi"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(local, path, body, param):
    err = assert_error(local.post(path, body), 400)
    assert err["param"].split(".")[0] == param, err
    assert "Unicode" in err["message"]
    local.assert_whole()


def test_the_python_engine_rejects_a_lone_surrogate_with_value_error(smol_engine):
    from jengine import SamplingParams

    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        smol_engine.generate("hi" + SURROGATE, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop is not valid Unicode"):
        SamplingParams(stop=[SURROGATE])
    with pytest.raises(ValueError, match="messages.0.content is not valid Unicode"):
        smol_engine.chat([{"role": "user", "content": SURROGATE}])
    [out] = smol_engine.generate("hi", SamplingParams(max_tokens=2, temperature=0))
    assert out.outputs[0].finish_reason == "length"


def test_control_characters_are_text_like_any_other(local):
    r = local.post("/v1/completions", {"model": MODEL, "prompt": "a\u0000b\u0007c\u001b[31m\u202e",
                                       "max_tokens": 2})
    assert r.status_code == 200, r.text
    local.assert_whole()


# -- bounded work ---------------------------------------------------------------------------------

def test_n_above_the_limit_is_refused(local):
    assert_error(local.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 100000}),
                 400, "n")
    assert_error(local.post("/v1/chat/completions", {**CHAT, "n": 9}), 400, "n")
    local.assert_whole()


def test_total_generated_tokens_per_request_are_bounded(local):
    # 8 x 64 > 256: the request could starve the batch
    err = assert_error(local.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 8,
                                                      "max_tokens": 64}), 400, "max_tokens")
    assert "256" in err["message"]
    # no max_tokens in completions (null): up to the context's end, 512 > 256
    assert_error(local.post("/v1/completions", {"model": MODEL, "prompt": "x",
                                                "max_tokens": None}), 400, "max_tokens")
    local.assert_whole()


def test_chat_without_max_tokens_gets_the_default(local):
    absent = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    for body in ({**CHAT, "max_tokens": None}, absent):
        r = local.post("/v1/chat/completions", {**body, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == LIMITS.default_max_tokens


def test_a_body_over_the_limit_is_a_413_before_parsing(local):
    big = json.dumps({"model": MODEL, "prompt": "a" * (LIMITS.max_body_bytes + 1)})
    assert_error(local.post("/v1/completions", big, headers={"content-type": "application/json"}),
                 413)

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMITS.max_body_bytes // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(local.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert_error(r, 413)
    local.assert_whole()


def _urllib_post(url: str, data) -> urllib.error.HTTPError:
    request = urllib.request.Request(url + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    return info.value


@pytest.mark.parametrize("chunked", [False, True])
def test_urllib_reads_the_413_of_a_body_it_sends_whole(local, chunked):
    """urllib sends all of a body before it reads the answer: unless the server reads the rest
    of a refused body, urllib sees a reset connection (or a broken pipe), not the 413."""
    size = 20 * LIMITS.max_body_bytes  # 5 MiB, as the clients that failed sent
    body = json.dumps({"model": MODEL, "prompt": "a" * size}).encode()
    data = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    error = _urllib_post(local.url, data)
    assert error.code == 413
    assert json.loads(error.read())["error"]["code"] == "request_too_large"
    local.assert_whole()


def _raw_post(local, head_extra: bytes, length: int, body: bytes) -> bytes:
    """Headers and `body` (of a declared `length`) on a raw socket, then waits for the answer
    without sending more; returns what came back before the server closed."""
    with socket.create_connection(("127.0.0.1", int(local.url.rsplit(":", 1)[1]))) as s:
        s.settimeout(60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n%s\r\n" % (length, head_extra)
                  + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
            if b"request_too_large" in answer:
                break
        return answer


def test_draining_a_refused_body_is_bounded(local, monkeypatch):
    """An attacker cannot tie the connection up: a body declared beyond the drain bound, or one
    that stalls, gets its 413 without the server waiting for the rest."""
    from jengine.server import middleware

    huge = middleware.DRAIN_MAX_BYTES + 1
    assert _raw_post(local, b"", huge, b"{").startswith(b"HTTP/1.1 413")
    assert _raw_post(local, b"Expect: 100-continue\r\n", 2 * LIMITS.max_body_bytes,
                     b"").startswith(b"HTTP/1.1 413")
    monkeypatch.setattr(middleware, "DRAIN_TIMEOUT_S", 1.0)
    start = time.monotonic()
    stalled = _raw_post(local, b"", 4 * LIMITS.max_body_bytes, b"a" * (LIMITS.max_body_bytes + 1))
    assert stalled.startswith(b"HTTP/1.1 413") and time.monotonic() - start < 30
    local.assert_whole()


# -- malformed requests ---------------------------------------------------------------------------

@pytest.mark.parametrize("body, headers, words", [
    (b"", {"content-type": "application/json"}, "empty"),
    (b'{"prompt": "x"', {"content-type": "application/json"}, "parse the JSON"),
    (b'[1, 2]', {"content-type": "application/json"}, "JSON object"),
    (b'{"prompt": "x"}', {"content-type": "text/plain"}, "application/json"),
    (b'prompt=x', {"content-type": "application/x-www-form-urlencoded"}, "application/json"),
    (b'\xff\xfe{', {"content-type": "application/json"}, "JSON"),
    (b'{"prompt": "x", "max_tokens": "5"}', {"content-type": "application/json"}, "max_tokens"),
])
def test_malformed_bodies_are_400s_that_say_why(local, body, headers, words):
    err = assert_error(local.post("/v1/completions", body, headers=headers), 400)
    assert words in err["message"], err
    local.assert_whole()


def test_out_of_vocabulary_ids_and_ranges_are_refused(local):
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert_error(local.post("/v1/completions", {**base, "logit_bias": {"10000000": 1}}), 400,
                 "logit_bias")
    assert_error(local.post("/v1/completions", {**base, "stop_token_ids": [10**9]}), 400,
                 "stop_token_ids")
    assert_error(local.post("/v1/completions", {**base, "allowed_token_ids": [10**9]}), 400,
                 "allowed_token_ids")
    assert_error(local.post("/v1/completions", {**base, "temperature": 2.5}), 400, "temperature")
    assert_error(local.post("/v1/completions", {**base, "max_tokens": 0}), 400, "max_tokens")
    local.assert_whole()


def test_errors_name_the_field_the_client_sent(local):
    """The engine's names (`logprobs`, `max_tokens`) are not what a chat client sent."""
    for body, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"max_completion_tokens": 0}, "max_completion_tokens"),
                        ({"max_completion_tokens": 100_000}, "max_completion_tokens"),
                        ({"max_tokens": 0}, "max_tokens")]:
        err = assert_error(local.post("/v1/chat/completions", {**CHAT, **body}), 400, param)
        assert err["message"].startswith(param) or f"lower n or {param}" in err["message"], err
    err = assert_error(local.post("/v1/responses", {"model": MODEL, "input": "hi",
                                                    "max_output_tokens": 0}), 400)
    assert err["param"] == "max_output_tokens" and "max_output_tokens" in err["message"], err


def test_a_prompt_the_engine_refuses_counts_as_a_client_error(local):
    """Out-of-vocabulary prompt ids are refused by the engine: a 400, counted in no request
    metric (as no other 400 is), not as an engine error."""
    def counts() -> dict[str, float]:
        text = httpx.get(local.url + "/metrics", timeout=30).text
        return {s.name + str(sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith(("jengine_requests_total", "jengine_e2e_request_latency"))}

    before = counts()
    assert_error(local.post("/v1/completions", {"model": MODEL, "prompt": [10**7]}), 400,
                 "prompt")
    assert counts() == before
    local.assert_whole()


def test_a_request_id_with_spaces_is_not_copied_into_ids(local):
    r = local.post("/v1/completions", {**REFERENCE, "max_tokens": 1},
                   headers={"X-Request-Id": "a b\"c"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert " " not in rid and '"' not in rid and r.json()["id"] == f"cmpl-{rid}"


# -- disconnects ----------------------------------------------------------------------------------

def test_a_storm_of_disconnects_leaks_nothing(local):
    body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 200,
            "ignore_eos": True, "stream": True}

    def drop_after_first_chunk() -> None:
        with httpx.stream("POST", local.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line)

    def drop_at_once() -> None:
        with socket.create_connection(("127.0.0.1", int(local.url.rsplit(":", 1)[1]))) as s:
            payload = json.dumps({**body, "stream": False}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)

    threads = [threading.Thread(target=drop_after_first_chunk if i % 2 else drop_at_once)
               for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    local.assert_whole()


# -- a fault inside one request -------------------------------------------------------------------

def test_a_failure_while_handling_one_request_fails_that_request_alone(smol_engine):
    """Fault injection: one request's detokenizer raises during a step. That request ends with
    its error; the request batched with it finishes exactly as it does alone; no page leaks."""
    from jengine import SamplingParams

    core = smol_engine.core
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    [alone] = smol_engine.generate("Once upon a time", greedy)
    core.add_request("victim", "Hello there", greedy)
    core.add_request("bystander", "Once upon a time", greedy)

    def broken(tokens):
        raise RuntimeError("injected detokenizer fault")

    core.requests["victim"].samples[0].detok.add_tokens = broken
    outs: dict[str, list] = {"victim": [], "bystander": []}
    while core.has_unfinished:
        for out in core.step():
            outs[out.request_id].append(out)
    assert outs["victim"][-1].finished and "injected" in outs["victim"][-1].error
    assert outs["victim"][-1].outputs[0].finish_reason == "abort"
    tokens = [t for o in outs["bystander"] for c in o.outputs for t in c.token_ids]
    assert tokens == alone.outputs[0].token_ids
    assert all(o.error is None for o in outs["bystander"])
    assert core.stats().kv_pages_used == 0


# -- server options (a second app over the same engine) ---------------------------------------

@pytest.fixture()
def configured(local):
    """An app with aliases, an API key, CORS for one origin, a server chat template."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\nSAY-{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    config = ServerConfig(api_key="k", served_model_name=("alias-a", "alias-b"),
                          allowed_origins=("http://ui.example",), chat_template=template)
    with serving(create_app(local.engine, config)) as url:
        yield url


def test_served_model_names_cors_and_server_chat_template(configured, local):
    auth = {"Authorization": "Bearer k"}
    models = httpx.get(configured + "/v1/models", headers=auth).json()["data"]
    assert [m["id"] for m in models] == ["alias-a", "alias-b"]
    assert all(m["max_model_len"] == local.engine.core.max_model_len for m in models)
    assert httpx.get(configured + "/v1/models/alias-b", headers=auth).json()["id"] == "alias-b"
    body = {**CHAT, "model": "alias-b", "temperature": 0}
    r = httpx.post(configured + "/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "alias-a"
    assert_error(httpx.post(configured + "/v1/chat/completions", json={**body, "model": MODEL},
                            headers=auth), 404, "model")
    # the server's template is the one rendered
    t = httpx.post(configured + "/tokenize", json={"messages": CHAT["messages"]}).json()
    assert "SAY-Hi" in local.engine.tokenizer.decode(t["tokens"])
    # a request's own template is refused unless the server trusts them
    assert_error(httpx.post(configured + "/v1/chat/completions", headers=auth,
                            json={**body, "chat_template": "{{ messages }}"}), 400,
                 "chat_template")
    # CORS preflight: answered before the API key is asked for
    pre = httpx.options(configured + "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.options(configured + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


# -- vLLM's request fields ------------------------------------------------------------------------

def test_vllm_chat_fields_are_honoured(local):
    tok = local.engine.tokenizer
    base = {**CHAT, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "The color is"}]
    cont = local.post("/v1/chat/completions", {
        **base, "messages": messages, "add_generation_prompt": False,
        "continue_final_message": True, "echo": True, "request_id": "trace-42"}).json()
    assert cont["id"] == "chatcmpl-trace-42"
    text = cont["choices"][0]["message"]["content"]
    assert text.startswith("The color is") and len(text) > len("The color is")
    # continue_final_message: the prompt ends inside the assistant's turn
    from jengine.text.chat import render_chat

    rendered = tok.decode(render_chat(tok, messages, add_generation_prompt=False,
                                      continue_final_message=True))
    assert rendered.rstrip().endswith("The color is")
    # prompt_logprobs + return_tokens_as_token_ids
    r = local.post("/v1/chat/completions", {**base, "prompt_logprobs": 1, "logprobs": True,
                                            "return_tokens_as_token_ids": True}).json()
    plp = r["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(isinstance(int(k), int) for entry in plp[1:] for k in entry)
    assert all(e["token"].startswith("token_id:") for e in r["choices"][0]["logprobs"]["content"])
    for field, value in (("priority", 1), ("guided_decoding_backend", "outlines")):
        assert_error(local.post("/v1/chat/completions", {**base, field: value}), 400, field)
    assert local.post("/v1/chat/completions", {**base, "priority": 0,
                                               "guided_decoding_backend": "guidance",
                                               "chat_template_kwargs": {"x": 1},
                                               "truncate_prompt_tokens": 8}).status_code == 200


def test_vllm_completion_fields_are_honoured(local):
    tok = local.engine.tokenizer
    base = {"model": MODEL, "prompt": "Hello", "temperature": 0, "max_tokens": 6,
            "ignore_eos": True}
    plain = local.post("/v1/completions", base).json()["choices"][0]["text"]
    # bad_words: the greedy text itself (several tokens) is banned, so it cannot come again
    assert len(tok(plain, add_special_tokens=False).input_ids) > 1
    other = local.post("/v1/completions", {**base, "bad_words": [plain]}).json()
    assert plain not in other["choices"][0]["text"]
    # allowed_token_ids: only those tokens
    allowed = tok(" the cat", add_special_tokens=False).input_ids
    r = local.post("/v1/completions", {**base, "allowed_token_ids": allowed,
                                       "return_tokens_as_token_ids": True, "logprobs": 0}).json()
    tokens = r["choices"][0]["logprobs"]["tokens"]
    assert tokens and all(int(t.split(":")[1]) in allowed for t in tokens)
    # echo + max_tokens 0: prompt scoring, nothing generated
    score = local.post("/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                           "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    choice = score["choices"][0]
    assert choice["text"] == "The capital of France is"
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert len(choice["logprobs"]["tokens"]) == score["usage"]["prompt_tokens"]
    assert score["usage"]["completion_tokens"] == 0
    # prompt_logprobs per choice; add_special_tokens reaches the tokenizer
    r = local.post("/v1/completions", {**base, "prompt": "a b c", "prompt_logprobs": 0}).json()
    assert r["choices"][0]["prompt_logprobs"][0] is None
    assert len(r["choices"][0]["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    for flag in (True, False):
        r = local.post("/v1/completions", {**base, "max_tokens": 1, "add_special_tokens": flag})
        assert r.json()["usage"]["prompt_tokens"] == len(
            tok("Hello", add_special_tokens=flag).input_ids)


def test_forced_tool_calls_cut_off_by_max_tokens_leak_no_partial_block(local):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    body = {**CHAT, "messages": [{"role": "user", "content": "Weather in Oslo and Rome?"}],
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": True,
            "max_tokens": 40, "temperature": 0}
    r = local.post("/v1/chat/completions", body).json()
    message = r["choices"][0]["message"]
    assert "<tool_call>" not in (message["content"] or ""), message
    stream = local.post("/v1/chat/completions", {**body, "stream": True}).text
    content = "".join(
        (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for line in stream.splitlines()
        if line.startswith("data: {") and "error" not in line)
    assert "<tool_call>" not in content, content


# -- the fuzzer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "messages": []}),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": []}}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}),
    ("/v1/completions", {**REFERENCE, "prompt": [49152]}),
    ("/v1/completions", {**REFERENCE, "prompt": [[1], [-1]]}),
    ("/v1/completions", {**REFERENCE, "prompt": ""}),
    ("/v1/completions", {**REFERENCE, "stop_token_ids": [10**7]}),
    ("/v1/completions", {**REFERENCE, "allowed_token_ids": [-5]}),
    ("/v1/completions", {**REFERENCE, "n": 0}),
    ("/v1/completions", {**REFERENCE, "temperature": 2.5}),
    ("/v1/responses", {"model": MODEL, "input": []}),
    ("/tokenize", {"messages": []}),
    ("/detokenize", {"tokens": [1, 49152]}),
])
def test_the_openapi_document_refuses_what_the_server_refuses(local, path, body):
    """The document the fuzzer (and any client generator) reads says these bodies are invalid,
    as the server does; the same bodies with the value in range are valid."""
    doc = httpx.get(local.url + "/openapi.json", timeout=30).json()
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
    assert not validator.is_valid(body), body
    assert_error(local.post(path, body), 400)
    fixed = {"messages": CHAT["messages"], "guided_choice": ["a"], "top_logprobs": 20,
             "structured_outputs": {"choice": ["a"]}, "max_completion_tokens": 1,
             "prompt": [[1], [49151]], "stop_token_ids": [49151], "allowed_token_ids": [0],
             "n": 1, "temperature": 2, "input": "hi", "tokens": [1, 49151]}
    assert validator.is_valid({**body, **{k: v for k, v in fixed.items() if k in body}})


def test_schema_fuzzing_finds_no_server_error(local):
    """schemathesis against the server's own /openapi.json: valid and invalid bodies for every
    route, a bounded number each. No 5xx, only documented status codes, then still whole."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

    schema = schemathesis.openapi.from_url(local.url + "/openapi.json")
    failures: list[str] = []
    ran = 0

    def fuzz(operation) -> None:
        @settings(max_examples=12, deadline=None, derandomize=True, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy())
        def run(case) -> None:
            nonlocal ran
            ran += 1
            try:
                # 60 s, not the client's default 10: a valid body may ask for many tokens, and
                # a loaded 2-core CI host took over 10 s on one (a hang still fails)
                case.call_and_validate(base_url=local.url, timeout=60, checks=[
                    not_a_server_error, status_code_conformance, content_type_conformance])
            except Exception as e:  # noqa: BLE001 - collect, report all at the end
                failures.append(f"{operation.label}: {type(e).__name__}: {str(e)[:300]}")

        run()

    for result in schema.get_all_operations():
        fuzz(result.ok())
    assert ran >= 60, ran
    assert not failures, "\n".join(failures[:10])
    local.assert_whole()


def test_official_sdk_after_the_abuse(local):
    client = openai.OpenAI(base_url=local.url + "/v1", api_key="unused", max_retries=0)
    body = {k: v for k, v in REFERENCE.items() if k != "ignore_eos"}
    r = client.completions.create(**body, extra_body={"ignore_eos": True})
    assert r.choices[0].text == local.reference_text
