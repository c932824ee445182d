"""Llama 4 text (`llama4_text`) against HF transformers on a tiny random model
(tests/models/test_models_parity.py's recipe: chunked prefill over shuffled pages, 8 decode
steps, float32 logits within `TOL`), with attention chunks of 8 tokens so a 30-token sequence
crosses three of them, and a NoPE layer whose temperature floor (4 positions) the sequence
passes. Negative controls, each pushing the logits past `TOL`: no chunks, no q/k norm, no
temperature, Llama's rope pairs (the q/k dims not reordered), the routing weight on the
expert's output instead of its input. Through the engine: greedy tokens equal HF's on the
reference backend, and a context past one chunk on another backend is refused at start.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers
from test_deepseek import ONE_BUCKET, _num_params
from test_deepseek_v3 import engine_greedy_matches_hf
from test_models_parity import TOL, VOCAB, _build, _max_diff

from converters import load_source
from jengine import Engine
from jengine.models import llama4, moe


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, attention_chunk_size=8, floor_scale=4,
        attn_scale=0.5, max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    return transformers.Llama4TextConfig(**{**base, **kw})


def _control(cfg, params, ids, expected) -> float:
    return _max_diff((cfg, params), ids, expected, decode_steps=0)


def _output_weighted(h, p, experts, weights, num_experts, gather):
    return moe._dense_experts(h, p, experts, weights, num_experts)


def test_llama4_text(tmp_path, monkeypatch):
    models: list = []
    loaded, ids, expected = _build(tmp_path, _config(), transformers.Llama4ForCausalLM,
                                   edit=models.append, greedy=False)
    cfg, params = loaded.config, loaded.params
    assert cfg.model_type == "llama4_text" and cfg.num_params == _num_params(models[0])
    assert (cfg.rope_layers, cfg.attention_chunk_size, cfg.attn_temperature) == (
        (True, True, True, False), 8, (4.0, 0.5))
    assert _max_diff(loaded, ids, expected) < TOL
    for wrong in (dict(attention_chunk_size=None), dict(qk_l2_norm=False),
                  dict(attn_temperature=None), dict(router_scoring="softmax")):
        assert _control(dataclasses.replace(cfg, **wrong), params, ids, expected) > TOL, wrong
    monkeypatch.setattr(moe, "_experts_of_scaled_inputs", _output_weighted)
    retraced = dataclasses.replace(cfg, max_position_embeddings=129)  # not the cached program
    assert _control(retraced, params, ids, expected) > TOL
    monkeypatch.undo()
    monkeypatch.setattr(llama4, "_evens_then_odds", lambda w: w)
    as_llama = load_source(str(tmp_path), dtype="float32", progress=False)
    assert _control(as_llama.config, as_llama.params, ids, expected) > TOL


def test_llama4_multimodal_config_reads_its_text_model(tmp_path):
    _build(tmp_path, _config(), transformers.Llama4ForCausalLM, greedy=False)
    text = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
         "text_config": text, "vision_config": {"hidden_size": 8}}))
    assert load_source(str(tmp_path), dtype="float32", progress=False).config.model_type == (
        "llama4_text")


def test_llama4_engine_greedy_and_chunk_refusal(tmp_path):
    engine_greedy_matches_hf(tmp_path, _config(), transformers.Llama4ForCausalLM,
                             ({"attention_backend": "reference"},))
    with pytest.raises(ValueError, match="chunks of 8 tokens"):
        Engine(str(tmp_path), config=ONE_BUCKET, dtype="float32", kv_cache_memory="4MiB",
               max_model_len=64, attention_backend="cpu")
