"""`--reasoning-parser openai_gptoss` end to end, with the official `openai` SDK against servers
on 127.0.0.1 over a tiny random gpt-oss (byte-level tokenizer, harmony's special tokens and
message layout; tests/tiny_models.py). A Lark grammar forces harmony's documented output shape,
`<|channel|>analysis<|message|>THOUGHT<|end|><|start|>assistant<|channel|>final<|message|>ANSWER`,
so the split is deterministic; the server without the flag shows the text with the special
tokens dropped, as any other special tokens are. Slow tier (the engine's start is ~25 s here):
the default tier checks the parser and its kept markers in tests/text/test_reasoning.py.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from local_server import serving  # tests/local_server.py
from tiny_models import gpt_oss_harmony  # tests/tiny_models.py

from jengine.async_engine import AsyncEngine
from jengine.cli.main import build_parser
from jengine.cli.serve import server_config
from jengine.config import ServerConfig
from jengine.server.app import create_app

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
MODEL = "tiny-gpt-oss"
HARMONY = ('start: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant" '
           '<|channel|> "final" <|message|> ANSWER\nTHOUGHT: /[a-z ]{3,12}/\n'
           'ANSWER: /[a-z]{2,6}/\n')
HI = [{"role": "user", "content": "hi"}]

pytestmark = pytest.mark.slow


def _flags(*argv: str) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", *argv]), ServerConfig())


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """OpenAI clients of three servers over one engine: `--reasoning-parser` openai_gptoss,
    auto and none."""
    path = gpt_oss_harmony(tmp_path_factory.mktemp("gpt_oss"))
    engine = AsyncEngine(str(path), config=ONE_BUCKET, progress=False)
    configs = {"openai_gptoss": _flags("--reasoning-parser", "openai_gptoss"),
               "auto": _flags("--reasoning-parser", "auto"), None: _flags()}
    try:
        with serving(create_app(engine, configs["openai_gptoss"], model_name=MODEL)) as h, \
                serving(create_app(engine, configs["auto"], model_name=MODEL)) as a, \
                serving(create_app(engine, configs[None], model_name=MODEL)) as n:
            yield {name: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                       timeout=120)
                   for name, url in zip(configs, (h, a, n))}
    finally:
        engine.shutdown()


def _chat(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=64, temperature=0,
        extra_body={"structured_outputs": {"grammar": HARMONY}}, **kw)


@pytest.mark.parametrize("parser", ["openai_gptoss", "auto"])
def test_analysis_is_reasoning_and_final_is_content(clients, parser):
    raw = _chat(clients[None]).choices[0]
    assert raw.finish_reason == "stop" and raw.message.content.startswith("analysis")
    thought, answer = raw.message.content.removeprefix("analysis").split("assistantfinal")
    message = _chat(clients[parser]).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (
        thought.strip(), thought.strip(), answer)
    assert "<|" not in message.content


def test_streamed_deltas_carry_the_same_split(clients):
    whole = _chat(clients["openai_gptoss"]).choices[0].message
    reasoning, content = [], []
    for chunk in _chat(clients["openai_gptoss"], stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == (whole.reasoning, whole.content)
    assert whole.reasoning and whole.content
