"""A vision model behind the real `Engine`: tests/tiny_models.py's random Idefics3, its
images through jengine's NumPy processor, its tower as the engine's compiled encoder and its
rows spliced into the step, against HF transformers' greedy tokens over the same ids and
pixels. The test preset's 64-token budget cuts a 5-tile image (80 placeholders) across
prefill chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import idefics3_tiny

from jengine import Engine, SamplingParams
from jengine.vision.decode import encode_png
from jengine.vision.inputs import ImagePrompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    model = idefics3_tiny(path)
    engine = Engine(str(path), config="test", progress=False, warmup=True)
    return model, engine


def _image(seed: int, height: int = 50, width: int = 70) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _hf_greedy(model, prompt: ImagePrompt, engine: Engine, n: int) -> list[int]:
    """HF's greedy continuation of the ids and tiles jengine prepares for `prompt` (a full
    forward per token, end of sequence ignored)."""
    ready = engine.core.images.prepare(prompt)
    ids = list(ready.token_ids)
    pixels = torch.from_numpy(ready.tiles)[None] if len(ready.tiles) else None
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_image_prompt_greedy_equals_hf(vlm):
    """vLLM's prompt form, one image cut into a 2x2 grid + global tile, and two images."""
    model, engine = vlm
    one = {"prompt": "t5 t6 <image> t7 t8", "multi_modal_data": {"image": _image(0)}}
    two = {"prompt": "t9 <image> t10 <image> t11",
           "multi_modal_data": {"image": [_image(1, 30, 20), encode_png(_image(2))]}}
    outs = engine.generate([one, two], GREEDY)
    for prompt, out in zip([one, two], outs):
        want = _hf_greedy(model, ImagePrompt.of(prompt), engine, GREEDY.max_tokens)
        assert out.outputs[0].token_ids == want
    assert engine.core.compiles_since_ready == 0


def test_mixed_batch_gives_each_its_solo_tokens(vlm):
    _, engine = vlm
    prompts = [{"prompt": "t5 <image> t6", "multi_modal_data": {"image": _image(3)}},
               "t7 t8 t9 t10", {"prompt": "t11 <image>", "multi_modal_data": {"image": _image(4)}},
               [1, 12, 13]]
    solo = [engine.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    engine.core.reset_prefix_cache()
    together = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert together == solo


def test_same_image_hits_the_cache_another_image_does_not(vlm):
    _, engine = vlm
    engine.core.reset_prefix_cache()

    def run(image):
        prompt = {"prompt": "t3 t4 <image> t5", "multi_modal_data": {"image": image}}
        return engine.generate(prompt, GREEDY)[0]

    first, again = run(_image(5)), run(_image(5))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = _image(5).copy()
    other[0, 0, 0] ^= 1  # one pixel's lowest bit
    differs = run(other)
    # Only the pages before the image (t1 t3 t4 + the first tags: under one page) may be shared.
    assert differs.num_cached_tokens == 0


def test_chat_with_an_image_part(vlm):
    """Engine.chat takes OpenAI's image_url part with a data: URL and equals the same prompt
    given as text + image."""
    import base64

    model, engine = vlm
    image = _image(6)
    url = "data:image/png;base64," + base64.b64encode(encode_png(image)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "t7"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    [out] = engine.chat(messages, GREEDY)
    prompt = engine.render_chat(messages)
    assert isinstance(prompt, ImagePrompt) and prompt.text.count("<image>") == 1
    assert out.outputs[0].token_ids == _hf_greedy(model, prompt, engine, GREEDY.max_tokens)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "t5 <image> <image>", "multi_modal_data": {"image": _image(7)}},
     "2 <image> placeholders for 1 images"),
    ({"prompt": "t5 <image>", "multi_modal_data": {"image": [_image(7)] * 5}},
     "limit is 4"),
    ({"prompt": "t5 <image>", "multi_modal_data": {"image": b"not an image"}}, "not a PNG"),
    ({"prompt": "t5 <image>", "multi_modal_data": {"image": np.zeros((4, 4), np.float32)}},
     "must be uint8"),
])
def test_bad_images_are_value_errors_and_the_engine_goes_on(vlm, prompt, message):
    _, engine = vlm
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt, GREEDY)
    assert len(engine.generate("t5 t6", GREEDY)[0].outputs[0].token_ids) == 6


def test_images_for_a_text_model_are_refused(smol_engine):
    prompt = {"prompt": "Describe <image>", "multi_modal_data": {"image": _image(8)}}
    with pytest.raises(ValueError, match="does not take images"):
        smol_engine.generate(prompt, GREEDY)
