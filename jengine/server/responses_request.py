"""The `POST /v1/responses` request body, and its translation into the chat request it means
(`ResponsesRequest.chat_request`): `instructions` become a first system message, `input` items
chat messages (`function_call` items an assistant turn's `tool_calls`, `function_call_output`
items `role: tool` results), `text.format` becomes `response_format`, and the flat function
tools become chat tools. Fields that need stored state are a 400 naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from jengine.server.chat_request import ChatCompletionRequest
from jengine.server.errors import bad_request, validation_message
from jengine.server.protocol import Float


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# Fields that need state or features this server does not have: set, they give a 400 saying so.
_UNSUPPORTED = {
    "previous_response_id": "previous_response_id is not supported: this server stores no "
                            "responses (send the whole conversation as input)",
    "conversation": "conversation is not supported: this server stores no conversations (send "
                    "the whole conversation as input)",
    "prompt": "prompt (stored prompt templates) is not supported",
    "background": "background responses are not supported",
    "include": "include is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses",
    "max_tool_calls": "max_tool_calls is not supported (parallel_tool_calls: false allows one)",
    "reasoning": "reasoning is not supported: the model does not reason",
    "context_management": "context_management is not supported",
}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (stateless)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None  # None: the served model
    input: StrictStr | list[dict[str, Any]] = Field(..., json_schema_extra={"minItems": 1})
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing is padded
    text: ResponseTextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # accepted and ignored, as they do not change what is generated
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None  # nothing is stored either way
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    # refused (`_UNSUPPORTED`)
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    prompt: Any = None
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    max_tool_calls: StrictInt | None = None
    reasoning: dict[str, Any] | None = None
    context_management: Any = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means; raises a 400 (in this route's field names)."""
        self._check_supported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += input_messages(self.input)
        tools = chat_tools(self.tools)
        fields = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "tools": tools, "tool_choice": chat_tool_choice(self.tool_choice, tools),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format(),
        }
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = validation_message(list(e.errors()))
            raise bad_request(message, renamed_param(param)) from None

    def check_images(self, takes_images: bool) -> None:
        """Images for a model that reads none: a 400 naming the first `input_image` part."""
        if takes_images or isinstance(self.input, str):
            return
        for i, item in enumerate(self.input):
            content = item.get("content") if isinstance(item, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    raise bad_request(f"input[{i}].content[{j}]: this model does not take "
                                      "images", f"input.{i}.content.{j}")

    def _check_supported(self) -> None:
        for name, message in _UNSUPPORTED.items():
            if _is_set(getattr(self, name)):
                raise bad_request(message, name)
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' is not supported (an input over the context "
                              "length is a 400)", "truncation")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise bad_request("text.verbosity is not supported", "text.verbosity")

    def _response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format`."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema", {}), dict):
                raise bad_request("text.format json_schema needs a 'name' and a 'schema' object",
                                  "text.format")
            spec = {k: v for k, v in fmt.items() if k != "type"}
            return {"type": "json_schema", "json_schema": spec}
        if fmt.get("type") in ("text", "json_object"):
            return fmt
        raise bad_request("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                          "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")


def _is_set(value: Any) -> bool:
    """Whether a field asks for something: not null, false, 0, empty, or all-null."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return bool(value)


# -- request translation --------------------------------------------------------------------------

def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses `input` as chat messages: a string is one user message; message items keep
    their role; consecutive `function_call` items join the assistant turn before them as its
    `tool_calls`; a `function_call_output` is a `role: tool` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i),
                                 "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(i, output, "output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": content})
        else:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (only "
                              "message, function_call and function_call_output)",
                              f"input.{i}.type")
    return messages


_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"input[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                          f"input.{i}.role")
    content = item.get("content")
    if isinstance(content, list) and any(isinstance(part, dict) and part.get("type")
                                         == "input_image" for part in content):
        return {"role": role, "content": _image_parts(i, content)}
    if not isinstance(content, str):
        content = _parts(i, content, "content")
    return {"role": role, "content": content}


def _image_parts(i: int, parts: list) -> list[dict[str, Any]]:
    """`input_text` / `input_image` parts as chat's `text` / `image_url` parts (the image
    as `image_url`, a URL string; `file_id` images are not supported)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise bad_request(f"input[{i}].content[{j}]: content part type {kind!r} is not "
                              "supported here (input_text, and input_image with an image_url)",
                              f"input.{i}.content.{j}")
    return out


def _parts(i: int, parts: Any, field: str) -> str:
    """The text of a list of `input_text` / `output_text` parts, joined by newlines."""
    if not isinstance(parts, list):
        raise bad_request(f"input[{i}].{field} must be a string or a list of content parts",
                          f"input.{i}.{field}")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"input[{i}].{field}[{j}]: content part type {kind!r} is not "
                              "supported (only input_text and output_text)",
                              f"input.{i}.{field}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}] ({item.get('type')}) needs a string '{key}'",
                          f"input.{i}.{key}")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got type "
                              f"{tool.get('type')!r}", "tools")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}] needs a string 'name'", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """Responses' `tool_choice` in chat's form (`{"type": "function", "name": N}` -> nested)."""
    if choice is None or (tools is None and choice in ("auto", "none")):
        return None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# Chat's field names in errors, as this route calls them.
_RENAMED = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


def renamed_param(param: str | None) -> str | None:
    """A chat-path field name (an error's `param`) in this route's terms."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    if head == "messages":  # message positions differ (instructions, merged function calls)
        return "input"
    return _RENAMED.get(head, head) + dot + rest
