"""Qwen2.5-VL and Qwen3-VL over the OpenAI API: tests/tiny_models.py's random models served on
127.0.0.1 and spoken to with the `openai` SDK. A chat `image_url` part with a data URL gives HF
transformers' greedy text (HF fed the ids, patches and grids jengine prepares, its own rope
index), a second identical request reports cached tokens, and an undecodable image is a 400
naming the part while the server goes on serving. The other image routes, URL schemes and limits
are the same code for every vision family (tests/server/test_server_vision.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from local_server import serving  # tests/local_server.py
from PIL import Image
from tiny_models import qwen2_5_vl_tiny, qwen3_vl_tiny

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app
from jengine.text.chat import render_chat_text
from jengine.vision.chat import split_images
from jengine.vision.inputs import ImagePrompt

pytestmark = pytest.mark.slow  # a whole engine (CI: tests/models/test_qwen2_5_vl.py's parity)
MAX_TOKENS = 5


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(request.param)
    model = {"qwen2_5_vl": qwen2_5_vl_tiny, "qwen3_vl": qwen3_vl_tiny}[request.param](path)
    engine = AsyncEngine(str(path), config="test", progress=False)
    try:
        with serving(create_app(engine, ServerConfig(), model_name="vlm")) as url:
            yield model, engine, url
    finally:
        engine.shutdown()


def _data_url(image: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(image).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _chat(url: str, image_url: str):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "t7"}, {"type": "image_url", "image_url": {"url": image_url}}]}]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return messages, client.chat.completions.create(model="vlm", messages=messages,
                                                    max_tokens=MAX_TOKENS, temperature=0)


def _hf_text(model, engine, messages: list[dict]) -> str:
    plain, images = split_images(messages)
    prompt = ImagePrompt(render_chat_text(engine.tokenizer, plain), tuple(images),
                         add_special_tokens=False)
    ready = engine.core.images.prepare(prompt)
    ids, out = torch.tensor([ready.token_ids]), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, pixel_values=torch.from_numpy(ready.tiles),
                           image_grid_thw=torch.tensor(ready.grids),
                           mm_token_type_ids=(ids == model.config.image_token_id).int()
                           ).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return engine.tokenizer.decode(out, skip_special_tokens=True)


def test_data_url_equals_hf_and_is_cached(vlm):
    model, engine, url = vlm
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    messages, first = _chat(url, _data_url(image))
    assert first.choices[0].message.content == _hf_text(model, engine, messages)
    _, again = _chat(url, _data_url(image))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_undecodable_image_is_a_400_naming_the_part(vlm):
    _, _, url = vlm
    with pytest.raises(openai.BadRequestError) as err:
        _chat(url, "data:image/png;base64," + base64.b64encode(b"not an image").decode())
    assert "messages[0].content[1]" in str(err.value)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model="vlm", max_tokens=3, temperature=0,
                                         messages=[{"role": "user", "content": "t5 t6"}])
    assert out.usage.completion_tokens == 3
