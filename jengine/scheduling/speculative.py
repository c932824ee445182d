"""Speculative decoding, host side: who may speculate, what is proposed, and what is accepted.

A speculating decode runs its last token plus `k` proposed tokens as `k + 1` query rows of the
ordinary ragged step, and the sampler draws one token from each row's logits exactly as it would
without speculation (same processing, same key `fold_in(key(seed), step)` with the row's own
output index as `step`). Row `j` predicts the token after proposal `j`, so the host keeps row
`j + 1`'s token only while row `j`'s token equals proposal `j + 1`; the first mismatch ends the
run, and that row's draw is the step's extra ("bonus") token. Every kept token was therefore drawn
from the target model's distribution given exactly the tokens before it:

- greedy rows: the longest prefix of proposals equal to the argmax chain, plus one token;
- sampled rows: this is the standard rejection rule for a proposer that puts all its mass on one
  token `d` (the n-gram proposer does): accepting with probability min(1, p(d) / q(d)) = p(d) and
  otherwise drawing from the residual max(0, p - q) normalised (= p without `d`) emits `y` with
  probability p(y) for every `y`, which is what "draw y ~ p, keep the run going iff y == d"
  does. With the same keys as a plain decode, a seeded request even draws the same tokens.

Proposals never enter the prefix cache or a sequence's tokens before they are accepted; the
K/V the step wrote for rejected ones sits in slots past the sequence's end and is overwritten
when those positions are computed for real. Nothing here touches JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jengine.config import SpeculativeConfig

# The pauses below are short since a verification got cheap (session 21: a 16-row step ~1.4x a
# decode on the AMX Xeon, from ~1.6x): each step a copying sequence waits is a plain decode
# where a verification might have yielded several tokens. Edit prompts, one stream, k = 15 with
# ngram_min 2, one run (experiments/spec_pauses.py; docs/engine.md): 1.68x plain decoding's
# tokens/s with the pauses before (found nothing 4, turned down 4, step declined 6, backoff 16),
# 1.75x with these.
# A sequence that saw this many verifications in a row accept nothing pauses speculation for
# `BACKOFF_STEPS` steps (a plain decode each), so text the proposer cannot predict costs little.
MISSES_BEFORE_BACKOFF = 4
BACKOFF_STEPS = 4
# A sequence whose proposal the cost model left out waits this many steps before it proposes
# again. A waiting sequence lets the engine schedule its next step before this one's token is
# back (async scheduling), which a proposing one cannot.
NO_PROPOSAL_PAUSE = 2
# A sequence whose proposer found nothing proposes again the next step: copied text comes back a
# token or two after an edit.
# When the cost model turns every proposal of a step down, nobody proposes for this many steps
# (so the engine keeps running ahead), then it weighs the batch again.
DECLINED_PAUSE = 2
# Acceptance estimates (the chance that a proposed token is accepted, after the ones before it
# were) start here. An n-gram proposal's estimate is the engine's for its match length
# (`AcceptanceByMatch`, following every verification with `MATCH_WEIGHT`): the longer the
# match, the likelier a copy (learned on spec_bench's edit prompts, bf16: ~0.3 for the first
# token after a 1-token match, 0.5-0.8 after 2, 0.65-0.95 after 3-4; docs/engine.md). A draft
# model's is its sequence's own, following that sequence's verifications with
# `ACCEPTANCE_WEIGHT`. A sequence left out for `REEXPLORE_STEPS` steps by the cost model gets
# the prior back, and each step the cost model turns down moves its match lengths' estimates
# 1/REEXPLORE_STEPS of the way back to the prior, so a change in the text can turn speculation
# on again.
ACCEPTANCE_PRIOR = 0.6
ACCEPTANCE_WEIGHT = 0.3
MATCH_WEIGHT = 0.1
REEXPLORE_STEPS = 32
# The most tokens a step may propose: a verification's 1 + k rows must stay a decode-sized block
# for the native CPU attention kernel (at most 16 rows: each row alone, as its decode runs), or
# its rows would take the prefill paths' rounding and greedy text could change.
MAX_PROPOSAL = 15


def match_reach(n: int) -> int:
    """The most tokens a match of the last `n` tokens proposes: 3, 7, 15, ... (2^(n+1) - 1).

    The longer the match, the longer the copy it predicts, while a short one is often a
    coincidence whose long proposal would only cost a larger verification. Replaying plain
    decoding's bf16 greedy text of spec_bench's edit prompts with this engine's step costs
    (docs/engine.md, session 21): 1.68-1.71x at 15 tokens after every match (1.71x after 2+
    token matches only), 1.78-1.80x with this reach."""
    return 2 ** (n + 1) - 1


def check_num_tokens(num_tokens: int) -> None:
    """Raises `ValueError` unless 1 <= num_tokens <= `MAX_PROPOSAL`."""
    if not 1 <= num_tokens <= MAX_PROPOSAL:
        raise ValueError(f"num_speculative_tokens must be in 1..{MAX_PROPOSAL}, got {num_tokens}")


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A sequence's proposed next tokens ([] for none), and the length of the suffix match the
    n-gram proposer found them after (0: a draft model's, or none)."""

    tokens: list[int]
    match: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last `n` tokens (n from `ngram_max` down to `ngram_min`), in its own prompt and output."""

    num_tokens: int
    ngram_min: int = 1
    ngram_max: int = 4
    drafts: ClassVar[bool] = False  # a host lookup: nothing to weigh before it runs

    def __post_init__(self):
        check_num_tokens(self.num_tokens)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    def propose_many(self, requests: list[tuple[list[int], int]]) -> list[Proposal]:
        """Each (tokens, limit)'s proposal (`lookup`)."""
        return [self.lookup(tokens, limit) for tokens, limit in requests]

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """`lookup`'s tokens."""
        return self.lookup(tokens, limit).tokens

    def lookup(self, tokens: list[int], limit: int) -> Proposal:
        """Up to `min(num_tokens, limit)` proposed next tokens of `tokens`, and at most
        `match_reach(n)` after a match of n tokens (n in the proposal)."""
        k = min(self.num_tokens, limit)
        if k <= 0 or len(tokens) <= self.ngram_min:
            return Proposal([])
        ids = np.asarray(tokens, np.int64)
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            # Windows that start before the suffix itself and have a token after them.
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence predicts best when copying
                return Proposal(ids[start:start + min(k, match_reach(n))].tolist(), n)
        return Proposal([])


def make_proposer(spec: SpeculativeConfig) -> NgramProposer | None:
    """The model-free proposer `spec` asks for (None: speculation off). A draft model
    (`draft`) is an engine core of its own, built by `jengine.core.draft.proposer_for`.

    Raises:
      ValueError: an unknown method, or `draft` (not a host-side proposer).
    """
    if spec.method is None:
        return None
    if spec.method == "draft":
        raise ValueError("speculative 'draft' runs a draft model: "
                         "jengine.core.draft.proposer_for builds it")
    if spec.method != "ngram":
        raise ValueError(f"unknown speculative method {spec.method!r}; use 'ngram' or 'draft'")
    return NgramProposer(num_tokens=spec.proposal_tokens(), ngram_min=spec.ngram_min,
                         ngram_max=spec.ngram_max)


@dataclasses.dataclass
class SpecState:
    """One sequence's speculation state (on `Sequence.spec`).

    Attributes:
      proposal: the tokens proposed for the step now scheduled ([] when it does not speculate).
      match: the length of the suffix match `proposal` came from (0: a draft model's).
      misses: verifications in a row that accepted nothing.
      paused: steps left before the sequence proposes again (after `MISSES_BEFORE_BACKOFF`).
    """

    proposal: list[int] = dataclasses.field(default_factory=list)
    match: int = 0
    misses: int = 0
    paused: int = 0
    acceptance: float = ACCEPTANCE_PRIOR  # a draft model's proposals' (AcceptanceByMatch: n-gram)
    declined: int = 0  # steps in a row the cost model chose not to verify its proposal

    def may_propose(self) -> bool:
        return self.paused == 0

    def tick(self) -> None:
        """One step of the sequence went by."""
        self.paused = max(0, self.paused - 1)

    def verified(self, accepted: int) -> None:
        """Records how many of `proposal` the step accepted, and clears it."""
        if not self.match:  # a draft model's (n-gram proposals are `AcceptanceByMatch`'s)
            self.acceptance += ACCEPTANCE_WEIGHT * (run_rate(len(self.proposal), accepted)
                                                    - self.acceptance)
        self.proposal, self.match, self.declined = [], 0, 0
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= MISSES_BEFORE_BACKOFF:
            self.misses, self.paused = 0, BACKOFF_STEPS

    def decline(self) -> None:
        """The cost model left this proposal out; after a while the estimate starts over."""
        self.proposal, self.match = [], 0
        self.declined += 1
        self.paused = NO_PROPOSAL_PAUSE
        if self.declined * NO_PROPOSAL_PAUSE >= REEXPLORE_STEPS:
            self.declined, self.acceptance = 0, ACCEPTANCE_PRIOR


def run_rate(proposed: int, accepted: int) -> float:
    """Per-token acceptance seen in one verification: tokens after the first rejection were
    never tried, so the run of `accepted` successes and one failure (if any) is the sample."""
    return accepted / max(min(proposed, accepted + 1), 1)


class AcceptanceByMatch:
    """The engine's acceptance curves per n-gram match length, from every sequence's
    verifications: entry j is the chance that proposed token j is accepted once the ones before
    it were. A curve, not one rate, since a copy, once under way, tends to go on (after 3-4
    matched tokens the later positions are accepted more often than the first), and per match
    length, since the match predicts a copy far better than a sequence's recent average, which
    cut the long proposals of long matches short."""

    def __init__(self):
        self._curves: dict[int, list[float]] = {}  # positions tried so far only

    def curve(self, match: int) -> list[float]:
        """[MAX_PROPOSAL] acceptance chances of positions 0, 1, ... after a `match`-token match.
        A position never tried takes the last tried one's (the copy goes on), so that a cap
        the cost model chose once is not kept only because what lies past it is unknown."""
        tried = self._curves.get(match) or [ACCEPTANCE_PRIOR]
        return tried + tried[-1:] * (MAX_PROPOSAL - len(tried))

    def observe(self, match: int, proposed: int, accepted: int) -> None:
        """One verification: positions before `accepted` were accepted, the one at it (if
        proposed) rejected, the rest never tried."""
        curve = self._curves.setdefault(match, [])
        for j in range(min(proposed, accepted + 1)):
            if j == len(curve):
                curve.append(curve[-1] if curve else ACCEPTANCE_PRIOR)
            curve[j] += MATCH_WEIGHT * ((j < accepted) - curve[j])

    def declined(self, match: int) -> None:
        """The cost model turned a step's proposals of this match length down: the curve
        drifts back toward the prior, so that they are tried again some time."""
        curve = self._curves.get(match, [])
        for j, rate in enumerate(curve):
            curve[j] = rate + (ACCEPTANCE_PRIOR - rate) / REEXPLORE_STEPS


def expected_tokens(length: int, acceptance: float | list[float]) -> float:
    """Tokens a verification of `length` proposals yields on average (the bonus token
    included): proposal j is accepted with probability `acceptance[j]` (or `acceptance` for
    every j) once those before it were, and the first rejection ends the run."""
    rates = acceptance[:length] if isinstance(acceptance, list) else [acceptance] * length
    total, alive = 1.0, 1.0
    for rate in rates:
        alive *= rate
        total += alive
    return total


class StepCosts:
    """Measured seconds of a step per token bucket (the median of its last `WINDOW` steps), so
    the scheduler can weigh the tokens a verification may gain against what its larger step
    costs here: on XLA:CPU a step of 4 query tokens costs well over a step of 1 (small-row dots
    run far below memory speed), on an accelerator about the same. A median, since a shared
    machine's stalls are single steps two or three times as long: an average (weight 0.2) took
    one such 8-token step to 2x a 16-token one and turned the proposals it should run down."""

    WINDOW = 9

    def __init__(self, bucket_of):
        self._bucket_of = bucket_of  # num_tokens -> the token bucket that runs them
        self._runs: dict[int, collections.deque[float]] = {}
        self._seconds: dict[int, float] = {}  # each bucket's median
        self._seen: set[int] = set()
        self._gaps: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.gap: float | None = None  # host seconds between steps run one after the other
        self._proposing: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.proposing: float | None = None  # seconds of a proposer's round (a draft model's)
        self._round = 0.0  # the last round's seconds, until the gap they fell in is observed

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Records one step. A bucket's first step is not counted: it may have built (compiled
        or loaded) its program."""
        t = self._bucket_of(num_tokens)
        if t not in self._seen:
            self._seen.add(t)
            return
        runs = self._runs.setdefault(t, collections.deque(maxlen=self.WINDOW))
        runs.append(seconds)
        self._seconds[t] = statistics.median(runs)

    def observe_gap(self, seconds: float) -> None:
        """Records the host's time between one step's outputs and the next launch when they
        did not overlap (nothing ran on the device meanwhile), less the proposer's round in
        it, which `proposing` has: what a verifying step pays on top, since it cannot run
        ahead."""
        self._gaps.append(seconds - self._round)
        self._round = 0.0
        self.gap = statistics.median(self._gaps)

    def observe_proposing(self, seconds: float) -> None:
        """Records one round of the proposer, run before the next launch: a verifying step
        waits for it too. (A proposing step is launched after the previous one's outputs, so
        the gap it falls in is observed.)"""
        self._proposing.append(seconds)
        self.proposing = statistics.median(self._proposing)
        self._round = seconds

    def estimate(self, num_tokens: int) -> float | None:
        """Seconds of a step of `num_tokens`: its bucket's, never more than a larger bucket's;
        an unmeasured bucket is taken to cost what the nearest measured smaller one does
        (optimism, so it gets tried and measured), or with none, the least of the larger ones.
        None before any measurement."""
        t = self._bucket_of(num_tokens)
        if not self._seconds:
            return None
        smaller = [b for b in self._seconds if b <= t]
        # Nor more than a larger bucket: a bucket seldom run keeps the figures of its first,
        # slow runs (its program and buffers cold) long after the busy ones came down. With
        # only larger ones measured, theirs is the bound: a sequence that verified every step
        # (a draft model's) never measured the plain step its proposals must beat.
        larger = [s for b, s in self._seconds.items() if b > t]
        return min(([self._seconds[max(smaller)]] if smaller else []) + larger)


def best_cap(base_tokens: int, base_rows: int,
             proposals: list[tuple[int, float | list[float]]], costs: StepCosts | None) -> int:
    """How many proposed tokens each verifying sequence may run this step (0: none), chosen to
    maximise expected tokens per second of step time. `proposals`: (length, acceptance: a rate
    or a curve, as `expected_tokens` takes) of each candidate; `base_tokens` / `base_rows`: the
    step's query tokens and sampled sequences without speculation. Without cost figures every
    proposal runs whole."""
    longest = max((n for n, _ in proposals), default=0)
    if costs is None or costs.estimate(base_tokens) is None:
        return longest
    base = costs.estimate(base_tokens)
    best, best_rate = 0, base_rows / base
    for cap in range(1, longest + 1):
        extra = sum(min(n, cap) for n, _ in proposals)
        gain = sum(expected_tokens(min(n, cap), a) - 1 for n, a in proposals)
        seconds = costs.estimate(base_tokens + extra)
        if seconds is not None:
            # A verifying step waits for the host and for its proposals.
            seconds += (costs.gap or 0.0) + (costs.proposing or 0.0)
        if seconds is not None and (base_rows + gain) / seconds > best_rate:
            best, best_rate = cap, (base_rows + gain) / seconds
    return best


def num_accepted(proposal: list[int], drawn: np.ndarray) -> int:
    """How many proposals the drawn tokens confirm: `drawn[j]` (row j's token) must equal
    `proposal[j]` for every j before the count. `drawn` has len(proposal) + 1 entries."""
    n = 0
    while n < len(proposal) and int(drawn[n]) == proposal[n]:
        n += 1
    return n


@dataclasses.dataclass
class SpecCounters:
    """Speculation since start-up: verifications, tokens proposed, tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
