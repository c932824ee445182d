"""`--tool-call-parser llama3_json` end to end with the `openai` SDK: a server on 127.0.0.1
over the tiny random Qwen3 of tests/tiny_models.py, whose output a grammar forces into Llama 3's
JSON call form, reads it as tool calls (whole and streamed); a server without the flag leaves
the same text as content."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from local_server import serving  # tests/local_server.py
from tiny_models import qwen3_thinking  # tests/tiny_models.py

from jengine.async_engine import AsyncEngine
from jengine.cli.main import build_parser
from jengine.cli.serve import server_config
from jengine.config import ServerConfig
from jengine.server.app import create_app

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
MODEL = "tiny"
CALLS = '{"name": "b", "parameters": {"x": 1}}; {"name": "b", "parameters": {"x": 2}}'
TOOLS = [{"type": "function", "function": {"name": "b"}}]


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    engine = AsyncEngine(str(qwen3_thinking(tmp_path_factory.mktemp("qwen3"))),
                         config=ONE_BUCKET, progress=False)
    llama3 = server_config(build_parser().parse_args(
        ["serve", "--tool-call-parser", "llama3_json"]), ServerConfig())
    try:
        with serving(create_app(engine, llama3, model_name=MODEL)) as url, \
                serving(create_app(engine, ServerConfig(), model_name=MODEL)) as plain:
            yield [openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=120)
                   for u in (url, plain)]
    finally:
        engine.shutdown()


def _chat(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=120,
        temperature=0, tools=TOOLS,
        extra_body={"structured_outputs": {"grammar": f"start: {json.dumps(CALLS)}\n"}}, **kw)


def test_llama3_json_calls_are_parsed(clients):
    llama3, plain = clients
    assert _chat(plain).choices[0].message.content == CALLS  # hermes: not a call
    choice = _chat(llama3).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("b", {"x": 1}), ("b", {"x": 2})]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"

    calls: dict[int, dict] = {}
    finish = None
    for chunk in _chat(llama3, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            for call in c.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
                entry["name"] = call.function.name or entry["name"]
                entry["arguments"] += call.function.arguments or ""
            finish = c.finish_reason or finish
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("b", {"x": 1}), ("b", {"x": 2})]
    assert finish == "tool_calls"
