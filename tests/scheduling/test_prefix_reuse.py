"""Tests for jengine.scheduling.prefix_reuse: the prefix cache under the scheduler, with the fake
runner of `tests/scheduler_harness.py` (no JAX), where a wrong or stale cached page changes the fake
model's output; then a random stress test, sync and async."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
from scheduler_harness import (
    VOCAB,
    Harness,
    check_against_solo,
    params,
    prompt_of,
    rows,
    solo_result,
    solo_tokens,
)

from jengine.scheduling.sequence import PENDING, SequenceStatus

PS = 4  # page size of the unit tests


def cached_harness(**kw) -> Harness:
    return Harness(prefix_caching=True, **kw)


def check_root_paths(h: Harness) -> None:
    """The cache's invariant: each live sequence's computed full pages are the tree's pages for
    its tokens up to `own_pages_from`, and its own, uncached, from there; so a page only the
    cache holds has no held page below it (checked over the whole tree)."""
    ps = h.allocator.page_size
    for seq in h.live_seqs():
        full = seq.num_computed // ps
        tokens = seq.tokens(0, full * ps)
        if PENDING in tokens:
            continue
        tree = [p for node, n in h.cache._walk(tokens, full) for p in node.pages[:n]]
        shared = full if seq.own_pages_from is None else seq.own_pages_from
        assert seq.pages[:shared] == tree[:shared], f"sequence {seq.seq_id} is off its path"
        assert seq.num_cached_pages <= full
        assert not any(h.allocator.is_cached(p) for p in seq.pages[shared:])
    stack = [(child, False) for child in h.cache._root.children.values()]
    while stack:
        node, above_unheld = stack.pop()
        for p in node.pages:
            held = h.allocator.refcount(p) > 1
            assert not (held and above_unheld), f"held page {p} below a page only the tree holds"
            above_unheld = above_unheld or not held
        stack += [(child, above_unheld) for child in node.children.values()]


def test_a_shared_prefix_is_computed_once_and_the_outputs_stay_the_same():
    h = cached_harness(page_size=PS, max_model_len=64)
    system = prompt_of(13)
    p = params(max_tokens=6, ignore_eos=True)
    h.add("a", system + [5, 6], p, seed=1)
    h.run()
    h.add("b", system + [7, 8, 9], p, seed=2)
    batch = h.step()
    # 15 tokens: 3 whole pages (12 tokens) come from the cache, 6 tokens are computed.
    assert int(batch.positions[0]) == 12 and batch.num_tokens == 4
    h.run()
    for rid, prompt, seed in [("a", system + [5, 6], 1), ("b", system + [7, 8, 9], 2)]:
        assert h.result(rid) == solo_result(rid, prompt, p, seed, page_size=PS, max_model_len=64)
    b, = h.requests["b"]
    assert b.num_cached_tokens == 12
    stats = h.cache.stats
    assert stats.queries == 2 and stats.hit_tokens == 12 and stats.query_tokens == 15 + 16
    h.check_pages()
    check_root_paths(h)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    h = cached_harness(page_size=PS, max_model_len=64)
    prompt = prompt_of(12)  # exactly 3 pages
    p = params(max_tokens=3, ignore_eos=True)
    h.add("a", prompt, p)
    h.run()
    h.add("b", prompt, p)
    batch = h.step()
    assert int(batch.positions[0]) == 8 and batch.num_tokens == 4  # the last page again
    h.run()
    assert h.result("b") == h.result("a")


def test_a_seeded_prompts_last_page_is_computed_in_a_step_of_its_own():
    """Cold, a seeded prompt's full pages come first and its last page in a step of its own, as
    a warm cache leaves it: so its rows meet the same kernels either way (`chunk_limit`).
    Unseeded prompts keep one chunk."""
    h = cached_harness(page_size=PS, max_model_len=64)
    p = params(max_tokens=2, ignore_eos=True, seed=5)
    for salt, (rid, n, cold) in enumerate((("a", 14, [(0, 12), (12, 2)]),
                                           ("b", 12, [(0, 8), (8, 4)]), ("c", 4, [(0, 4)]))):
        h.add(rid, prompt_of(n, salt), p)
        steps = [h.step() for _ in cold]
        assert [(int(b.positions[0]), b.num_tokens) for b in steps] == cold, rid
        h.run()
        h.add(rid + "'", prompt_of(n, salt), p)
        warm = h.step()
        assert (int(warm.positions[0]), warm.num_tokens) == cold[-1], rid
        h.run()
        assert h.result(rid + "'") == h.result(rid)
    off = Harness(prefix_caching=False, page_size=PS, max_model_len=64)
    off.add("a", prompt_of(14), p)
    assert off.step().num_tokens == 14  # no cache, nothing to match: one chunk
    h.add("u", prompt_of(14, 9), params(max_tokens=2, ignore_eos=True))
    assert h.step().num_tokens == 14  # no seed: one chunk


def test_a_generated_reply_is_reused_by_the_next_turn():
    h = cached_harness(page_size=PS, max_model_len=64)
    turn1 = prompt_of(10)
    h.add("t1", turn1, params(max_tokens=9, ignore_eos=True))
    h.run()
    reply = h.requests["t1"][0].output_ids
    turn2 = turn1 + reply + [3, 4, 5]
    h.add("t2", turn2, params(max_tokens=4, ignore_eos=True))
    h.run()
    # 10 + 9 tokens were computed for turn 1 except the last reply token: 18 -> 4 whole pages.
    assert h.requests["t2"][0].num_cached_tokens == 16
    assert h.result("t2") == solo_result("t2", turn2, params(max_tokens=4, ignore_eos=True), 0,
                                         page_size=PS, max_model_len=64)


def test_prompt_logprobs_requests_compute_every_prompt_token():
    h = cached_harness(page_size=PS, max_model_len=64)
    prompt = prompt_of(10)
    h.add("a", prompt, params(max_tokens=2))
    h.run()
    h.add("b", prompt, params(max_tokens=2, prompt_logprobs=1))
    batch = h.step()
    assert int(batch.positions[0]) == 0 and batch.num_tokens == 10
    h.run()


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    h = cached_harness(page_size=PS, max_model_len=64, max_num_batched_tokens=64)
    prompt = prompt_of(14)
    a, = h.add("a", prompt, params(max_tokens=4, ignore_eos=True))
    b, = h.add("b", prompt, params(max_tokens=4, ignore_eos=True))
    c, = h.add("c", prompt_of(9, 1), params(max_tokens=4, ignore_eos=True))
    assert h.step().seqs == [a, c]  # b waits: a fills the pages it would reuse
    batch = h.step()
    assert (b.seq_id, 12, 2, True) in rows(batch)  # only the last partial page is computed
    assert b.pages[:3] == a.pages[:3] and b.num_cached_tokens == 12
    h.run()
    assert h.result("a") == h.result("b")


def test_pages_computed_twice_stay_each_sequences_own():
    """A later turn sent while the earlier one still decodes: both fill the reply's pages (the
    decoding sequence does not hold the next one back); each reads its own copy to the end,
    and the one that meets the other's copy in the tree caches no page from there."""
    h = cached_harness(page_size=PS, max_model_len=64, max_num_batched_tokens=64)
    turn1 = prompt_of(6)
    t1, = h.add("t1", turn1, params(max_tokens=12, ignore_eos=True))
    h.step()
    turn2 = turn1 + solo_tokens(turn1, 0, 12) + [9]
    t2, = h.add("t2", turn2, params(max_tokens=2, ignore_eos=True))
    pages: dict[str, list[int]] = {}
    own_from: dict[str, int] = {}

    def check(_):
        check_root_paths(h)
        for seq in (t1, t2):
            if seq.pages:  # only ever extended: no page a sequence reads is swapped
                before = pages.setdefault(seq.request_id, list(seq.pages))
                assert seq.pages[:len(before)] == before[:len(seq.pages)]
                pages[seq.request_id] = list(seq.pages)
            if seq.own_pages_from is not None:
                own_from[seq.request_id] = seq.own_pages_from

    h.run(on_step=check)
    assert h.cache.stats.duplicate_pages > 0 and own_from
    assert h.result("t2") == solo_result("t2", turn2, params(max_tokens=2, ignore_eos=True), 0,
                                         page_size=PS, max_model_len=64)


def test_a_preempted_sequence_recomputes_only_its_last_page():
    page_size, max_model_len = 4, 32
    h = cached_harness(num_pages=10, page_size=page_size, max_model_len=max_model_len)
    specs = {f"r{i}": (prompt_of(5 + i, i), params(max_tokens=20, ignore_eos=True), i)
             for i in range(4)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    h.run(on_step=lambda _: check_root_paths(h))
    assert h.scheduler.num_preemptions > 0
    assert h.cache.stats.hit_tokens > 0  # recomputes found their own pages
    for rid, spec in specs.items():
        assert h.result(rid) == solo_result(rid, *spec, page_size=page_size,
                                            max_model_len=max_model_len)


def test_eviction_makes_room_for_new_prompts():
    h = cached_harness(num_pages=9, page_size=PS, max_model_len=32)
    p = params(max_tokens=4, ignore_eos=True)
    for i in range(6):  # each leaves 4-5 pages cached; the pool has 8
        h.add(f"r{i}", prompt_of(14, i), p, seed=i)
        h.run()
        assert h.result(f"r{i}") == solo_result(f"r{i}", prompt_of(14, i), p, i, page_size=PS,
                                                max_model_len=32)
    assert h.cache.stats.evicted_pages > 0
    assert h.allocator.num_used == h.cache.num_pages  # only the cache holds pages now
    cached = h.cache.num_pages
    assert h.cache.clear() == cached and h.allocator.num_free == 8


def test_disabled_cache_reuses_nothing():
    h = Harness(page_size=PS, max_model_len=64)
    h.add("a", prompt_of(13), params(max_tokens=2))
    h.run()
    h.add("b", prompt_of(13), params(max_tokens=2))
    assert int(h.step().positions[0]) == 0
    assert h.allocator.num_evictable == 0


# ------------------------------------------------------------------------------ stress


def step_async(h: Harness, inflight):
    """One engine iteration as `EngineCore` runs it with async scheduling: advance the step in
    flight, schedule and launch the next (its PENDING tokens read from the previous step's
    output, like `Runner.launch(feed=...)`), then finalize the previous step."""
    sched = h.scheduler
    if inflight is None:
        batch = sched.schedule()
        return None if batch is None else (batch, h.runner(batch))
    batch, tokens = inflight
    sampled = sched.advance(batch)
    nxt = sched.schedule()
    new = None
    if nxt is not None:
        row_of = {id(seq): row for seq, row in sampled}
        fed = nxt.token_ids.copy()
        for t in np.flatnonzero(fed == PENDING):
            owner = int(np.searchsorted(nxt.cu_q_lens[1:], t, side="right"))
            fed[t] = tokens[row_of[id(nxt.seqs[owner])]]
        real = nxt.token_ids
        nxt.token_ids = fed
        new = (nxt, h.runner(nxt))
        nxt.token_ids = real
    sched.finalize(sampled, tokens)
    h.check_pages()
    check_root_paths(h)
    return new


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_random_stress_with_a_tiny_pool_matches_uncached_runs(mode):
    """500 requests over a 12-page pool: shared system prompts, multi-turn continuations and
    random prompts; aborts, preemptions, n > 1, constant eviction. Every output equals the
    request run alone without a cache, and at the end every page is free or cached."""
    rng = random.Random(7 if mode == "sync" else 8)
    page_size, max_model_len = 4, 40
    kw = {"page_size": page_size, "max_model_len": max_model_len}
    h = cached_harness(num_pages=12, max_num_seqs=6, max_num_batched_tokens=24, **kw)
    systems = [prompt_of(rng.randint(4, 18), salt) for salt in range(4)]
    specs, history = {}, []
    for i in range(500):
        kind = rng.random()
        if kind < 0.45:
            prompt = rng.choice(systems) + [rng.randrange(1, VOCAB) for _ in range(
                rng.randint(1, 8))]
        elif kind < 0.7 and history:  # a later turn: an earlier prompt + its reply + more
            base = rng.choice(history)
            prompt = base + solo_tokens(base, 0, rng.randint(1, 6)) + [rng.randrange(1, VOCAB)]
        else:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))]
        prompt = prompt[: max_model_len - 2]
        history.append(prompt)
        p = params(
            n=rng.choice([1, 1, 1, 1, 2, 3]),
            max_tokens=rng.randint(1, min(12, max_model_len - len(prompt))),
            ignore_eos=rng.random() < 0.3,
            prompt_logprobs=1 if rng.random() < 0.05 else None,
            seed=rng.choice([None, 11]),  # seeded: the last prompt page in a step of its own
        )
        arrival = i + rng.randint(0, 2)
        abort_at = arrival + rng.randint(0, 20) if rng.random() < 0.1 else None
        specs[f"r{i}"] = (prompt, p, i % 3, arrival, abort_at)

    arrivals, aborts = collections.defaultdict(list), collections.defaultdict(list)
    for rid, (_, _, _, arrival, abort_at) in specs.items():
        arrivals[arrival].append(rid)
        if abort_at is not None:
            aborts[abort_at].append(rid)
    inflight, step = None, 0
    while step <= max(arrivals) or h.scheduler.has_work or inflight is not None:
        for rid in aborts.get(step, ()):
            h.scheduler.abort(rid)
        for rid in arrivals.get(step, ()):
            prompt, p, seed, _, _ = specs[rid]
            h.add(rid, prompt, p, seed)
        if mode == "sync":
            if h.scheduler.has_work:
                h.step()
                check_root_paths(h)
        else:
            inflight = step_async(h, inflight)
        step += 1
        assert step < 50_000

    stats = h.cache.stats
    print(f"{mode}: hit rate {stats.hit_tokens / stats.query_tokens:.2f}, "
          f"{stats.evicted_pages} evicted, "
          f"{stats.duplicate_pages} computed twice, {h.scheduler.num_preemptions} preemptions")
    assert h.scheduler.num_preemptions > 0 and stats.evicted_pages > 0
    assert stats.hit_tokens > 0.2 * stats.query_tokens
    held = [p for p in range(1, h.allocator.num_pages) if h.allocator.refcount(p)]
    assert all(h.allocator.is_cached(p) and h.allocator.refcount(p) == 1 for p in held)
    h.cache.clear()
    assert h.allocator.num_used == 0 and h.allocator.num_free == h.allocator.num_pages - 1
    assert h.cache.num_pages == 0
    assert check_against_solo(h, specs, **kw) > 0
    assert all(s.status is SequenceStatus.FINISHED for seqs in h.requests.values() for s in seqs)
