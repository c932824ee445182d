"""After `/health` is 200 the server builds no step program, whatever a request asks for: every
public sampling and output feature, alone and mixed in one batch, runs on the programs
`serve` built before it was ready (conftest's shared `server`, `--config test`)."""

from __future__ import annotations

import asyncio

from serve_process import MODEL  # tests/serve_process.py

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}
CHAT = [{"role": "user", "content": "Tell me about a person."}]
# Each one a public feature (or a mix), as the OpenAI SDK sends it.
COMPLETIONS = [
    dict(prompt="Counting: one two", max_tokens=4, logprobs=5),
    dict(prompt="Counting: one two", max_tokens=4, echo=True, logprobs=2),  # prompt logprobs
    dict(prompt="Counting: one two", max_tokens=4, echo=True, logprobs=0, presence_penalty=0.5),
    dict(prompt="The sky is", max_tokens=6, frequency_penalty=1.0, presence_penalty=0.3),
    dict(prompt="The sky is", max_tokens=6, logit_bias={"13": -100, "42": 5}),
    dict(prompt="The sky is", max_tokens=6, n=3, temperature=0.8, seed=3),
    dict(prompt="The sky is", max_tokens=6, stop=[" blue", "."], temperature=0),
    dict(prompt="The sky is", max_tokens=6, top_p=0.5, extra_body={
        "min_tokens": 4, "repetition_penalty": 1.2, "top_k": 5, "min_p": 0.1}),
    dict(prompt="The sky is", max_tokens=6, extra_body={"bad_words": [" blue"]}),
    dict(prompt="The sky is", max_tokens=3, extra_body={"allowed_token_ids": [13, 42, 100]}),
    dict(prompt="The sky is", max_tokens=3, extra_body={"prompt_logprobs": 3}),
]
CHATS = [
    dict(messages=CHAT, max_tokens=40, response_format=SCHEMA),
    dict(messages=CHAT, max_tokens=40, response_format={"type": "json_object"}),
    dict(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=30,
         tools=[WEATHER], tool_choice="required"),
    dict(messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=20, stream=True),
    dict(messages=CHAT, max_tokens=8, n=2, extra_body={"guided_regex": "[a-z]{3,6}"}),
]


def _count(server) -> float:
    return server.metrics()["jengine_compiles_after_ready_total"]


async def _send_all(server) -> None:
    client = server.async_client()

    async def completion(kwargs):
        return await client.completions.create(model=MODEL, **kwargs)

    async def chat(kwargs):
        out = await client.chat.completions.create(model=MODEL, **kwargs)
        if kwargs.get("stream"):
            return [chunk async for chunk in out]
        return out

    # Mixed into shared batches: every request in flight at once.
    await asyncio.gather(*(completion(k) for k in COMPLETIONS), *(chat(k) for k in CHATS))
    await client.close()


def test_no_step_program_is_built_after_ready(server):
    assert _count(server) == 0
    client = server.client()
    for kwargs in COMPLETIONS:  # each feature alone in its batch
        client.completions.create(model=MODEL, **kwargs)
    for kwargs in CHATS:
        out = client.chat.completions.create(model=MODEL, **kwargs)
        if kwargs.get("stream"):
            list(out)
    asyncio.run(_send_all(server))
    assert _count(server) == 0
