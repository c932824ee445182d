"""Constrained decoding on the real SmolLM2: the llguidance backend (errors, mask layout, EOS),
the engine (every case of tests/structured_cases.py, length, n > 1, preemption, abort) and tool
calling through `Engine.chat`. experiments/structured_check.py runs the same cases 50 times each."""

from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from structured_cases import CASES, WEATHER, run_cases

from jengine import SamplingParams
from jengine.runtime.sampler import _unpack_bitmask
from jengine.sampling_params import StructuredOutputs
from jengine.scheduling.sequence import SequenceStatus
from jengine.structured.llguidance_backend import LLGuidanceBackend
from jengine.text.tools import (
    CallArguments,
    CallStart,
    ToolCallStream,
    parse_tool_calls,
    text_messages,
    tool_setup,
)

EOS = 2  # SmolLM2's <|im_end|>

ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


@pytest.fixture(scope="module")
def backend(smol_engine):
    core = smol_engine.core
    return LLGuidanceBackend(core.tokenizer, core.model_config.vocab_size, core.eos_token_ids)


def _allowed(backend, matcher) -> np.ndarray:
    """The matcher's mask as [V] bool, unpacked by the sampler's own unpacking."""
    mask = np.zeros((1, -(-backend.tokenizer.vocab_size // 32)), np.int32)
    backend.fill_masks([(matcher, 0)], mask)
    return np.asarray(_unpack_bitmask(jnp.asarray(mask), backend.tokenizer.vocab_size))[0]


# -- the backend -------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputs(regex="[a-"), "unclosed character class"),
    (StructuredOutputs(json={"type": "string", "format": "bogus"}), "Unknown format: bogus"),
    (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "/$defs/missing"),
    (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_invalid_specs_raise_value_error_with_the_backend_message(backend, spec, message):
    with pytest.raises(ValueError, match="structured_outputs") as info:
        backend.compile(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_mask_layout_matches_the_sampler_and_eos_comes_when_the_grammar_accepts(backend,
                                                                                  smol_tokenizer):
    matcher = backend.compile(StructuredOutputs(choice=["yes", "yesterday"])).matcher()
    allowed = _allowed(backend, matcher)
    # llguidance's own per-token answer (one byte per token), independent of the bit layout
    reference = np.frombuffer(matcher._m.compute_logit_bias(), np.uint8) > 0
    np.testing.assert_array_equal(allowed, reference[: allowed.shape[0]])
    assert allowed.any() and not allowed[EOS]
    for tid in np.flatnonzero(allowed):
        assert "yesterday".startswith(smol_tokenizer.decode([int(tid)]))
    for tid in smol_tokenizer("yes", add_special_tokens=False).input_ids:
        assert matcher.accept(tid)
    allowed = _allowed(backend, matcher)
    assert allowed[EOS] and allowed.sum() > 1  # "yes" may end here, or go on to "yesterday"
    assert not matcher.is_stopped


def test_compiled_grammars_are_cached(smol_engine):
    grammars = smol_engine.core.grammars
    spec = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    same = StructuredOutputs(json=json.dumps(spec.json))
    assert grammars.submit(spec).result() is grammars.submit(same).result()


# -- the engine --------------------------------------------------------------------------------

def test_every_case_validates_at_temperature_0_7(smol_engine):
    """Four samples of every case in one batch (the script runs 50 each)."""
    tallies = run_cases(smol_engine, CASES, n=4)
    report = {case.name: (t.stop, t.length, t.valid) for case, t in zip(CASES, tallies)}
    print("\ncase: (stop, length, valid)", report)
    for case, tally in zip(CASES, tallies):
        assert tally.valid == tally.stop, (case.name, tally.bad)
        assert tally.stop >= 3, (case.name, report[case.name])


def test_max_tokens_mid_structure_finishes_with_length(smol_engine):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    params = SamplingParams(max_tokens=3, temperature=0,
                            structured_outputs=StructuredOutputs(json=schema))
    [out] = smol_engine.generate("Write a JSON object.", params)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text.startswith('{"text"')


def test_greedy_constrained_output_is_deterministic(smol_engine):
    params = SamplingParams(max_tokens=20, temperature=0, n=2,
                            structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"))
    [out] = smol_engine.generate("My number is", params)
    texts = {o.text for o in out.outputs}
    assert len(texts) == 1 and all(o.finish_reason == "stop" for o in out.outputs), out.outputs


def test_preempted_constrained_sequence_resumes_its_grammar(smol_engine):
    """Preemption by recompute keeps the output tokens, and the matcher that consumed them."""
    core = smol_engine.core
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 6, "maxItems": 6}
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=5,
                            structured_outputs=StructuredOutputs(json=schema))
    state = core.add_request("preempt-me", "Six numbers as a JSON array:", params)
    seq = state.samples[0].seq
    while len(seq.output_ids) < 4:
        core.step()
    core.scheduler._preempt(seq)
    assert seq.status is SequenceStatus.WAITING and seq.num_computed == 0
    while not seq.is_finished:
        core.step()
    assert seq.num_preemptions == 1 and seq.finish_reason == "stop"
    jsonschema.validate(json.loads(state.samples[0].text), schema)


def test_abort_drops_a_constrained_request(smol_engine):
    core = smol_engine.core
    params = SamplingParams(max_tokens=30, structured_outputs=StructuredOutputs(regex="[a-z]{20}"))
    core.add_request("abort-me", "Twenty letters:", params)
    core.step()
    assert core.abort("abort-me").finished
    assert "abort-me" not in core.requests and not core.scheduler.has_work


def test_min_tokens_does_not_fight_the_grammar(smol_engine):
    params = SamplingParams(min_tokens=5, max_tokens=10, temperature=0,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    [out] = smol_engine.generate("Yes or no?", params)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


# -- tool calling --------------------------------------------------------------------------------

def _check_call(call) -> None:
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])


def test_named_tool_call_has_valid_arguments(smol_engine):
    """The server tests cover tool_choice required (and named) through the SDK."""
    choice = {"type": "function", "function": {"name": "add"}}
    params = SamplingParams(n=4, temperature=0.7, max_tokens=40, seed=2)
    [out] = smol_engine.chat([{"role": "user", "content": "What is 17 plus 25?"}], params,
                             tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    finished = [o for o in out.outputs if o.finish_reason == "tool_calls"]
    assert finished, out.outputs
    for o in finished:
        assert len(o.tool_calls) == 1 and o.text == ""
        for call in o.tool_calls:
            _check_call(call)
            assert call.name == "add"


def test_tool_setup_validates_tools_and_choice():
    assert tool_setup(None).choice == "none"
    assert tool_setup(TOOLS).choice == "auto"
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        tool_setup([{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ValueError, match="tool_choice"):
        tool_setup(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="unique"):
        tool_setup([ADD, ADD])
    with pytest.raises(ValueError, match="cannot be combined"):
        from jengine.text.tools import constrain

        constrain(SamplingParams(structured_outputs=StructuredOutputs(regex="a")),
                  tool_setup(TOOLS, "required"))


def test_tool_calls_parse_whole_and_streamed():
    text = ('Let me check.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '</tool_call>\n<tool_call>not json</tool_call>')
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert content == "Let me check.\n\n\n<tool_call>not json</tool_call>"
    for size in (1, 3, 10):
        pieces = _stream(text, size, incremental=False)
        assert _reassemble(pieces) == [(c.name, json.loads(c.arguments)) for c in calls]
        assert _argument_texts(pieces) == [c.arguments for c in calls]
        assert "".join(p for p in pieces if isinstance(p, str)).startswith("Let me check.")
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_forced_tool_calls_stream_argument_fragments():
    text = ('<tool_call>{"name": "add", "arguments": {"a": {"b": [1, 2]}, "c": "}"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    expected = [("add", {"a": {"b": [1, 2]}, "c": "}"}), ("get_weather", {"city": "Oslo"})]
    # the streamed argument text is the non-streamed one to the character (no leading space)
    whole = [c.arguments for c in parse_tool_calls(text, forced=True)[1]]
    for size in (1, 4, 9, len(text)):
        pieces = _stream(text, size, incremental=True)
        assert _reassemble(pieces) == expected
        assert _argument_texts(pieces) == whole, size
        assert not any(isinstance(p, str) for p in pieces)
        fragments = [p for p in pieces if isinstance(p, CallArguments)]
        assert size == len(text) or len(fragments) > 2


def _stream(text: str, size: int, *, incremental: bool) -> list:
    stream, pieces = ToolCallStream(incremental), []
    for i in range(0, len(text), size):
        pieces += stream.feed(text[i:i + size])
    return pieces + stream.finish()


def _argument_texts(pieces: list) -> list[str]:
    texts: dict[int, str] = {}
    for p in pieces:
        if isinstance(p, CallArguments):
            texts[p.index] = texts.get(p.index, "") + p.text
    return [texts[i] for i in sorted(texts)]


def _reassemble(pieces: list) -> list[tuple[str, dict]]:
    calls: dict[int, list] = {}
    for p in pieces:
        if isinstance(p, CallStart):
            assert p.index not in calls and p.id.startswith("call_")
            calls[p.index] = [p.name, ""]
        elif isinstance(p, CallArguments):
            calls[p.index][1] += p.text
    return [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]


def test_tool_messages_render_as_text_for_a_template_without_tools(smol_engine):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees, snow"},
    ]
    rendered = text_messages(messages, [WEATHER["function"]])
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert rendered[2]["content"] == ('<tool_call>{"name": "get_weather", "arguments": '
                                      '{"city": "Oslo", "unit": "celsius"}}</tool_call>')
    assert rendered[3]["role"] == "user" and "-3 degrees, snow" in rendered[3]["content"]
    text = smol_engine.tokenizer.decode(smol_engine.render_chat(messages, tools=[WEATHER]))
    assert "-3 degrees, snow" in text and '"city": "Oslo"' in text and "get_weather" in text
