"""Tests for jengine.runtime.sampler against a NumPy reference of every setting."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.runtime import pick, sampler
from jengine.runtime.sampler import SamplingArrays, pack_bitmask, process_logits, sample

V = 1000
S = 4  # rows of most tests: one compiled program per function
MANY = 256  # rows of the many-seed tests
HISTORY = 12  # history width of the tests' penalty rows
NEG_INF = np.float32(-np.inf)

_sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs",))
_process_jit = jax.jit(process_logits)


# ----------------------------------------------------------------------------- helpers


def _logits(num_rows: int, vocab: int = V, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """[S, V] f32 fixed random logits."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(num_rows, vocab)) * scale).astype(np.float32)


def _arrays(num_rows: int, *, vocab: int = V, bare: bool = False, **fields) -> SamplingArrays:
    """SamplingArrays with no-op (greedy) defaults; `fields` override, broadcast to [S].

    Unless `bare`, the optional arrays are present too (no-op history, bias and mask), so that
    most tests share one pytree structure and hence one compiled program per shape.
    """
    defaults = {
        "temperature": (0.0, np.float32),
        "top_k": (0, np.int32),
        "top_p": (1.0, np.float32),
        "min_p": (0.0, np.float32),
        "presence_penalty": (0.0, np.float32),
        "frequency_penalty": (0.0, np.float32),
        "repetition_penalty": (1.0, np.float32),
        "seeds": (0, np.uint32),
        "steps": (0, np.int32),
    }
    kwargs = {
        name: jnp.asarray(np.broadcast_to(np.asarray(fields.pop(name, value), dtype), (num_rows,)))
        for name, (value, dtype) in defaults.items()
    }
    optional = {
        "history": (np.full((num_rows, HISTORY), -1), np.int32),
        "history_is_output": (np.zeros((num_rows, HISTORY)), bool),
        "logit_bias": (np.zeros((num_rows, vocab)), np.float32),
        "allowed_mask": (np.full((num_rows, -(-vocab // 32)), -1), np.int32),
    }
    for name, (no_op, dtype) in optional.items():
        if name in fields or not bare:
            kwargs[name] = jnp.asarray(np.asarray(fields.pop(name, no_op), dtype))
    assert not fields, fields
    return SamplingArrays(**kwargs)


def _replicate(logits_row: np.ndarray, num: int, **settings) -> tuple[np.ndarray, SamplingArrays]:
    """`num` copies of one row with seeds 0..num-1: many independent draws in one call."""
    logits = np.broadcast_to(logits_row, (num, logits_row.shape[-1])).copy()
    return logits, _arrays(num, seeds=np.arange(num), **settings)


def _tokens(logits: np.ndarray, arrays: SamplingArrays) -> np.ndarray:
    out = _sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=0)
    return np.asarray(out.tokens)


def _processed(logits: np.ndarray, arrays: SamplingArrays) -> np.ndarray:
    return np.asarray(_process_jit(jnp.asarray(logits), arrays))


def _assert_same_logits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same filtered-out set exactly; finite values equal to float32 rounding."""
    np.testing.assert_array_equal(np.isfinite(actual), np.isfinite(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- NumPy reference


def _softmax64(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - np.max(logits)
    weights = np.exp(shifted)
    return weights / weights.sum()


def ref_unpack(packed: np.ndarray, vocab: int) -> np.ndarray:
    """[S, W] int32 -> [S, V] bool, bit j of word w is token 32 * w + j."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] >> np.arange(32)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab].astype(bool)


def ref_penalize(row, history, is_output, repetition, frequency, presence):
    """vLLM penalties on one row [V] f32."""
    row = row.copy()
    valid = history >= 0
    counts = np.bincount(history[valid & is_output], minlength=row.shape[0]).astype(np.float32)
    for token in np.unique(history[valid]):
        if row[token] > 0:
            row[token] = row[token] / np.float32(repetition)
        else:
            row[token] = row[token] * np.float32(repetition)
    row = row - np.float32(frequency) * counts
    return row - np.float32(presence) * (counts > 0).astype(np.float32)


def ref_filter(row, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Temperature, min-p, top-k, top-p on one row [V] f32, via a full sort."""
    row = row / np.float32(temperature)
    if min_p > 0:
        probs = _softmax64(row)
        row = np.where(probs < min_p * probs.max(), NEG_INF, row)
    if 0 < top_k < row.shape[0]:
        kth = np.sort(row)[::-1][top_k - 1]
        row = np.where(row < kth, NEG_INF, row)
    if top_p < 1:
        probs = _softmax64(row)
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        num_kept = max(1, int(np.sum(cumulative - probs[order] < top_p)))
        dropped = np.zeros(row.shape, bool)
        dropped[order[num_kept:]] = True
        row = np.where(dropped, NEG_INF, row)
    return row


def _nucleus_size(row: np.ndarray, top_p: float) -> int:
    return int(np.isfinite(ref_filter(row, 1.0, top_p=top_p)).sum())


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
    logits_row = _logits(1)[0]
    allowed = rng.random(V) < 0.05
    allowed[np.argmax(logits_row)] = False  # the raw argmax is forbidden
    mask = pack_bitmask(np.broadcast_to(allowed, (MANY, V)))
    logits, arrays = _replicate(logits_row, MANY, temperature=1.5, allowed_mask=mask)
    tokens = _tokens(logits, arrays)
    assert allowed[tokens].all()
    assert len(np.unique(tokens)) > 10  # really sampled

    expected = np.where(allowed, logits_row, NEG_INF)
    greedy = _arrays(S, allowed_mask=mask[:S])
    _assert_same_logits(_processed(logits[:S], greedy), np.broadcast_to(expected, (S, V)))
    np.testing.assert_array_equal(_tokens(logits[:S], greedy), np.argmax(expected))


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ignores_filters():
    logits = _logits(S)
    arrays = _arrays(S, top_k=3, top_p=0.5, min_p=0.3, seeds=np.arange(S))
    np.testing.assert_array_equal(_tokens(logits, arrays), np.argmax(logits, -1))
    np.testing.assert_array_equal(_processed(logits, arrays), logits)


def test_greedy_takes_the_first_of_tied_maxima():
    logits = np.zeros((S, V), np.float32)
    logits[0, [7, V - 2]] = 2.0  # tie: first wins
    logits[1, [V - 1]] = 1.0  # the last id
    logits[2] = -np.inf  # nothing allowed: id 0, as argmax
    logits[3, [0, 1]] = 5.0
    expected = np.argmax(logits, -1)
    np.testing.assert_array_equal(_tokens(logits, _arrays(S)), expected)
    assert expected.tolist() == [7, V - 1, 0, 0]


def test_greedy_rows_in_mixed_batch_and_bare_arrays():
    logits = _logits(S)
    settings = {"temperature": np.array([0, 1.0, 0, 0.7], np.float32), "seeds": np.arange(S)}
    tokens = _tokens(logits, _arrays(S, **settings))
    greedy = settings["temperature"] == 0
    np.testing.assert_array_equal(tokens[greedy], np.argmax(logits[greedy], -1))
    # Optional arrays left out (None) sample exactly as no-op ones.
    np.testing.assert_array_equal(_tokens(logits, _arrays(S, bare=True, **settings)), tokens)


def test_sample_has_greedy_fast_path():
    # Drawing (random bits) happens only inside a cond branch, never at the top level.
    jaxpr = jax.make_jaxpr(functools.partial(sample, num_top_logprobs=0))(
        jnp.asarray(_logits(2)), _arrays(2, bare=True)
    )
    top_level = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "cond" in top_level
    assert not [name for name in top_level if "random" in name or "threefry" in name]
    assert "random_bits" in str(jaxpr) or "threefry" in str(jaxpr)


# ----------------------------------------------------------------------------- temperature


def test_temperature_processed_logits():
    logits = _logits(S)
    temperature = np.array([0.5, 1.0, 2.0, 0.9], np.float32)
    processed = _processed(logits, _arrays(S, temperature=temperature))
    expected = np.stack([ref_filter(row, t) for row, t in zip(logits, temperature)])
    _assert_same_logits(processed, expected)  # XLA may divide by multiplying with 1 / T


def test_temperature_draw_inverts_the_cdf_at_the_row_keys_uniform():
    logits = _logits(S)
    seeds = np.arange(100, 100 + S)
    steps = np.arange(S) * 3
    tokens = _tokens(logits, _arrays(S, temperature=0.8, seeds=seeds, steps=steps))
    for row, seed, step, token in zip(logits, seeds, steps, tokens):
        u = float(jax.random.uniform(jax.random.fold_in(jax.random.key(int(seed)), int(step))))
        cdf = np.cumsum(_softmax64(row / 0.8))
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
    arrays = _arrays(num, vocab=16, bare=True, temperature=temperature, seeds=np.arange(num))
    counts = np.bincount(_tokens(logits, arrays), minlength=16)
    expected = _softmax64(logits_row / temperature) * num
    chi_square = np.sum((counts - expected) ** 2 / expected)
    assert chi_square < 50.0  # 15 degrees of freedom: p < 1e-5 for a correct sampler


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
    logits_row = _logits(1, scale=2.0, seed=3)[0]
    expected = ref_filter(logits_row, **settings)
    assert 1 < np.isfinite(expected).sum() < V  # the filter really filters

    logits, arrays = _replicate(logits_row, MANY, **settings)
    _assert_same_logits(_processed(logits[:S], _arrays(S, **settings))[0], expected)
    tokens = _tokens(logits, arrays)
    assert np.isfinite(expected[tokens]).all()
    assert len(np.unique(tokens)) > 1


_candidates_jit = jax.jit(sampler._filter_with_candidates, static_argnums=3)
_tiers_jit = jax.jit(sampler._filter_top_k_top_p, static_argnames=("widths",))


def test_candidate_tiers_agree_with_full_sort():
    # Rows whose cutoffs lie inside 16 candidates, inside 64, and only in the full sort.
    logits = np.concatenate([_logits(3, scale=5.0, seed=4), _logits(3, scale=1.0, seed=5)])
    top_k = np.array([0, 10, 40, 0, 0, 300], np.int32)
    top_p = np.array([0.5, 1.0, 0.9, 0.2, 0.9, 1.0], np.float32)
    args = (jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p))
    covered16 = np.asarray(_candidates_jit(*args, 16)[1])
    covered64 = np.asarray(_candidates_jit(*args, 64)[1])
    assert not covered16.all() and not covered64.all() and covered64.sum() > covered16.sum()

    expected = np.stack([ref_filter(*row) for row in zip(logits, np.ones(6), top_k, top_p)])
    for widths in [(16, 64, V), (V,)]:
        filtered = _tiers_jit(args[0], top_k=args[1], top_p=args[2], widths=widths)
        _assert_same_logits(np.asarray(filtered), expected)
    for width, covered in [(16, covered16), (64, covered64)]:  # covered rows are exact already
        filtered = np.asarray(_candidates_jit(*args, width)[0])
        _assert_same_logits(filtered[covered], expected[covered])


def test_large_vocab_top_p_tiers():
    vocab = 49152
    logits = np.concatenate([_logits(3, vocab, scale=4.0, seed=6), _logits(1, vocab, 2.0, 7)])
    top_p = np.array([0.5, 0.95, 1.0, 0.9], np.float32)
    top_k = np.array([0, 0, 5000, 0], np.int32)
    sizes = [_nucleus_size(row, p) for row, p in zip(logits[[0, 1, 3]], top_p[[0, 1, 3]])]
    assert sizes[0] < 256 < sizes[1] < 4096 < sizes[2]  # one row per tier
    arrays = _arrays(S, vocab=vocab, bare=True, temperature=1.0, top_k=top_k, top_p=top_p)
    processed = _processed(logits, arrays)
    for row, k, p, actual in zip(logits, top_k, top_p, processed):
        _assert_same_logits(actual, ref_filter(row, 1.0, top_k=k, top_p=p))


# ----------------------------------------------------------------------------- penalties, bias


def _history() -> tuple[np.ndarray, np.ndarray]:
    """[S, HISTORY] prompt + output histories with repeats and -1 padding, and is-output flags."""
    history = np.array(
        [
            [5, 9, 9, 17, 3, 3, 3, 40, -1, -1, -1, -1],
            [1, 2, 3, 4, 5, 6, 2, 2, 7, 7, 7, 8],
            [11, 12, 13, 12, -1, -1, -1, -1, -1, -1, -1, -1],
            [20, 21, 22, 20, 21, 20, -1, -1, -1, -1, -1, -1],
        ],
        np.int32,
    )
    is_output = np.zeros_like(history, bool)
    is_output[0, 4:8] = True  # output 3 3 3 40; the prompt's 5 9 9 17 only feel repetition
    is_output[1, 6:] = True
    is_output[2, 3] = True
    is_output[3, 3:6] = True
    return history, is_output


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
    logits = _logits(S, scale=3.0, seed=8)
    history, is_output = _history()
    arrays = _arrays(S, history=history, history_is_output=is_output, **settings)
    no_penalty = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}
    expected = []
    for i in range(S):
        penalties = {name.split("_")[0]: value[i] for name, value in settings.items()}
        row = ref_penalize(logits[i], history[i], is_output[i], **{**no_penalty, **penalties})
        expected.append(row)
    expected = np.stack(expected)
    assert not np.allclose(expected, logits)
    _assert_same_logits(_processed(logits, arrays), expected)
    np.testing.assert_array_equal(_tokens(logits, arrays), np.argmax(expected, -1))


def test_penalty_arrays_without_penalties_change_nothing():
    history, is_output = _history()
    logits = _logits(S)
    arrays = _arrays(S, history=history, history_is_output=is_output)
    np.testing.assert_array_equal(_processed(logits, arrays), logits)


def test_logit_bias_matches_reference():
    logits = _logits(S)
    bias = np.zeros((S, V), np.float32)
    bias[0, 17] = 100.0
    bias[1, np.argmax(logits[1])] = -100.0
    bias[1, 5:50] = 0.25
    bias[3] = np.linspace(-1.0, 1.0, V)
    arrays = _arrays(S, logit_bias=bias)
    _assert_same_logits(_processed(logits, arrays), logits + bias)
    tokens = _tokens(logits, arrays)
    assert tokens[0] == 17
    np.testing.assert_array_equal(tokens, np.argmax(logits + bias, -1))


# ----------------------------------------------------------------------------- determinism


def test_row_token_independent_of_batch():
    rng = np.random.default_rng(9)
    logits = _logits(MANY, scale=2.0, seed=9)
    settings = {
        "temperature": rng.uniform(0.5, 1.5, MANY).astype(np.float32),
        "top_k": rng.choice([0, 5, 40], MANY).astype(np.int32),
        "top_p": rng.choice([1.0, 0.5, 0.9], MANY).astype(np.float32),
        "min_p": rng.choice([0.0, 0.02], MANY).astype(np.float32),
        "seeds": rng.integers(0, 2**32, MANY, dtype=np.uint32),
        "steps": rng.integers(0, 100, MANY, dtype=np.int32),
    }
    alone = _tokens(logits, _arrays(MANY, **settings))
    np.testing.assert_array_equal(_tokens(logits, _arrays(MANY, **settings)), alone)

    # The first 64 rows again, at other positions, among rows with other settings (whose wide
    # nucleus pushes the whole batch from the candidate tier onto the full sort).
    positions = rng.permutation(MANY)[:64]
    mixed_logits = _logits(MANY, scale=1.0, seed=10)
    mixed_logits[positions] = logits[:64]
    mixed = {name: np.resize(value[::-1], MANY) for name, value in settings.items()}
    mixed["top_p"][:] = 0.99
    for name, value in settings.items():
        mixed[name][positions] = value[:64]
    together = _tokens(mixed_logits, _arrays(MANY, **mixed))
    np.testing.assert_array_equal(together[positions], alone[:64])

    later = _tokens(logits, _arrays(MANY, **{**settings, "steps": settings["steps"] + 1}))
    assert (later != alone).mean() > 0.3


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_sorted():
    logits = _logits(S, scale=2.0, seed=11)
    history, is_output = _history()
    arrays = _arrays(
        S,
        temperature=[0.0, 0.7, 1.5, 1.0],
        top_k=[0, 5, 0, 0],
        repetition_penalty=[2.0, 1.0, 1.0, 1.0],
        seeds=[1, 2, 3, 4],
        history=history,
        history_is_output=is_output,
    )
    out = _sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=5)
    reference = np.stack([np.log(_softmax64(row)) for row in logits])
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, reference[np.arange(S), tokens], atol=1e-5)
    top_ids = np.argsort(-reference, axis=-1)[:, :5]
    np.testing.assert_array_equal(out.top_ids, top_ids)
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(reference, top_ids, -1), atol=1e-5
    )
    assert (np.diff(np.asarray(out.top_logprobs), axis=-1) <= 0).all()
    none = _sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=0)
    assert none.top_ids.shape == (S, 0) and none.top_logprobs.shape == (S, 0)


# ----------------------------------------------------------------------------- jit, padding


def test_sample_jits_with_padded_rows():
    logits = _logits(S, scale=2.0, seed=12)
    history, is_output = _history()
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
    unpadded = _sample_jit(
        jnp.asarray(logits), _arrays(S, **real), num_top_logprobs=5
    )

    pad = 4
    padded_logits = np.concatenate([logits, _logits(pad, seed=14)])
    no_op = _arrays(pad)
    padded = {name: np.concatenate([value, getattr(no_op, name)]) for name, value in real.items()}
    out = _sample_jit(
        jnp.asarray(padded_logits), _arrays(S + pad, **padded), num_top_logprobs=5
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
    logits = _logits(S)
    mask = np.zeros((S, 32), np.int32)
    arrays = _arrays(S, temperature=[0.0, 1.0, 1.0, 0.5], top_p=0.9, min_p=0.1, allowed_mask=mask)
    out = _sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=0)
    assert np.isfinite(np.asarray(out.logprobs)).all()
    assert ((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < V)).all()
