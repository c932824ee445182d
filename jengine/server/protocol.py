"""OpenAI request bodies as pydantic models, and their translation into `SamplingParams`.

Top-level request fields are `extra="forbid"`, as in OpenAI's API (an unknown argument is a 400),
except that vLLM's sampling extras are accepted too (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`) and vLLM's structured-output fields (`structured_outputs` and the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), which, like `response_format`
and a forcing `tool_choice`, each constrain the output: at most one may be set per request.
vLLM's fields for what this server does not do are accepted at the value that asks for nothing
(what clients send unasked: `use_beam_search: false`, `length_penalty: 1.0`, empty `vllm_xargs`
and `kv_transfer_params`) and a 400 naming the field otherwise; `spaces_between_special_tokens`
is accepted and changes nothing (the fast tokenizer never puts spaces between special tokens,
as in vLLM with one); `cache_salt` only where nothing is shared (prefix caching off).
Message objects accept extra keys. Numbers and flags are strict
(`"5"` is not an integer, `1` is not a boolean). Value ranges are left to `SamplingParams`,
whose ValueError becomes a 400 with the same message.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    WithJsonSchema,
)

from jengine.sampling_params import SamplingParams, StructuredOutputs, check_strings
from jengine.server.errors import bad_request
from jengine.vision.chat import IMAGE_PART_TYPES

# What /openapi.json says about values the handlers and `SamplingParams` check themselves:
# these only document (the checks keep their own messages). A token id is at least 0, and
# below the vocabulary's size: openapi.py turns the marker into that maximum once the engine
# is loaded.
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "x-token-id": True}
TokenId = Annotated[StrictInt, WithJsonSchema(TOKEN_ID_SCHEMA)]
NON_EMPTY = {"minItems": 1}
# `prompt` (the handler checks it: `CompletionRequest.prompts`); embeddings' `input` too.
PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
     "minItems": 1},
]}
MAX_LOGPROBS = {"minimum": 0, "maximum": 20}


def documented(**schema: Any) -> Any:
    """A field whose /openapi.json schema also says `schema` (bounds checked elsewhere)."""
    return Field(None, json_schema_extra=schema)
Float = Annotated[float, Strict()]  # accepts JSON integers, rejects strings
# guided_decoding_backend values that name the backend this server has (vLLM's names)
_BACKENDS = (None, "auto", "guidance", "llguidance")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's: usage on every chunk
    include_obfuscation: StrictBool | None = False  # OpenAI's (default true there): padding


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = documented(**NON_EMPTY)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class SamplingFields(BaseModel):
    """The fields chat and completions share, and the vLLM extras."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None  # None: the served model
    n: StrictInt | None = Field(1, json_schema_extra={"minimum": 1})
    temperature: Float | None = documented(minimum=0, maximum=2)
    top_p: Float | None = documented(exclusiveMinimum=0, maximum=1)
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted and ignored, as by OpenAI
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: StrictInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = documented(**NON_EMPTY)
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    priority: StrictInt | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    request_id: StrictStr | None = None
    spaces_between_special_tokens: StrictBool | None = None  # no effect (module docstring)
    cache_salt: StrictStr | None = None
    thinking_token_budget: StrictInt | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    use_beam_search: StrictBool | None = None
    length_penalty: Float | None = None

    # Whether the route reads reasoning (chat): elsewhere a thinking budget is a 400.
    has_reasoning: ClassVar[bool] = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's sampling fields; a field left out or null keeps vLLM's default."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if self.temperature is not None and self.temperature > 2.0:
            raise bad_request(f"temperature must be between 0 and 2, got {self.temperature}",
                              "temperature")
        if self.priority:
            raise bad_request("priority scheduling is not enabled (requests are served first "
                              "come, first served); leave priority at 0", "priority")
        self._check_unsupported_extras()
        if self.guided_decoding_backend not in _BACKENDS:
            raise bad_request(f"guided_decoding_backend {self.guided_decoding_backend!r} is not "
                              "available; structured outputs use llguidance ('guidance')",
                              "guided_decoding_backend")
        names = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                 "stop", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                 "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        constraint = self.constraint()
        return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, logit_bias=self._logit_bias(),
                              structured_outputs=constraint[1] if constraint else None)

    def _check_unsupported_extras(self) -> None:
        """vLLM's fields for features this server lacks: their no-op values pass (clients send
        them unasked), anything else is a 400 that names the field."""
        if self.use_beam_search:
            raise bad_request("beam search is not supported; use_beam_search must be false",
                              "use_beam_search")
        if self.length_penalty is not None and self.length_penalty != 1.0:
            raise bad_request("length_penalty only applies to beam search, which is not "
                              "supported; leave it at 1.0", "length_penalty")
        if self.thinking_token_budget is not None and not self.has_reasoning:
            raise bad_request("thinking_token_budget applies to chat completions on a server "
                              "with --reasoning-parser; leave it out", "thinking_token_budget")
        if self.vllm_xargs:
            raise bad_request("vllm_xargs is not supported: this server has no custom logits "
                              "processors to pass arguments to", "vllm_xargs")
        if self.kv_transfer_params:
            raise bad_request("kv_transfer_params is not supported: this server does not "
                              "disaggregate prefill and decode", "kv_transfer_params")

    def check_cache_salt(self, prefix_caching: bool) -> None:
        """`cache_salt` asks that only requests with the same salt share cached prompt pages
        (so that one tenant cannot time another's prompts). The prefix cache here is not
        partitioned: the salt is honoured only when nothing is shared at all."""
        if self.cache_salt is not None and prefix_caching:
            raise bad_request("cache_salt is not supported: the prefix cache is shared by all "
                              "requests (start the server with --no-enable-prefix-caching to "
                              "share nothing)", "cache_salt")

    def constraint_param(self) -> str | None:
        """The field whose constraint the engine compiles (for the 400 of a bad one)."""
        constraint = self.constraint()
        return constraint[0] if constraint else None

    def constraint(self) -> tuple[str, StructuredOutputs] | None:
        """(the field that set it, the constraint) of the request's one output constraint."""
        found = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                found.append(("response_format", spec))
        so = self.structured_outputs
        if so is not None:
            fields = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                      "grammar": so.grammar, "json_object": so.json_object or False}
            found.append(("structured_outputs", structured("structured_outputs", **fields)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", structured(f"guided_{kind}", **{kind: value})))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise bad_request(f"only one output constraint may be set; got {names}", found[1][0])
        return found[0] if found else None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().lstrip("-").isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {value}",
                                  "logit_bias")
            bias[int(key)] = value
        return bias


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)] = Field(...)
    max_tokens: StrictInt | None = Field(16, json_schema_extra={"minimum": 0})  # 0: echo only
    echo: StrictBool | None = False
    logprobs: StrictInt | None = documented(**MAX_LOGPROBS)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) back, nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of engine prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return list(p)
            if all(_is_token(x) for x in p):
                return [list(p)]
            if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in p):
                return [list(x) for x in p]
        if isinstance(p, list) and not p:
            raise bad_request("prompt must not be empty", "prompt")
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists", "prompt")

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of must equal n (best-of selection is not supported)",
                              "best_of")
        # echo + logprobs: the echoed prompt tokens get their logprobs too, as in OpenAI
        prompt_logprobs = self.logprobs if self.echo else None
        # Scoring a prompt runs one token, which the view leaves out.
        max_tokens = 1 if self.scores_only else self.max_tokens
        return self._sampling_params(max_tokens=max_tokens, logprobs=self.logprobs,
                                     prompt_logprobs=prompt_logprobs)


def check_text_fields(body: BaseModel) -> None:
    """A 400 naming the first string field (at any depth) that is not valid Unicode, such as a
    lone surrogate, which JSON can carry ("\\ud800") and no tokenizer can encode."""
    for name in type(body).model_fields:
        try:
            check_strings(name, _plain(getattr(body, name)))
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def structured(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputs | None:
    """OpenAI's `response_format` as a constraint (None for plain text)."""
    kind = fmt.get("type")
    if kind == "text" and len(fmt) == 1:
        return None
    if kind == "json_object" and len(fmt) == 1:
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request("response_format json_schema needs a 'json_schema' object with a "
                              "'name'", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema.schema must be an object",
                              "response_format")
        return structured("response_format", json=schema)
    raise bad_request("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                      "{'type': 'json_schema', 'json_schema': {...}}", "response_format")


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def for_template(self, position: int) -> dict[str, Any]:
        """The message as the chat template expects it: text content, `developer` as system."""
        content = self.content
        if isinstance(content, list) and any(p.type in IMAGE_PART_TYPES for p in content):
            # Parts as given: `jengine.vision.chat.split_images` reads and checks them.
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part type {part.type!r} is not supported (only "
                                      "'text' and 'image_url')", f"messages.{position}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"messages[{position}] ({self.role}) needs content",
                              f"messages.{position}.content")
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content or "",
        }
        for key in ("name", "tool_call_id", "tool_calls"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        return message


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a prompt, or chat messages rendered as the chat endpoint renders them."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = documented(**NON_EMPTY)
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[TokenId]
