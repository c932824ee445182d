"""Pre-quantized sources read as int8 (converters/prequant.py), checked against jengine's own
quantization of the same float weights.

- compressed-tensors: a tiny random Llama whose projections this test quantizes with
  `quantize_weight` per output row ([out, in] over `in`, float32 scales) and writes in that
  format's layout (`<proj>.weight` int8 + `<proj>.weight_scale` [out, 1], `quantization_config`
  in config.json, lm_head ignored). jengine quantizing the float model over the same axes
  computes the same int8 values and scales element for element, so the greedy tokens must be
  equal, not close, in int8 (with smoothing off in the float run: a pre-quantized checkpoint
  has no float weights to smooth) and in w8a16, at tp=1 and at tp=2 with padded q heads.
- GGUF Q8_0: gguf-py quantizes the projections (every non-zero block reaches |q| = 127, as
  llama.cpp's do), so folding the blocks onto each row's largest scale gives what quantizing the
  dequantized rows gives in exact float32 arithmetic: asserted equal (values and scales); and
  greedy tokens equal to an F32 GGUF of the dequantized weights run as int8 without smoothing
  (jengine's XLA quantization may round exact ties the other way; none occur in this model).
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_tiny_llama  # tests/gguf_writer.py
from safetensors.numpy import load_file, save_file
from test_quant import _engine_greedy, _first_wq, _preset
from tiny_models import llama_heads

from converters import ModelLoadError, load_source
from converters.prequant import hf_quantization
from jengine.cli.main import main
from jengine.models import family_module
from jengine.models.quant import QArray, quantize_weight

W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def _config(activations: bool = True, **changes) -> dict:
    group = {"targets": ["Linear"], "weights": dict(W8A8),
             "input_activations": dict(TOKEN) if activations else None}
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized",
          "quantization_status": "compressed", "config_groups": {"group_0": group},
          "ignore": ["lm_head"]}
    for path, value in changes.items():  # "weights.strategy" -> group["weights"]["strategy"]
        *outer, last = path.split(".")
        target = qc if path in ("format", "kv_cache_scheme") else group
        for part in outer:
            target = target[part]
        target[last] = value
    return qc


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    """A random untied Llama with 9 q / 3 kv heads (q heads pad to 10 under tp=2)."""
    return llama_heads(tmp_path_factory.mktemp("float9x3"), 9, 3)


@pytest.fixture(scope="module")
def compressed_dir(float_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "w8a8"
    shutil.copytree(float_dir, out)
    state = load_file(str(out / "model.safetensors"))
    written = {}
    for key, w in state.items():
        if key.endswith("_proj.weight"):
            qa = quantize_weight(jnp.asarray(w), (1,), "int8")
            written[key], written[key + "_scale"] = np.asarray(qa.q), np.asarray(qa.scale)
        else:
            written[key] = w
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _config()
    (out / "config.json").write_text(json.dumps(config))
    return out, written


def test_compressed_tensors_load_as_the_int8_values_written(compressed_dir):
    out, written = compressed_dir
    loaded = load_source(str(out), progress=False)
    assert loaded.quantization == "int8" and "compressed-tensors" in loaded.weights_note
    wq, wo = loaded.params["wq"], loaded.params["wo"]
    assert isinstance(wq, QArray) and wq.q.dtype == np.int8 and wq.scale.shape == (2, 1, 9, 4)
    hf_q = written["model.layers.1.self_attn.q_proj.weight"]  # [H*D, E]
    np.testing.assert_array_equal(wq.q[1], hf_q.T.reshape(36, 9, 4))
    np.testing.assert_array_equal(
        wq.scale[1].reshape(-1), written["model.layers.1.self_attn.q_proj.weight_scale"][:, 0])
    np.testing.assert_array_equal(
        wo.scale[0].reshape(-1), written["model.layers.0.self_attn.o_proj.weight_scale"][:, 0])
    assert not isinstance(loaded.params["lm_head"], QArray)  # ignored: float, as stored
    # The lazy (sharded) reader gives the same values.
    lazy = load_source(str(out), progress=False, lazy=True)
    np.testing.assert_array_equal(np.asarray(lazy.params["w_down"].q), loaded.params["w_down"].q)
    np.testing.assert_array_equal(lazy.params["w_down"].scale, loaded.params["w_down"].scale)


def test_compressed_tensors_greedy_equals_jengines_own_int8(float_dir, compressed_dir, tmp_path):
    out = str(compressed_dir[0])
    own = {}
    for mode in ("int8", "w8a16"):
        own[mode], own_params = _engine_greedy(
            str(float_dir), _preset(tmp_path, quantization=mode, smoothing_alpha=0), "tp=1")
        # int8: the checkpoint's own mode (none given); w8a16: asked for, same int8 weights.
        keys = {} if mode == "int8" else {"quantization": mode}
        got, params = _engine_greedy(out, _preset(tmp_path, **keys), "tp=1")
        assert _first_wq(params).mode == mode
        np.testing.assert_array_equal(np.asarray(_first_wq(params).q),
                                      np.asarray(_first_wq(own_params).q))
        assert got == own[mode], mode
    # tp=2: q heads 9 -> 10 (zero values, zero scales), the scales split with their heads.
    got, params = _engine_greedy(out, _preset(tmp_path), "tp=2")
    assert _first_wq(params).scale.sharding.spec[1] == "tp"
    assert got == own["int8"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"format": "float-quantized"}, "format 'float-quantized'"),
    ({"weights.symmetric": False}, "asymmetric"),
    ({"weights.strategy": "group", "weights.group_size": 128}, "strategy 'group'"),
    ({"weights.strategy": "tensor"}, "strategy 'tensor'"),
    ({"weights.num_bits": 4}, "4-bit int"),
    ({"input_activations.dynamic": False}, "static input_activations"),
    ({"input_activations.strategy": "tensor"}, "strategy 'tensor'"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
])
def test_unsupported_compressed_tensors_variants_name_what(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        hf_quantization({"quantization_config": _config(**changes)})


def test_quantization_configs_that_map():
    assert hf_quantization({}) == "none"
    assert hf_quantization({"quantization_config": _config()}) == "int8"
    assert hf_quantization({"quantization_config": _config(activations=False)}) == "w8a16"
    assert hf_quantization({"quantization_config": _config(format="naive-quantized")}) == "int8"
    with pytest.raises(ModelLoadError, match="quant_method 'gptq'"):
        hf_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4}})


def test_unsupported_checkpoint_fails_at_load(compressed_dir, tmp_path):
    out = tmp_path / "static"
    shutil.copytree(compressed_dir[0], out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _config(**{"input_activations.dynamic": False})
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="input_scale"):
        load_source(str(out), progress=False, lazy=True)


# -- GGUF Q8_0 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf",
                            matrices=Q.Q8_0)[0]


def test_q8_0_folds_to_what_quantizing_the_dequantized_rows_gives(q8_gguf):
    floats = load_source(str(q8_gguf), progress=False)  # `none`: dequantized, as before
    assert floats.quantization == "none" and not isinstance(floats.params["wq"], QArray)
    int8 = load_source(str(q8_gguf), progress=False, quantization="int8")
    assert int8.quantization == "int8"
    specs = family_module(int8.config).param_specs(int8.config)
    names = [n for n, p in int8.params.items() if isinstance(p, QArray)]
    assert sorted(names) == sorted(["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"])
    for name in names:
        w, contract = floats.params[name], specs[name].contract
        scale = np.abs(w).max(axis=contract, keepdims=True) / np.float32(127)
        np.testing.assert_array_equal(int8.params[name].scale, scale, name)
        np.testing.assert_array_equal(int8.params[name].q, np.round(w / scale), name)
        # jengine's own (XLA) quantization: the same but where w / scale is an exact tie
        # (k + 1/2), which its division may tip either way (SmolLM2 in Q8_0: 0.009% of values).
        own = np.asarray(quantize_weight(jnp.asarray(w), contract, "int8").q)
        ties = np.abs(w / scale - np.trunc(w / scale)) == 0.5
        assert (np.abs(own.astype(int) - int8.params[name].q)[~ties] == 0).all(), name
    assert not isinstance(int8.params["lm_head"], QArray)  # only with quantize_lm_head
    head = load_source(str(q8_gguf), progress=False, quantization="w8a16",
                       quantize_lm_head=True)
    assert isinstance(head.params["lm_head"], QArray) and head.params["lm_head"].mode == "w8a16"


def test_q8_0_engine_greedy_equals_the_float_round_trip(q8_gguf, tmp_path):
    # The same model with the Q8_0 weights' values written as F32: quantized from float.
    f32 = write_tiny_llama(tmp_path / "dequantized.gguf", matrices=Q.Q8_0, dequantized=True)[0]
    np.testing.assert_array_equal(load_source(str(f32), progress=False).params["w_up"],
                                  load_source(str(q8_gguf), progress=False).params["w_up"])
    preset = _preset(tmp_path, quantization="int8", smoothing_alpha=0)
    expected, _ = _engine_greedy(str(f32), preset, "tp=1")
    got, params = _engine_greedy(str(q8_gguf), _preset(tmp_path, quantization="int8"), "tp=1")
    assert _first_wq(params).mode == "int8"
    assert got == expected


def test_info_says_which_formats_read_as_int8(q8_gguf, compressed_dir, capsys):
    assert main(["info", str(q8_gguf)]) == 0
    fields = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert fields["weights"] == ("read as int8 with --quantization int8|w8a16: 14 x Q8_0; "
                                 "as 4-bit groups with w4a16: none; "
                                 "dequantized to float: 5 x F32, 2 x Q8_0")
    assert main(["info", str(compressed_dir[0])]) == 0
    fields = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert fields["quantization"] == "int8" and "compressed-tensors" in fields["weights"]
