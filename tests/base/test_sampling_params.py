"""SamplingParams / StructuredOutputs: vLLM's defaults, normalisation, and every rejected value."""

import dataclasses
import math

import numpy as np
import pytest

from jengine.sampling_params import SamplingParams, StructuredOutputs


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logit_bias, p.seed, p.stop, p.stop_token_ids) == (None, None, (), ())
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (
        False,
        False,
        True,
    )
    assert (p.logprobs, p.prompt_logprobs, p.structured_outputs) == (None, None, None)
    assert not p.greedy


def test_frozen_and_keyword_only():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


def test_normalisation():
    p = SamplingParams(
        top_k=-1,
        stop="END",
        stop_token_ids=[np.int64(7), 3],
        logit_bias={np.int32(5): 1, 6: -2.5},
        seed=np.int64(3),
        temperature=np.float32(0.5),
        max_tokens=None,
    )
    assert p.top_k == 0
    assert p.stop == ("END",)
    assert p.stop_token_ids == (7, 3) and all(type(t) is int for t in p.stop_token_ids)
    assert p.logit_bias == {5: 1.0, 6: -2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert p.seed == 3 and type(p.seed) is int
    assert type(p.temperature) is float
    assert p.max_tokens is None
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_logit_bias_is_copied():
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = 5.0
    assert p.logit_bias == {1: 2.0}


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [({"temperature": 0}, True), ({"top_k": 1}, True), ({"temperature": 1e-6}, True),
     ({"temperature": 0.01}, False), ({}, False)],
)
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_boundary_values_accepted():
    SamplingParams(
        n=1,
        max_tokens=1,
        min_tokens=1,
        temperature=0,
        top_p=1,
        top_k=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        logprobs=20,
        prompt_logprobs=0,
        seed=-5,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"^n must be an integer at least 1, got 0\.$"),
        ({"n": 1.5}, r"^n must be an integer at least 1, got 1\.5\.$"),
        ({"n": True}, r"^n must be an integer"),
        ({"max_tokens": 0}, r"^max_tokens must be an integer at least 1, got 0\.$"),
        ({"max_tokens": "8"}, r"^max_tokens must be an integer"),
        ({"min_tokens": -1}, r"^min_tokens must be an integer at least 0, got -1\.$"),
        ({"min_tokens": 17}, r"^min_tokens must be <= max_tokens=16, got 17\.$"),
        ({"temperature": -0.1}, r"^temperature must be >= 0, got -0\.1\.$"),
        ({"temperature": math.nan}, r"^temperature must be a finite number, got nan\.$"),
        ({"temperature": "hot"}, r"^temperature must be a finite number"),
        ({"top_p": 0.0}, r"^top_p must be in \(0, 1\], got 0\.0\.$"),
        ({"top_p": 1.01}, r"^top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"^top_k must be an integer at least -1, got -2\.$"),
        ({"top_k": 2.0}, r"^top_k must be an integer"),
        ({"min_p": -0.01}, r"^min_p must be in \[0, 1\], got -0\.01\.$"),
        ({"min_p": 1.5}, r"^min_p must be in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"^presence_penalty must be in \[-2, 2\], got 2\.5\.$"),
        ({"presence_penalty": -2.5}, r"^presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"^frequency_penalty must be in \[-2, 2\], got -3\.$"),
        ({"frequency_penalty": math.inf}, r"^frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0}, r"^repetition_penalty must be > 0, got 0\.$"),
        ({"repetition_penalty": -1.0}, r"^repetition_penalty must be > 0, got -1\.0\.$"),
        ({"logit_bias": [1, 2]}, r"^logit_bias must be a dict mapping token ids to biases"),
        ({"logit_bias": {"5": 1.0}}, r"^logit_bias keys must be integer token ids"),
        ({"logit_bias": {5: math.inf}}, r"^logit_bias\[5\] must be a finite number, got inf\.$"),
        ({"logit_bias": {5: "x"}}, r"^logit_bias\[5\] must be a finite number"),
        ({"seed": 1.5}, r"^seed must be an integer, got 1\.5\.$"),
        ({"seed": "42"}, r"^seed must be an integer"),
        ({"stop": 5}, r"^stop has an unknown stop type .*, got 5\.$"),
        ({"stop": ["ok", 5]}, r"^stop has an unknown stop type"),
        ({"stop": {"a": 1}}, r"^stop has an unknown stop type"),
        ({"stop": ""}, r"^stop must not contain empty strings"),
        ({"stop": ["a", ""]}, r"^stop must not contain empty strings"),
        ({"stop_token_ids": [1, -2]}, r"^stop_token_ids must be a list of non-negative integer"),
        ({"stop_token_ids": 7}, r"^stop_token_ids must be a list"),
        ({"stop_token_ids": ["7"]}, r"^stop_token_ids must be a list"),
        ({"logprobs": 21}, r"^logprobs must be an integer between 0 and 20, got 21\.$"),
        ({"logprobs": -1}, r"^logprobs must be an integer between 0 and 20"),
        ({"prompt_logprobs": 21}, r"^prompt_logprobs must be an integer between 0 and 20"),
        ({"prompt_logprobs": 1.0}, r"^prompt_logprobs must be an integer between 0 and 20"),
        (
            {"structured_outputs": {"regex": "a"}},
            r"^structured_outputs must be a StructuredOutputs",
        ),
    ],
)
def test_invalid_values_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_structured_outputs_accepts_each_kind():
    for kwargs in (
        {"json": {"type": "object"}},
        {"json": '{"type": "string"}'},
        {"regex": "[a-z]+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a"'},
        {"json_object": True},
        {},
    ):
        so = StructuredOutputs(**kwargs)
        assert SamplingParams(structured_outputs=so).structured_outputs is so


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": {}, "regex": "a"}, r"^structured_outputs: set at most one of json, regex"),
        ({"choice": ["a"], "json_object": True}, r"^structured_outputs: set at most one"),
        ({"grammar": "g", "regex": "a"}, r"^structured_outputs: set at most one"),
        ({"json": "{not json"}, r"^structured_outputs\.json is not valid JSON"),
        ({"json": 5}, r"^structured_outputs\.json must be a JSON schema object, got 5\.$"),
        ({"json": "[1]"}, r"^structured_outputs\.json must be a JSON schema object"),
        ({"regex": 5}, r"^structured_outputs\.regex must be a str, got 5\.$"),
        ({"grammar": ["a"]}, r"^structured_outputs\.grammar must be a str"),
        ({"choice": []}, r"^structured_outputs\.choice must be a non-empty list of str"),
        ({"choice": ["a", 1]}, r"^structured_outputs\.choice must be a non-empty list of str"),
        ({"choice": "ab"}, r"^structured_outputs\.choice must be a non-empty list of str"),
        ({"json_object": 1}, r"^structured_outputs\.json_object must be a bool, got 1\.$"),
    ],
)
def test_invalid_structured_outputs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_max_tokens_none_runs_to_the_context_end():
    assert SamplingParams(max_tokens=None).max_tokens_for(room=100) == 100  # default is 16
    assert SamplingParams(max_tokens=7).max_tokens_for(room=100) == 7
