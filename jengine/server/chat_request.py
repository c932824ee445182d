"""The `POST /v1/chat/completions` request body: messages as the chat template takes them,
tools and `tool_choice`, and the sampling fields it shares with completions (`SamplingFields`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from jengine.sampling_params import SamplingParams
from jengine.server.errors import bad_request, invalid_value, rename_param
from jengine.server.protocol import (
    MAX_LOGPROBS,
    NON_EMPTY,
    ChatMessage,
    SamplingFields,
    documented,
)
from jengine.text.chat import render_chat, render_chat_text
from jengine.text.tools import ToolSetup, constrain, tool_setup
from jengine.vision.chat import IMAGE_PART_TYPES, has_images, split_images
from jengine.vision.inputs import ImagePrompt
from jengine.vision.media import MediaPolicy

# Fields of OpenAI's chat API this server does not implement yet: set, they give a clear 400.
_CHAT_UNSUPPORTED = ("functions", "function_call", "audio", "prediction",
                     "web_search_options")
# OpenAI's reasoning_effort as a thinking budget (tokens of thought; None: no cap). The values
# are this server's choice: a short, a moderate and an uncapped think.
EFFORT_BUDGETS = {"low": 1024, "medium": 8192, "high": None}


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    has_reasoning: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(..., json_schema_extra=NON_EMPTY)
    max_tokens: StrictInt | None = documented(minimum=1)
    max_completion_tokens: StrictInt | None = documented(minimum=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = documented(**MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None
    modalities: list[StrictStr] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: StrictStr | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's chat extras
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    echo: StrictBool = False
    # accepted and ignored, as they do not change what is generated
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise bad_request("messages must be a non-empty list", "messages")
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def render(self, tokenizer: Any, messages: list[dict[str, Any]], tools: ToolSetup,
               template: str | None, media: MediaPolicy | None = None) -> list[int] | ImagePrompt:
        """The prompt's token ids: `messages` (`template_messages()`) through `template`
        (None: the model's), with the tools when they are active; with image content parts,
        the template's text and the images, loaded as `media` allows."""
        if has_images(messages):
            try:
                messages, images = split_images(messages, (media or MediaPolicy()).load)
            except ValueError as e:
                raise bad_request(str(e), _part_param(str(e))) from None
            text = render_chat_text(
                tokenizer, messages, tools=self.tools if tools.active else None,
                chat_template=template, add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                template_kwargs=self.chat_template_kwargs)
            return ImagePrompt(text, tuple(images), add_special_tokens=self.add_special_tokens)
        return render_chat(
            tokenizer, messages, tools=self.tools if tools.active else None,
            chat_template=template, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            template_kwargs=self.chat_template_kwargs, add_special_tokens=self.add_special_tokens)

    def check_images(self, takes_images: bool) -> None:
        """Images for a model that reads none: a 400 naming the first image part."""
        if takes_images:
            return
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if part.type in IMAGE_PART_TYPES:
                    raise bad_request(f"messages[{i}].content[{j}]: this model does not take "
                                      "images", f"messages.{i}.content.{j}")

    def thinking_budget(self, reasoning_parser: str | None) -> tuple[int | None, str]:
        """The most tokens the thought may take (None: no cap) and the field that set it:
        `thinking_token_budget` (vLLM's), else `reasoning_effort` mapped by `EFFORT_BUDGETS`.
        Either needs the server's `reasoning_parser`; a bad value is a 400 naming its field."""
        if self.thinking_token_budget is not None:
            budget, field = self.thinking_token_budget, "thinking_token_budget"
            if budget < 0:
                raise bad_request(f"thinking_token_budget must be >= 0, got {budget}", field)
        elif self.reasoning_effort is not None:
            field = "reasoning_effort"
            if self.reasoning_effort not in EFFORT_BUDGETS:
                raise bad_request(f"reasoning_effort must be one of "
                                  f"{', '.join(EFFORT_BUDGETS)}, got {self.reasoning_effort!r}",
                                  field)
            budget = EFFORT_BUDGETS[self.reasoning_effort]
        else:
            return None, "thinking_token_budget"
        if reasoning_parser is None:
            raise bad_request(f"{field} needs a server started with --reasoning-parser (this one "
                              "does not read reasoning); leave it out", field)
        return budget, field

    def tool_setup(self) -> ToolSetup:
        try:
            return tool_setup(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as e:
            param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
            raise bad_request(str(e), param) from None

    def sampling_params(self, tools: ToolSetup | None = None, *,
                        default_max_tokens: int | None = None) -> SamplingParams:
        """The request's sampling parameters, with the tool-call grammar of `tools` when its
        `tool_choice` forces calls. Without max_(completion_)tokens, `default_max_tokens`
        (None: up to the context's end, as OpenAI and vLLM do)."""
        self._check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        try:
            params = self._sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        except ValueError as e:
            error = invalid_value(e)
            name = {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_field}
            raise rename_param(error, name.get(error.param, error.param)) from None
        if tools is None:
            return params
        try:
            return constrain(params, tools)
        except ValueError as e:
            raise bad_request(str(e), "tool_choice") from None

    @property
    def max_tokens_field(self) -> str:
        """The field the client bounded the output with (errors name it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def constraint_param(self) -> str | None:
        return super().constraint_param() or ("tools" if self.tools else None)

    def _check_supported(self) -> None:
        for name in _CHAT_UNSUPPORTED:
            if getattr(self, name):
                raise bad_request(f"{name} is not supported yet", name)
        if self.verbosity not in (None, "medium"):
            # OpenAI's answer for a model without verbosity control
            raise bad_request(f"Unsupported value: 'verbosity' does not support "
                              f"{self.verbosity!r} with this model. Supported values are: "
                              "'medium'.", "verbosity")
        if self.modalities and self.modalities != ["text"]:
            raise bad_request("only the 'text' modality is supported", "modalities")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt false",
                              "continue_final_message")
        if self.continue_final_message and self.messages[-1:] and \
                self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a last message from the assistant",
                              "continue_final_message")

    def echo_text(self) -> str:
        """With `echo`, the text the answer starts with: the last message's content when it is
        the assistant's (vLLM's meaning), else nothing."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != "assistant":
            return ""
        return last.for_template(len(self.messages) - 1)["content"]


def _part_param(message: str) -> str:
    """`messages[i].content[j]: ...` -> the param `messages.i.content.j`."""
    head = message.split(":", 1)[0]
    return head.replace("[", ".").replace("]", "") if head.startswith("messages[") else "messages"
