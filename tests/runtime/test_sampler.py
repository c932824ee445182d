"""Tests for jengine.runtime.sampler against the NumPy reference of tests/sampler_reference.py:
bitmasks, greedy, temperature draws, determinism, logprobs, padding (filters, penalties and
logit bias: test_sampler_filters.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampler_reference import (  # tests/sampler_reference.py
    MANY,
    NEG_INF,
    S,
    V,
    assert_same_logits,
    penalty_history,
    processed_logits,
    random_logits,
    ref_filter,
    ref_unpack,
    replicate,
    sample_jit,
    sampling_arrays,
    softmax64,
    tokens_of,
)

from jengine.runtime import pick, sampler
from jengine.runtime.sampler import pack_bitmask, sample

# ----------------------------------------------------------------------------- bitmask


def test_pack_bitmask_layout_and_round_trip():
    rng = np.random.default_rng(1)
    allowed = rng.random((4, 1003)) < 0.3
    packed = pack_bitmask(allowed)
    assert packed.dtype == np.int32 and packed.shape == (4, 32)  # ceil(1003 / 32)
    np.testing.assert_array_equal(ref_unpack(packed, 1003), allowed)

    only = np.zeros((3, 33), bool)
    only[0, 0] = only[1, 31] = only[2, 32] = True
    np.testing.assert_array_equal(pack_bitmask(only), [[1, 0], [-(2**31), 0], [0, 1]])


def test_bitmask_never_samples_disallowed_tokens():
    rng = np.random.default_rng(2)
    logits_row = random_logits(1)[0]
    allowed = rng.random(V) < 0.05
    allowed[np.argmax(logits_row)] = False  # the raw argmax is forbidden
    mask = pack_bitmask(np.broadcast_to(allowed, (MANY, V)))
    logits, arrays = replicate(logits_row, MANY, temperature=1.5, allowed_mask=mask)
    tokens = tokens_of(logits, arrays)
    assert allowed[tokens].all()
    assert len(np.unique(tokens)) > 10  # really sampled

    expected = np.where(allowed, logits_row, NEG_INF)
    greedy = sampling_arrays(S, allowed_mask=mask[:S])
    assert_same_logits(processed_logits(logits[:S], greedy), np.broadcast_to(expected, (S, V)))
    np.testing.assert_array_equal(tokens_of(logits[:S], greedy), np.argmax(expected))


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ignores_filters():
    logits = random_logits(S)
    arrays = sampling_arrays(S, top_k=3, top_p=0.5, min_p=0.3, seeds=np.arange(S))
    np.testing.assert_array_equal(tokens_of(logits, arrays), np.argmax(logits, -1))
    np.testing.assert_array_equal(processed_logits(logits, arrays), logits)


def test_greedy_takes_the_first_of_tied_maxima():
    logits = np.zeros((S, V), np.float32)
    logits[0, [7, V - 2]] = 2.0  # tie: first wins
    logits[1, [V - 1]] = 1.0  # the last id
    logits[2] = -np.inf  # nothing allowed: id 0, as argmax
    logits[3, [0, 1]] = 5.0
    expected = np.argmax(logits, -1)
    np.testing.assert_array_equal(tokens_of(logits, sampling_arrays(S)), expected)
    assert expected.tolist() == [7, V - 1, 0, 0]


def test_greedy_rows_in_mixed_batch_and_bare_arrays():
    logits = random_logits(S)
    settings = {"temperature": np.array([0, 1.0, 0, 0.7], np.float32), "seeds": np.arange(S)}
    tokens = tokens_of(logits, sampling_arrays(S, **settings))
    greedy = settings["temperature"] == 0
    np.testing.assert_array_equal(tokens[greedy], np.argmax(logits[greedy], -1))
    # Optional arrays left out (None) sample exactly as no-op ones.
    bare = sampling_arrays(S, bare=True, **settings)
    np.testing.assert_array_equal(tokens_of(logits, bare), tokens)


def test_sample_has_greedy_fast_path():
    # Drawing (random bits) happens only inside a cond branch, never at the top level.
    jaxpr = jax.make_jaxpr(functools.partial(sample, num_top_logprobs=0))(
        jnp.asarray(random_logits(2)), sampling_arrays(2, bare=True)
    )
    top_level = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "cond" in top_level
    assert not [name for name in top_level if "random" in name or "threefry" in name]
    assert "random_bits" in str(jaxpr) or "threefry" in str(jaxpr)


# ----------------------------------------------------------------------------- temperature


def test_temperature_processed_logits():
    logits = random_logits(S)
    temperature = np.array([0.5, 1.0, 2.0, 0.9], np.float32)
    processed = processed_logits(logits, sampling_arrays(S, temperature=temperature))
    expected = np.stack([ref_filter(row, t) for row, t in zip(logits, temperature)])
    assert_same_logits(processed, expected)  # XLA may divide by multiplying with 1 / T


def test_temperature_draw_inverts_the_cdf_at_the_row_keys_uniform():
    logits = random_logits(S)
    seeds = np.arange(100, 100 + S)
    steps = np.arange(S) * 3
    tokens = tokens_of(logits, sampling_arrays(S, temperature=0.8, seeds=seeds, steps=steps))
    for row, seed, step, token in zip(logits, seeds, steps, tokens):
        u = float(jax.random.uniform(jax.random.fold_in(jax.random.key(int(seed)), int(step))))
        cdf = np.cumsum(softmax64(row / 0.8))
        assert token == int(np.searchsorted(cdf, u, side="right"))


def test_draw_never_picks_a_token_of_zero_probability():
    # Only the first 3 tokens allowed: a uniform near 1 must not run past them to the -inf
    # tail, and a row with one allowed token always draws it.
    logits = np.full((2, 64), -np.inf, np.float32)
    logits[0, :3] = [0.0, 1.0, 2.0]
    logits[1, 10] = 5.0
    rows = np.concatenate([np.repeat(logits[:1], 300, 0), np.repeat(logits[1:], 100, 0)])
    tokens = np.asarray(jax.jit(sampler._draw)(
        jnp.asarray(rows), jnp.arange(400, dtype=jnp.uint32), jnp.zeros(400, jnp.int32)))
    assert set(tokens[:300]) == {0, 1, 2} and set(tokens[300:]) == {10}


@pytest.mark.parametrize("vocab", [128 * 5, 1000, 7])  # whole blocks, a padded last block, one
def test_blocked_picks_equal_the_one_level_forms(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(6, vocab)).astype(np.float32) * 3
    logits[1, :] = logits[1, 0]  # all tied: the first index
    logits[2, vocab // 2:] = -np.inf
    logits[3, -1] = 50.0  # the maximum in the last (maybe padded) block
    logits[4, :] = -np.inf
    logits[4, vocab - 1] = 0.0  # one allowed token, the last
    np.testing.assert_array_equal(pick.first_argmax(jnp.asarray(logits)),
                                  np.argmax(logits, axis=-1))
    keys = jax.vmap(jax.random.key)(jnp.arange(6, dtype=jnp.uint32))
    tokens = np.asarray(pick.draw(jnp.asarray(logits), keys))
    u = np.asarray(jax.vmap(jax.random.uniform)(keys), np.float64)
    cdf = np.cumsum(np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True)), -1)
    np.testing.assert_array_equal(
        tokens, [np.searchsorted(c, x * c[-1], side="right") for c, x in zip(cdf, u)])


def test_temperature_empirical_distribution():
    logits_row = np.linspace(-2.0, 2.0, 16).astype(np.float32)
    temperature, num = 0.7, 20000
    logits = np.broadcast_to(logits_row, (num, 16))
    arrays = sampling_arrays(num, vocab=16, bare=True, temperature=temperature,
                             seeds=np.arange(num))
    counts = np.bincount(tokens_of(logits, arrays), minlength=16)
    expected = softmax64(logits_row / temperature) * num
    chi_square = np.sum((counts - expected) ** 2 / expected)
    assert chi_square < 50.0  # 15 degrees of freedom: p < 1e-5 for a correct sampler


# ----------------------------------------------------------------------------- determinism


def test_row_token_independent_of_batch():
    rng = np.random.default_rng(9)
    logits = random_logits(MANY, scale=2.0, seed=9)
    settings = {
        "temperature": rng.uniform(0.5, 1.5, MANY).astype(np.float32),
        "top_k": rng.choice([0, 5, 40], MANY).astype(np.int32),
        "top_p": rng.choice([1.0, 0.5, 0.9], MANY).astype(np.float32),
        "min_p": rng.choice([0.0, 0.02], MANY).astype(np.float32),
        "seeds": rng.integers(0, 2**32, MANY, dtype=np.uint32),
        "steps": rng.integers(0, 100, MANY, dtype=np.int32),
    }
    alone = tokens_of(logits, sampling_arrays(MANY, **settings))
    np.testing.assert_array_equal(tokens_of(logits, sampling_arrays(MANY, **settings)), alone)

    # The first 64 rows again, at other positions, among rows with other settings (whose wide
    # nucleus pushes the whole batch from the candidate tier onto the full sort).
    positions = rng.permutation(MANY)[:64]
    mixed_logits = random_logits(MANY, scale=1.0, seed=10)
    mixed_logits[positions] = logits[:64]
    mixed = {name: np.resize(value[::-1], MANY) for name, value in settings.items()}
    mixed["top_p"][:] = 0.99
    for name, value in settings.items():
        mixed[name][positions] = value[:64]
    together = tokens_of(mixed_logits, sampling_arrays(MANY, **mixed))
    np.testing.assert_array_equal(together[positions], alone[:64])

    later = tokens_of(logits, sampling_arrays(MANY, **{**settings, "steps": settings["steps"] + 1}))
    assert (later != alone).mean() > 0.3


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_sorted():
    logits = random_logits(S, scale=2.0, seed=11)
    history, is_output = penalty_history()
    arrays = sampling_arrays(
        S,
        temperature=[0.0, 0.7, 1.5, 1.0],
        top_k=[0, 5, 0, 0],
        repetition_penalty=[2.0, 1.0, 1.0, 1.0],
        seeds=[1, 2, 3, 4],
        history=history,
        history_is_output=is_output,
    )
    out = sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=5)
    reference = np.stack([np.log(softmax64(row)) for row in logits])
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, reference[np.arange(S), tokens], atol=1e-5)
    top_ids = np.argsort(-reference, axis=-1)[:, :5]
    np.testing.assert_array_equal(out.top_ids, top_ids)
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(reference, top_ids, -1), atol=1e-5
    )
    assert (np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0).all()
    none = sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=0)
    assert none.top_ids.shape == (S, 0) and none.top_logprobs.shape == (S, 0)


# ----------------------------------------------------------------------------- jit, padding


def test_sample_jits_with_padded_rows():
    logits = random_logits(S, scale=2.0, seed=12)
    history, is_output = penalty_history()
    rng = np.random.default_rng(13)
    real = {
        "temperature": np.array([0.0, 0.8, 1.0, 1.2], np.float32),
        "top_k": np.array([0, 30, 0, 0], np.int32),
        "top_p": np.array([1.0, 0.8, 0.5, 1.0], np.float32),
        "min_p": np.array([0.0, 0.0, 0.0, 0.05], np.float32),
        "repetition_penalty": np.array([1.2, 1.0, 1.5, 1.0], np.float32),
        "frequency_penalty": np.array([0.0, 0.0, 0.0, 0.5], np.float32),
        "seeds": np.array([5, 6, 7, 8], np.uint32),
        "steps": np.array([0, 4, 9, 2], np.int32),
        "history": history,
        "history_is_output": is_output,
        "logit_bias": rng.normal(size=(S, V)).astype(np.float32),
        "allowed_mask": pack_bitmask(rng.random((S, V)) < 0.5),
    }
    unpadded = sample_jit(
        jnp.asarray(logits), sampling_arrays(S, **real), num_top_logprobs=5
    )

    pad = 4
    padded_logits = np.concatenate([logits, random_logits(pad, seed=14)])
    no_op = sampling_arrays(pad)
    padded = {name: np.concatenate([value, getattr(no_op, name)]) for name, value in real.items()}
    out = sample_jit(
        jnp.asarray(padded_logits), sampling_arrays(S + pad, **padded), num_top_logprobs=5
    )
    for name in ("tokens", "top_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name))[:S], getattr(unpadded, name))
    for name in ("logprobs", "top_logprobs"):  # reductions may round differently per batch shape
        np.testing.assert_allclose(
            np.asarray(getattr(out, name))[:S], getattr(unpadded, name), 1e-6
        )
    np.testing.assert_array_equal(np.asarray(out.tokens)[S:], np.argmax(padded_logits[S:], -1))
    allowed = ref_unpack(real["allowed_mask"], V)
    assert allowed[np.arange(S), np.asarray(unpadded.tokens)].all()


def test_fully_masked_row_stays_finite():
    logits = random_logits(S)
    mask = np.zeros((S, 32), np.int32)
    arrays = sampling_arrays(S, temperature=[0.0, 1.0, 1.0, 0.5], top_p=0.9, min_p=0.1,
                             allowed_mask=mask)
    out = sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=0)
    assert np.isfinite(np.asarray(out.logprobs)).all()
    assert ((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < V)).all()
