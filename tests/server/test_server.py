"""`jengine serve` as a real process on 127.0.0.1, driven by the official `openai` SDK and httpx:
start-up and discovery, completions and chat (usage, prompt forms, n, echo, logprobs, stops,
seeds, streaming against non-streaming).

The session's one server (conftest's `server`: SmolLM2, `--config test`, `--api-key`; see
tests/serve_process.py) serves this module and the other test_server_*.py modules that take
`server`: errors (bad input, auth, request ids), gRPC, load (concurrency, disconnects, metrics,
then SIGTERM, which stops it after all of them), the Responses API, Anthropic's Messages API
(test_server_messages.py), structured outputs and a short `bench soak`.
Engine failures, the queue limit and timeouts are in test_server_faults.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from openai_shapes import sse_payloads  # tests/openai_shapes.py
from serve_process import KEY, MODEL  # tests/serve_process.py


@pytest.fixture(scope="module")
def tokenizer():
    from converters.gguf_file import GGUFModel
    from converters.source import default_model_path

    return GGUFModel(default_model_path()).tokenizer()


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
