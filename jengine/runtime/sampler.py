"""Token sampling inside the jitted engine step.

`sample` turns the step's last-token logits into next tokens on the device, so that only token
ids and the requested logprobs cross back to the host. Every per-request setting arrives as a
row of `SamplingArrays`, padded to the step's sequence bucket `S`; padded rows are greedy and
change nothing.

Processing order (vLLM's):
  1. allowed-token bitmask (disallowed -> -inf), additive logit bias;
  2. repetition penalty over prompt + output tokens, frequency and presence penalties over
     output tokens;
  3. greedy rows (temperature 0, below `GREEDY_TEMPERATURE`) take the argmax here; sampled
     rows go on:
  4. divide by temperature, min-p, top-k, top-p;
  5. draw with the row's own key `fold_in(key(seed), step)`, so a row's token depends only on its
     logits, seed and step, never on the rest of the batch.
Reported logprobs are those of the raw model distribution (log_softmax of the unprocessed
logits), as vLLM reports them by default.

Cost control on XLA:CPU (a full-vocabulary sort costs more than a decode step there):
  - penalties, min-p and top-k/top-p each run under `lax.cond` only when some row needs them;
  - an all-greedy batch skips temperature, filtering and drawing altogether;
  - top-k/top-p never sort the vocabulary unless they must: the filter works on the
    `lax.top_k` candidates of `CANDIDATE_WIDTHS`, falling back to the next width, and last to a
    full sort, only when some row's answer does not lie within the candidates (see
    `_filter_top_k_top_p`);
  - the argmax and the draw work in two levels over blocks of the vocabulary
    (`jengine.runtime.pick`), never one [S, V] scan or cumulative sum.
On accelerators (`branches=False`: `ModelConfig.branches`) the sampler holds no conditional,
each of which would copy its predicate to the host and wait: the host runs an all-greedy batch
through a program without the draw (`step_io.Variant.greedy`), and a sampled one applies every
filter with selects (neutral settings change nothing, exactly), top-k/top-p on the full
vocabulary (the candidate widths' fallback is data-dependent).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models.layers import row_sum
from jengine.runtime import pick
from jengine.sampling_params import GREEDY_TEMPERATURE

# Candidate widths tried in turn before a full sort of the vocabulary. On this project's CPU
# (vocab 49152, 32 rows) `lax.top_k` costs ~9 ms at 256, ~72 ms at 4096 and a full sort ~570 ms.
# 256 should hold the top-p nucleus of most steps of a trained model at ordinary settings (an
# expectation, not yet measured on real traffic); the 4096 tier keeps a flat row (high
# temperature, top_p near 1) from paying for a full sort; only top-k beyond 4096 or a nucleus
# wider than 4096 tokens sorts everything. The fallback is batch-wide (one row that overflows
# moves the whole batch to the next tier), which is why the middle tier matters at large batch
# sizes. Every tier gives the same result, up to float rounding of cumulative sums at a cutoff.
CANDIDATE_WIDTHS = (256, 4096)

_BITS_PER_WORD = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-request sampling settings of one step, one row per sequence slot, padded to `S`.

    Padded rows hold the no-op values: temperature 0 (greedy), top_k 0, top_p 1, min_p 0,
    penalties 0 / 0 / 1, history all -1, logit_bias 0, allowed_mask all ones (-1 words).

    Attributes:
      temperature: [S] f32; 0 (below `GREEDY_TEMPERATURE`) means greedy.
      top_k: [S] i32; 0 (or >= vocab) means off.
      top_p: [S] f32 in (0, 1]; 1 means off.
      min_p: [S] f32 in [0, 1]; 0 means off.
      presence_penalty: [S] f32; subtracted once from every token present in the output.
      frequency_penalty: [S] f32; subtracted once per occurrence of a token in the output.
      repetition_penalty: [S] f32 > 0; 1 means off. Applies to prompt and output tokens.
      seeds: [S] u32 per-request seed (the engine draws one for unseeded requests).
      steps: [S] i32 index, within its sequence's output, of the token being sampled (0 first).
      history: [S, H] i32 prompt + output token ids padded with -1, or None when no row has a
        penalty.
      history_is_output: [S, H] bool, True where `history` holds a generated token; None exactly
        when `history` is None.
      logit_bias: [S, V] f32 additive bias, or None when no row has one.
      allowed_mask: [S, ceil(V / 32)] i32 packed bitmask (bit j of word w set: token 32 * w + j
        allowed; see `pack_bitmask`), or None when no row is constrained.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    seeds: jax.Array
    steps: jax.Array
    history: jax.Array | None = None
    history_is_output: jax.Array | None = None
    logit_bias: jax.Array | None = None
    allowed_mask: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What the sampler returns to the step (and the step to the host).

    Attributes:
      tokens: [S] i32 the sampled (or greedy) next token of every row.
      logprobs: [S] f32 log-probability of `tokens` under the raw model distribution.
      top_ids: [S, K] i32 the K most likely tokens of the raw distribution, most likely first.
      top_logprobs: [S, K] f32 their raw log-probabilities, descending.
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array

    @classmethod
    def of_tokens(cls, tokens: jax.Array) -> SamplerOutput:
        """Tokens with no logprobs (zeros, no top-K): what a plain step reports."""
        s = tokens.shape[0]
        return cls(tokens=tokens, logprobs=jnp.zeros((s,), jnp.float32),
                   top_ids=jnp.zeros((s, 0), jnp.int32),
                   top_logprobs=jnp.zeros((s, 0), jnp.float32))


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """Packs a boolean allowed-token mask into the sampler's int32 word layout (host side).

    Args:
      allowed: [S, V] bool, True where a token may be sampled.

    Returns:
      [S, ceil(V / 32)] int32; bit j of word w is set when token 32 * w + j is allowed. This is
      the layout llguidance and xgrammar fill; bits past V are 0.
    """
    allowed = np.asarray(allowed, dtype=bool)
    num_seqs, vocab = allowed.shape
    num_words = -(-vocab // _BITS_PER_WORD)
    padded = np.zeros((num_seqs, num_words * _BITS_PER_WORD), dtype=bool)
    padded[:, :vocab] = allowed
    packed = np.packbits(padded, axis=-1, bitorder="little")  # [S, 4 * W] u8, token order
    return packed.view("<i4").astype(np.int32)


def sample(
    logits: jax.Array, arrays: SamplingArrays, *, num_top_logprobs: int,
    with_logprobs: bool = True, branches: bool = True,
) -> SamplerOutput:
    """Picks the next token of every row.

    Args:
      logits: [S, V] f32 raw last-token logits.
      arrays: the rows' sampling settings, padded to S.
      num_top_logprobs: static K, the number of top raw logprobs to return per row (0 for none).
      with_logprobs: static; False skips the raw log-normaliser and reports zero logprobs
        (with K = 0), for steps whose rows want none.
      branches: static; False (accelerators) computes every stage with selects, no
        conditional (module docstring).

    Returns:
      The tokens [S], their raw logprobs [S] and the raw top-K ids and logprobs [S, K].
    """
    adjusted = _adjust_logits(logits, arrays, branches)
    greedy_tokens = pick.first_argmax(adjusted)
    is_greedy = arrays.temperature < GREEDY_TEMPERATURE

    def draw() -> jax.Array:
        filtered = _scale_and_filter(adjusted, arrays, branches)
        return jnp.where(is_greedy, greedy_tokens, _draw(filtered, arrays.seeds, arrays.steps))

    tokens = jax.lax.cond(jnp.all(is_greedy), lambda: greedy_tokens, draw) if branches else draw()
    if not with_logprobs:
        assert num_top_logprobs == 0, "top logprobs need the log-normaliser"
        return SamplerOutput.of_tokens(tokens)
    return _raw_logprobs(logits, tokens, num_top_logprobs)


def process_logits(logits: jax.Array, arrays: SamplingArrays, *,
                   branches: bool = True) -> jax.Array:
    """The logits each row's token is drawn from: `sample` without the draw (for tests).

    Args:
      logits: [S, V] f32 raw logits.
      arrays: the rows' sampling settings.

    Returns:
      [S, V] f32: greedy rows after steps 1-2 of the module docstring (their argmax is the
      token); sampled rows after steps 1-4, with filtered-out tokens at -inf.
    """
    adjusted = _adjust_logits(logits, arrays, branches)
    filtered = _scale_and_filter(adjusted, arrays, branches)
    is_greedy = arrays.temperature < GREEDY_TEMPERATURE
    return jnp.where(is_greedy[:, None], adjusted, filtered)


def _when(pred: jax.Array, fn: Callable[[jax.Array], jax.Array], x: jax.Array,
          branches: bool = True) -> jax.Array:
    """`fn(x)` if the scalar `pred` holds, else `x`, computing `fn` only when it is needed; without
    `branches`, `fn(x)` always (each `fn` here leaves rows with neutral settings as they are)."""
    if not branches:
        return fn(x)
    return jax.lax.cond(pred, fn, lambda y: y, x)


def _adjust_logits(logits: jax.Array, arrays: SamplingArrays,
                   branches: bool = True) -> jax.Array:
    """Steps 1-2: bitmask, logit bias and penalties. [S, V] -> [S, V]."""
    if arrays.allowed_mask is not None:
        allowed = _unpack_bitmask(arrays.allowed_mask, logits.shape[-1])
        logits = jnp.where(allowed, logits, -jnp.inf)
    if arrays.logit_bias is not None:
        logits = logits + arrays.logit_bias
    if arrays.history is not None:
        penalized = (
            (arrays.repetition_penalty != 1.0)
            | (arrays.frequency_penalty != 0.0)
            | (arrays.presence_penalty != 0.0)
        )
        logits = _when(jnp.any(penalized), functools.partial(_penalize, arrays=arrays), logits,
                       branches)
    return logits


def _unpack_bitmask(mask: jax.Array, vocab: int) -> jax.Array:
    """[S, W] i32 packed words -> [S, V] bool allowed (the inverse of `pack_bitmask`)."""
    shifts = jnp.arange(_BITS_PER_WORD, dtype=jnp.int32)
    bits = (mask[:, :, None] >> shifts) & 1  # [S, W, 32]; arithmetic shift is fine under & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(bool)


def _token_counts(
    history: jax.Array, is_output: jax.Array, vocab: int
) -> tuple[jax.Array, jax.Array]:
    """Counts each row's tokens.

    Args:
      history: [S, H] i32 prompt + output ids, -1 padding.
      is_output: [S, H] bool, True at generated tokens.
      vocab: V.

    Returns:
      output_counts [S, V] i32 occurrences in the output, and seen [S, V] bool present in the
      prompt or the output.
    """
    rows = jnp.arange(history.shape[0])[:, None]  # [S, 1]
    ids = jnp.where(history >= 0, history, vocab)  # padding -> out of range, dropped below
    zeros = jnp.zeros((history.shape[0], vocab), jnp.int32)
    output_counts = zeros.at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    seen = zeros.at[rows, ids].set(1, mode="drop").astype(bool)
    return output_counts, seen


def _penalize(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Repetition, then frequency and presence penalties (vLLM semantics). [S, V] -> [S, V]."""
    output_counts, seen = _token_counts(arrays.history, arrays.history_is_output, logits.shape[-1])
    repetition = arrays.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen, repeated, logits)
    logits = logits - arrays.frequency_penalty[:, None] * output_counts
    return logits - arrays.presence_penalty[:, None] * (output_counts > 0)


def _scale_and_filter(logits: jax.Array, arrays: SamplingArrays,
                      branches: bool = True) -> jax.Array:
    """Step 4: temperature, min-p, then top-k and top-p. [S, V] -> [S, V]."""
    is_greedy = arrays.temperature < GREEDY_TEMPERATURE
    temperature = jnp.where(is_greedy, 1.0, arrays.temperature)
    logits = logits / temperature[:, None]
    min_p = jnp.where(is_greedy, 0.0, arrays.min_p)
    logits = _when(jnp.any(min_p > 0), functools.partial(_filter_min_p, min_p=min_p), logits,
                   branches)
    vocab = logits.shape[-1]
    top_k = jnp.where(is_greedy | (arrays.top_k <= 0) | (arrays.top_k >= vocab), 0, arrays.top_k)
    top_p = jnp.where(is_greedy, 1.0, arrays.top_p)
    widths = (tuple(w for w in CANDIDATE_WIDTHS if w < vocab) if branches else ()) + (vocab,)
    filter_fn = functools.partial(_filter_top_k_top_p, top_k=top_k, top_p=top_p, widths=widths)
    return _when(jnp.any(top_k > 0) | jnp.any(top_p < 1.0), filter_fn, logits, branches)


def _filter_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens whose probability is below min_p times the row's top probability.

    p_i / p_max = exp(l_i - l_max), so no softmax denominator is needed.

    Args:
      logits: [S, V] temperature-scaled logits.
      min_p: [S] f32, 0 for rows without min-p.

    Returns:
      [S, V] with dropped tokens at -inf.
    """
    keep = jnp.exp(logits - pick.row_max(logits)) >= min_p[:, None]
    return jnp.where(keep, logits, -jnp.inf)


def _filter_top_k_top_p(
    logits: jax.Array, *, top_k: jax.Array, top_p: jax.Array, widths: tuple[int, ...]
) -> jax.Array:
    """Top-k then top-p on candidates of the first width that covers every row.

    Tries `widths[0]`; if some row's top-k or top-p cutoff lies beyond those candidates, tries
    the next width under `lax.cond`, and so on. The last width is the vocabulary (a full sort),
    which always covers, so the result is exact whichever width serves.

    Args:
      logits: [S, V] scaled, min-p filtered logits.
      top_k: [S] i32, 0 for off.
      top_p: [S] f32, 1 for off.
      widths: increasing static candidate widths, the last equal to V.

    Returns:
      [S, V] with the filtered-out tokens at -inf.
    """
    filtered, covered = _filter_with_candidates(logits, top_k, top_p, widths[0])
    if len(widths) == 1:
        return filtered
    wider = functools.partial(_filter_top_k_top_p, top_k=top_k, top_p=top_p, widths=widths[1:])
    return jax.lax.cond(jnp.all(covered), lambda x: filtered, wider, logits)


def _filter_with_candidates(
    logits: jax.Array, top_k: jax.Array, top_p: jax.Array, width: int
) -> tuple[jax.Array, jax.Array]:
    """Top-k then top-p, finding both cutoffs among the `width` largest logits of each row.

    Both filters become value thresholds applied to the whole row, so only the candidates'
    values are needed, never their ids. Top-p's cumulative probabilities are taken over the
    candidates but normalised by the full (top-k filtered) softmax denominator, so they equal
    those of a full sort on the prefix the candidates cover. The nucleus is the smallest prefix
    whose mass reaches top_p (the top token is always kept); tokens tied with a cutoff value are
    all kept.

    Args:
      logits: [S, V] logits.
      top_k: [S] i32, 0 for off.
      top_p: [S] f32, 1 for off.
      width: static number C of candidates, 1 <= C <= V.

    Returns:
      filtered [S, V] with dropped tokens at -inf, and covered [S] bool: False where the row's
      top-k exceeds C or its nucleus extends past the candidates (its `filtered` row is then
      not to be used).
    """
    vocab = logits.shape[-1]
    candidates = jax.lax.top_k(logits, width)[0]  # [S, C], descending

    k_off = top_k <= 0
    kth = jnp.take_along_axis(candidates, jnp.clip(top_k, 1, width)[:, None] - 1, axis=-1)
    kth = jnp.where(k_off[:, None], -jnp.inf, kth)  # [S, 1]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
    candidates = jnp.where(candidates >= kth, candidates, -jnp.inf)

    top = pick.row_max(candidates)
    denominator = jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)  # [S, 1]
    probs = jnp.exp(candidates - top) / jnp.where(denominator > 0, denominator, 1.0)
    cumulative = jnp.cumsum(probs, axis=-1)  # [S, C]
    num_kept = jnp.sum(cumulative - probs < top_p[:, None], axis=-1)  # prefix length, >= 1
    cutoff = jnp.take_along_axis(candidates, jnp.clip(num_kept, 1, width)[:, None] - 1, axis=-1)
    p_off = top_p >= 1.0
    cutoff = jnp.where(p_off[:, None], -jnp.inf, cutoff)  # [S, 1]

    all_finite_in = (width == vocab) | (candidates[:, -1] == -jnp.inf)
    k_covered = k_off | (top_k <= width)
    p_covered = p_off | all_finite_in | (cumulative[:, -1] >= top_p)
    return jnp.where(logits >= cutoff, logits, -jnp.inf), k_covered & p_covered


def _draw(logits: jax.Array, seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """[S] i32 tokens from [S, V] processed logits, row i's drawn with the key
    `fold_in(key(seeds[i]), steps[i])` ([S] u32 and [S] i32), so it depends only on that row."""
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(seeds, steps)
    return pick.draw(logits, keys)


def _raw_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> SamplerOutput:
    """The sampler's output for `tokens` ([S] i32), with the raw distribution's logprobs of
    them and of its top `num_top` (static K >= 0) tokens; `logits` [S, V] are raw."""
    # logsumexp with `row_sum`'s fixed order: a row's logprobs come out the same in any bucket
    # of rows (a verification's rows against the decodes they stand for).
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [S, 1]
    log_norm = (jnp.log(row_sum(jnp.exp(logits - top))) + top)[:, 0]  # [S]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_norm
    top_values, top_ids = jax.lax.top_k(logits, num_top)  # [S, K]
    return SamplerOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids.astype(jnp.int32),
                         top_logprobs=top_values - log_norm[:, None])
