"""`--tool-call-parser` through a real server on 127.0.0.1 (SmolLM2, the official `openai` SDK):
a regex makes the model write a Mistral-format call, which the server reads as a call when
`auto` finds `[TOOL_CALLS]` in the chat template (or the flag names `mistral`), and leaves as
content under hermes (`auto` on SmolLM2's own template), whole and streamed (free calls of the
JSON formats stream their arguments in fragments); and `tool_choice`
named / required under mistral and llama3_json (named under the other formats too), written by
the grammar in that format."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from local_server import serving

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app

MODEL = "SmolLM2-135M-Instruct"
# A ChatML template like SmolLM2's own, naming Mistral's call marker (as Mistral templates do).
MISTRAL_TEMPLATE = ("{#- assistant calls are written [TOOL_CALLS][...] -#}"
                    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = r'\[\{"name": "get_weather", "arguments": \{"city": "(Oslo|Zürich)"\}\}\]'
REQUEST = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=TOOLS, temperature=0, max_tokens=40,
               extra_body={"structured_outputs": {"regex": CALL}})


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(config="test", progress=False)
    yield engine
    engine.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _streamed(client: openai.OpenAI, request: dict | None = None,
              fragments: list[str] | None = None) -> tuple[str, dict[int, list[str]], str]:
    """Content, {index: [name, arguments]} and finish_reason of a streamed request; each
    non-empty arguments fragment is appended to `fragments`."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**(request or REQUEST), stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
            if call.function.arguments and fragments is not None:
                fragments.append(call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("config", [ServerConfig(chat_template=MISTRAL_TEMPLATE,
                                                 tool_call_parser="auto"),
                                    ServerConfig(tool_call_parser="mistral")],
                         ids=["auto", "named"])
def test_mistral_calls_are_parsed_whole_and_streamed(engine, config):
    with serving(create_app(engine, config)) as url:
        client = _client(url)
        choice = client.chat.completions.create(**REQUEST).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Oslo", "Zürich")
        fragments: list[str] = []
        content, calls, finish = _streamed(client, fragments=fragments)
        assert content.strip() == "" and finish == "tool_calls"
        assert calls == {0: ["get_weather", call.function.arguments]}
        assert len(fragments) > 2  # the free call's arguments streamed as generated


def test_free_llama3_json_call_streams_its_arguments(engine):
    """A free llama3_json call (a regex makes SmolLM2 write one): whole, and streamed in
    fragments that join into the whole response's arguments, the text as generated."""
    request = {**REQUEST, "extra_body": {"structured_outputs": {"regex": (
        r'\{"name": "get_weather", "parameters": \{"city": "(Oslo|Zürich)"\}\}')}}}
    with serving(create_app(engine, ServerConfig(tool_call_parser="llama3_json"))) as url:
        client = _client(url)
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert call.function.arguments in ('{"city": "Oslo"}', '{"city": "Zürich"}')
        fragments: list[str] = []
        content, calls, finish = _streamed(client, request, fragments)
        assert content == "" and finish == "tool_calls"
        assert calls == {0: ["get_weather", call.function.arguments]}
        assert len(fragments) > 2


def test_hermes_leaves_a_mistral_call_as_content(engine):
    with serving(create_app(engine, ServerConfig(tool_call_parser="auto"))) as url:  # SmolLM2
        client = _client(url)
        choice = client.chat.completions.create(**REQUEST).choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert json.loads(choice.message.content)[0]["name"] == "get_weather"
        content, calls, _ = _streamed(client)
        assert calls == {} and content == choice.message.content


# -- tool_choice required / named: the grammar writes the parser's own format -------------------

FORCED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city for some days",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("parser", "choice"), [
    # mistral's and llama3_json's named calls ~9 s each; CI: their required calls, and the
    # named grammar through pythonic's and qwen3_coder's formats
    ("mistral", "required"), pytest.param("mistral", NAMED, marks=pytest.mark.slow),
    ("llama3_json", "required"), pytest.param("llama3_json", NAMED, marks=pytest.mark.slow),
    pytest.param("deepseek_v3", NAMED, marks=pytest.mark.slow),  # ~13 s: 200 tokens of markers
    ("pythonic", NAMED), ("qwen3_coder", NAMED)],
    ids=["mistral-required", "mistral-named", "llama3_json-required", "llama3_json-named",
         "deepseek_v3-named", "pythonic-named", "qwen3_coder-named"])
def test_forced_calls_in_the_parsers_format(engine, parser, choice):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                   tools=FORCED_TOOLS, tool_choice=choice, parallel_tool_calls=False,
                   temperature=0, max_tokens=200)  # DeepSeek markers: ~70 SmolLM2 tokens
    with serving(create_app(engine, ServerConfig(tool_call_parser=parser))) as url:
        client = _client(url)
        choice_ = client.chat.completions.create(**request).choices[0]
        assert choice_.finish_reason == "tool_calls" and not choice_.message.content
        [call] = choice_.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls, finish = {}, None
        for chunk in client.chat.completions.create(**request, stream=True):
            delta = chunk.choices[0].delta
            assert not delta.content
            for c in delta.tool_calls or []:
                entry = calls.setdefault(c.index, ["", ""])
                entry[0] += c.function.name or ""
                entry[1] += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert calls == {0: [call.function.name, call.function.arguments]}
