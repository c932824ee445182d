"""The request mix of `jengine bench soak`: one kind of request per slot, taken in turn, so a soak
exercises every path that holds memory in the server (streamed and plain chat and completions,
long prompts, shared prefixes, grammar-constrained replies, clients that hang up mid-stream, and
bad input that must be refused with a 4xx while the server keeps serving).

Prompts fit a 512-token context (the test suite's preset), so one mix serves the tests and a
default server alike.
"""

from __future__ import annotations

import json

# ~200 tokens, the same in every `shared_prefix` request: its pages live in the prefix cache
SHARED_SYSTEM = ("You are a patient assistant for a museum of natural history. " * 20).strip()

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}

# bad requests in turn: each must be answered with this status and leave nothing behind
BAD_INPUTS = (
    (400, "chat", {"temperature": -1.0}),
    (404, "chat", {"model": "no-such-model"}),
    (400, "completion", {"max_tokens": 10**6}),
    (400, "chat", {"messages": []}),
)


class UnexpectedAnswer(Exception):
    """A 200 where a 4xx was due, a 4xx other than the one due, or a reply of the wrong shape."""


def _long_prompt(i: int) -> str:
    """~250-330 tokens that differ from the first word on, so no two share cached pages."""
    words = " ".join(f"item{(i * 7 + k) % 997}" for k in range(80))
    return f"Note {i}. Summarise this list in one line: {words}"


async def _chat(client, model: str, i: int, stream: bool) -> None:
    messages = [{"role": "user", "content": f"Request {i}: name three colours."}]
    if stream:
        s = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, stream=True,
            stream_options={"include_usage": True})
        usage = None
        async for chunk in s:
            usage = chunk.usage or usage
        if usage is None:
            raise UnexpectedAnswer("a streamed chat ended without usage")
        return
    r = await client.chat.completions.create(model=model, messages=messages, max_tokens=24)
    if not r.choices or r.choices[0].finish_reason not in ("stop", "length"):
        raise UnexpectedAnswer(f"chat finish {r.choices[0].finish_reason if r.choices else None}")


async def _completion(client, model: str, i: int, stream: bool, prompt: str | None = None,
                      max_tokens: int = 24) -> None:
    prompt = prompt or f"Story {i}: once upon a time"
    if stream:
        s = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                            stream=True)
        finishes = [c.finish_reason async for chunk in s for c in chunk.choices if c.finish_reason]
        if len(finishes) != 1:
            raise UnexpectedAnswer(f"a streamed completion ended with {finishes}")
        return
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
    if r.usage is None or r.usage.completion_tokens < 1:
        raise UnexpectedAnswer("a completion without tokens")


async def _shared_prefix(client, model: str, i: int) -> None:
    await client.chat.completions.create(
        model=model, max_tokens=16,
        messages=[{"role": "system", "content": SHARED_SYSTEM},
                  {"role": "user", "content": f"Visitor {i} asks: where are the fossils?"}])


async def _json_schema(client, model: str, i: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = await client.chat.completions.create(
        model=model, max_tokens=64, response_format=fmt, temperature=1.0, seed=i,
        messages=[{"role": "user", "content": f"Invent person number {i} as JSON."}])
    choice = r.choices[0]
    if choice.finish_reason == "stop":  # a reply cut by max_tokens may be unfinished JSON
        reply = json.loads(choice.message.content or "")  # ValueError: counted as an error
        if set(reply) != {"name", "age"}:
            raise UnexpectedAnswer(f"JSON reply off the schema: {reply}")


async def _abort(client, model: str, i: int) -> None:
    """Reads a few chunks of a long stream, then closes the connection (the server must abort
    the request and free its pages)."""
    s = await client.completions.create(model=model, prompt=f"Chapter {i}:", max_tokens=300,
                                        stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in s:
        seen += 1
        if seen == 3:
            break
    await s.close()


async def _bad_input(client, model: str, i: int) -> None:
    import openai

    status, route, change = BAD_INPUTS[i % len(BAD_INPUTS)]
    body = {"model": model, "max_tokens": 8, **change}
    try:
        if route == "chat":
            body.setdefault("messages", [{"role": "user", "content": "Hi"}])
            await client.chat.completions.create(**body)
        else:
            await client.completions.create(prompt="Hi", **body)
    except openai.APIStatusError as e:
        if e.status_code != status:
            raise UnexpectedAnswer(f"bad input {change} got {e.status_code}, not {status}") \
                from None
        return
    raise UnexpectedAnswer(f"bad input {change} was accepted")


async def _run(kind: str, client, model: str, i: int) -> None:
    if kind in ("chat", "chat_stream"):
        await _chat(client, model, i, stream=kind == "chat_stream")
    elif kind in ("completion", "completion_stream"):
        await _completion(client, model, i, stream=kind == "completion_stream")
    elif kind == "long_prompt":
        await _completion(client, model, i, stream=i % 2 == 0, prompt=_long_prompt(i),
                          max_tokens=32)
    elif kind == "shared_prefix":
        await _shared_prefix(client, model, i)
    elif kind == "json_schema":
        await _json_schema(client, model, i)
    elif kind == "abort":
        await _abort(client, model, i)
    else:
        await _bad_input(client, model, i)


KINDS = ("chat_stream", "chat", "completion_stream", "completion", "long_prompt",
         "shared_prefix", "json_schema", "abort", "bad_input")


async def send(client, model: str, i: int) -> tuple[str, str | None]:
    """Sends the mix's `i`th request; returns its kind and None, or the kind of error it met
    (`"<kind>:<ExceptionName>"`, with the status for an HTTP error)."""
    import openai

    kind = KINDS[i % len(KINDS)]
    try:
        await _run(kind, client, model, i)
    except openai.APIStatusError as e:
        return kind, f"{kind}:{type(e).__name__}({e.status_code})"
    except Exception as e:  # noqa: BLE001 - a soak counts every failure by kind and goes on
        return kind, f"{kind}:{type(e).__name__}"
    return kind, None
