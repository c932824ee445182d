"""Idefics3 / SmolVLM against HF transformers: the vision tower, the connector and the text
model with image rows spliced in, on tests/tiny_models.py's random model saved as
transformers writes it.

The pixels are random normalized tiles (what the image processor hands the model), so the test
pins the network, not the resizing: transformers' processor needs Pillow or torchvision, which
this environment lacks. Tolerance as tests/models/test_models_parity.py: float32 on both
sides, `TOL = 1e-4`.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import transformers
from paged import run_paged  # tests/paged.py: pytest puts tests/ on sys.path
from safetensors.numpy import load_file
from tiny_models import IDEFICS3_SPECIAL, IDEFICS3_TILE, IDEFICS3_WORDS, idefics3_tiny
from transformers import AutoTokenizer

from converters import load_source
from jengine.models import idefics3

TOL = 1e-4
IMAGE = IDEFICS3_WORDS + IDEFICS3_SPECIAL.index("<image>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, HF model) of tests/tiny_models.py's random Idefics3."""
    path = tmp_path_factory.mktemp("idefics3")
    return path, idefics3_tiny(path)


def _prompt(tokenizer, grids: list[tuple[int, int]], seq_len: int) -> list[int]:
    """Token ids of `t5 t6 <image> t7 ... ` with one image per grid, expanded as the processor
    expands it, then a few words after each."""
    text = "t5 t6 " + " ".join(
        idefics3.image_prompt(r, c, seq_len) + f" t{7 + i} t9" for i, (r, c) in enumerate(grids))
    spaced = text.replace("<", " <").replace(">", "> ").replace("\n", " t3 ")
    return tokenizer(spaced.split(), is_split_into_words=True)["input_ids"]


def _tiles(grids: list[tuple[int, int]]) -> np.ndarray:
    count = sum(r * c + 1 for r, c in grids)
    shape = (count, 3, IDEFICS3_TILE, IDEFICS3_TILE)
    return np.random.default_rng(3).standard_normal(shape).astype(np.float32)


def _vision(path):
    hf = transformers.AutoConfig.from_pretrained(path).to_dict()
    vc = idefics3.vision_config_from_hf(hf)
    params = idefics3.params_from_hf(vc, load_file(path / "model.safetensors").items())
    return vc, params


@pytest.mark.parametrize("grids", [[(0, 0)], [(1, 2)], [(0, 0), (2, 1)]],
                         ids=["one_tile", "grid_1x2", "two_images"])
def test_idefics3_image_logits(tiny, grids):
    """Every position's logits, the prompt prefilled in chunks of 7 that cut through the
    images' placeholders, then 4 decode steps, equal HF's over the same ids and pixels."""
    path, model = tiny
    vc, vparams = _vision(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = _prompt(tokenizer, grids, vc.tokens_per_tile) + [11, 12, 13, 14]
    tiles = _tiles(grids)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids]),
                         pixel_values=torch.from_numpy(tiles)[None]).logits[0].numpy()
        hf_rows = model.model.get_image_features(torch.from_numpy(tiles)[None]).pooler_output
    rows = np.asarray(idefics3.encode(vparams, vc, tiles))
    assert rows.shape == (len(tiles) * vc.tokens_per_tile, 64)
    np.testing.assert_allclose(rows, torch.cat(list(hf_rows)).numpy(), atol=TOL, rtol=0)
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.config.model_type == "idefics3"
    at = idefics3.splice_positions(np.asarray(ids), IMAGE)
    got = run_paged(loaded, ids, decode_steps=4, images=(rows, at))
    assert np.abs(got - expected).max() < TOL
    # Negative control: the text tokens alone (placeholders embedded as tokens) differ.
    plain = run_paged(loaded, ids, decode_steps=4)
    assert np.abs(plain - expected).max() > 100 * TOL


def test_image_prompt_is_the_processors(tiny):
    """`image_prompt` writes what Idefics3Processor.replace_image_token writes."""
    fake = types.SimpleNamespace(fake_image_token="<fake_token_around_image>",
                                 image_token="<image>", global_image_tag="<global-img>",
                                 image_seq_len=3)
    for rows, cols in [(0, 0), (1, 1), (2, 3)]:
        want = transformers.Idefics3Processor.replace_image_token(
            fake, {"rows": [[rows]], "cols": [[cols]]}, 0)
        assert idefics3.image_prompt(rows, cols, 3) == want


def test_missing_vision_weight_is_named(tiny):
    path, _ = tiny
    hf = transformers.AutoConfig.from_pretrained(path).to_dict()
    vc = idefics3.vision_config_from_hf(hf)
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items()
               if "layers.1.mlp.fc2" not in k}
    with pytest.raises(ValueError, match="fc2"):
        idefics3.params_from_hf(vc, tensors.items())


# SmolVLM-256M-Instruct's config.json as published (transformers 4.50's layout: a sparse
# vision_config that leaves num_hidden_layers and the activation to the class defaults).
PUBLISHED = {
    "architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190,
    "model_type": "idefics3", "scale_factor": 4, "tie_word_embeddings": False,
    "text_config": {
        "architectures": ["VLlama3ForCausalLM"], "attention_bias": False, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
        "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "pad_token_id": 2, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": False, "vocab_size": 49280},
    "vision_config": {"hidden_size": 768, "image_size": 512, "intermediate_size": 3072,
                      "max_image_size": {"longest_edge": 512}, "model_type": "idefics3",
                      "num_attention_heads": 12, "patch_size": 16,
                      "size": {"longest_edge": 2048}},
    "vocab_size": 49280,
}


def test_published_config_layout_reads_as_transformers_reads_it():
    from jengine.models import model_config_from_hf

    hf = transformers.Idefics3Config(**PUBLISHED)
    vc = idefics3.vision_config_from_hf(PUBLISHED)
    v = hf.vision_config
    assert (vc.hidden_size, vc.intermediate_size, vc.num_layers, vc.num_heads, vc.image_size,
            vc.patch_size, vc.layer_norm_eps) == (
        v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads,
        v.image_size, v.patch_size, v.layer_norm_eps)
    assert (vc.scale_factor, vc.image_token_id, vc.tokens_per_tile) == (4, 49190, 64)
    cfg = model_config_from_hf(PUBLISHED)
    t = hf.text_config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (
        "idefics3", t.hidden_size, t.num_hidden_layers, t.num_attention_heads,
        t.num_key_value_heads, t.vocab_size, False)
