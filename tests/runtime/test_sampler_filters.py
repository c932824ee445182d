"""jengine.runtime.sampler's filters (temperature, min-p, top-k, top-p, their candidate tiers),
penalties and logit bias, against the NumPy reference of tests/sampler_reference.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_reference import (  # tests/sampler_reference.py
    MANY,
    S,
    V,
    assert_same_logits,
    nucleus_size,
    penalty_history,
    processed_logits,
    random_logits,
    ref_filter,
    ref_penalize,
    replicate,
    sampling_arrays,
    tokens_of,
)

from jengine.runtime import sampler

# ----------------------------------------------------------------------------- filters


FILTER_CASES = {
    "top_k": {"temperature": 0.9, "top_k": 20},
    "top_p": {"temperature": 1.0, "top_p": 0.3},
    "top_p_wide": {"temperature": 1.0, "top_p": 0.95},  # nucleus > 256: full-sort fallback
    "min_p": {"temperature": 1.0, "min_p": 0.1},
    "all": {"temperature": 0.8, "top_k": 50, "top_p": 0.6, "min_p": 0.05},
}


@pytest.mark.parametrize("case", FILTER_CASES)
def test_filter_matches_reference_and_bounds_support(case):
    settings = FILTER_CASES[case]
    logits_row = random_logits(1, scale=2.0, seed=3)[0]
    expected = ref_filter(logits_row, **settings)
    assert 1 < np.isfinite(expected).sum() < V  # the filter really filters

    logits, arrays = replicate(logits_row, MANY, **settings)
    assert_same_logits(processed_logits(logits[:S], sampling_arrays(S, **settings))[0], expected)
    tokens = tokens_of(logits, arrays)
    assert np.isfinite(expected[tokens]).all()
    assert len(np.unique(tokens)) > 1


_candidates_jit = jax.jit(sampler._filter_with_candidates, static_argnums=3)
_tiers_jit = jax.jit(sampler._filter_top_k_top_p, static_argnames=("widths",))


def test_candidate_tiers_agree_with_full_sort():
    # Rows whose cutoffs lie inside 16 candidates, inside 64, and only in the full sort.
    logits = np.concatenate([random_logits(3, scale=5.0, seed=4),
                             random_logits(3, scale=1.0, seed=5)])
    top_k = np.array([0, 10, 40, 0, 0, 300], np.int32)
    top_p = np.array([0.5, 1.0, 0.9, 0.2, 0.9, 1.0], np.float32)
    args = (jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p))
    covered16 = np.asarray(_candidates_jit(*args, 16)[1])
    covered64 = np.asarray(_candidates_jit(*args, 64)[1])
    assert not covered16.all() and not covered64.all() and covered64.sum() > covered16.sum()

    expected = np.stack([ref_filter(*row) for row in zip(logits, np.ones(6), top_k, top_p)])
    for widths in [(16, 64, V), (V,)]:
        filtered = _tiers_jit(args[0], top_k=args[1], top_p=args[2], widths=widths)
        assert_same_logits(np.asarray(filtered), expected)
    for width, covered in [(16, covered16), (64, covered64)]:  # covered rows are exact already
        filtered = np.asarray(_candidates_jit(*args, width)[0])
        assert_same_logits(filtered[covered], expected[covered])


def test_large_vocab_top_p_tiers():
    vocab = 49152
    logits = np.concatenate([random_logits(3, vocab, scale=4.0, seed=6),
                             random_logits(1, vocab, 2.0, 7)])
    top_p = np.array([0.5, 0.95, 1.0, 0.9], np.float32)
    top_k = np.array([0, 0, 5000, 0], np.int32)
    sizes = [nucleus_size(row, p) for row, p in zip(logits[[0, 1, 3]], top_p[[0, 1, 3]])]
    assert sizes[0] < 256 < sizes[1] < 4096 < sizes[2]  # one row per tier
    arrays = sampling_arrays(S, vocab=vocab, bare=True, temperature=1.0, top_k=top_k, top_p=top_p)
    processed = processed_logits(logits, arrays)
    for row, k, p, actual in zip(logits, top_k, top_p, processed):
        assert_same_logits(actual, ref_filter(row, 1.0, top_k=k, top_p=p))


# ----------------------------------------------------------------------------- penalties, bias




PENALTY_CASES = {
    "repetition": {"repetition_penalty": [1.5, 1.2, 0.8, 3.0]},
    "frequency": {"frequency_penalty": [0.5, 1.0, -0.5, 2.0]},
    "presence": {"presence_penalty": [1.0, 0.5, 2.0, -1.0]},
    "all": {
        "repetition_penalty": [1.3, 1.0, 2.0, 1.1],
        "frequency_penalty": [0.2, 0.0, 0.7, 0.4],
        "presence_penalty": [0.4, 0.3, 0.0, 0.5],
    },
}


@pytest.mark.parametrize("case", PENALTY_CASES)
def test_penalties_match_reference(case):
    settings = {name: np.asarray(value, np.float32) for name, value in PENALTY_CASES[case].items()}
    logits = random_logits(S, scale=3.0, seed=8)
    history, is_output = penalty_history()
    arrays = sampling_arrays(S, history=history, history_is_output=is_output, **settings)
    no_penalty = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}
    expected = []
    for i in range(S):
        penalties = {name.split("_")[0]: value[i] for name, value in settings.items()}
        row = ref_penalize(logits[i], history[i], is_output[i], **{**no_penalty, **penalties})
        expected.append(row)
    expected = np.stack(expected)
    assert not np.allclose(expected, logits)
    assert_same_logits(processed_logits(logits, arrays), expected)
    np.testing.assert_array_equal(tokens_of(logits, arrays), np.argmax(expected, -1))


def test_penalty_arrays_without_penalties_change_nothing():
    history, is_output = penalty_history()
    logits = random_logits(S)
    arrays = sampling_arrays(S, history=history, history_is_output=is_output)
    np.testing.assert_array_equal(processed_logits(logits, arrays), logits)


def test_logit_bias_matches_reference():
    logits = random_logits(S)
    bias = np.zeros((S, V), np.float32)
    bias[0, 17] = 100.0
    bias[1, np.argmax(logits[1])] = -100.0
    bias[1, 5:50] = 0.25
    bias[3] = np.linspace(-1.0, 1.0, V)
    arrays = sampling_arrays(S, logit_bias=bias)
    assert_same_logits(processed_logits(logits, arrays), logits + bias)
    tokens = tokens_of(logits, arrays)
    assert tokens[0] == 17
    np.testing.assert_array_equal(tokens, np.argmax(logits + bias, -1))


# ----------------------------------------------------------------------------- no branches


_sample_no_branches = jax.jit(functools.partial(sampler.sample, num_top_logprobs=0,
                                                branches=False))


def test_accelerator_sampler_without_branches_agrees():
    """The accelerators' sampler (selects, no conditional) filters and draws as the CPU's: a
    batch mixing greedy rows, every filter and penalties, and one with no penalised row."""
    history, is_output = penalty_history()
    settings = dict(temperature=np.float32([0.0, 0.8, 1.0, 1.3]),
                    top_k=np.int32([0, 50, 0, 7]), top_p=np.float32([1.0, 0.6, 0.95, 1.0]),
                    min_p=np.float32([0.0, 0.05, 0.0, 0.2]),
                    repetition_penalty=np.float32([1.3, 1.0, 2.0, 1.0]),
                    seeds=np.arange(S, dtype=np.uint32), steps=np.arange(S, dtype=np.int32))
    logits = random_logits(S, scale=2.0, seed=11)
    for penalised in (True, False):
        fields = dict(settings, history=history, history_is_output=is_output)
        if not penalised:
            fields["repetition_penalty"] = np.ones(S, np.float32)
        arrays = sampling_arrays(S, **fields)
        expected = processed_logits(logits, arrays)
        assert_same_logits(np.asarray(_process_no_branches(jnp.asarray(logits), arrays)),
                           expected)
        np.testing.assert_array_equal(
            np.asarray(_sample_no_branches(jnp.asarray(logits), arrays).tokens),
            tokens_of(logits, arrays))


_process_no_branches = jax.jit(functools.partial(sampler.process_logits, branches=False))
