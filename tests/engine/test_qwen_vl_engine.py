"""Qwen2.5-VL (and Qwen3-VL, last test) behind the real `Engine`: tests/tiny_models.py's
random model (its config.json in the published layout), images through jengine's processor,
the tower as the engine's compiled encoder bucketed by patch count, and each step carrying the
three rope positions per token, against HF transformers' greedy tokens over the ids and pixels
HF's own Pillow image processor and tokenizer give. transformers' `Qwen2_5_VLProcessor` itself
cannot be built here (its video processor needs torchvision), so its expansion (`<|image_pad|>`
times the merged blocks) is written out from its image processor's grid. The test preset's
64-token budget cuts the images (24 to 40 placeholders each, two per prompt) across prefill
chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import qwen2_5_vl_tiny, qwen3_vl_tiny
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from jengine import Engine, SamplingParams
from jengine.vision.inputs import ImagePrompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAD = "<|vision_start|><|image_pad|><|vision_end|>"

pytestmark = pytest.mark.slow  # a whole engine (CI: tests/models/test_qwen2_5_vl.py's parity)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return path, qwen2_5_vl_tiny(path)


@pytest.fixture(scope="module")
def vlm(tiny):
    path, model = tiny
    return model, Engine(str(path), config="test", progress=False, warmup=True)


def _image(seed: int, height: int = 50, width: int = 70) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _hf_inputs(path, text: str, images: list[np.ndarray]) -> dict:
    """What Qwen2_5_VLProcessor hands the model: its image processor's patches and grids, and
    each `<|image_pad|>` repeated once per merged block before tokenizing."""
    out = Qwen2VLImageProcessorPil.from_pretrained(path)(
        images=[Image.fromarray(i) for i in images], return_tensors="pt")
    for t, h, w in out["image_grid_thw"].tolist():
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"]}


def _hf_greedy(model, inputs: dict, image_token: int, n: int) -> list[int]:
    ids, out = inputs["input_ids"], []
    with torch.no_grad():
        for _ in range(n):
            types = (ids == image_token).int()
            logits = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                           image_grid_thw=inputs["image_grid_thw"],
                           mm_token_type_ids=types).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


@pytest.mark.parametrize("sizes", [[(50, 70)], [(30, 90), (70, 40)]],
                         ids=["one_image", "two_images"])
def test_greedy_equals_hf(tiny, vlm, sizes):
    """jengine's ids and patches equal HF's processor's, and its greedy tokens HF's."""
    model, engine = vlm
    images = [_image(i, h, w) for i, (h, w) in enumerate(sizes)]
    text = "t5 t6 " + " ".join(f"{PAD} t{7 + i}" for i in range(len(images)))
    hf = _hf_inputs(tiny[0], text, images)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    ready = engine.core.images.prepare(ImagePrompt.of(prompt))
    assert ready.token_ids == hf["input_ids"][0].tolist()
    np.testing.assert_array_equal(ready.tiles, hf["pixel_values"].numpy())
    want = _hf_greedy(model, hf, model.config.image_token_id, GREEDY.max_tokens)
    assert engine.generate(prompt, GREEDY)[0].outputs[0].token_ids == want
    assert engine.core.compiles_since_ready == 0


def test_mixed_batch_gives_each_its_solo_tokens(vlm):
    _, engine = vlm
    prompts = [{"prompt": f"t5 {PAD} t6", "multi_modal_data": {"image": _image(3)}},
               "t7 t8 t9 t10",
               {"prompt": f"t11 {PAD}", "multi_modal_data": {"image": _image(4, 90, 30)}},
               [1, 12, 13]]
    solo = [engine.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    engine.core.reset_prefix_cache()
    together = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert together == solo


def test_same_image_hits_the_cache(vlm):
    _, engine = vlm
    engine.core.reset_prefix_cache()

    def run(image):
        prompt = {"prompt": f"t3 t4 {PAD} t5", "multi_modal_data": {"image": image}}
        return engine.generate(prompt, GREEDY)[0]

    first, again = run(_image(5)), run(_image(5))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_chat_with_an_image_part(vlm):
    """Engine.chat renders the model's template (one vision_start / pad / end per image)."""
    import base64
    import io

    _, engine = vlm
    buf = io.BytesIO()
    Image.fromarray(_image(6)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "t7"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    [out] = engine.chat(messages, GREEDY)
    prompt = engine.render_chat(messages)
    assert isinstance(prompt, ImagePrompt) and prompt.text.count("<|image_pad|>") == 1
    assert out.outputs[0].token_ids == engine.generate(
        {"prompt": prompt.text, "multi_modal_data": {"image": _image(6)}},
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": f"t5 {PAD} {PAD}", "multi_modal_data": {"image": _image(7)}},
     "2 <|image_pad|> placeholders for 1 images"),
    ({"prompt": "t5 <|image_pad|><|image_pad|>", "multi_modal_data": {"image": [_image(7)] * 2}},
     "runs of image placeholders"),
    ({"prompt": f"t5 {PAD}", "multi_modal_data": {"image": _image(7, 1, 300)}}, "aspect ratio"),
])
def test_bad_images_are_value_errors_and_the_engine_goes_on(vlm, prompt, message):
    _, engine = vlm
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt, GREEDY)
    assert len(engine.generate("t5 t6", GREEDY)[0].outputs[0].token_ids) == 6


@pytest.fixture(scope="module")
def vlm3(tmp_path_factory):
    """(checkpoint directory, HF model, engine) of the random Qwen3-VL."""
    path = tmp_path_factory.mktemp("qwen3_vl")
    model = qwen3_vl_tiny(path)
    return path, model, Engine(str(path), config="test", progress=False, warmup=True)


def test_qwen3_vl_greedy_equals_hf_and_mixed_batch(vlm3):
    """Qwen3-VL (DeepStack rows and interleaved rope positions in every step): two images of
    different grids give HF's ids, patches and greedy tokens; beside a text prompt in one
    batch, each gives its solo tokens."""
    path, model, engine = vlm3
    images = [_image(1, 30, 90), _image(2, 70, 40)]
    text = f"t5 t6 {PAD} t7 {PAD} t8"
    hf = _hf_inputs(path, text, images)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    ready = engine.core.images.prepare(ImagePrompt.of(prompt))
    assert ready.token_ids == hf["input_ids"][0].tolist()
    np.testing.assert_array_equal(ready.tiles, hf["pixel_values"].numpy())
    want = _hf_greedy(model, hf, model.config.image_token_id, GREEDY.max_tokens)
    assert engine.generate(prompt, GREEDY)[0].outputs[0].token_ids == want
    engine.core.reset_prefix_cache()
    both = engine.generate([prompt, "t9 t10 t11"], GREEDY)
    assert both[0].outputs[0].token_ids == want
    assert both[1].outputs[0].token_ids == engine.generate("t9 t10 t11", GREEDY)[0].outputs[
        0].token_ids
    assert engine.core.compiles_since_ready == 0
