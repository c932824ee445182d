"""Structured-output cases shared by tests/structured/test_structured.py (a few generations per
case) and experiments/structured_check.py (50 per case): a prompt, a constraint and a check of the
output; and a tool for the tool-calling tests."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

import jsonschema

from jengine import SamplingParams
from jengine.sampling_params import StructuredOutputs


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    spec: StructuredOutputs
    valid: Callable[[str], bool]
    max_tokens: int = 96


def _schema_case(name: str, prompt: str, schema: dict) -> Case:
    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True

    return Case(name, prompt, StructuredOutputs(json=schema), valid)


def _regex_case(name: str, prompt: str, regex: str) -> Case:
    return Case(name, prompt, StructuredOutputs(regex=regex),
                lambda text: re.fullmatch(regex, text) is not None, max_tokens=48)


def _obj(properties: dict, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, **extra}


_SHORT = {"type": "string", "maxLength": 24}
_POINT = _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
               "y": {"type": "integer", "minimum": -100, "maximum": 100}})

SCHEMA_CASES = [
    _schema_case("nested", "Describe a person and their home address as JSON.",
                 _obj({"name": _SHORT,
                       "address": _obj({"city": _SHORT,
                                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    _schema_case("array", "List a few tags for a blog post about cooking, as JSON.",
                 _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                "minItems": 2, "maxItems": 4}})),
    _schema_case("enum_range", "Pick a colour and rate it from 1 to 10, as JSON.",
                 _obj({"color": {"enum": ["red", "green", "blue"]},
                       "score": {"type": "integer", "minimum": 1, "maximum": 10}})),
    _schema_case("ref_defs", "Give the start and end points of a line segment as JSON.",
                 {"$defs": {"point": _POINT},
                  **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})}),
    _schema_case("any_of", "Give me one value (a number, a word or a boolean) as JSON.",
                 _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                           {"type": "string", "maxLength": 20},
                                           {"type": "boolean"}]}})),
    _schema_case("pattern", "Make up a product code and a price as JSON.",
                 _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                       "price": {"type": "number", "minimum": 0, "maximum": 1000}})),
]

REGEX_CASES = [
    _regex_case("email", "Write an email address for John Smith.",
                r"[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.(com|org|net)"),
    _regex_case("iso_date", "When did the first moon landing happen? Answer with the date.",
                r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    _regex_case("phone", "Write a US phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
]

CHOICES = ["positive", "negative", "neutral"]
CHOICE_CASE = Case("choice", "Is the sentiment of 'I love this movie!' positive, negative or "
                   "neutral?", StructuredOutputs(choice=CHOICES), lambda text: text in CHOICES,
                   max_tokens=8)

CASES = SCHEMA_CASES + REGEX_CASES + [CHOICE_CASE]


# An OpenAI function tool for the tool-calling tests.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@dataclasses.dataclass
class Tally:
    stop: int = 0
    length: int = 0
    valid: int = 0  # of the outputs that finished with "stop"
    bad: list[str] = dataclasses.field(default_factory=list)


def run_cases(engine, cases: list[Case], n: int, *, temperature: float = 0.7,
              seed: int = 0) -> list[Tally]:
    """`n` samples of each case, all in one batched `generate`; every "stop" output checked."""
    prompts = [engine.render_chat([{"role": "user", "content": c.prompt}]) for c in cases]
    params = [SamplingParams(n=n, temperature=temperature, max_tokens=c.max_tokens, seed=seed,
                             structured_outputs=c.spec) for c in cases]
    tallies = []
    for case, out in zip(cases, engine.generate(prompts, params)):
        tally = Tally()
        for completion in out.outputs:
            if completion.finish_reason == "length":
                tally.length += 1
                continue
            assert completion.finish_reason == "stop", completion.finish_reason
            tally.stop += 1
            if case.valid(completion.text):
                tally.valid += 1
            else:
                tally.bad.append(completion.text)
        tallies.append(tally)
    return tallies
