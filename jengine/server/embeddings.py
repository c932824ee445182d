"""The pooling routes: `/v1/embeddings` (OpenAI's shape), `/v1/rerank` and `/v1/score`
(vLLM's), views over the generation pipeline for an engine of task embed or score.

Each input is one engine request carrying `PoolingParams`: it is admitted, bounded and
tokenized as a prompt is (`pipeline.start`), runs as a prefill in the continuous batch, and
comes back as a vector on its final delta (`RequestOutput.embedding`). Rerank and score embed
the query and the documents (or both sides of each pair) and answer the cosine of the vectors:
a cross-encoder's classifier head is not served. A server that generates answers these routes
with a 400, as an embedding server answers the generating routes.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import Request

from jengine.pooling_params import PoolingParams
from jengine.sampling_params import SamplingParams
from jengine.server.embeddings_request import (
    EmbeddingRequest,
    PoolingFields,
    Prompt,
    RerankRequest,
    ScoreRequest,
)
from jengine.server.errors import bad_request, renamed_params
from jengine.server.pipeline import Job, accept, start

# An embedding request "generates" nothing: one token's bound per input for the limits.
_BOUND = SamplingParams(max_tokens=1)


async def _embed(request: Request, body: PoolingFields, prompts: list[Prompt], field: str,
                 dimensions: int | None = None) -> tuple[list[list[float]], int, str]:
    """(one vector per prompt, in order; the prompt tokens of all; the response's request id).
    Errors name `field` where the engine names the prompt."""
    state = accept(request, body)
    try:
        params = PoolingParams(dimensions=dimensions,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None

    def check(engine: Any) -> None:
        model = engine.core.model
        if model.pooling is None:
            raise bad_request(f"this server runs task {model.task!r}: start it with --task "
                              "embed (or score) to serve embeddings, rerank and score", "model")
        try:
            model.pooling.check(params)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None

    def prompt_ids(tokenizer: Any) -> list[list[int]]:
        return [p if isinstance(p, list) else
                list(tokenizer(p, add_special_tokens=body.add_special_tokens).input_ids)
                for p in prompts]

    request_id = state.response_id(request, None)
    with renamed_params(lambda name: field if name == "prompt" else name):
        stream = await start(state, request, Job(_BOUND, prompt_ids, len(prompts), request_id,
                                                 check=check, pooling=params))
        vectors: list[list[float] | None] = [None] * len(prompts)
        tokens = 0
        async with stream:
            async for index, delta in stream:
                if delta.finished:
                    vectors[index] = delta.embedding
                    tokens += len(delta.prompt_token_ids)
    return vectors, tokens, request_id


async def create_embedding(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    vectors, tokens, request_id = await _embed(request, body, body.prompts(), "input",
                                               body.dimensions)
    encode = _base64 if body.encoding_format == "base64" else (lambda v: v)
    return {
        "id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
        "model": request.app.state.server.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def create_rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    if body.top_n is not None and body.top_n < 0:
        raise bad_request("top_n must be at least 0 (0: every document)", "top_n")
    documents = body.document_texts()
    query = [body.query] if body.query else []
    if not query:
        raise bad_request("query must not be empty", "query")
    vectors, tokens, request_id = await _embed(request, body, query + documents, "documents")
    scores = _cosines([vectors[0]] * len(documents), vectors[1:])
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": f"rerank-{request_id}", "model": request.app.state.server.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


async def create_score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    left, right = body.pairs()
    vectors, tokens, request_id = await _embed(request, body, left + right, "text_1")
    n = len(left)
    scores = _cosines(vectors[:n], vectors[n:])
    return {
        "id": f"score-{request_id}", "object": "list", "created": int(time.time()),
        "model": request.app.state.server.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _cosines(left: list[list[float]], right: list[list[float]]) -> list[float]:
    """Row-wise cosine similarity (vectors are normalised only when the server normalises)."""
    a, b = np.asarray(left, np.float64), np.asarray(right, np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return ((a * b).sum(axis=1) / norms).tolist()


def _base64(vector: list[float]) -> str:
    """OpenAI's `encoding_format: base64`: the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
