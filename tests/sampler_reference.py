"""The sampler tests' shared part: SamplingArrays with no-op defaults, jitted entry points, and a
NumPy reference of every setting (vLLM's penalties, temperature / min-p / top-k / top-p by a full
sort) that tests/runtime/test_sampler.py and tests/runtime/test_sampler_filters.py compare
jengine.runtime.sampler with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine.runtime.sampler import SamplingArrays, process_logits, sample

V = 1000
S = 4  # rows of most tests: one compiled program per function
MANY = 256  # rows of the many-seed tests
HISTORY = 12  # history width of the tests' penalty rows
NEG_INF = np.float32(-np.inf)

sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs",))
process_jit = jax.jit(process_logits)


# ----------------------------------------------------------------------------- helpers


def random_logits(num_rows: int, vocab: int = V, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """[S, V] f32 fixed random logits."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(num_rows, vocab)) * scale).astype(np.float32)


def sampling_arrays(num_rows: int, *, vocab: int = V, bare: bool = False,
                    **fields) -> SamplingArrays:
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


def replicate(logits_row: np.ndarray, num: int, **settings) -> tuple[np.ndarray, SamplingArrays]:
    """`num` copies of one row with seeds 0..num-1: many independent draws in one call."""
    logits = np.broadcast_to(logits_row, (num, logits_row.shape[-1])).copy()
    return logits, sampling_arrays(num, seeds=np.arange(num), **settings)


def tokens_of(logits: np.ndarray, arrays: SamplingArrays) -> np.ndarray:
    out = sample_jit(jnp.asarray(logits), arrays, num_top_logprobs=0)
    return np.asarray(out.tokens)


def processed_logits(logits: np.ndarray, arrays: SamplingArrays) -> np.ndarray:
    return np.asarray(process_jit(jnp.asarray(logits), arrays))


def assert_same_logits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same filtered-out set exactly; finite values equal to float32 rounding."""
    np.testing.assert_array_equal(np.isfinite(actual), np.isfinite(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- NumPy reference


def softmax64(logits: np.ndarray) -> np.ndarray:
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
        probs = softmax64(row)
        row = np.where(probs < min_p * probs.max(), NEG_INF, row)
    if 0 < top_k < row.shape[0]:
        kth = np.sort(row)[::-1][top_k - 1]
        row = np.where(row < kth, NEG_INF, row)
    if top_p < 1:
        probs = softmax64(row)
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        num_kept = max(1, int(np.sum(cumulative - probs[order] < top_p)))
        dropped = np.zeros(row.shape, bool)
        dropped[order[num_kept:]] = True
        row = np.where(dropped, NEG_INF, row)
    return row


def nucleus_size(row: np.ndarray, top_p: float) -> int:
    return int(np.isfinite(ref_filter(row, 1.0, top_p=top_p)).sum())


def penalty_history() -> tuple[np.ndarray, np.ndarray]:
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
