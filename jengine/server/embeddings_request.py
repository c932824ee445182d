"""The bodies of the pooling routes (embeddings.py): OpenAI's `POST /v1/embeddings`, and
vLLM's `POST /v1/rerank` (Jina's and Cohere's shape) and `POST /v1/score`.

Fields are strict and `extra="forbid"`, as the generating routes' are, with vLLM's extras:
`truncate_prompt_tokens` (keep each input's last N tokens instead of a 400 for an input over
the context) and `add_special_tokens`. Each model turns its input into a list of engine
prompts (text or token ids) or a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, WithJsonSchema

from jengine.server.errors import bad_request
from jengine.server.protocol import PROMPT_SCHEMA

Prompt = str | list[int]

_TEXTS_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1},
                            "minItems": 1}]}


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class PoolingFields(BaseModel):
    """What every pooling route takes besides its inputs."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, json_schema_extra={"minimum": 1})
    add_special_tokens: StrictBool = True
    user: StrictStr | None = None  # OpenAI's end-user id: accepted, not used


class EmbeddingRequest(PoolingFields):
    """`POST /v1/embeddings`."""

    input: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)] = Field(...)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, json_schema_extra={"minimum": 1})

    def prompts(self) -> list[Prompt]:
        """`input` as engine prompts: a string, strings, token ids, or lists of token ids."""
        p = self.input
        if isinstance(p, str):
            return [_text(p, "input")]
        if isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                return [_text(x, "input") for x in p]
            if all(_is_token(x) for x in p):
                return [list(p)]
            if all(isinstance(x, list) and all(_is_token(t) for t in x) for x in p):
                if not all(p):
                    raise bad_request("input must not hold an empty token list", "input")
                return [list(x) for x in p]
        if isinstance(p, list) and not p:
            raise bad_request("input must not be empty", "input")
        raise bad_request("input must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists", "input")


class RerankRequest(PoolingFields):
    """`POST /v1/rerank` (also `/rerank`, `/v2/rerank` in vLLM; the /v1 path here)."""

    query: StrictStr
    documents: list[Any] = Field(..., json_schema_extra={"minItems": 1})
    top_n: StrictInt | None = Field(None, json_schema_extra={"minimum": 0})  # None / 0: all
    return_documents: StrictBool = True

    def document_texts(self) -> list[str]:
        """Each document's text: a string, or Cohere's `{"text": ...}` object."""
        if not self.documents:
            raise bad_request("documents must not be empty", "documents")
        texts = []
        for d in self.documents:
            if isinstance(d, dict) and set(d) == {"text"}:
                d = d["text"]
            if not isinstance(d, str):
                raise bad_request("each document must be a string or {\"text\": string}",
                                  "documents")
            texts.append(_text(d, "documents"))
        return texts


class ScoreRequest(PoolingFields):
    """`POST /v1/score` (vLLM's): `text_1` against each of `text_2`."""

    text_1: Annotated[Any, WithJsonSchema(_TEXTS_SCHEMA)] = Field(...)
    text_2: Annotated[Any, WithJsonSchema(_TEXTS_SCHEMA)] = Field(...)

    def pairs(self) -> tuple[list[str], list[str]]:
        """(left, right) texts of each scored pair, as vLLM pairs them: one `text_1` against
        every `text_2`, or the two lists element by element (equal lengths)."""
        left, right = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise bad_request(f"text_1 ({len(left)} texts) and text_2 ({len(right)}) must have "
                              "the same length, or text_1 one text", "text_1")
        return left, right


def _text(value: str, field: str) -> str:
    if not value:
        raise bad_request(f"{field} must not hold an empty string", field)
    return value


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [_text(value, field)]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        return [_text(x, field) for x in value]
    raise bad_request(f"{field} must be a string or a non-empty list of strings", field)
