"""Sharded loading on the 8 fake CPU devices: every device's slice is read on its own, from the
safetensors slice it needs, and the result equals the eager loader (after q-head padding) bit
for bit.

Two head layouts: 16 q / 8 kv heads (kv heads split over tp) and 9 q / 3 kv heads (kv heads
replicated, q heads zero-padded to a multiple of tp; the padding is never read). Bytes read are
counted per HF tensor: a tp-sharded tensor is read in pieces of at most its per-device share,
each byte once; a replicated tensor is read whole, once.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import transformers
from jax.sharding import Mesh
from tiny_models import llama_heads, save_words

from converters import ModelLoadError, load_params_sharded, load_source
from converters.checkpoint import save_checkpoint
from converters.lazy import LazyParam
from jengine.models import family_module
from jengine.sharding import ShardingRules, pad_query_heads, padded_config
from jengine.sharding.mesh import TP

HEADS = {"even": (16, 8), "padded": (9, 3)}


def _shardings(cfg, tp: int):
    mesh = Mesh(np.asarray(jax.devices()[:tp]), (TP,))
    rules = ShardingRules.for_model(mesh, cfg)
    return rules.param_shardings(family_module(cfg).param_specs(cfg))


def _assert_equal(params, expected):
    assert set(params) == set(expected)
    for name, w in params.items():
        assert w.shape == expected[name].shape, name
        np.testing.assert_array_equal(np.asarray(w), expected[name], err_msg=name)


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("layout", ["even", "padded"])
def test_lazy_load_equals_eager_and_reads_only_each_shard(tmp_path, layout, tp):
    llama_heads(tmp_path, *HEADS[layout], bias=layout == "padded")
    eager = load_source(str(tmp_path), progress=False)
    cfg, expected = pad_query_heads(eager.config, eager.params, tp)

    lazy = load_source(str(tmp_path), progress=False, lazy=True)
    assert all(isinstance(p, LazyParam) and not p.reads for p in lazy.params.values())
    assert padded_config(lazy.config, tp) == cfg
    shardings = _shardings(cfg, tp)
    params = load_params_sharded(lazy, cfg, shardings, "float32")
    _assert_equal(params, expected)

    print(f"\n{'param':10s} {'HF tensor bytes':>15s} {'reads':>6s} {'largest':>8s}  spec")
    for name, param in sorted(lazy.params.items()):
        spec = tuple(shardings[name].spec)
        for source in param.sources:
            reads = param.reads[source.key]
            print(f"{name:10s} {source.nbytes:15d} {len(reads):6d} {max(reads):8d}  {spec}")
            assert sum(reads) == source.nbytes, (name, reads)  # every byte once, no padding
            if TP in spec:
                # One device's share: 1/tp of the padded axis, e.g. 5 of 9 real heads at tp=2.
                axis = spec.index(TP)
                real, padded = param.shape[axis], params[name].shape[axis]
                share = source.nbytes * (padded // tp) // real
                assert max(reads) <= share, (name, reads, share)
                assert len(reads) > 1
            else:
                assert reads == [source.nbytes], (name, reads)


def test_lazy_load_on_one_device_and_tied_embeddings(tmp_path):
    llama_heads(tmp_path, 4, 2, tied=True)
    eager = load_source(str(tmp_path), progress=False)
    assert "lm_head" not in eager.params
    lazy = load_source(str(tmp_path), progress=False, lazy=True)
    params = load_params_sharded(lazy, lazy.config, None, "float32")
    _assert_equal(params, eager.params)


def test_eager_and_gguf_style_numpy_params_place_shard_by_shard(tmp_path):
    # Numpy params (what GGUF gives after dequantizing) take the same path, padding included.
    llama_heads(tmp_path, *HEADS["padded"])
    eager = load_source(str(tmp_path), progress=False)
    cfg, expected = pad_query_heads(eager.config, eager.params, 8)
    _assert_equal(load_params_sharded(eager, cfg, _shardings(cfg, 8), "float32"), expected)


@pytest.mark.parametrize("layout", ["even", "padded"])
def test_checkpoint_restores_onto_shardings_with_padding(tmp_path, layout):
    llama_heads(tmp_path / "hf", *HEADS[layout])
    eager = load_source(str(tmp_path / "hf"), progress=False)
    save_checkpoint(eager, tmp_path / "ckpt")
    loaded = load_source(str(tmp_path / "ckpt"), progress=False, lazy=True)
    assert loaded.kind == "checkpoint" and loaded.params == {}
    cfg, expected = pad_query_heads(eager.config, eager.params, 8)
    shardings = _shardings(cfg, 8)
    params = load_params_sharded(loaded, cfg, shardings, "float32")
    _assert_equal(params, expected)
    for name, w in params.items():
        assert w.sharding == shardings[name], name


def test_bfloat16_target(tmp_path):
    llama_heads(tmp_path, *HEADS["padded"])
    eager = load_source(str(tmp_path), dtype="bfloat16", progress=False)
    cfg, expected = pad_query_heads(eager.config, eager.params, 2)
    lazy = load_source(str(tmp_path), dtype="bfloat16", progress=False, lazy=True)
    params = load_params_sharded(lazy, cfg, _shardings(cfg, 2), "bfloat16")
    assert params["wq"].dtype == expected["wq"].dtype
    _assert_equal(params, expected)


def _drop_key(path, key: str, replace=None):
    from safetensors.numpy import load_file, save_file

    [file] = sorted(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    del tensors[key]
    if replace is not None:
        tensors[key] = replace
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("lazy", [False, True])
def test_missing_weight_is_a_clear_error(tmp_path, lazy):
    llama_heads(tmp_path, *HEADS["padded"])
    _drop_key(tmp_path, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match="checkpoint is missing weights for w_up"):
        load_source(str(tmp_path), progress=False, lazy=lazy)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("shape", [(40, 36), (39, 36), (36, 40)])
def test_wrong_shape_is_a_clear_error(tmp_path, lazy, shape):
    # 40 rows = 10 heads of 4, 39 rows = no whole number of heads: both fail before reshaping.
    llama_heads(tmp_path, *HEADS["padded"])
    key = "model.layers.0.self_attn.q_proj.weight"
    _drop_key(tmp_path, key, replace=np.zeros(shape, np.float32))
    pattern = rf"weight '{key}' has shape \({shape[0]}, {shape[1]}\); expected \(36, 36\) for wq"
    with pytest.raises(ModelLoadError, match=pattern):
        load_source(str(tmp_path), progress=False, lazy=lazy)


def test_checkpoint_missing_weight_or_wrong_shape_is_a_clear_error(tmp_path):
    llama_heads(tmp_path / "hf", *HEADS["even"])
    eager = load_source(str(tmp_path / "hf"), progress=False)
    del eager.params["w_up"]
    eager.params["w_gate"] = eager.params["w_gate"][:, :, :32]
    save_checkpoint(eager, tmp_path / "ckpt")
    loaded = load_source(str(tmp_path / "ckpt"), progress=False, lazy=True)
    with pytest.raises(ModelLoadError, match="checkpoint is missing weights for w_up"):
        load_params_sharded(loaded, loaded.config, None, "float32")
    eager.params["w_up"] = eager.params["w_gate"]
    save_checkpoint(eager, tmp_path / "ckpt", overwrite=True)
    with pytest.raises(ModelLoadError, match=r"param w_gate has shape \(2, 64, 32\); expected "
                       r"\(2, 64, 64\)"):
        load_params_sharded(loaded, loaded.config, None, "float32")


def _tiny_fused_or_moe(path, model_type: str) -> None:
    """A random Phi-3 (fused qkv_proj / gate_up_proj), Mixtral (per-expert tensors) or
    Granite-MoE (all experts of a layer in one tensor, gate and up fused on axis 1)."""
    import torch

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    if model_type == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, pad_token_id=0))
    elif model_type == "granitemoe":
        model = transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(path)
    save_words(path, 64)


@pytest.mark.parametrize("model_type", ["phi3", "mixtral", "granitemoe"])
def test_lazy_load_of_fused_and_expert_tensors(tmp_path, model_type):
    # A fused tensor feeds several params, each reading only its own rows; an expert weight
    # [L, X, E, F] is read per (layer, expert), each device its columns of each expert.
    _tiny_fused_or_moe(tmp_path, model_type)
    eager = load_source(str(tmp_path), progress=False)
    cfg, expected = pad_query_heads(eager.config, eager.params, 2)
    lazy = load_source(str(tmp_path), progress=False, lazy=True)
    _assert_equal(load_params_sharded(lazy, cfg, _shardings(cfg, 2), "float32"), expected)
    reads: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for param in lazy.params.values():
        for source in param.sources:
            reads[source.key] = reads.get(source.key, 0) + sum(param.reads[source.key])
            sizes[source.key] = source.nbytes
    assert reads == sizes  # every byte of every HF tensor read once, fused ones included
    if model_type == "phi3":
        assert sum("qkv_proj" in key for key in sizes) == 2
    elif model_type == "mixtral":
        assert sum(".experts." in key for key in sizes) == 2 * 4 * 3
    else:
        assert sum("input_linear" in key for key in sizes) == 2
