"""LoRA adapters served over HTTP, through the official `openai` SDK against a server on
127.0.0.1: adapters as models (`/v1/models` with `parent`), picked by `model` in the
completions and chat routes, runtime load and unload (vLLM's routes and bodies), and the
4xx answers for unknown names and bad adapters. Oracle: HF transformers + PEFT."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from local_server import free_port, serving  # tests/local_server.py
from lora_adapters import ATTENTION, base_model, hf_greedy, random_adapter

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
STEPS = 10
EXTRAS = {"ignore_eos": True, "skip_special_tokens": False}  # every token, as words
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the words, as given


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server over a tiny Llama with adapter a1 from --lora-modules and runtime updating on;
    yields (base URL, the engine, the adapters' dir, oracles {name: (HF model)})."""
    root = tmp_path_factory.mktemp("lora_server")
    base = base_model(root / "base", "llama")
    oracles = {
        "base": base,
        "a1": random_adapter(root / "base", root / "a1", "llama", r=8, alpha=16, seed=1),
        "a2": random_adapter(root / "base", root / "a2", "llama", r=4, alpha=4,
                             targets=ATTENTION, seed=2),
    }
    engine = AsyncEngine(str(root / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=2,
                         max_lora_rank=8, progress=False)
    config = ServerConfig(lora_modules=(f"a1={root / 'a1'}",), allow_runtime_lora_updating=True,
                          chat_template=TEMPLATE, grpc_port=free_port())
    try:
        with serving(create_app(engine, config, model_name="base")) as url:
            yield url, engine, root, oracles, f"127.0.0.1:{config.grpc_port}"
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="x", max_retries=0, timeout=120)


PROMPT = np.random.default_rng(0).integers(3, 96, 12).tolist()


def _expected(served, name: str, prompt: list[int] = PROMPT) -> list[str]:
    """The oracle's greedy tokens as the words of the word-level tokenizer (t0..t95)."""
    return [f"t{i}" for i in hf_greedy(served[3][name], prompt, STEPS)]


def _complete(client, model: str, **kw):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=STEPS,
                                     temperature=0, extra_body=EXTRAS, **kw)


def test_adapters_are_models_with_a_parent(served, client):
    _, _, root, _, _ = served
    cards = {m.id: m for m in client.models.list().data}
    assert "base" in cards and "a1" in cards
    assert cards["a1"].parent == "base" and cards["a1"].root == str(root / "a1")
    assert client.models.retrieve("a1").parent == "base"


def test_model_picks_the_adapter_in_completions_and_chat(served, client):
    for name in ("base", "a1"):
        assert _complete(client, name).choices[0].text.split() == _expected(served, name), name
    assert _expected(served, "a1") != _expected(served, "base")  # the test can fail
    words = " ".join(f"t{i}" for i in PROMPT)
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": words}], max_tokens=STEPS,
        temperature=0, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert chat.model == "a1"
    messages = [{"role": "user", "content": words}]
    ids = httpx.post(served[0] + "/tokenize", json={"model": "a1", "messages": messages}
                     ).json()["tokens"]  # the prompt the template made
    assert chat.choices[0].message.content.split() == _expected(served, "a1", ids)


def test_an_unknown_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "a9")
    assert info.value.code == "model_not_found"
    assert info.value.body["message"] == "The model 'a9' does not exist."


def _post(client, path: str, body: dict) -> str:
    return client.post(path, body=body, cast_to=str)


def test_runtime_load_serve_and_unload(served, client):
    url, _, root, _, _ = served
    assert "Success" in _post(client, "/load_lora_adapter",
                              {"lora_name": "a2", "lora_path": str(root / "a2")})
    assert "a2" in {m.id for m in client.models.list().data}
    assert _complete(client, "a2").choices[0].text.split() == _expected(served, "a2")
    _post(client, "/unload_lora_adapter", {"lora_name": "a2"})
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a2")
    with pytest.raises(openai.NotFoundError) as info:
        _post(client, "/unload_lora_adapter", {"lora_name": "a2"})
    assert "cannot be found" in info.value.body["message"]


def test_unloading_an_adapter_in_use_lets_its_requests_finish(served, client):
    url, _, root, _, _ = served
    _post(client, "/load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a2")})
    pieces, unloaded = [], threading.Event()
    stream = _complete(client, "a3", stream=True)
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if not unloaded.is_set():  # after the first token: the adapter goes while it runs
            _post(client, "/unload_lora_adapter", {"lora_name": "a3"})
            unloaded.set()
    assert "".join(pieces).split() == _expected(served, "a2")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a3")


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("rank", "rank 16, over max_lora_rank 8"),
    ("dora", "DoRA adapters"),
    ("embedding", "embed_tokens adapters are not built"),
    ("other_base", r"lora_[AB]\.weight' has shape \[\d+, \d+\]; this model needs"),
    ("corrupt", "corrupt or truncated safetensors"),
    ("duplicate", "has already been loaded"),
])
def test_bad_adapters_are_400s_and_the_server_keeps_serving(served, client, tmp_path,
                                                            case, message):
    _, _, root, _, _ = served
    path, name = tmp_path / case, f"bad-{case}"
    if case == "rank":
        random_adapter(root / "base", path, "llama", r=16, alpha=16)
    elif case in ("dora", "embedding", "corrupt"):
        random_adapter(root / "base", path, "llama", r=2, alpha=2)
        if case == "corrupt":
            file = path / "adapter_model.safetensors"
            file.write_bytes(file.read_bytes()[:100])
        else:
            config = json.loads((path / "adapter_config.json").read_text())
            config.update({"use_dora": True} if case == "dora"
                          else {"target_modules": ["embed_tokens", "q_proj"]})
            (path / "adapter_config.json").write_text(json.dumps(config))
    elif case == "other_base":
        base_model(tmp_path / "qwen", "qwen3")
        random_adapter(tmp_path / "qwen", path, "qwen3", r=2, alpha=2)
    elif case == "duplicate":
        path, name = root / "a1", "a1"
    with pytest.raises(openai.BadRequestError) as info:
        _post(client, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert info.value.body["param"] in ("lora_path", "lora_name")
    assert __import__("re").search(message, info.value.body["message"]), info.value.body
    assert name == "a1" or name not in {m.id for m in client.models.list().data}
    assert _complete(client, "a1").choices[0].text.split() == _expected(served, "a1")


def test_runtime_updating_is_off_by_default(served):
    _, engine, root, _, _ = served
    with serving(create_app(engine, ServerConfig(), model_name="base")) as url:
        r = httpx.post(url + "/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": str(root / "a1")})
        assert r.status_code == 404
        assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]


def test_bench_serve_spreads_prompts_over_adapters(served):
    """`jengine bench serve --served-model base a1` sends prompt i to name i mod 2 (the
    multi-adapter served benchmark, docs/lora.md); an unknown name among them is the server's
    404, so every name is really requested."""
    import argparse

    from jengine.bench.serve import run_serve_bench

    def bench(names):
        return run_serve_bench(argparse.Namespace(
            url=served[0], api_key="x", served_model=names, concurrency=2, num_prompts=4,
            output_len=3, temperature=0.0))

    result = bench(["base", "a1"])
    assert result["model"] == ["base", "a1"]
    assert result["requests"] == 4 and result["output_tokens"] == 12
    with pytest.raises(openai.NotFoundError):
        bench(["base", "no-such-adapter"])


def test_grpc_model_picks_the_adapter(served):
    """gRPC's `model` names an adapter as HTTP's does: the same greedy tokens as PEFT's."""
    pytest.importorskip("grpc")
    from jengine.server.grpc_client import generate_stream

    for name in ("base", "a1"):
        msgs = list(generate_stream(served[4], PROMPT, model=name, max_tokens=STEPS,
                                    temperature=0, ignore_eos=True, skip_special_tokens=False))
        assert "".join(m.text for m in msgs).split() == _expected(served, name), name
