"""Qwen2.5-VL against HF transformers: the windowed vision tower and merger, the multimodal rope
positions, and the Qwen2 text model with image rows spliced in and three rope positions per
token, on tests/tiny_models.py's random model (its config.json in the published layout).

The pixels are random normalized patches (what the image processor hands the model), so this
pins the network; tests/vision/test_qwen2_vl_processor.py pins the processor. Tolerance as
tests/models/test_models_parity.py: float32 on both sides, `TOL = 1e-4`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from paged import run_paged  # tests/paged.py: pytest puts tests/ on sys.path
from safetensors.numpy import load_file
from tiny_models import QWEN_VL_WORDS, qwen2_5_vl_published, qwen2_5_vl_tiny

from converters import load_source
from jengine.models import model_config_from_hf, qwen2_5_vl

TOL = 1e-4
IMAGE, START, END = QWEN_VL_WORDS + 4, QWEN_VL_WORDS + 2, QWEN_VL_WORDS + 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, HF model) of tests/tiny_models.py's random Qwen2.5-VL."""
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return path, qwen2_5_vl_tiny(path)


def _vision(path):
    hf = json.loads((path / "config.json").read_text())
    vc = qwen2_5_vl.vision_config_from_hf(hf)
    return vc, qwen2_5_vl.params_from_hf(vc, load_file(path / "model.safetensors").items())


def _patches(vc, grids) -> np.ndarray:
    count = sum(t * h * w for t, h, w in grids)
    rng = np.random.default_rng(3)
    return rng.standard_normal((count, vc.patch_in)).astype(np.float32)


def _prompt(grids, merge: int) -> list[int]:
    """t5 t6, then per image <|vision_start|> its placeholders <|vision_end|> and two words."""
    ids = [5, 6]
    for i, (_, h, w) in enumerate(grids):
        ids += [START] + [IMAGE] * (h * w // merge ** 2) + [END, 7 + i, 9]
    return ids


# Slow tier: one image alone (CI keeps two images of different grids, windows cut short).
GRIDS = [pytest.param([(1, 4, 8), (1, 10, 6)], id="two_images"),
         pytest.param([(1, 6, 10)], id="one_image", marks=pytest.mark.slow),
         pytest.param([(1, 4, 4)], id="square", marks=pytest.mark.slow)]


@pytest.mark.parametrize("grids", GRIDS)
def test_qwen2_5_vl_image_logits(tiny, grids):
    """The tower's rows equal HF's `get_image_features`; the rope positions HF's
    `get_rope_index`; every position's logits, the prompt prefilled in chunks of 7 that cut
    through the placeholders, then 4 decode steps at the shifted positions, equal HF's."""
    path, model = tiny
    vc, vparams = _vision(path)
    patches = _patches(vc, grids)
    ids = _prompt(grids, vc.merge_size) + [11, 12, 13, 14]
    thw = torch.tensor(grids)
    types = torch.tensor([[int(i == IMAGE) for i in ids]])
    with torch.no_grad():
        hf_rows = model.model.get_image_features(torch.from_numpy(patches), thw).pooler_output
        expected = model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(patches),
                         image_grid_thw=thw, mm_token_type_ids=types).logits[0].numpy()
        hf_pos, hf_delta = model.model.get_rope_index(torch.tensor([ids]), types, thw)
    rows = qwen2_5_vl.encode_images(vparams, vc, patches, grids)
    np.testing.assert_allclose(rows, torch.cat(list(hf_rows)).numpy(), atol=TOL, rtol=0)
    prompt = ids[:-4]
    pos, delta = qwen2_5_vl.mrope_positions(np.asarray(prompt), IMAGE, grids, vc.merge_size)
    np.testing.assert_array_equal(pos, hf_pos[:, 0, :len(prompt)].numpy())
    assert delta == int(hf_delta)  # the decode tokens' shift
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.config.model_type == "qwen2_5_vl"
    assert loaded.config.rope.mrope_section == (2, 3, 3)
    at = np.full(len(prompt), -1, np.int32)
    hits = np.flatnonzero(np.asarray(prompt) == IMAGE)
    at[hits] = np.arange(len(hits))
    got = run_paged(loaded, ids, decode_steps=4, images=(rows, at), mrope=(pos, delta))
    assert np.abs(got - expected).max() < TOL
    # Negative control: the same rows with one position per token differ.
    plain = run_paged(loaded, ids, decode_steps=4, images=(rows, at))
    assert np.abs(plain - expected).max() > 100 * TOL


def test_text_only_prompt_is_the_qwen2_text_model(tiny):
    """Without images every token's three positions are its index: the plain path equals HF."""
    path, model = tiny
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert np.abs(run_paged(loaded, ids, decode_steps=3) - expected).max() < TOL


def test_missing_vision_weight_is_named(tiny):
    path, _ = tiny
    vc, _ = _vision(path)
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items()
               if "blocks.2.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="w_up"):
        qwen2_5_vl.params_from_hf(vc, tensors.items())


def test_published_and_transformers_5_layouts_read_alike(tmp_path):
    """The published config.json (top-level text fields, rope_scaling "mrope", `in_chans`) and
    transformers 5's save of it (nested text_config, rope_parameters) give one config."""
    published = qwen2_5_vl_published(70)
    transformers.Qwen2_5_VLConfig(**published).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in saved
    for hf in (published, saved):
        cfg = model_config_from_hf(hf)
        assert (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads,
                cfg.rope.mrope_section, cfg.rope.theta, cfg.sliding_window) == (
            "qwen2_5_vl", 64, 2, 2, (2, 3, 3), 10000.0, None)
        vc = qwen2_5_vl.vision_config_from_hf(hf)
        assert (vc.depth, vc.hidden_size, vc.in_channels, vc.window_size,
                vc.fullatt_block_indexes, vc.text_hidden_size, vc.image_token_id) == (
            3, 32, 3, 16, (1,), 64, QWEN_VL_WORDS + 4)
