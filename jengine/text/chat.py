"""Chat messages -> prompt token ids through the tokenizer's chat template (HF transformers'
`apply_chat_template`), with OpenAI tools rendered by the template or written as text."""

from __future__ import annotations

from typing import Any

from jengine.sampling_params import check_strings
from jengine.text.tools import template_has_tools, template_messages, text_messages


def render_chat(
    tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
    chat_template: str | None = None, add_generation_prompt: bool = True,
    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """`render_chat_text`'s text as token ids (`add_special_tokens`: the tokenizer's BOS etc.
    on top of the template's)."""
    text = render_chat_text(
        tokenizer, messages, tools=tools, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def render_chat_text(
    tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
    chat_template: str | None = None, add_generation_prompt: bool = True,
    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Chat messages -> the prompt text of the tokenizer's chat template (or `chat_template`,
    a Jinja template text, instead).

    `tools` (validated OpenAI function tools) go to a template that renders tools itself, and
    into the system prompt otherwise; tool calls and results in `messages` are written as text
    for a template without a tool format (see `jengine.tools`). `add_generation_prompt`,
    `continue_final_message` (the reply goes on from the last assistant message) and
    `template_kwargs` (extra template variables) are passed to the template as in HF
    transformers.
    """
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    check_strings("messages", messages)
    check_strings("tools", tools)
    check_strings("chat_template", chat_template)
    check_strings("chat_template_kwargs", template_kwargs)
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template")
    if template_has_tools(tokenizer, chat_template):
        messages = template_messages(messages)
    else:
        functions = [t["function"] for t in tools or ()]
        messages, tools = text_messages(messages, functions), None
    reserved = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                "continue_final_message"} & set(template_kwargs or ())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=chat_template, continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error (jinja2) is the request's fault
        raise ValueError(f"chat_template failed to render: {type(e).__name__}: {e}") from None
