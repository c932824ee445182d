"""A row's value must not depend on how many rows run beside it: a speculative verification
recomputes a sequence's next decodes as several rows of one step, and its greedy tokens and
logprobs are only a plain decode's if every op gives each row the bits it gives that row alone.
XLA:CPU's reduce does not (from 8 rows it sums in another order); `layers.row_sum` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.models import layers
from jengine.runtime import sampler


def _alone_and_together(fn, x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """fn over all rows of x, and over each row alone (stacked), both jitted."""
    f = jax.jit(fn)
    together = np.asarray(f(x))
    alone = np.concatenate([np.asarray(f(x[i:i + 1])) for i in range(x.shape[0])])
    return together, alone


@pytest.mark.parametrize("width", [576, 640, 64])
def test_row_sum_is_the_same_alone_and_in_any_batch(width):
    rng = np.random.default_rng(width)
    for rows in (8, 16, 64):
        x = jnp.asarray(rng.standard_normal((rows, width)) * 3, jnp.float32)
        together, alone = _alone_and_together(layers.row_sum, x * x)
        np.testing.assert_array_equal(together, alone)
        np.testing.assert_allclose(together[:, 0], np.sum(np.asarray(x) ** 2, -1), rtol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "native"])
def test_rms_norm_rows_are_batch_invariant(backend):
    if backend == "native" and not cpu_matmul.available():
        pytest.skip("the native CPU kernels are not built")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 576)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(576), jnp.bfloat16)
    together, alone = _alone_and_together(lambda v: layers.rms_norm(v, w, 1e-5, backend=backend),
                                          x)
    np.testing.assert_array_equal(together.astype(np.float32), alone.astype(np.float32))
    # Per head ([T, H, D]: Gemma's and Qwen 3's q/k norms), and the same as the reference formula.
    heads = x.reshape(32, 9, 64)
    together, alone = _alone_and_together(
        lambda v: layers.rms_norm(v, w[:64], 1e-5, backend=backend), heads)
    np.testing.assert_array_equal(together.astype(np.float32), alone.astype(np.float32))
    h32 = np.asarray(heads, np.float32)
    want = h32 / np.sqrt((h32 ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(w[:64], np.float32)
    np.testing.assert_allclose(together.astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_raw_logprobs_are_batch_invariant():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((16, 49152)) * 4, jnp.float32)

    def logprobs(rows):
        out = sampler._raw_logprobs(rows, jnp.argmax(rows, -1).astype(jnp.int32), 2)
        return jnp.concatenate([out.logprobs[:, None], out.top_logprobs], -1)

    together, alone = _alone_and_together(logprobs, logits)
    np.testing.assert_array_equal(together, alone)
    want = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(together[:, 0], np.asarray(want).max(-1), rtol=1e-6, atol=1e-5)


def test_a_seeded_request_samples_alike_on_a_cold_and_a_warm_cache(smol_engine):
    """One seed, one output: a prompt sampled on a cold prefix cache and again once its pages
    are cached gives the same tokens and logprobs to the bit. The warm run computes only the
    prompt's last page, and the cold one computes that page in a step of its own too
    (`prefix_reuse.chunk_limit`); before, the cold run's one 40-row chunk and the warm run's
    8 rows summed the last rows in other orders (logprobs ~1e-5 apart in f32, 3e-2 in bf16)."""
    from jengine import SamplingParams

    prompt = ("A seeded request on a cold cache and then on a warm one: the sea, the wind, the "
              "stars and the long road home, told in four short lines.")
    assert len(smol_engine.tokenizer.encode(prompt)) > 2 * 16  # two full pages and a last one
    sp = SamplingParams(seed=1234, temperature=1.0, max_tokens=24, logprobs=0, ignore_eos=True)
    hits = smol_engine.stats().prefix_cache_hit_tokens
    cold, warm = (smol_engine.generate([prompt], sp)[0].outputs[0] for _ in range(2))
    assert smol_engine.stats().prefix_cache_hit_tokens >= hits + 32  # the second run was warm
    assert warm.token_ids == cold.token_ids
    assert [lp[t].logprob for lp, t in zip(warm.logprobs, warm.token_ids)] == \
        [lp[t].logprob for lp, t in zip(cold.logprobs, cold.token_ids)]
