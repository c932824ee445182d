"""Quantization (jengine/models/quant.py): round trips, exact int8 dots, whole steps against a
float reference that applies the same quantization, and the engine under tensor parallelism.

The int8 dot accumulates in int32, which is exact, so `quant.einsum` must equal the integer
product rescaled in float64 up to float32 rounding of the rescale. A whole int8 step is compared
with `INT8_REFERENCE` (the same int8 operands, dequantized and multiplied in float32): there the
two paths differ by float32 accumulation order inside each dot, and rarely an activation sits
so close to a rounding boundary that the next layer quantizes it one step apart. Measured:
2e-6 against logits of magnitude 4-6 (the bound is 1e-4 of that range), while quantization
itself moves the logits by 0.07-0.12 (checked at > 30x the difference, so the comparison can
tell a wrong quantization from a right one).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged import run_paged  # tests/paged.py: pytest puts tests/ on sys.path
from tiny_models import llama_heads

from converters import load_source
from converters.checkpoint import load_checkpoint, save_checkpoint
from jengine import Engine, SamplingParams
from jengine.cli.main import build_parser
from jengine.config import load_config
from jengine.engine import build_config
from jengine.engine_flags import engine_kwargs
from jengine.models import ModelConfig, family_module, model_config_from_hf, quant
from jengine.models.quant import INT8_REFERENCE, QArray, quantize_params

ONE_BUCKET = (Path(__file__).parents[1] / "one_bucket.yaml").read_text()
SEQ_LEN = 24  # 16 prefilled in chunks of 7, then 8 decode steps over pages of 4
DECODE = 8

LLAMA = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
GEMMA3 = {
    "model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "sliding_window": 8,
    "sliding_window_pattern": 2, "query_pre_attn_scalar": 16, "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
}


# -- round trips -------------------------------------------------------------------------------

def _weight(seed: int = 0) -> np.ndarray:
    """[32, 3, 8]: 24 output channels whose ranges differ by up to 1000x, one all zero."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(32, 3, 8)) * rng.uniform(0.01, 10, size=(1, 3, 8))
    w[:, 1, 2] = 0.0
    return w.astype(np.float32)


def test_int8_weight_round_trip_is_within_half_a_step_per_channel():
    w = _weight()
    qa = quant.quantize_weight(jnp.asarray(w), (0,), "int8")
    q, scale = np.asarray(qa.q), np.asarray(qa.scale)
    assert q.dtype == np.int8 and scale.shape == (1, 3, 8)
    amax = np.abs(q).max(axis=0)
    assert amax[1, 2] == 0 and scale[0, 1, 2] == 1.0  # the zero channel stays zero
    amax[1, 2] = 127
    assert (amax == 127).all()  # every other channel spans its own full range
    err = np.abs(w - q.astype(np.float32) * scale)
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    np.testing.assert_array_equal(np.asarray(qa.dequantize()), q.astype(np.float32) * scale)


def test_fp8_weight_round_trip_keeps_three_mantissa_bits():
    w = _weight(1)
    qa = quant.quantize_weight(jnp.asarray(w), (0,), "fp8")
    assert qa.q.dtype == jnp.float8_e4m3fn
    back = np.asarray(qa.dequantize())
    scale = np.asarray(qa.scale)
    normal = np.abs(w) >= scale * 2.0**-6  # e4m3's smallest normal, in weight units
    rel = np.abs(back - w)[normal] / np.abs(w)[normal]
    assert rel.max() <= 2.0**-4  # round to nearest with 3 mantissa bits
    assert np.allclose(np.abs(back).max(axis=0)[scale[0] != 1], 448 * scale[0][scale[0] != 1])


def test_activation_rows_round_trip():
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(5, 40)) * np.array([[1e-3], [1], [30], [0], [5]])).astype(np.float32)
    q, scale = (np.asarray(a) for a in quant.quantize_rows(jnp.asarray(x)))
    assert q.dtype == np.int8 and scale.shape == (5, 1)
    assert (np.abs(q[[0, 1, 2, 4]]).max(axis=1) == 127).all() and (q[3] == 0).all()
    assert (np.abs(x - q * scale) <= scale / 2 * (1 + 1e-6)).all()


# -- the int8 dot ------------------------------------------------------------------------------

DOTS = [  # every projection equation the models use: (eq, x shape, w shape, contracted axes)
    ("te,ehd->thd", (6, 32), (32, 4, 8), (0,)),  # wq / wk / wv
    ("tk,ke->te", (6, 32), (32, 16), (0,)),  # wo (heads merged), w_down
    ("te,ef->tf", (6, 32), (32, 48), (0,)),  # w_gate / w_up
    ("te,ve->tv", (6, 32), (40, 32), (1,)),  # tied lm_head (the embedding table)
    ("te,ef->tf", (1, 32), (32, 48), (0,)),  # one row (a lone decode): padded to two
]


@pytest.mark.parametrize("eq,xs,ws,contract", DOTS)
def test_int8_dot_equals_the_integer_product_rescaled(eq, xs, ws, contract):
    rng = np.random.default_rng(4)
    x = rng.normal(size=xs).astype(np.float32) * rng.uniform(0.1, 10, size=(xs[0], 1))
    w = rng.normal(size=ws).astype(np.float32)
    qa = quant.quantize_weight(jnp.asarray(w), contract, "int8")
    got = np.asarray(quant.einsum(eq, jnp.asarray(x), qa))
    xq, sx = (np.asarray(a) for a in quant.quantize_rows(jnp.asarray(x)))
    exact = np.einsum(eq, xq.astype(np.int64), np.asarray(qa.q).astype(np.int64))
    scale = np.asarray(qa.scale, np.float64).reshape(exact.shape[1:])
    expected = exact * sx.astype(np.float64).reshape((-1,) + (1,) * (exact.ndim - 1)) * scale
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6 * np.abs(expected).max())
    # The weight-only form is the float dot with the dequantized weight.
    w8 = QArray(q=qa.q, scale=qa.scale, mode="w8a16")
    ref = np.einsum(eq, x.astype(np.float64), np.asarray(qa.dequantize(), np.float64))
    np.testing.assert_allclose(np.asarray(quant.einsum(eq, jnp.asarray(x), w8)), ref,
                               rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # And both approximate the float product (int8 costs ~1% here, not more).
    full = np.einsum(eq, x, w)
    assert np.abs(got - full).max() < 0.03 * np.abs(full).max()


# -- whole steps on tiny random models ------------------------------------------------------------

def _random_model(hf: dict, seed: int = 0) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """A config from an HF-style dict and seeded params from its declarations: projections
    ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms near their identity."""
    cfg = model_config_from_hf(hf)
    rng = np.random.default_rng(seed)
    params = {}
    for name, spec in family_module(cfg).param_specs(cfg).items():
        noise = rng.normal(size=spec.shape).astype(np.float32)
        if spec.init == "ones":
            value = 1 + 0.2 * noise
        elif spec.init == "zeros":
            value = 0.2 * noise
        elif spec.contract:
            value = noise / np.sqrt(np.prod([spec.shape[a] for a in spec.contract]))
        else:
            value = noise
        params[name] = jnp.asarray(value)
    return cfg, params


def _quantized(cfg, params, mode, lm_head=False):
    specs = family_module(cfg).param_specs(cfg)
    return quantize_params(params, specs, mode, tied_embeddings=cfg.tie_word_embeddings,
                           lm_head=lm_head)


def _logits(cfg, params, ids, layout):
    return run_paged((cfg, params), ids, prefill_chunk=7, decode_steps=DECODE, page_size=4,
                     layer_layout=layout)


@pytest.mark.parametrize("hf,layout,lm_head", [
    (LLAMA, "unstacked", False), (LLAMA, "as_given", True),  # as_given: the lax.scan layout
    (GEMMA3, "unstacked", True), (GEMMA3, "as_given", False),
])
def test_int8_step_matches_the_float_reference_of_the_same_quantization(hf, layout, lm_head):
    cfg, params = _random_model(hf)
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, SEQ_LEN).tolist()
    int8 = _quantized(cfg, params, "int8", lm_head)
    assert isinstance(int8["wq"], QArray) and int8["wq"].q.dtype == jnp.int8
    assert isinstance(int8["embed" if cfg.tie_word_embeddings else "lm_head"], QArray) == lm_head
    got = _logits(cfg, int8, ids, layout)
    ref = _logits(cfg, _quantized(cfg, params, INT8_REFERENCE, lm_head), ids, layout)
    full = _logits(cfg, params, ids, layout)
    span = np.abs(full).max()
    diff, effect = np.abs(got - ref).max(), np.abs(got - full).max()
    assert diff < 1e-4 * span, (diff, span)
    assert effect > 30 * diff, (effect, diff)  # the comparison can tell quantization apart


@pytest.mark.parametrize("hf", [LLAMA, GEMMA3])
def test_w8a16_step_is_the_float_model_with_dequantized_weights(hf):
    cfg, params = _random_model(hf)
    ids = np.random.default_rng(6).integers(3, cfg.vocab_size, SEQ_LEN).tolist()
    w8 = _quantized(cfg, params, "w8a16")
    dequantized = {k: v.dequantize() if isinstance(v, QArray) else v for k, v in w8.items()}
    got = _logits(cfg, w8, ids, "unstacked")
    ref = _logits(cfg, dequantized, ids, "unstacked")
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()
    # Weights as stored: int8 plus one float32 scale per output channel, ~1/4 of float32.
    names = quant.quantized_names(family_module(cfg).param_specs(cfg), cfg.tie_word_embeddings,
                                  False)
    stored = quant.weight_bytes([w8[n] for n in names])
    assert stored < 0.3 * quant.weight_bytes([params[n] for n in names])


# -- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_padded(tmp_path_factory):
    """A random tied Llama with 9 q / 3 kv heads: under tp=2 its q heads pad to 10 (a zero
    channel in wq, zero rows in wo) and its kv heads are replicated."""
    return llama_heads(tmp_path_factory.mktemp("tiny9x3"), 9, 3, tied=True)


PROMPTS = [np.random.default_rng(7).integers(3, 64, n).tolist() for n in (3, 9, 20)]


def _preset(tmp_path, **model_keys) -> str:
    """tests/one_bucket.yaml with extra `model` keys, as a file. XLA's dots unless asked: these
    tests read the engine's int8 weights as `QArray`s and compare tp=1 with tp=2 (which keeps
    XLA's dots), where on one AMX-INT8 device `auto` would pack them for the AMX kernel
    (tests/kernels/test_amx_int8.py checks that kernel against XLA's int8 dot to the bit)."""
    model_keys.setdefault("matmul_backend", "xla")
    path = tmp_path / f"preset{len(list(tmp_path.glob('preset*')))}.yaml"
    extra = "".join(f"  {k}: {str(v).lower()}\n" for k, v in model_keys.items())
    path.write_text(ONE_BUCKET.replace("model:\n", "model:\n" + extra))
    return str(path)


def _engine_greedy(model: str, preset: str, mesh: str) -> tuple[list[list[int]], dict]:
    """Greedy outputs of `PROMPTS` and the engine's params (max_model_len: the tiny model's)."""
    engine = Engine(model, config=preset, mesh=mesh, max_model_len=64, progress=False)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)]
    return outputs, engine.core.runner.params


def _first_wq(params) -> QArray:
    wq = params["layers"][0]["wq"] if "layers" in params else params["wq"]
    assert isinstance(wq, QArray) and wq.q.dtype == jnp.int8
    return wq


@pytest.mark.parametrize("lm_head", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_int8_engine_greedy_on_tp2_equals_tp1(tiny_padded, tmp_path, lm_head):
    preset = _preset(tmp_path, quantization="int8", quantize_lm_head=lm_head)
    outputs = {}
    for mesh in ("tp=1", "tp=2"):
        outputs[mesh], params = _engine_greedy(str(tiny_padded), preset, mesh)
        wq = _first_wq(params)
        assert wq.mode == "int8" and isinstance(params["embed"], QArray) == lm_head
        if mesh == "tp=2":  # the scales are split with their q-head channels
            assert wq.q.sharding.spec[1] == "tp" and wq.scale.sharding.spec[1] == "tp"
            assert wq.scale.addressable_shards[0].data.shape == (1, 5, 4)  # 10 padded heads
    assert outputs["tp=2"] == outputs["tp=1"]


def test_converted_int8_checkpoint_loads_as_stored(tiny_padded, tmp_path):
    loaded = load_source(str(tiny_padded), progress=False)
    out = save_checkpoint(loaded, tmp_path / "int8", quantization="int8")
    restored = load_checkpoint(out)
    assert restored.quantization == "int8" and not isinstance(restored.params["embed"], QArray)
    # Stored smoothed (jengine.models.smoothing): the norms carry the factors' inverse.
    assert not np.allclose(np.asarray(restored.params["attn_norm"]),
                           np.asarray(loaded.params["attn_norm"]))
    assert restored.params["wq"].q.dtype == jnp.int8 and restored.params["wq"].mode == "int8"
    # The engine smooths at load time with the same calibration, so the same int8 weights.
    expected, _ = _engine_greedy(str(tiny_padded), _preset(tmp_path, quantization="int8"),
                                 "tp=1")
    # No quantization asked: the checkpoint's own; q heads pad 9 -> 10 (scales zero-filled).
    got, params = _engine_greedy(str(out), _preset(tmp_path), "tp=2")
    assert _first_wq(params).mode == "int8"
    assert got == expected


def test_bad_quantization_is_a_value_error_before_loading():
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        Engine("/nonexistent/model", quantization="int4", progress=False)
    with pytest.raises(ValueError, match="fp8 needs a GPU or TPU"):
        Engine("/nonexistent/model", quantization="fp8", progress=False)


def test_quantization_config_key_and_cli_flag(tmp_path):
    preset = tmp_path / "q.yaml"
    preset.write_text("model:\n  quantization: w8a16\n  quantize_lm_head: true\n")
    cfg = load_config(str(preset))
    assert (cfg.model.quantization, cfg.model.quantize_lm_head) == ("w8a16", True)
    assert load_config(None, quantization="int8").model.quantization == "int8"
    args = build_parser().parse_args(["generate", "hi", "--quantization", "int8"])
    assert engine_kwargs(args)["quantization"] == "int8"
    args = build_parser().parse_args(["serve", "--config", str(preset), "--no-quantize-lm-head"])
    assert build_config(**engine_kwargs(args)).model.quantize_lm_head is False
    args = build_parser().parse_args(["generate", "hi", "--quantize-lm-head"])
    assert build_config(**engine_kwargs(args)).model.quantize_lm_head is True
    # Not given: the preset decides, else the config default "none".
    assert build_parser().parse_args(["generate", "hi"]).quantization is None
    assert load_config(str(preset), quantization=None).model.quantization == "w8a16"
    assert load_config(None).model.quantization == "none"
    with pytest.raises(SystemExit) as exit_info:  # argparse: one usage line + error, status 2
        build_parser().parse_args(["generate", "hi", "--quantization", "int4"])
    assert exit_info.value.code == 2
