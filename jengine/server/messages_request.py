"""The `POST /v1/messages` (and `/v1/messages/count_tokens`) request body of Anthropic's
Messages API, and its translation into the chat request it means (`chat_request`), so that the
chat route's checks, template, tool prompt, tool grammar and sampling apply unchanged:

    system (a string or text blocks)     a first system message
    user text blocks                     a user message (consecutive ones joined by newlines)
    user image blocks                    chat `image_url` parts in the message, in order
      (source base64 -> a data: URL;     (vision models; loaded as chat's image parts are:
      source url -> that URL)             --allowed-local-media-path, --allow-remote-media)
    user tool_result blocks              `role: tool` messages (`tool_call_id` = `tool_use_id`)
    assistant text and tool_use blocks   an assistant message with `tool_calls` (input as JSON)
    a last assistant message             a prefill: the answer continues it
                                         (chat's `continue_final_message`)
    tools (name, description,            function tools (`parameters` = `input_schema`)
      input_schema)
    tool_choice auto / any / tool / none auto / required / named / none;
                                         `disable_parallel_tool_use`: `parallel_tool_calls` false
    stop_sequences, top_k                stop, top_k
    output_config.format (json_schema)   response_format (the output is constrained to it)
    thinking enabled, budget_tokens N    thinking_token_budget N (needs --reasoning-parser;
                                         the reply's thinking goes to `thinking` blocks)
    thinking disabled                    chat_template_kwargs.enable_thinking false

Document and server-tool blocks, file-id image sources and images inside tool results are a
400 naming the block; `thinking` and
`redacted_thinking` blocks of earlier assistant turns are dropped (chat templates leave out
earlier turns' reasoning); `cache_control` is accepted anywhere and
ignored (the prefix cache is automatic). Errors from the chat path name this API's fields.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from jengine.server.chat_request import ChatCompletionRequest
from jengine.server.errors import bad_request, validation_message
from jengine.server.protocol import NON_EMPTY, Float, documented


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class ToolParam(BaseModel):
    """A client tool. Anthropic's optional extras (`cache_control`, `strict`, ...) are
    accepted and do nothing; server tools (web search, bash, ...) have no `input_schema`."""

    model_config = ConfigDict(extra="allow")

    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MessagesInput(BaseModel):
    """What renders the prompt: the `/v1/messages/count_tokens` body, and the base of
    `/v1/messages`'."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None  # None: the served model (Anthropic requires it)
    messages: list[MessageParam] = Field(..., json_schema_extra=NON_EMPTY)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # enabled (+ budget_tokens) or disabled
    output_config: dict[str, Any] | None = None  # format (json_schema); effort refused
    # accepted and ignored, as they do not change what is generated here
    cache_control: dict[str, Any] | None = None
    speed: StrictStr | None = None
    inference_geo: StrictStr | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None

    def check_images(self, takes_images: bool) -> None:
        """Images for a model that reads none: a 400 naming the first image block."""
        if takes_images:
            return
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list)
                                      else ()):
                if isinstance(block, dict) and block.get("type") == "image":
                    raise bad_request(f"messages.{i}.content.{j}: this model does not take "
                                      "images", f"messages.{i}.content.{j}")

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat request this one means (with chat's `sampling` fields); a 400 in this
        route's field names."""
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        messages = [] if self.system is None else [
            {"role": "system", "content": _text(self.system, "system")}]
        for i, message in enumerate(self.messages):
            messages += _chat_messages(i, message)
        fields: dict[str, Any] = {"model": self.model, "messages": messages,
                                  "response_format": self._response_format(), **sampling,
                                  **self._thinking()}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}}
                for t in self.tools]
        fields.update(self._tool_choice())
        last = self.messages[-1]
        if last.role == "assistant" and not any(m.get("tool_calls") for m in messages[-1:]):
            fields.update(add_generation_prompt=False, continue_final_message=True)
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = validation_message(list(e.errors()))
            raise bad_request(message, messages_param(param)) from None

    def _thinking(self) -> dict[str, Any]:
        """`thinking` as chat's fields: `enabled` with `budget_tokens` is a thinking budget
        (the server needs `--reasoning-parser`; the reply then has `thinking` blocks),
        `disabled` is `chat_template_kwargs.enable_thinking: false` (Qwen3's, SmolLM3's switch;
        a template without it renders as before)."""
        if self.thinking is None:
            return {}
        kind, budget = self.thinking.get("type"), self.thinking.get("budget_tokens")
        if kind == "disabled":
            return {"chat_template_kwargs": {"enable_thinking": False}}
        if kind != "enabled":
            raise bad_request("thinking.type must be 'enabled' or 'disabled'", "thinking")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise bad_request(f"thinking.budget_tokens must be an integer >= 0, got {budget!r}",
                              "thinking")
        return {"thinking_token_budget": budget}

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.get("type") == "enabled"

    def _response_format(self) -> dict[str, Any] | None:
        """`output_config.format` as chat's `response_format`."""
        config = self.output_config or {}
        unknown = set(config) - {"effort", "format"}
        if unknown:
            raise bad_request(f"output_config.{sorted(unknown)[0]} is not supported",
                              "output_config")
        if config.get("effort") is not None:
            raise bad_request("output_config.effort is not supported: the effort of the "
                              "answer is not adjustable here (leave it out)", "output_config")
        fmt = config.get("format")
        if fmt is None:
            return None
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                and isinstance(fmt.get("schema"), dict)):
            raise bad_request("output_config.format must be {'type': 'json_schema', "
                              "'schema': {...}}", "output_config")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}

    def _tool_choice(self) -> dict[str, Any]:
        choice = self.tool_choice
        if choice is None:
            return {}
        if choice.type == "tool" and choice.name is None:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", "tool_choice")
        fields: dict[str, Any] = {"tool_choice": {
            "auto": "auto", "any": "required", "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}}}[choice.type]}
        if not self.tools and choice.type in ("auto", "none"):
            return {}  # nothing to choose from: as no tool_choice (Anthropic accepts it)
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        return fields


class MessagesRequest(MessagesInput):
    """`POST /v1/messages`."""

    max_tokens: StrictInt = Field(..., json_schema_extra={"minimum": 1})
    stop_sequences: list[StrictStr] | None = None
    temperature: Float | None = documented(minimum=0, maximum=1)
    top_p: Float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: StrictInt | None = documented(minimum=0)
    stream: StrictBool | None = False
    # accepted and ignored, as they do not change what is generated
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None

    def chat(self) -> ChatCompletionRequest:
        if self.max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {self.max_tokens}",
                              "max_tokens")
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise bad_request(f"temperature must be between 0 and 1, got {self.temperature}",
                              "temperature")
        return self.chat_request(max_tokens=self.max_tokens, stop=self.stop_sequences,
                                 temperature=self.temperature, top_p=self.top_p,
                                 top_k=self.top_k, stream=self.stream)


# -- content blocks -------------------------------------------------------------------------------

_DROPPED = ("thinking", "redacted_thinking")


def _chat_messages(i: int, message: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages, in its blocks' order."""
    where = f"messages.{i}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if not message.content:
        raise bad_request(f"{where} must be a string or a non-empty list of blocks", where)
    out: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        kind = block.get("type")
        at = f"{where}.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            last = out[-1] if out else None
            if last is not None and last["role"] == message.role and "tool_calls" not in last:
                if isinstance(last["content"], list):
                    last["content"].append({"type": "text", "text": block["text"]})
                else:
                    last["content"] += "\n" + block["text"]
            else:
                out.append({"role": message.role, "content": block["text"]})
        elif kind == "image" and message.role == "user":
            part = {"type": "image_url", "image_url": {"url": _image_url(block, at)}}
            last = out[-1] if out else None
            if last is None or last["role"] != "user":
                out.append({"role": "user", "content": [part]})
            elif isinstance(last["content"], list):
                last["content"].append(part)
            else:
                last["content"] = [{"type": "text", "text": last["content"]}, part]
        elif kind == "tool_use" and message.role == "assistant":
            call = {"id": _string(block, "id", at), "type": "function",
                    "function": {"name": _string(block, "name", at),
                                 "arguments": json.dumps(block.get("input") or {})}}
            if not out:
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content")
            text = "" if content is None else _text(content, at + ".content")
            if block.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                        "content": text})
        elif kind in _DROPPED and message.role == "assistant":
            continue
        else:
            raise bad_request(f"{at}: {message.role} content blocks of type {kind!r} are not "
                              "supported (user: text, image, tool_result; assistant: text, "
                              "tool_use)",
                              at)
    return out or [{"role": message.role, "content": ""}]


_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's list


def _image_url(block: dict[str, Any], at: str) -> str:
    """An image block's source as the URL chat's image parts take (decoded when rendered)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in _IMAGE_TYPES:
            raise bad_request(f"{at}.source.media_type: {media_type!r} is not one of "
                              f"{', '.join(_IMAGE_TYPES)}", f"{at}.source.media_type")
        if not isinstance(data, str) or not data:
            raise bad_request(f"{at}.source.data must be a non-empty base64 string",
                              f"{at}.source.data")
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return source["url"]
    raise bad_request(f"{at}.source: image sources of type {kind!r} are not supported (base64, "
                      "url)", f"{at}.source")


def _text(value: Any, where: str) -> str:
    """A string, or the text of a list of `text` blocks joined by newlines."""
    if isinstance(value, str):
        return value
    texts = []
    for j, block in enumerate(value if isinstance(value, list) else [None]):
        if not (isinstance(block, dict) and block.get("type") == "text"
                and isinstance(block.get("text"), str)):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}.{j}: blocks of type {kind!r} are not supported here "
                              "(only text)", f"{where}.{j}")
        texts.append(block["text"])
    return "\n".join(texts)


def _string(block: dict[str, Any], key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{at} ({block.get('type')}) needs a string '{key}'", f"{at}.{key}")
    return value


# Chat's field names in errors, as this route calls them.
_RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
            "thinking_token_budget": "thinking", "chat_template_kwargs": "thinking",
            "parallel_tool_calls": "tool_choice", "response_format": "output_config"}


def messages_param(param: str | None) -> str | None:
    """A chat-path field name (an error's `param`) in this route's terms."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    if head == "messages":  # positions differ (system first, blocks split into messages)
        return "messages"
    return _RENAMED.get(head, head) + dot + rest
