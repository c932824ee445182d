"""The embedding task end to end: `/v1/embeddings` with the official `openai` SDK, `/v1/rerank`
and `/v1/score` with httpx, against servers on 127.0.0.1, and `Engine(task="embed").embed`.

The oracle is HF transformers' last hidden state (after the final norm), pooled and normalised
here: on SmolLM2 (the bundled GGUF) for mean, last-token and CLS pooling, and on a tiny random
Llama saved as a sentence-transformers model (modules.json: mean pooling, Normalize; config.json:
Matryoshka sizes), whose server reads its pooling from those files.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from hf_gguf import load_hf_gguf  # tests/hf_gguf.py
from local_server import serving  # tests/local_server.py
from tiny_models import random_hf_model  # tests/tiny_models.py

from jengine import Engine, PoolingParams
from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app
from jengine.server.warmup import warm_up

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention reads KV pages.",
         "Bonjour"]
LONG = "Continuous batching keeps the accelerator busy with many requests. " * 12  # ~130 tokens


def _pool(hidden: np.ndarray, method: str) -> np.ndarray:
    v = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[method]
    return v / np.linalg.norm(v)


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def smol():
    """A SmolLM2 embedding server (`task embed`, mean pooling, one 16-token bucket: a long
    input runs as several prefill chunks) and its engine."""
    engine = AsyncEngine(config=ONE_BUCKET, task="embed", pooling="mean", progress=False)
    try:
        with serving(create_app(engine, ServerConfig(), model_name="smol")) as url:
            yield engine, url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def smol_client(smol):
    return openai.OpenAI(base_url=smol[1] + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_smol(smol):
    """SmolLM2's HF tokenizer and model: token ids -> final-norm hidden states [n, E]."""
    tok, model = load_hf_gguf(Path(smol[0].core.model.source))

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].numpy()
    return hidden


def test_embeddings_equal_hf_mean_pooling(smol, smol_client, hf_smol):
    tokenizer = smol[0].tokenizer
    texts = TEXTS + [LONG]  # LONG spans nine 16-token prefill chunks
    got = smol_client.embeddings.create(model="smol", input=texts, encoding_format="float")
    assert [d.index for d in got.data] == list(range(len(texts)))
    ids = [tokenizer(t).input_ids for t in texts]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(got.data, ids):
        assert len(d.embedding) == 576
        assert _cos(d.embedding, _pool(hf_smol(i), "mean")) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    # token ids in, the same vectors out; the SDK's default base64 decodes to them too
    by_ids = smol_client.embeddings.create(model="smol", input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == got.data[0].embedding
    one = smol_client.embeddings.create(model="smol", input=texts[1], encoding_format="float")
    default = smol_client.embeddings.create(model="smol", input=texts[1])
    assert default.data[0].embedding == one.data[0].embedding
    raw = httpx.post(smol[1] + "/v1/embeddings", json={
        "input": texts[1], "encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == one.data[0].embedding
    # nothing is left on the page pool once the requests finish
    assert smol[0].stats().kv_pages_used == 0


def test_same_input_same_vector_whatever_the_batch(smol, smol_client):
    alone = smol_client.embeddings.create(model="smol", input=TEXTS[0],
                                          encoding_format="float").data[0].embedding
    batched = smol_client.embeddings.create(model="smol", input=[LONG, TEXTS[1], TEXTS[0]],
                                            encoding_format="float").data[2].embedding

    async def concurrent() -> list[float]:
        client = openai.AsyncOpenAI(base_url=smol[1] + "/v1", api_key="x", max_retries=0)
        many = [client.embeddings.create(model="smol", input=[LONG, t], encoding_format="float")
                for t in TEXTS]
        results = await asyncio.gather(*many)
        return results[0].data[1].embedding
    # Bit for bit within one step shape (this server has one bucket); across token buckets
    # the matmuls of another shape may round a few values differently (~1e-7, measured).
    assert batched == alone
    assert asyncio.run(concurrent()) == alone


def test_bad_input_is_a_400_and_the_server_keeps_serving(smol, smol_client):
    cases = [
        ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
        ({"input": [1, "a"]}, "input"), ({"input": 5}, "input"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "dimensions": 32}, "dimensions"),  # SmolLM2 declares no Matryoshka
        ({"input": [7] * 513}, "input"),  # over the 512-token context
        ({"input": [10 ** 6]}, "input"),  # out of the vocabulary
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "stream": True}, "stream"),
    ]
    for body, param in cases:
        r = httpx.post(smol[1] + "/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], body
        assert error["param"] == param, (body, error)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        smol_client.embeddings.create(model="smol", input="hi", dimensions=64)
    # vLLM's truncate_prompt_tokens keeps the last tokens instead of the 400
    cut = smol_client.embeddings.create(model="smol", input=[[7] * 600], encoding_format="float",
                                        extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100
    full = smol_client.embeddings.create(model="smol", input=[[7] * 512], encoding_format="float")
    assert full.usage.prompt_tokens == 512  # an input may fill the whole context
    # the generating routes are refused on an embedding server, in their own error shape
    with pytest.raises(openai.BadRequestError, match="task 'embed'"):
        smol_client.completions.create(model="smol", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="task 'embed'"):
        smol_client.chat.completions.create(model="smol", max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}])
    assert len(smol_client.embeddings.create(model="smol", input="still here").data) == 1
    assert smol[0].stats().kv_pages_used == 0
    assert smol[0].core.compiles_since_ready == 0  # the embed programs were all built at start
    # `jengine serve`'s start-up request on an embedding server embeds (it cannot generate)
    warm_up(smol[0], smol[1], token="t", model="smol", api_key=None, chat_template=None)


@pytest.mark.parametrize("method", ["last", "cls"])
def test_engine_embed_last_and_cls_equal_hf(smol, hf_smol, method):
    engine = Engine(config=ONE_BUCKET, task="embed", pooling=method, progress=False)
    texts = [TEXTS[0], LONG]
    vectors = engine.embed(texts)
    for text, v in zip(texts, vectors):
        ids = engine.tokenizer(text).input_ids
        assert _cos(v, _pool(hf_smol(ids), method)) >= 0.9999
    assert engine.stats().kv_pages_used == 0
    with pytest.raises(ValueError, match="does not generate"):
        engine.generate("hi")


# -- a tiny sentence-transformers model: pooling from its files, Matryoshka, rerank, score -----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, tokenizer, server URL, engine) of a random Llama saved with modules.json
    (mean pooling + Normalize) and `matryoshka_dimensions`, served with `--task score`."""
    path = tmp_path_factory.mktemp("st_llama")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, matryoshka_dimensions=[16, 32])
    model = random_hf_model(path, config, transformers.LlamaForCausalLM)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
        "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}))
    engine = AsyncEngine(str(path), config=ONE_BUCKET, task="score", progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    try:
        with serving(create_app(engine, ServerConfig(), model_name="tiny")) as url:
            yield model, tokenizer, url, engine
    finally:
        engine.shutdown()


def _tiny_ref(tiny, text: str, dims: int | None = None) -> np.ndarray:
    model, tokenizer = tiny[0], tiny[1]
    with torch.no_grad():
        out = model(torch.tensor([tokenizer(text).input_ids]), output_hidden_states=True)
    v = out.hidden_states[-1][0].numpy().mean(0)[:dims]
    return v / np.linalg.norm(v)


def test_sentence_transformers_files_set_the_pooling(tiny):
    client = openai.OpenAI(base_url=tiny[2] + "/v1", api_key="x", max_retries=0, timeout=60)
    texts = ["t5 t9 t33 t4", "t1 t70 t3 t3 t3 t8 t60 t61 t62 t63 t64 t65 t66 t67 t68 t69 t70"]
    got = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    for text, d in zip(texts, got.data):
        assert _cos(d.embedding, _tiny_ref(tiny, text)) >= 0.9999
    short = client.embeddings.create(model="tiny", input=texts[0], dimensions=16,
                                     encoding_format="float").data[0].embedding
    assert len(short) == 16 and _cos(short, _tiny_ref(tiny, texts[0], 16)) >= 0.9999
    assert abs(np.linalg.norm(short) - 1) < 1e-5
    with pytest.raises(openai.BadRequestError, match=r"one of \[16, 32\]"):
        client.embeddings.create(model="tiny", input=texts[0], dimensions=20)


def test_rerank_and_score_by_cosine(tiny):
    url = tiny[2]
    query, docs = "t5 t9 t33", ["t40 t41 t42", "t5 t9 t33 t4", "t80 t81"]
    refs = [_tiny_ref(tiny, t) for t in [query, *docs]]
    want = [float(refs[0] @ r) for r in refs[1:]]
    r = httpx.post(url + "/v1/rerank", json={"model": "tiny", "query": query, "documents": docs,
                                             "top_n": 2}, timeout=60).json()
    assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -want[i])[:2]
    for x in r["results"]:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
        assert x["document"] == {"text": docs[x["index"]]}
    assert r["usage"]["total_tokens"] > 0
    bare = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs,
                                                "return_documents": False}, timeout=60).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    s = httpx.post(url + "/v1/score", json={"model": "tiny", "text_1": query, "text_2": docs},
                   timeout=60).json()
    assert [d["index"] for d in s["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in s["data"])
    assert np.allclose([d["score"] for d in s["data"]], want, atol=1e-4)
    pairs = httpx.post(url + "/v1/score", json={"text_1": docs[:2], "text_2": docs[1:]},
                       timeout=60).json()
    assert abs(pairs["data"][0]["score"] - float(refs[1] @ refs[2])) < 1e-4
    for path, body, param in [
        ("/v1/rerank", {"query": query, "documents": []}, "documents"),
        ("/v1/rerank", {"query": query, "documents": [3]}, "documents"),
        ("/v1/rerank", {"query": "", "documents": docs}, "query"),
        ("/v1/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n"),
        ("/v1/score", {"text_1": docs, "text_2": docs[:2]}, "text_1"),
        ("/v1/score", {"text_1": [], "text_2": docs}, "text_1"),
        ("/v1/score", {"text_1": query}, "text_2"),
    ]:
        bad = httpx.post(url + path, json=body, timeout=60)
        assert bad.status_code == 400, (path, body, bad.text)
        assert bad.json()["error"]["param"] == param, (path, body, bad.text)
    assert tiny[3].stats().kv_pages_used == 0


def test_a_generating_engine_refuses_to_embed(tiny):
    engine = AsyncEngine(tiny[3].core.model.source, config=ONE_BUCKET, progress=False)
    try:
        with pytest.raises(ValueError, match="task='embed'"):
            engine.core.add_request("e", "t5 t6", PoolingParams())
        with serving(create_app(engine, ServerConfig(), model_name="gen")) as url:
            r = httpx.post(url + "/v1/embeddings", json={"input": "t5 t6"}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
            assert "--task embed" in r.json()["error"]["message"]
            ok = httpx.post(url + "/v1/completions", json={"prompt": "t5", "max_tokens": 2},
                            timeout=60)
            assert ok.status_code == 200, ok.text
    finally:
        engine.shutdown()
