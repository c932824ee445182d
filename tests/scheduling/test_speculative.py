"""Speculative decoding: the n-gram proposer, the scheduler's verification bookkeeping (fake
runner, tests/scheduler_harness.py), and the real engine's outputs with and without it."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from kv_pool import small_kv_pool
from scheduler_harness import (
    EOS,
    Harness,
    OracleProposer,
    check_against_solo,
    params,
    prompt_of,
)
from verify_all import verifying_everything  # tests/verify_all.py

from jengine.scheduling.speculative import (
    ACCEPTANCE_PRIOR,
    MAX_PROPOSAL,
    REEXPLORE_STEPS,
    AcceptanceByMatch,
    NgramProposer,
    Proposal,
    StepCosts,
    best_cap,
    expected_tokens,
    num_accepted,
)

# -- the proposer ---------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(num_tokens=3, ngram_min=1, ngram_max=3)
    # The suffix [5, 6] occurs at 1 (followed by 7 8 9) and at 6 (followed by 1 2 3): latest wins.
    assert p.propose([4, 5, 6, 7, 8, 9, 5, 6, 1, 2, 3, 0, 5, 6], limit=10) == [1, 2, 3]
    # Longer matches are tried first: [0, 5, 6] beats the later [5, 6] alone.
    assert p.propose([0, 5, 6, 9, 9, 5, 6, 1, 0, 5, 6], limit=10) == [9, 9, 5]
    assert p.propose([1, 2, 3, 1, 2], limit=10) == [3, 1, 2]
    assert p.propose([1, 2, 3, 1, 2], limit=1) == [3]
    assert p.propose([1, 2, 3, 4], limit=10) == []  # nothing repeats
    assert p.propose([7], limit=10) == []
    assert p.propose([1, 2, 1, 2], limit=0) == []
    # At the end of the text: only the tokens there are.
    assert p.propose([3, 1, 2, 3], limit=10) == [1, 2, 3]


def test_a_longer_match_reaches_further():
    """A match of n tokens proposes at most 2^(n+1) - 1 (3, 7, 15): a one-token match is often
    a coincidence, a long one a copy."""
    p = NgramProposer(num_tokens=15, ngram_min=1, ngram_max=4)
    text = list(range(100, 130))
    assert p.propose([*text, 7, 100], limit=20) == text[1:4]  # [100]: 1 token matched
    assert p.propose([*text, 7, 100, 101], limit=20) == text[2:9]  # 2 tokens
    assert p.propose([*text, 7, 100, 101, 102], limit=20) == text[3:18]  # 3: all 15
    assert p.propose([*text, 7, 100, 101, 102], limit=4) == text[3:7]  # the limit still holds


def test_a_proposal_carries_its_match_length():
    p = NgramProposer(num_tokens=15, ngram_min=1, ngram_max=4)
    text = list(range(100, 130))
    assert p.lookup([*text, 7, 100, 101], limit=20) == Proposal(text[2:9], 2)
    assert p.lookup([*text, 7, 1], limit=20) == Proposal([], 0)


def test_acceptance_is_learned_per_match_length_and_position():
    """Each match length has its own curve: position j learns from the verifications that tried
    it (accepted, or the first rejection); declines drift the curve back to the prior."""
    est = AcceptanceByMatch()
    assert est.curve(1) == est.curve(4) == [ACCEPTANCE_PRIOR] * MAX_PROPOSAL
    for _ in range(60):
        est.observe(1, proposed=3, accepted=0)  # 1-token matches: rejected at once
        est.observe(4, proposed=15, accepted=15)  # 4-token matches: copies
    assert max(est.curve(1)) < 0.01  # positions never tried take the last tried one's
    assert min(est.curve(4)) > 0.99
    est.observe(2, proposed=7, accepted=2)  # positions 0, 1 accepted, 2 rejected, 3-6 untried
    w = 0.1  # MATCH_WEIGHT
    # A position tried for the first time starts from the one before it.
    p0 = ACCEPTANCE_PRIOR + w * (1 - ACCEPTANCE_PRIOR)
    p1 = p0 + w * (1 - p0)
    p2 = p1 * (1 - w)
    assert est.curve(2) == pytest.approx([p0, p1] + [p2] * 13)
    before = est.curve(2)
    est.observe(2, proposed=7, accepted=7)  # all accepted: each of positions 0-6 goes up
    after = est.curve(2)
    assert all(a > b for a, b in zip(after[:7], before[:7]))
    assert after[7:] == [after[6]] * 8
    low = est.curve(1)[0]
    for _ in range(REEXPLORE_STEPS):
        est.declined(1)
    assert ACCEPTANCE_PRIOR / 2 < est.curve(1)[0] < ACCEPTANCE_PRIOR and low < est.curve(1)[0]
    # Expected tokens follow the curve: a copy under way goes on.
    assert expected_tokens(3, [0.5, 1.0, 1.0]) == pytest.approx(1 + 0.5 * 3)
    assert expected_tokens(2, 0.5) == expected_tokens(2, [0.5, 0.5, 0.1]) == pytest.approx(1.75)


def test_ngram_min_bounds_the_match():
    p = NgramProposer(num_tokens=2, ngram_min=2, ngram_max=2)
    assert p.propose([1, 9, 3, 1], limit=5) == []  # only a 1-gram matches
    assert p.propose([1, 9, 3, 1, 9], limit=5) == [3, 1]


@pytest.mark.parametrize("bad", [dict(num_tokens=0), dict(num_tokens=16),
                                 dict(num_tokens=2, ngram_min=0),
                                 dict(num_tokens=2, ngram_min=3, ngram_max=2)])
def test_ngram_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        NgramProposer(**bad)


def test_num_accepted_is_the_matching_prefix():
    assert num_accepted([4, 5, 6], np.array([4, 5, 6, 7])) == 3
    assert num_accepted([4, 5, 6], np.array([4, 9, 6, 7])) == 1
    assert num_accepted([4, 5, 6], np.array([1, 5, 6, 7])) == 0


def test_cost_model_verifies_only_where_it_pays():
    buckets = (1, 2, 4, 8)
    costs = StepCosts(lambda n: next(b for b in buckets if b >= n))
    assert best_cap(1, 1, [(3, 0.9)], costs) == 3  # nothing measured: verify everything
    only_big = StepCosts(costs._bucket_of)
    for _ in range(2):
        only_big.observe(4, 0.060)
    assert only_big.estimate(1) == pytest.approx(0.060)  # a plain step costs no more
    for t, seconds in ((1, 0.050), (1, 0.050), (4, 0.9), (4, 0.060), (8, 0.150), (8, 0.150)):
        costs.observe(t, seconds)  # the first of each bucket (a compile, 0.9 s) is not counted
    assert costs.estimate(3) == pytest.approx(0.060)
    assert costs.estimate(2) == pytest.approx(0.050)  # unmeasured: the smaller one's
    assert best_cap(1, 1, [(3, 0.9)], costs) == 3  # 3.4 tokens for 1.2x the time
    assert best_cap(1, 1, [(3, 0.05)], costs) == 1  # a 2-token step costs no more; 4: 1.2x
    assert best_cap(1, 1, [(7, 0.9)], costs) == 3  # 8 tokens for 3x: 3.4 for 1.2x is better
    # Where 8 tokens cost 1.6x, a long match's estimate verifies all 7, a short one's 1.
    cheap = StepCosts(costs._bucket_of)
    for t, seconds in ((1, 0.050), (1, 0.050), (4, 0.060), (4, 0.060), (8, 0.080), (8, 0.080)):
        cheap.observe(t, seconds)
    assert best_cap(1, 1, [(7, 0.99)], cheap) == 7  # 7.7 tokens for 1.6x
    assert best_cap(1, 1, [(7, 0.3)], cheap) == 1
    # A curve: after a shaky first token a copy goes on, which a rate of 0.5 would not see.
    assert best_cap(1, 1, [(7, 0.5)], cheap) == 3
    assert best_cap(1, 1, [(7, [0.5] + [1.0] * 14)], cheap) == 7
    cheap.observe(2, 0.300)
    cheap.observe(2, 0.300)  # a seldom bucket's slow runs: no dearer than a larger one
    assert cheap.estimate(2) == pytest.approx(0.060)
    for seconds in (0.080, 0.080, 0.500):  # one stalled step: the median holds
        cheap.observe(8, seconds)
    assert cheap.estimate(8) == pytest.approx(0.080)
    assert best_cap(2, 2, [(3, 0.05), (1, 0.05)], costs) == 0  # two sequences: the estimates
    assert best_cap(4, 4, [(3, 0.9)], costs) == 0  # 5-8 tokens cost 2.5x for at most 1.6x more
    assert best_cap(5, 5, [(3, 0.9)], costs) == 3  # already in the 8-token bucket: free
    assert expected_tokens(0, 0.5) == 1 and expected_tokens(2, 0.5) == pytest.approx(1.75)


def test_a_proposers_round_is_kept_out_of_the_host_gap():
    """A draft model's round runs between two steps: `proposing` has it, and the gap it fell
    in is recorded without it (the verification pays it through `proposing`, not twice)."""
    costs = StepCosts(lambda n: n)
    costs.observe_proposing(0.030)
    costs.observe_gap(0.031)
    costs.observe_gap(0.002)  # no round before this launch
    assert costs.proposing == pytest.approx(0.030)
    assert sorted(costs._gaps) == pytest.approx([0.001, 0.002])


# -- the scheduler, with a fake model -------------------------------------------------------------


def _cached_pages_hold_their_tokens(h: Harness) -> None:
    """Every page in the prefix cache holds, in the fake KV cache, exactly the tokens its key
    says: no proposal the model rejected was ever cached."""
    ps = h.allocator.page_size
    for node in h.cache._iter_nodes():
        for key, page in zip(node.keys, node.pages):
            slots = page * ps + np.arange(ps)
            assert h.runner.tokens[slots].tolist() == list(key)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("num_pages", [200, 13])  # 13: preemption by recompute
def test_verification_leaves_every_output_unchanged(prefix_caching, num_pages):
    proposer = OracleProposer(num_tokens=3)
    kw = dict(page_size=4, max_num_seqs=16, max_num_batched_tokens=32, max_model_len=40)
    h = Harness(num_pages=num_pages, proposer=proposer, prefix_caching=prefix_caching, **kw)
    specs = {}
    for i in range(8):
        prompt = prompt_of(4 + 2 * i, salt=i % 3)
        p = params(max_tokens=[1, 2, 7, 12, 16, 20][i] if i < 6 else None,
                   n=2 if i == 3 else 1, ignore_eos=i != 5)
        specs[f"r{i}"] = (prompt, p, 0)
        h.add(f"r{i}", prompt, p, 0)

    def on_step(_):
        h.check_pages()
        for seq in h.scheduler.running:  # pages that only rejected proposals needed are gone
            assert len(seq.pages) <= h.allocator.pages_for(seq.num_tokens)
        if prefix_caching:
            _cached_pages_hold_their_tokens(h)

    h.run(on_step=on_step)
    check_against_solo(h, specs, **kw)
    if num_pages < 200:
        assert h.scheduler.num_preemptions > 0
    c = h.scheduler.spec_counters
    assert c.num_drafts > 10 and 0 < c.num_accepted_tokens < c.num_draft_tokens
    spans = collections.Counter(len(b.spec_lens.nonzero()[0]) for b in h.batches
                                if b.spec_lens is not None)
    assert max(spans) > 1  # several sequences verified in one step


def test_speculation_stays_within_the_budgets():
    """Proposals use only the tokens and rows the decodes and prefills left: a full batch of
    decodes gets none, and a prefill is never pushed out by them."""
    h = Harness(proposer=OracleProposer(num_tokens=4), max_num_seqs=4,
                max_num_batched_tokens=8, page_size=4, max_model_len=64)
    for i in range(4):
        h.add(f"r{i}", prompt_of(6, salt=i), params(max_tokens=12, ignore_eos=True))
    h.run()  # the harness checks rows <= max_num_seqs and tokens <= the budget every step
    full = [b for b in h.batches if b.num_seqs == 4]
    assert full and all(b.spec_lens is None for b in full)
    assert any(b.spec_lens is not None for b in h.batches)  # the stragglers speculate


def test_a_draft_model_is_asked_about_before_it_drafts():
    """A proposer whose rounds cost model steps (a draft model) drafts only while the cost
    model says a verification may pay with the rounds' measured seconds counted in; once they
    cost more than verifying can gain, it is not run at all, and outputs stay the solo ones."""
    proposer = OracleProposer(num_tokens=3)
    proposer.drafts = True
    h = Harness(proposer=proposer, page_size=4, max_model_len=64)
    costs = StepCosts(lambda n: next(b for b in (1, 2, 4, 8, 16) if b >= n))
    for t in (1, 1, 4, 4):
        costs.observe(t, 0.010)  # verifying 3 costs what a decode does
    h.scheduler.speculator.step_costs = costs
    specs = {f"r{i}": (prompt_of(6, salt=i), params(max_tokens=20, ignore_eos=True), 0)
             for i in range(2)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    for _ in range(3):
        h.step()
    assert proposer.proposed  # no figure for a round yet, then cheap rounds: it drafts
    for _ in range(StepCosts.WINDOW):
        costs.observe_proposing(1.0)  # rounds now cost 100 steps
    drafted = len(proposer.proposed)
    h.run()
    assert len(proposer.proposed) == drafted
    check_against_solo(h, specs, page_size=4, max_model_len=64)


def test_eos_and_length_inside_an_accepted_run():
    """A stop token or max_tokens reached among the accepted tokens ends the sequence there."""
    proposer = OracleProposer(num_tokens=4)
    proposer.rng = np.random.default_rng(1)
    kw = dict(page_size=4, max_model_len=64)
    h = Harness(proposer=proposer, **kw)
    specs = {}
    for i in range(12):
        prompt = prompt_of(4 + i, salt=i)
        p = params(max_tokens=3 + i % 5, stop_token_ids=[7, 11] if i % 3 else None)
        specs[f"r{i}"] = (prompt, p, 0)
        h.add(f"r{i}", prompt, p, 0)
    h.run()
    check_against_solo(h, specs, **kw)
    reasons = {h.result(r)[0][1] for r in specs}
    assert reasons == {"stop", "length"}
    assert EOS == 0


# -- the real engine ------------------------------------------------------------------------------

REPETITIVE = [
    "Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
]
FREE = ["Tell me about the moon.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def spec_engine():
    """The test preset with n-gram speculation (the step programs are smol_engine's), verifying
    every proposal."""
    from jengine import Engine

    return verifying_everything(
        Engine(config="test", speculative="ngram", num_speculative_tokens=3, progress=False))


def _fields(out):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_engine_greedy_is_unchanged_by_speculation(smol_engine, spec_engine):
    from jengine import SamplingParams

    cases = [(p, SamplingParams(max_tokens=40, temperature=0)) for p in REPETITIVE + FREE]
    cases += [
        (REPETITIVE[1], SamplingParams(max_tokens=40, temperature=0, stop=["mat. The"])),
        (REPETITIVE[0], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[28])),
        (REPETITIVE[2], SamplingParams(max_tokens=5, temperature=0, logprobs=2)),
    ]
    prompts = [p for p, _ in cases]
    sps = [sp for _, sp in cases]
    want = smol_engine.generate(prompts, sps)
    before = spec_engine.stats()
    with small_kv_pool(spec_engine.core, 8):  # 7 usable pages for 9 requests of up to 4: preempts
        got = spec_engine.generate(prompts, sps)
    for g, w in zip(got, want):
        assert _fields(g) == _fields(w)
    logprobs = got[-1].outputs[0].logprobs
    for g, w in zip(logprobs, want[-1].outputs[0].logprobs):
        assert g.keys() == w.keys()
        for t in g:
            assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4)
    after = spec_engine.stats()
    assert after.num_preemptions > before.num_preemptions
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert 0 < accepted < drafted
    assert spec_engine.core.allocator.num_used - spec_engine.core.allocator.num_evictable == 0


def test_engine_seeded_sampling_is_unchanged_by_speculation(smol_engine, spec_engine):
    """Each row draws with its own output index's key, so a seeded request samples the same
    tokens with speculation as without."""
    from jengine import SamplingParams

    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, n=3)
    want = smol_engine.generate([REPETITIVE[1]], sp)
    got = spec_engine.generate([REPETITIVE[1]], sp)
    assert _fields(got[0]) == _fields(want[0])


@pytest.mark.slow  # a statistical check, ~20 s; greedy speculation stays in CI
def test_engine_sampled_distribution_matches_the_model(smol_engine, spec_engine):
    """Two-sample chi-square test (significance 0.001) of the first three sampled tokens, with
    and without speculation, over disjoint seeds: equal distributions pass."""
    from scipy.stats import chi2_contingency

    from jengine import SamplingParams

    prompt = "a b c a b c a b c a b"
    n = 120

    def draws(engine, first_seed, one_by_one):
        # Requests of 4 samples (4 x 4 rows fill the 16-row test preset, so all may speculate
        # when they run one at a time), seeds never reused.
        sps = [SamplingParams(max_tokens=3, temperature=0.6, n=4, seed=first_seed + 4 * i)
               for i in range(n // 4)]
        outs = ([engine.generate(prompt, sp)[0] for sp in sps] if one_by_one
                else engine.generate([prompt] * len(sps), sps))
        return collections.Counter(tuple(c.token_ids) for o in outs for c in o.outputs)

    before = spec_engine.stats()
    a = draws(spec_engine, 0, one_by_one=True)
    after = spec_engine.stats()
    b = draws(smol_engine, 1_000_003, one_by_one=False)
    assert after.spec_num_drafts - before.spec_num_drafts > n // 2
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 0
    common = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    table = [[a[k] for k in common] + [n - sum(a[k] for k in common)],
             [b[k] for k in common] + [n - sum(b[k] for k in common)]]
    assert len(common) >= 2
    p_value = chi2_contingency(np.asarray(table) + 0.5).pvalue
    assert p_value > 1e-3, (table, p_value)
