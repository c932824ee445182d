"""The tail of a step: the logits of the rows that are sampled, then the sampler.

A step's sequence bucket S holds more rows than most steps sample (a lone prefill runs in a
64-row bucket; a decode batch of 40 in one of 64), and everything after the last hidden state
is per row: the lm_head, the argmax, the log-normaliser. So the head runs on the first n rows
only, n the smallest of `SAMPLED_ROWS` and S that holds the step's `num_rows`, chosen on device
(`lax.switch` runs one branch), and the rest are zeros.

The plain variant (`step_io.Variant`: no logprobs, penalties, bias or grammar) adjusts no logit
and reports no logprob, so it skips the log-normaliser, and a batch whose rows are all greedy
(temperature 0) takes the argmax inside the branch, on its n rows, never padding the logits to
S. On SmolLM2 at T = 64 with one live row that is 16 of a prefill step's ~60 ms on CPU (the pad,
the argmax and the normaliser over [64, 49152]). The full sampler stays outside the branches: a
copy of it per branch cost 70% more compile time for its last 8 ms.

Both branchings are XLA:CPU's (`branches`, `ModelConfig.branches`). On accelerators, where a
conditional copies its predicate to the host and waits, the head runs on all S rows and the
host picks the program: the greedy variant (`Variant.greedy`: every row greedy) takes the
argmax alone, the others run the sampler without branches.

An embedding engine's steps end otherwise (`embed_tail`): no head and no sampler, every token's
hidden state after the final norm goes back to the host, which pools each request's rows
(`jengine.core.pooling`); [T, E] f32 is the step's whole output (1.2 MB for SmolLM2 at T = 512).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jengine.models.layers import rms_norm
from jengine.runtime.pick import first_argmax
from jengine.runtime.sampler import SamplerOutput, SamplingArrays, sample
from jengine.runtime.step_io import Variant
from jengine.sampling_params import GREEDY_TEMPERATURE

SAMPLED_ROWS = (1, 8)  # row counts below S that a step's lm_head can run on


def first_rows(fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, num_rows: jax.Array,
               sizes: tuple[int, ...] = SAMPLED_ROWS) -> jax.Array:
    """[S, E] hidden rows -> `fn` of the first n of them, zeros after (padded to S along the
    first axis), n the smallest of `sizes` and S that holds `num_rows`."""
    s = hidden.shape[0]
    widths = sorted({n for n in sizes if n < s} | {s})

    def rows(n: int) -> Callable[[], jax.Array]:
        def run() -> jax.Array:
            out = fn(hidden[:n])
            return jnp.pad(out, ((0, s - n),) + ((0, 0),) * (out.ndim - 1))
        return run

    if len(widths) == 1:
        return fn(hidden)
    index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), num_rows)
    return jax.lax.switch(jnp.minimum(index, len(widths) - 1), [rows(n) for n in widths])


def embed_tail(network, params, cfg, kv, md, num_seqs: int):
    """The embed variant's step: ((no-op sampler rows [S], no prompt logprobs), the cache,
    every token's normed final hidden state [T, E] f32). `network`: the model's `Network`,
    whose `final_norm` hook (None: RMSNorm by `final_norm`, Llama's) the hidden states take."""
    hidden, kv = network.forward(params, cfg, kv, md, all_logits=True, head=False)  # [T, E]
    if network.final_norm is not None:
        hidden = network.final_norm(params, cfg, hidden)
    else:
        hidden = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps,
                          backend=cfg.matmul_backend)
    tokens = jnp.zeros((num_seqs,), jnp.int32)
    return (SamplerOutput.of_tokens(tokens), None), kv, hidden.astype(jnp.float32)


def head_and_sample(logits_of: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    num_rows: jax.Array, arrays: SamplingArrays,
                    variant: Variant, *, branches: bool = True) -> SamplerOutput:
    """[S, E] last hidden states -> the sampler's output for the first `num_rows` rows.

    Args:
      logits_of: [n, E] -> [n, V] f32 logits (the model's head).
      hidden: [S, E] the hidden state of each sampled row.
      num_rows: scalar i32, the rows the host reads; rows after it are padding.
      arrays: the rows' sampling settings, padded to S.
      variant: the step's static features; a plain one reports zero logprobs, a greedy one
        takes every row's argmax.
      branches: static; False (accelerators): no conditional (module docstring).
    """
    sizes = SAMPLED_ROWS if branches else ()

    def full() -> SamplerOutput:
        logits = first_rows(logits_of, hidden, num_rows, sizes)
        with jax.named_scope("sample"):
            return sample(logits, arrays, num_top_logprobs=variant.num_top_logprobs,
                          with_logprobs=variant.features, branches=branches)

    if variant.features:
        return full()

    def greedy() -> SamplerOutput:
        def tokens_of(h: jax.Array) -> jax.Array:
            logits = logits_of(h)
            with jax.named_scope("sample"):
                return first_argmax(logits)
        return SamplerOutput.of_tokens(first_rows(tokens_of, hidden, num_rows, sizes))

    if variant.greedy:
        return greedy()
    if not branches:
        return full()
    all_greedy = jnp.all(arrays.temperature < GREEDY_TEMPERATURE)  # padding rows are greedy
    return jax.lax.cond(all_greedy, greedy, full)
