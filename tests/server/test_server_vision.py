"""Images over the OpenAI API: tests/tiny_models.py's random Idefics3 served on 127.0.0.1,
spoken to with the `openai` SDK. Chat `image_url` parts (data:, file: under
--allowed-local-media-path, http(s) from a 127.0.0.1 image server with --allow-remote-media)
and the Responses API's `input_image` give HF transformers' greedy tokens; a lossless WebP
gives the PNG's tokens and a JPEG HF's over its decoded pixels; bad images are 400s naming the
content part, and the engine goes on serving."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
import time

import numpy as np
import openai
import pytest
import torch
from local_server import serving  # tests/local_server.py
from PIL import Image
from tiny_models import idefics3_tiny

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app
from jengine.text.chat import render_chat_text
from jengine.vision.chat import split_images
from jengine.vision.inputs import ImagePrompt

MAX_TOKENS = 5


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (50, 70, 3), dtype=np.uint8)


def _encode(image: np.ndarray, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, fmt, **options)
    return out.getvalue()


def _data_url(image: np.ndarray, fmt: str = "PNG", **options) -> str:
    data = base64.b64encode(_encode(image, fmt, **options)).decode()
    return f"data:image/{fmt.lower()};base64,{data}"


class _Images(http.server.BaseHTTPRequestHandler):
    """/ok.png: a PNG; /big.png: more bytes than the limit; /slow.png: answers after 3 s."""

    png = _encode(_image(0))

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(3)
        body = self.png if self.path != "/big.png" else self.png + b"\0" * 300_000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the server gave up (size, time limits)
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(HF model, engine, open URL, locked-down URL, image server URL, media dir)."""
    path = tmp_path_factory.mktemp("idefics3")
    model = idefics3_tiny(path)
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(_encode(_image(0)))
    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    engine = AsyncEngine(str(path), config="test", progress=False)
    try:
        open_config = ServerConfig(allowed_local_media_path=str(media), allow_remote_media=True,
                                   max_image_bytes=200_000, media_fetch_timeout=1.0)
        with serving(create_app(engine, open_config, model_name="vlm")) as url, \
                serving(create_app(engine, ServerConfig(), model_name="vlm")) as closed:
            yield (model, engine, url, closed, f"http://127.0.0.1:{images.server_port}",
                   media)
    finally:
        images.shutdown()
        engine.shutdown()


def _messages(url: str, text: str = "t7") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _chat(url: str, messages: list[dict]):
    return _client(url).chat.completions.create(model="vlm", messages=messages,
                                                max_tokens=MAX_TOKENS, temperature=0)


def _hf_text(model, engine, messages: list[dict]) -> str:
    """HF's greedy continuation of what the chat route renders, as text."""
    plain, images = split_images(messages)
    prompt = ImagePrompt(render_chat_text(engine.tokenizer, plain), tuple(images),
                         add_special_tokens=False)
    return engine.tokenizer.decode(_hf_greedy(model, engine, prompt), skip_special_tokens=True)


def _hf_greedy(model, engine, prompt: ImagePrompt) -> list[int]:
    """HF's greedy tokens over the ids and tiles jengine prepares for `prompt`."""
    ready = engine.core.images.prepare(prompt)
    ids, out = list(ready.token_ids), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=torch.tensor([ids]),
                           pixel_values=torch.from_numpy(ready.tiles)[None]).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_data_url_equals_hf_and_the_same_image_is_cached(vlm):
    model, engine, url, *_ = vlm
    messages = _messages(_data_url(_image(0)))
    first = _chat(url, messages)
    assert first.choices[0].message.content == _hf_text(model, engine, messages)
    again = _chat(url, messages)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    other = _chat(url, _messages(_data_url(_image(1))))
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_webp_and_jpeg_data_urls(vlm):
    """A lossless WebP holds the PNG's pixels, so its greedy text is the PNG's; a JPEG's
    pixels differ from the PNG's, so its text is checked against HF over what it decodes to."""
    model, engine, url, *_ = vlm
    png = _chat(url, _messages(_data_url(_image(7)))).choices[0].message.content
    webp = _chat(url, _messages(_data_url(_image(7), "WEBP", lossless=True)))
    assert webp.choices[0].message.content == png
    jpeg_messages = _messages(_data_url(_image(7), "JPEG", quality=90))
    jpeg = _chat(url, jpeg_messages)
    assert jpeg.usage.completion_tokens == MAX_TOKENS
    assert jpeg.choices[0].message.content == _hf_text(model, engine, jpeg_messages)


def test_file_and_http_urls_where_allowed(vlm):
    _, _, url, _, images, media = vlm
    want = _chat(url, _messages(_data_url(_image(0)))).choices[0].message.content
    assert _chat(url, _messages(f"file://{media}/cat.png")).choices[0].message.content == want
    assert _chat(url, _messages(f"{images}/ok.png")).choices[0].message.content == want


def test_responses_input_image(vlm):
    model, engine, url, *_ = vlm
    data = _data_url(_image(2))
    response = _client(url).responses.create(
        model="vlm", max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "t7"},
                                            {"type": "input_image", "image_url": data}]}])
    assert response.output_text == _hf_text(model, engine, _messages(data))


@pytest.mark.parametrize("which, image_url, message", [
    ("open", "data:image/png;base64,aGVsbG8=", "not a decodable"),
    ("open", "data:image/png;base64,@@@", "not valid base64"),
    ("open", "ftp://127.0.0.1/x.png", "scheme 'ftp' is not allowed"),
    ("open", "file:///etc/passwd", "outside --allowed-local-media-path"),
    ("closed", "file:///etc/passwd", "--allowed-local-media-path DIR"),
    ("closed", "{images}/ok.png", "--allow-remote-media"),
    ("open", "{images}/big.png", "over the 200000 byte limit"),
    ("open", "{images}/slow.png", "cannot fetch"),
])
def test_bad_image_urls_are_400s_naming_the_part(vlm, which, image_url, message):
    _, _, url, closed, images, _ = vlm
    target = url if which == "open" else closed
    with pytest.raises(openai.BadRequestError) as e:
        _chat(target, _messages(image_url.format(images=images)))
    assert message in e.value.message
    assert e.value.body["param"] == "messages.0.content.1"
    assert _chat(target, [{"role": "user", "content": "t5 t6"}]).usage.completion_tokens == 5


def test_too_many_images_is_a_400(vlm):
    _, _, url, *_ = vlm
    part = {"type": "image_url", "image_url": {"url": _data_url(_image(3))}}
    with pytest.raises(openai.BadRequestError, match="limit is 4"):
        _chat(url, [{"role": "user", "content": [part] * 5}])


def test_anthropic_image_blocks_equal_chats_image_parts(vlm):
    """`/v1/messages` through the `anthropic` SDK: a base64 image block gives chat's greedy
    text for the same image; count_tokens refuses images as /tokenize does."""
    import anthropic

    model, engine, url, *_ = vlm
    image = _encode(_image(4))
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    content = [{"type": "text", "text": "t7"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}}]
    reply = client.messages.create(model="vlm", max_tokens=MAX_TOKENS, extra_body={
        "temperature": 0}, messages=[{"role": "user", "content": content}])
    assert reply.content[0].text == _hf_text(model, engine, _messages(_data_url(_image(4))))
    with pytest.raises(anthropic.BadRequestError, match="count_tokens does not count image"):
        client.messages.count_tokens(model="vlm", messages=[{"role": "user",
                                                             "content": content}])


def test_tokenize_refuses_images(vlm):
    import httpx

    _, _, url, *_ = vlm
    reply = httpx.post(f"{url}/tokenize", json={"messages": _messages(_data_url(_image(5)))})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"


def test_async_engine_takes_vllms_prompt_dict(vlm):
    import asyncio

    from jengine import SamplingParams

    model, engine, *_ = vlm
    image = _image(6)

    async def tokens() -> list[int]:
        out = []
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        prompt = {"prompt": "t1 t4 <image> t7", "multi_modal_data": {"image": image}}
        async for delta in engine.generate(prompt, params):
            out += delta.outputs[0].token_ids
        return out

    want = _hf_greedy(model, engine, ImagePrompt("t1 t4 <image> t7", (image,)))
    assert asyncio.run(tokens()) == want


def test_text_streams_while_an_image_encodes(vlm):
    """The tower runs on its own thread, never the engine thread's: with it held busy, a text
    request streams to its end while an image request waits for its encoding; once the tower
    is free, the image request gets HF's tokens."""
    import asyncio

    from jengine import SamplingParams

    model, engine, *_ = vlm
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompt = ImagePrompt("t2 <image> t3", (_image(7),))

    async def tokens(request, out: list[int]) -> list[int]:
        async for delta in engine.generate(request, params):
            out += delta.outputs[0].token_ids
        return out

    async def both() -> tuple[list[int], list[int], list[int]]:
        image_tokens: list[int] = []
        image = asyncio.create_task(tokens(prompt, image_tokens))
        text = await tokens("t4 t5 t6", [])
        before = list(image_tokens)  # what the image request had when the text one ended
        gate.set()
        return text, await image, before

    gate = threading.Event()
    engine._tower.submit(gate.wait, 60)  # the tower's one thread is busy until the gate opens
    try:
        text, image, before = asyncio.run(both())
    finally:
        gate.set()
    assert len(text) == MAX_TOKENS and before == []
    assert image == _hf_greedy(model, engine, prompt)
