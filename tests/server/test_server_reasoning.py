"""`--reasoning-parser` end to end, with the official `openai` SDK against servers on 127.0.0.1
over a tiny random Qwen3 (byte-level tokenizer, `<think>` / `</think>` tokens, Qwen3's
generation prompt; tests/tiny_models.py). A Lark grammar that writes the think block forces
`<think>THOUGHT</think>\\n\\nANSWER`, so the split is exercised deterministically; the same
engine behind a server without the flag shows the raw text the split comes from.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
import transformers
from local_server import serving  # tests/local_server.py
from tiny_models import qwen3_thinking  # tests/tiny_models.py

from jengine.async_engine import AsyncEngine
from jengine.cli.main import build_parser
from jengine.cli.serve import server_config
from jengine.config import ServerConfig
from jengine.server.app import create_app

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
MODEL = "tiny-qwen3"
THINK = 'start: <think> THOUGHT </think> "\\n\\n" ANSWER\nTHOUGHT: /[a-z ]{3,12}/\n' \
        'ANSWER: /[a-z]{2,6}/\n'
# A call inside the thinking stays reasoning; the one in the answer is parsed.
CALLS = ('start: <think> "<tool_call>{\\"name\\": \\"a\\", \\"arguments\\": {}}</tool_call>" '
         '</think> "\\n\\n<tool_call>{\\"name\\": \\"b\\", \\"arguments\\": {\\"x\\": 1}}'
         '</tool_call>"\n')
TOOLS = [{"type": "function", "function": {"name": "b"}}]  # (a short prompt: bytes are tokens)
HI = [{"role": "user", "content": "hi"}]


def _flags(*argv: str) -> ServerConfig:
    """The server settings `jengine serve` makes of these flags."""
    return server_config(build_parser().parse_args(["serve", *argv]), ServerConfig())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return qwen3_thinking(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def clients(model_path):
    """OpenAI clients of four servers over one engine: `--reasoning-parser` qwen3, none,
    deepseek_r1 and auto."""
    path = model_path
    engine = AsyncEngine(str(path), config=ONE_BUCKET, progress=False)
    configs = {"qwen3": _flags("--reasoning-parser", "qwen3"), None: _flags(),
               "deepseek_r1": _flags("--reasoning-parser", "deepseek_r1"),
               "auto": _flags("--reasoning-parser", "auto")}
    assert configs["qwen3"].reasoning_parser == "qwen3"
    try:
        with serving(create_app(engine, configs["qwen3"], model_name=MODEL)) as q, \
                serving(create_app(engine, configs[None], model_name=MODEL)) as n, \
                serving(create_app(engine, configs["deepseek_r1"], model_name=MODEL)) as d, \
                serving(create_app(engine, configs["auto"], model_name=MODEL)) as a:
            yield {name: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                       timeout=120)
                   for name, url in zip(configs, (q, n, d, a))}
    finally:
        engine.shutdown()


def _chat(client, grammar: str = THINK, max_tokens: int = 48, extra=None, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=max_tokens, temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}, **(extra or {})}, **kw)


@pytest.mark.parametrize("parser", ["qwen3", "auto", "deepseek_r1"])
def test_think_block_split_from_the_answer(clients, parser):
    raw = _chat(clients[None]).choices[0].message
    assert raw.content.startswith("<think>") and "</think>\n\n" in raw.content
    assert getattr(raw, "reasoning", None) is None  # no flag: nothing changes
    thought, answer = raw.content.removeprefix("<think>").split("</think>\n\n")
    message = _chat(clients[parser]).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == \
        (thought.strip(), thought.strip(), answer)


def test_streamed_deltas_carry_the_same_split(clients):
    whole = _chat(clients["qwen3"]).choices[0].message
    reasoning, reasoning_content, content = [], [], []
    for chunk in _chat(clients["qwen3"], stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning.append(getattr(delta, "reasoning", None) or "")
            reasoning_content.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
    assert "".join(reasoning) == "".join(reasoning_content) == whole.reasoning
    assert "".join(content) == whole.content
    assert len([r for r in reasoning if r]) >= 2  # streamed as generated, not at the end


def test_tool_calls_are_read_from_the_answer_only(clients):
    choice = _chat(clients["qwen3"], CALLS, 140, tools=TOOLS).choices[0]
    assert choice.message.reasoning == '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("b", {"x": 1})]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"


def test_structured_output_applies_after_the_thinking(clients):
    """A JSON schema constrains the answer: deepseek_r1's template-opened block must close
    first, and the answer after it is the schema's. (A small bias on `</think>`, token 259,
    lets the random model end its thought within a few tokens.)"""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
              "additionalProperties": False}
    choice = clients["deepseek_r1"].chat.completions.create(
        model=MODEL, messages=HI, max_tokens=40, temperature=0, logit_bias={"259": 2},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    ).choices[0]
    assert choice.message.reasoning and "{" not in choice.message.reasoning
    assert json.loads(choice.message.content)["a"] in (1, 2)
    assert choice.finish_reason == "stop"


def test_enable_thinking_false_renders_the_empty_block_and_parses_nothing(clients):
    on = _chat(clients["qwen3"])
    off = _chat(clients["qwen3"], extra={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's template adds `<think>\n\n</think>\n\n` (6 tokens here) to the prompt
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 6
    message = off.choices[0].message
    assert message.reasoning is None and message.reasoning_content is None
    assert message.content.startswith("<think>")  # not parsed: thinking is off


def test_responses_reasoning_item_before_the_message(clients):
    """deepseek_r1: an output cut off before `</think>` is all reasoning."""
    raw = clients[None].chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                                temperature=0).choices[0].message.content
    assert "</think>" not in raw
    response = clients["deepseek_r1"].responses.create(model=MODEL, input="hi",
                                                       max_output_tokens=8, temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == raw.strip()
    assert message.type == "message" and message.content[0].text == ""
    assert response.status == "incomplete"

    events = list(clients["deepseek_r1"].responses.create(
        model=MODEL, input="hi", max_output_tokens=8, temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done.text == raw.strip()
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert events[-1].response.output[0].content[0].text == raw.strip()


def test_a_thinking_budget_closes_the_thought_after_n_tokens(clients, model_path):
    """deepseek_r1 (the block open from the first token): under a budget larger than the
    output the random model does not close its thought within 8 tokens; under a budget of 4
    the grammar forces `</think>` after the same first 4 tokens, and an answer follows.
    (Tokens are compared as generated, by id, not by re-tokenizing text.)"""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)

    def run(budget: int, max_tokens: int, **kw):
        return clients["deepseek_r1"].chat.completions.create(
            model=MODEL, messages=HI, temperature=0, logprobs=True, max_tokens=max_tokens,
            extra_body={"thinking_token_budget": budget, "return_tokens_as_token_ids": True},
            **kw)

    def ids(choice) -> list[int]:
        return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]

    long = run(1000, 8).choices[0]
    assert "</think>" not in tokenizer.decode(ids(long)) and long.message.content is None
    choice = run(4, 24).choices[0]
    assert ids(choice)[:4] == ids(long)[:4]  # the thought as it would have gone on
    assert tokenizer.decode(ids(choice)[4:]).startswith("</think>")  # then the forced end
    assert choice.message.reasoning == tokenizer.decode(ids(choice)[:4]).strip()
    assert choice.message.content  # and the answer after it
    reasoning, content = [], []
    for chunk in run(4, 24, stream=True):
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning", None) or "")
            content.append(c.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == \
        (choice.message.reasoning, choice.message.content)


def test_reasoning_effort_maps_to_a_budget(clients):
    """`low` is a budget of 1024 tokens, `high` none."""
    def chat(**fields):
        message = clients["deepseek_r1"].chat.completions.create(
            model=MODEL, messages=HI, max_tokens=8, temperature=0, **fields).choices[0].message
        return message.reasoning, message.content

    assert chat(reasoning_effort="low") == chat(extra_body={"thinking_token_budget": 1024})
    assert chat(reasoning_effort="high") == chat()


@pytest.mark.parametrize(("server", "fields", "param"), [
    ("qwen3", {"thinking_token_budget": -1}, "thinking_token_budget"),
    ("qwen3", {"thinking_token_budget": "8"}, "thinking_token_budget"),
    ("qwen3", {"thinking_token_budget": 2.5}, "thinking_token_budget"),
    ("qwen3", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    (None, {"thinking_token_budget": 8}, "thinking_token_budget"),  # no reasoning parser
    (None, {"reasoning_effort": "low"}, "reasoning_effort"),
])
def test_a_bad_or_unusable_budget_is_a_400_naming_the_field(clients, server, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        clients[server].chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                                extra_body=fields)
    assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:  # completions read no reasoning
        clients["qwen3"].completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                            extra_body={"thinking_token_budget": 4})
    assert e.value.body["param"] == "thinking_token_budget"
    assert _chat(clients["qwen3"]).choices[0].message.reasoning  # still serving


def test_anthropic_thinking_is_the_same_budget_as_thinking_blocks(clients):
    """`/v1/messages` with `thinking` enabled: chat's budgeted split, as a `thinking` block
    before the text, whole and streamed alike; `disabled` renders Qwen3's empty block."""
    url = str(clients["deepseek_r1"].base_url).rstrip("/").removesuffix("/v1")
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    chat = clients["deepseek_r1"].chat.completions.create(
        model=MODEL, messages=HI, max_tokens=24, temperature=0,
        extra_body={"thinking_token_budget": 4}).choices[0].message
    ask = {"model": MODEL, "messages": HI, "max_tokens": 24, "extra_body": {"temperature": 0},
           "thinking": {"type": "enabled", "budget_tokens": 4}}
    message = client.messages.create(**ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in message.content] == [("thinking", chat.reasoning), ("text", chat.content)]
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == \
        [b.model_dump() for b in message.content]

    plain = client.messages.create(model=MODEL, messages=HI, max_tokens=2)
    off = client.messages.create(model=MODEL, messages=HI, max_tokens=2,
                                 thinking={"type": "disabled"})
    assert off.usage.input_tokens == plain.usage.input_tokens + 6  # `<think>\n\n</think>\n\n`
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, messages=HI, max_tokens=4,
                               thinking={"type": "enabled", "budget_tokens": -1})
