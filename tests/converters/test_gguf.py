"""GGUF models: what llama.cpp's converter does undone (q/k rows permuted, experts stacked per
layer, llama3 rope scaling as `rope_freqs.weight`), the weights placed without a copy, and logits
against HF transformers on tiny random models written by tests/gguf_writer.py (Llama, Qwen3,
Qwen3-MoE, Mixtral). The file format and dequantization: tests/converters/test_gguf_format.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from gguf_writer import llama_cpp_permute, write_tiny_llama  # tests/gguf_writer.py
from paged import run_paged  # tests/paged.py: pytest puts tests/ on sys.path

from converters import load_source
from converters.gguf_file import GGUFModel

TOL = 1e-4  # logits tolerance of the end-to-end check (see tests/models/test_models_parity.py)


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


def _gguf_logits_diff(path, model) -> float:
    loaded = load_source(str(path), dtype="float32", progress=False)
    ids = np.random.default_rng(2).integers(3, 96, 24).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = run_paged(loaded, ids, prefill_chunk=7, decode_steps=6, page_size=4)
    return float(np.abs(got - expected).max())


def test_gguf_qk_permutation_is_undone(tiny_llama_gguf):
    path, _, state = tiny_llama_gguf
    got = dict(GGUFModel(path).tensors())
    assert set(got) == set(state)
    for key, want in state.items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)
    # The permutation is not the identity for these shapes: skipping its inverse would show.
    q = state["model.layers.0.self_attn.q_proj.weight"]
    k = state["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, 4, 4), q)
    assert not np.array_equal(llama_cpp_permute(k, 4, 2), k)


def test_gguf_llama_logits_match_transformers(tiny_llama_gguf):
    path, model, _ = tiny_llama_gguf
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.kind == "gguf" and loaded.config.num_kv_heads == 2
    assert loaded.tokenizer('!"#$a</s>').input_ids == [92, 93, 64, 95]  # merges, "a", eos
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_weights_are_placed_on_the_cpu_without_a_copy(tiny_llama_gguf):
    """One CPU device, float weights: every placed weight, each layer's slice included, uses the
    assembled host array's memory (XLA:CPU aliases 64-byte-aligned arrays), so a start pays
    neither a second copy of the weights nor its page faults."""
    from jengine.core.build import place_weights

    path, _, _ = tiny_llama_gguf
    loaded = load_source(str(path), dtype="float32", progress=False)
    params = place_weights(loaded, loaded.config, None, dtype="float32", quantization="none",
                           layer_layout="unstacked", quantize_lm_head=False, smoothing_alpha=0.0,
                           progress=False)
    hosts = [np.asarray(w) for w in loaded.params.values()]
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in hosts]
    leaves = jax.tree.leaves(params)
    assert len(leaves) > len(hosts)  # the layers were split
    for leaf in leaves:
        assert any(lo <= leaf.unsafe_buffer_pointer() < hi for lo, hi in spans), leaf.shape


def test_gguf_qwen3(tmp_path):
    path, model, _ = write_tiny_llama(tmp_path / "qwen3.gguf", arch="qwen3")
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.config.model_type == "qwen3" and loaded.config.qk_norm
    assert loaded.config.head_dim == 32
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_qwen3_moe(tmp_path):
    # llama.cpp's layout: a router per layer and each expert weight stacked [X, out, in].
    path, model, _ = write_tiny_llama(tmp_path / "qwen3moe.gguf", arch="qwen3moe")
    cfg = load_source(str(path), dtype="float32", progress=False).config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob and cfg.qk_norm
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_mixtral(tmp_path):
    # A `llama` GGUF with expert tensors is Mixtral; its q/k rows are permuted like Llama's.
    path, model, _ = write_tiny_llama(tmp_path / "mixtral.gguf", mixtral=True)
    cfg = load_source(str(path), dtype="float32", progress=False).config
    assert (cfg.model_type, cfg.num_experts, cfg.moe_intermediate_size) == ("mixtral", 8, 32)
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_llama31_rope_freqs(tmp_path):
    """llama.cpp stores llama3 rope scaling as a `rope_freqs.weight` tensor of divisors."""
    rope = {
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }
    path, model, _ = write_tiny_llama(tmp_path / "llama31.gguf", rope)
    assert GGUFModel(path).hf_config()["rope_scaling"]["rope_type"] == "freq_factors"
    assert _gguf_logits_diff(path, model) < TOL
