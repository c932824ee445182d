"""How one request wants its tokens chosen and when it wants them to stop.

`SamplingParams` keeps vLLM's field names and defaults, so that code and habits written for vLLM
carry over. It is validated once, at construction, so that nothing downstream (scheduler, sampler,
detokenizer, server) re-checks it: a bad value raises `ValueError` with a one-line message naming
the field, which the CLI prints and the server turns into HTTP 400.

Some fields are normalised on the way in: `top_k=-1` becomes 0 (both mean "off"), `stop` becomes a
tuple of strings, `stop_token_ids` a tuple of ints, numbers their plain Python type.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs; also bounds the device->host transfer.
# Temperatures below this are greedy (vLLM's epsilon): dividing by them would overflow the logits.
# The one definition of greedy: `SamplingParams.greedy` and the device sampler both read it.
GREEDY_TEMPERATURE = 1e-5


def _fail(field: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"{field} {requirement}, got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(field: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """`value` as a plain int, checked to lie in [low, high] (None: unbounded)."""
    if _is_int(value) and (low is None or value >= low) and (high is None or value <= high):
        return int(value)
    if low is not None and high is not None:
        raise _fail(field, f"must be an integer between {low} and {high}", value)
    if low is not None:
        raise _fail(field, f"must be an integer at least {low}", value)
    raise _fail(field, "must be an integer", value)


def _optional_int(
    field: str, value: Any, low: int | None = None, high: int | None = None
) -> int | None:
    return None if value is None else _int(field, value, low, high)


def _float(field: str, value: Any) -> float:
    """`value` as a plain float, checked to be a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _fail(field, "must be a finite number", value)
    return float(value)


def _real(field: str, value: Any, valid: Callable[[float], bool], requirement: str) -> float:
    """`value` as a plain float, checked to be finite and to satisfy `valid`."""
    number = _float(field, value)
    if not valid(number):
        raise _fail(field, requirement, value)
    return number


def _non_negative(x: float) -> bool:
    return x >= 0.0


def _positive(x: float) -> bool:
    return x > 0.0


def check_text(field: str, text: str) -> str:
    """`text` itself, or a ValueError naming `field` when it cannot be encoded as UTF-8 (a lone
    surrogate such as "\\ud800", which JSON allows and every tokenizer rejects)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field} is not valid Unicode text: {text[e.start:e.end]!a} at character {e.start} "
            "cannot be encoded as UTF-8 (a lone surrogate?)"
        ) from None
    return text


def check_strings(field: str, value: Any) -> None:
    """Raises ValueError naming the path of the first string inside `value` (dicts, lists)
    that cannot be encoded as UTF-8; see `check_text`."""
    if isinstance(value, str):
        check_text(field, value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(field, key)
            check_strings(f"{field}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_strings(f"{field}.{i}", item)


def _strings(field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise _fail(field, f"has an unknown {field.removesuffix('s')} type (expected a str or "
                    "a list of str)", value)
    if any(not s for s in strings):
        raise _fail(field, "must not contain empty strings", value)
    return tuple(check_text(field, s) for s in strings)


def _token_ids(field: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise _fail(field, "must be a list of non-negative integer token ids", value)
    return tuple(int(t) for t in value)


def _allowed_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = _token_ids("allowed_token_ids", value)
    if not ids:
        raise _fail("allowed_token_ids", "must not be empty", value)
    return ids


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _fail("logit_bias", "must be a dict mapping token ids to biases", value)
    if not all(_is_int(k) for k in value):
        raise _fail("logit_bias", "keys must be integer token ids", value)
    return {int(k): _float(f"logit_bias[{k}]", v) for k, v in value.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """A constraint on the generated text; at most one kind may be set.

    Attributes:
      json: a JSON schema (dict, or its JSON text) the output must validate against.
      regex: a regular expression the whole output must match.
      choice: the output must be exactly one of these strings.
      grammar: a context-free grammar (EBNF / Lark, as the grammar backend reads it).
      json_object: the output must be some JSON object (OpenAI's `json_object` response format).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        kinds = [self.json, self.regex, self.choice, self.grammar]
        if sum(kind is not None for kind in kinds) + bool(self.json_object) > 1:
            raise ValueError(
                "structured_outputs: set at most one of json, regex, choice, grammar, json_object."
            )
        if self.json is not None:
            self._check_json(self.json)
        if self.regex is not None and not isinstance(self.regex, str):
            raise _fail("structured_outputs.regex", "must be a str", self.regex)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise _fail("structured_outputs.grammar", "must be a str", self.grammar)
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise _fail("structured_outputs.choice", "must be a non-empty list of str", self.choice)
        if not isinstance(self.json_object, bool):
            raise _fail("structured_outputs.json_object", "must be a bool", self.json_object)

    @staticmethod
    def _check_json(schema: Any) -> None:
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except jsonlib.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
        if not isinstance(schema, (dict, bool)):
            raise _fail("structured_outputs.json", "must be a JSON schema object", schema)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling and stopping settings, with vLLM's names and defaults.

    Attributes:
      n: completions to generate for the prompt.
      max_tokens: most tokens to generate per completion; None means up to the context length.
      min_tokens: tokens to generate before EOS, `stop_token_ids` or `stop` may end a completion.
      temperature: softmax temperature; 0 (below `GREEDY_TEMPERATURE`) means greedy.
      top_p: nucleus sampling mass in (0, 1]; 1 means off.
      top_k: sample among the k most likely tokens; 0 means off (-1 is accepted, stored as 0).
      min_p: drop tokens less likely than min_p times the most likely one; 0 means off.
      presence_penalty: subtracted once from the logit of every token already generated.
      frequency_penalty: subtracted from a token's logit per time it was generated.
      repetition_penalty: divides positive (multiplies negative) logits of prompt and generated
        tokens; 1 means off.
      logit_bias: token id -> value added to its logit before sampling.
      seed: makes this request's sampling reproducible regardless of what it is batched with.
      stop: strings that end a completion when generated; the text stops before them.
      stop_token_ids: token ids that end a completion (in addition to EOS).
      ignore_eos: keep generating past EOS.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
      skip_special_tokens: leave special tokens out of the text.
      keep_special_tokens: special tokens (by their text) kept in the text even under
        skip_special_tokens: a tool-call format's markers that are special tokens (Mistral's
        `[TOOL_CALLS]`), which its parser must see; set by `tools.constrain`.
      logprobs: how many top log-probabilities to return per generated token, besides the sampled
        token's own; None returns none.
      prompt_logprobs: the same, per prompt token.
      structured_outputs: a constraint (JSON schema, regex, choice, grammar) on the output.
      allowed_token_ids: only these tokens may be generated (None: any).
      bad_words: words that must not be generated: a word's last token is banned whenever the
        tokens before it were just generated (its first token, for a one-token word).
      truncate_prompt_tokens: keep only the last this many prompt tokens (None: all).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    keep_special_tokens: Sequence[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, value in self._validated().items():
            object.__setattr__(self, name, value)

    def _validated(self) -> dict[str, Any]:
        """Every field checked and normalised; raises ValueError on the first bad one."""
        penalty = (lambda x: -2.0 <= x <= 2.0), "must be in [-2, 2]"
        fields = {
            "n": _int("n", self.n, 1),
            "max_tokens": _optional_int("max_tokens", self.max_tokens, 1),
            "min_tokens": _int("min_tokens", self.min_tokens, 0),
            "temperature": _real("temperature", self.temperature, _non_negative, "must be >= 0"),
            "top_p": _real("top_p", self.top_p, lambda x: 0.0 < x <= 1.0, "must be in (0, 1]"),
            "top_k": max(_int("top_k", self.top_k, -1), 0),  # -1 and 0 both mean "off"
            "min_p": _real("min_p", self.min_p, lambda x: 0.0 <= x <= 1.0, "must be in [0, 1]"),
            "presence_penalty": _real("presence_penalty", self.presence_penalty, *penalty),
            "frequency_penalty": _real("frequency_penalty", self.frequency_penalty, *penalty),
            "repetition_penalty": _real(
                "repetition_penalty", self.repetition_penalty, _positive, "must be > 0"
            ),
            "logit_bias": _logit_bias(self.logit_bias),
            "seed": _optional_int("seed", self.seed),
            "stop": _strings("stop", self.stop),
            "stop_token_ids": _token_ids("stop_token_ids", self.stop_token_ids),
            "keep_special_tokens": _strings("keep_special_tokens", self.keep_special_tokens),
            "logprobs": _optional_int("logprobs", self.logprobs, 0, MAX_LOGPROBS),
            "prompt_logprobs": _optional_int(
                "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS
            ),
            "allowed_token_ids": _allowed_ids(self.allowed_token_ids),
            "bad_words": _strings("bad_words", self.bad_words),
            "truncate_prompt_tokens": _optional_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, 1
            ),
        }
        if fields["max_tokens"] is not None and fields["min_tokens"] > fields["max_tokens"]:
            raise _fail("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise _fail("structured_outputs", "must be a StructuredOutputs", so)
        return fields

    @property
    def uses_token_history(self) -> bool:
        """Whether a penalty reads the sequence's token history (built on the host each step)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def max_tokens_for(self, room: int) -> int:
        """The tokens one completion may generate with `room` tokens of context left after its
        prompt: `max_tokens`, or (None) up to the context's end. The one place None is
        resolved: admission passes the room left, the server (before tokenizing) the whole
        context as the bound."""
        return room if self.max_tokens is None else self.max_tokens

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax: temperature 0 (below `GREEDY_TEMPERATURE`, as on
        the device), or only the top token allowed."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
