"""int8 activation smoothing (jengine/models/smoothing.py) on tiny random models: the folded
float model computes what the unfolded one does, and on a model with outlier channels the
smoothing flattens the activations the int8 dots see and brings int8 closer to float.

The random models get outliers the way trained ones have them: a few channels of each
pre-norm weight and of w_up's columns 30-60x the rest (then the post-norm hidden states and the
MLP product carry 30-60x channels, as SmolLM2's do, docs/quantization.md).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_quant import GEMMA3, LLAMA, _logits, _quantized, _random_model

from jengine.models import family_module, smoothing

LLAMA_BIASES = {**LLAMA, "attention_bias": True, "mlp_bias": True}  # bq/bk/bv/bo, b_up ...
SEQ = 24


def _with_outliers(cfg, params: dict) -> dict:
    """Channels 3 and 40 of every pre-norm (x30, x60) and columns 7, 90 of w_up (x40)."""
    out = dict(params)
    gemma = family_module(cfg).name == "gemma3"
    for norm in ("attn_norm", "pre_mlp_norm" if gemma else "mlp_norm"):
        w = np.array(out[norm]) + (1.0 if gemma else 0.0)  # the factor the norm applies
        w[:, 3] *= 30
        w[:, 40] *= 60
        out[norm] = jax.numpy.asarray(w - (1.0 if gemma else 0.0))
    up = np.array(out["w_up"])
    up[:, :, [7, 90]] *= 40
    out["w_up"] = jax.numpy.asarray(up)
    return out


def _model(hf: dict):
    cfg, params = _random_model(hf)
    return cfg, _with_outliers(cfg, params), family_module(cfg)


def _calibration(cfg) -> np.ndarray:
    """Two windows of 16 random tokens (a different draw from the evaluation ids)."""
    return np.random.default_rng(11).integers(3, cfg.vocab_size, (2, 16)).astype(np.int32)


def _ids(cfg) -> list[int]:
    return np.random.default_rng(12).integers(3, cfg.vocab_size, SEQ).tolist()


@pytest.mark.parametrize("hf", [LLAMA_BIASES, GEMMA3])
def test_the_folded_float_model_computes_the_same_logits(hf):
    cfg, params, family = _model(hf)
    folded = smoothing.smooth(params, cfg, family, _calibration(cfg), alpha=0.5)
    for name in ("attn_norm", "wq", "wv", "wo", "w_up", "w_down"):  # every fold did fold
        assert not np.allclose(np.asarray(folded[name]), np.asarray(params[name])), name
    if "b_up" in params:
        assert not np.allclose(np.asarray(folded["b_up"]), np.asarray(params["b_up"]))
    ids = _ids(cfg)
    ref = _logits(cfg, params, ids, "unstacked")
    got = _logits(cfg, folded, ids, "unstacked")
    # Power-of-two factors: Llama's folds are exact; Gemma's (1 + w) / s - 1 rounds once.
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("hf", [LLAMA, GEMMA3])
def test_smoothing_flattens_the_int8_inputs_and_brings_int8_closer_to_float(hf):
    cfg, params, family = _model(hf)
    windows = _calibration(cfg)
    folds = family.smoothing_folds(cfg)
    names = tuple(smoothing.observed_name(f) for f in folds)
    before = smoothing.activation_maxima(params, cfg, family.forward, family.layer_keys, names,
                                         windows)
    folded = smoothing.smooth(params, cfg, family, windows, alpha=0.5)
    after = smoothing.activation_maxima(folded, cfg, family.forward, family.layer_keys, names,
                                        windows)
    for name in ("wq", "w_gate", "w_down"):  # the inputs given outliers
        ratio = smoothing.outlier_ratio(before[name]), smoothing.outlier_ratio(after[name])
        assert ratio[0] > 10 and ratio[1] < ratio[0] / 3, (name, ratio)
    ids = _ids(cfg)
    full = _logits(cfg, params, ids, "unstacked")
    plain = np.abs(_logits(cfg, _quantized(cfg, params, "int8"), ids, "unstacked") - full)
    smooth = np.abs(_logits(cfg, _quantized(cfg, folded, "int8"), ids, "unstacked") - full)
    assert smooth.mean() < 0.7 * plain.mean(), (smooth.mean(), plain.mean())


def test_factors_are_powers_of_two_and_one_where_a_channel_is_empty():
    act = np.array([[4.0, 0.0, 1.0, 9.0]])
    wmax = np.array([[1.0, 2.0, 0.0, 1.0]])
    s = smoothing._factors(act, wmax, 0.5)
    np.testing.assert_array_equal(s, [[2.0, 1.0, 1.0, 4.0]])  # sqrt(9) = 3 -> 4 (log2 1.58)


def test_a_family_without_folds_and_alpha_zero_are_left_as_they_are():
    cfg, params, family = _model(LLAMA)
    assert smoothing.smooth(params, cfg, family, _calibration(cfg), alpha=0) is params
    no_folds = dataclasses.replace(family, smoothing_folds=None)  # a network that declares none
    assert smoothing.smooth(params, cfg, no_folds, _calibration(cfg)) is params
