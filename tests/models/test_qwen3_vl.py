"""Qwen3-VL against HF transformers: the tower (interpolated learned positions, full attention
per image, DeepStack mergers), and the Qwen3 text model with the image rows spliced in,
DeepStack rows added after its first layers and interleaved multimodal rope, on
tests/tiny_models.py's random model (config.json in the published layout). Random normalized
patches, float32 on both sides, `TOL = 1e-4` (as tests/models/test_qwen2_5_vl.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from paged import run_paged  # tests/paged.py: pytest puts tests/ on sys.path
from safetensors.numpy import load_file
from tiny_models import QWEN_VL_WORDS, qwen3_vl_tiny

from converters import load_source
from jengine.models import qwen2_5_vl, qwen3_vl

TOL = 1e-4
IMAGE, START, END = QWEN_VL_WORDS + 4, QWEN_VL_WORDS + 2, QWEN_VL_WORDS + 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl")
    return path, qwen3_vl_tiny(path)


@pytest.fixture(scope="module")
def case(tiny):
    """(loaded model, ids, rows [1 + K, M, E], placeholder rows, mrope, HF logits, HF tower
    rows) for two images of different grids (one not square: the position table is resampled
    unevenly on each axis)."""
    path, model = tiny
    hf = json.loads((path / "config.json").read_text())
    vc = qwen3_vl.vision_config_from_hf(hf)
    params = qwen3_vl.params_from_hf(vc, load_file(path / "model.safetensors").items())
    grids = [(1, 4, 8), (1, 10, 6)]
    patches = np.random.default_rng(3).standard_normal(
        (sum(h * w for _, h, w in grids), vc.patch_in)).astype(np.float32)
    ids = [5, 6]
    for i, (_, h, w) in enumerate(grids):
        ids += [START] + [IMAGE] * (h * w // 4) + [END, 7 + i, 9]
    ids += [11, 12, 13, 14]
    thw, types = torch.tensor(grids), torch.tensor([[int(i == IMAGE) for i in ids]])
    with torch.no_grad():
        feats = model.model.get_image_features(torch.from_numpy(patches), thw)
        expected = model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(patches),
                         image_grid_thw=thw, mm_token_type_ids=types).logits[0].numpy()
    hf_rows = torch.stack([torch.cat(list(feats.pooler_output))] + [
        torch.cat(list(f)) for f in feats.deepstack_features]).numpy()
    rows = qwen3_vl.encode_images(params, vc, patches, grids)  # [1 + K, M, E]
    prompt = np.asarray(ids[:-4])
    mrope = qwen2_5_vl.mrope_positions(prompt, IMAGE, grids, vc.merge_size)
    at = np.where(prompt == IMAGE, np.cumsum(prompt == IMAGE) - 1, -1).astype(np.int32)
    loaded = load_source(str(path), dtype="float32", progress=False)
    return loaded, ids, rows, at, mrope, expected, hf_rows


def test_qwen3_vl_image_logits(case):
    """The tower's rows and DeepStack rows equal HF's, and every position's logits, prefilled
    in chunks of 7 through the pads, then 4 decode steps, equal HF's."""
    loaded, ids, rows, at, mrope, expected, hf_rows = case
    np.testing.assert_allclose(rows, hf_rows, atol=TOL, rtol=0)
    assert loaded.config.model_type == "qwen3_vl" and loaded.config.rope.mrope_interleaved
    got = run_paged(loaded, ids, decode_steps=4, images=(rows, at), mrope=mrope)
    assert np.abs(got - expected).max() < TOL


@pytest.mark.slow  # a negative control (CI: the parity above)
@pytest.mark.parametrize("drop", ["deepstack", "interleave"])
def test_without_deepstack_or_interleave_logits_differ(case, drop):
    loaded, ids, rows, at, mrope, expected, _ = case
    if drop == "deepstack":
        got = run_paged(loaded, ids, decode_steps=4, images=(rows[0], at), mrope=mrope)
    else:
        rope = dataclasses.replace(loaded.config.rope, mrope_interleaved=False)
        cfg = dataclasses.replace(loaded.config, rope=rope)
        got = run_paged((cfg, loaded.params), ids, decode_steps=4, images=(rows, at),
                        mrope=mrope)
    assert np.abs(got - expected).max() > 100 * TOL
