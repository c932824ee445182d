"""Scheduler tests, driven by the fake runner of `tests/scheduler_harness.py` (no JAX): budgets
and order, chunked prefill, continuous batching, preemption, and a random stress test. Aborts,
n > 1 and stop rules have their own test_scheduler_*.py modules."""

from __future__ import annotations

import collections
import random

from scheduler_harness import (  # tests/ is on sys.path under pytest
    VOCAB,
    Harness,
    check_against_solo,
    params,
    prompt_of,
    rows,
    solo_result,
    solo_tokens,
)

from jengine.scheduling.sequence import SequenceStatus

# ----------------------------------------------------------------------------- the fake itself


def test_fake_runner_output_matches_the_closed_form():
    h = Harness()
    prompt = prompt_of(9)
    h.add("a", prompt, params(max_tokens=12, ignore_eos=True), seed=5)
    h.run()
    assert h.result("a") == [(solo_tokens(prompt, 5, 12), "length", None)]
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- budgets and order


def test_decodes_first_then_prefill_chunks_within_the_budgets():
    h = Harness(max_num_seqs=3, max_num_batched_tokens=10)
    ignore = params(max_tokens=8, ignore_eos=True)
    a, = h.add("a", prompt_of(6), ignore)
    b, = h.add("b", prompt_of(3, 1), ignore)
    c, = h.add("c", prompt_of(20, 2), ignore)
    d, = h.add("d", prompt_of(2, 3), ignore)
    # Step 1: a and b whole, c gets the one token left; d is past max_num_seqs.
    assert rows(h.step()) == [(a.seq_id, 0, 6, True), (b.seq_id, 0, 3, True),
                              (c.seq_id, 0, 1, False)]
    assert list(h.scheduler.waiting) == [d]
    # Step 2: the decodes of a and b first, then c's next chunk fills the token budget.
    assert rows(h.step()) == [(a.seq_id, 6, 1, True), (b.seq_id, 3, 1, True),
                              (c.seq_id, 1, 8, False)]
    assert rows(h.step()) == [(a.seq_id, 7, 1, True), (b.seq_id, 4, 1, True),
                              (c.seq_id, 9, 8, False)]
    # Step 4: c's last chunk samples; 5 tokens of budget are left but max_num_seqs is reached.
    batch = h.step()
    assert rows(batch) == [(a.seq_id, 8, 1, True), (b.seq_id, 5, 1, True),
                           (c.seq_id, 17, 3, True)]
    assert batch.kv_lens.tolist() == [9, 6, 20]
    assert batch.cu_q_lens.tolist() == [0, 1, 2, 5]
    assert list(h.scheduler.waiting) == [d]
    h.run()
    for rid, seq in [("a", a), ("b", b), ("c", c), ("d", d)]:
        assert h.result(rid) == [(solo_tokens(seq.prompt_ids, 0, 8), "length", None)]
    assert h.allocator.num_used == 0


def test_batch_fields_of_a_mixed_step_are_exact():
    h = Harness(max_num_batched_tokens=16, page_size=4)
    a, = h.add("a", prompt_of(5), params(max_tokens=4, ignore_eos=True))
    h.step()  # a: 5 tokens -> pages [1, 2]
    b, = h.add("b", prompt_of(7, 1), params(max_tokens=4, ignore_eos=True))
    batch = h.step()
    assert a.pages == [1, 2] and b.pages == [3, 4]
    assert batch.seq_ids == [a.seq_id, b.seq_id]
    assert batch.q_lens.tolist() == [1, 7]
    assert batch.kv_lens.tolist() == [6, 7]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 6]
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 12, 13, 14, 15, 16, 17, 18]
    assert batch.page_table.tolist() == [[1, 2], [3, 4]]
    assert batch.sample.tolist() == [True, True]
    assert batch.token_ids.tolist() == [a.output_ids[0]] + b.prompt_ids


def test_max_num_seqs_caps_decodes_too():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [h.add(f"r{i}", prompt_of(3, i), params(max_tokens=3, ignore_eos=True))[0]
            for i in range(3)]
    assert [r[0] for r in rows(h.step())] == [seqs[0].seq_id, seqs[1].seq_id]
    assert [r[0] for r in rows(h.step())] == [seqs[0].seq_id, seqs[1].seq_id]
    h.run()
    assert all(b.num_seqs <= 2 for b in h.batches)
    assert h.allocator.num_used == 0


def test_token_budget_caps_decodes():
    h = Harness(max_num_seqs=8, max_num_batched_tokens=3)
    seqs = [h.add(f"r{i}", prompt_of(1, i), params(max_tokens=4, ignore_eos=True))[0]
            for i in range(5)]
    first = h.step()
    assert first.seq_ids == [s.seq_id for s in seqs[:3]]
    second = h.step()  # three decodes use the whole budget: the waiting two stay out
    assert second.seq_ids == [s.seq_id for s in seqs[:3]] and second.q_lens.tolist() == [1] * 3
    h.run()
    for s in seqs:
        assert s.output_ids == solo_tokens(s.prompt_ids, 0, 4)
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- chunked prefill


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    h = Harness(max_num_batched_tokens=8, page_size=4)
    prompt = prompt_of(23)
    seq, = h.add("a", prompt, params(max_tokens=3, ignore_eos=True), seed=3)
    assert [rows(h.step()) for _ in range(3)] == [
        [(seq.seq_id, 0, 8, False)], [(seq.seq_id, 8, 8, False)], [(seq.seq_id, 16, 7, True)]
    ]
    assert seq.output_ids == solo_tokens(prompt, 3, 1)
    assert len(seq.pages) == 6
    h.run()
    assert h.result("a") == [(solo_tokens(prompt, 3, 3), "length", None)]
    assert h.allocator.num_used == 0


def test_chunk_allocates_only_the_pages_it_reaches():
    h = Harness(max_num_batched_tokens=5, page_size=4)
    seq, = h.add("a", prompt_of(12), params(max_tokens=1))
    used = []
    for _ in range(3):
        h.step()
        used.append(h.allocator.num_used)
    assert used[:2] == [2, 3]  # positions 0..4 -> 2 pages, 0..9 -> 3 pages
    assert seq.is_finished and used[2] == 0


# ----------------------------------------------------------------------------- continuous batching


def test_finished_sequences_leave_and_waiting_ones_join_the_same_step():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    a, = h.add("a", prompt_of(4), params(max_tokens=2, ignore_eos=True))
    b, = h.add("b", prompt_of(5, 1), params(max_tokens=5, ignore_eos=True))
    c, = h.add("c", prompt_of(6, 2), params(max_tokens=3, ignore_eos=True))
    assert h.step().seq_ids == [a.seq_id, b.seq_id]
    assert h.step().seq_ids == [a.seq_id, b.seq_id]
    assert a.is_finished and a.finish_reason == "length" and a.pages == []
    assert rows(h.step()) == [(b.seq_id, 6, 1, True), (c.seq_id, 0, 6, True)]
    h.run()
    for rid, s, n in [("a", a, 2), ("b", b, 5), ("c", c, 3)]:
        assert h.result(rid) == [(solo_tokens(s.prompt_ids, 0, n), "length", None)]
    assert h.allocator.num_used == 0


def test_requests_arriving_mid_run_get_the_same_outputs():
    h = Harness(max_num_seqs=4, max_num_batched_tokens=12)
    specs = {f"r{i}": (prompt_of(3 + 2 * i, i), params(max_tokens=6 + i, ignore_eos=True))
             for i in range(6)}

    def arrive(step: int) -> None:
        if step < len(specs) * 2 and step % 2 == 0:
            rid = f"r{step // 2}"
            h.add(rid, *specs[rid], seed=step)

    h.run(on_step=arrive)
    for i, (rid, (prompt, p)) in enumerate(specs.items()):
        assert h.result(rid) == [(solo_tokens(prompt, 2 * i, p.max_tokens), "length", None)]
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- preemption


def test_preemption_by_recompute_reproduces_the_solo_outputs():
    page_size, max_model_len = 4, 32
    # 9 usable pages: one sequence of max_model_len fits (8), four growing ones do not.
    h = Harness(num_pages=10, page_size=page_size, max_model_len=max_model_len,
                max_num_batched_tokens=32)
    specs = {f"r{i}": (prompt_of(5 + i, i), params(max_tokens=20, ignore_eos=True), i)
             for i in range(4)}
    for rid, spec in specs.items():
        h.add(rid, *spec)
    h.run()
    assert h.scheduler.num_preemptions > 0
    assert sum(s.num_preemptions for seqs in h.requests.values() for s in seqs) == (
        h.scheduler.num_preemptions
    )
    for rid, spec in specs.items():
        assert h.result(rid) == solo_result(rid, *spec, page_size=page_size,
                                            max_model_len=max_model_len)
    assert h.allocator.num_used == 0


def test_the_most_recently_admitted_sequence_is_preempted():
    h = Harness(num_pages=7, page_size=4, max_model_len=16, max_num_batched_tokens=32)
    ignore = params(max_tokens=12, ignore_eos=True)
    a, = h.add("a", prompt_of(4), ignore)
    b, = h.add("b", prompt_of(4, 1), ignore)
    c, = h.add("c", prompt_of(4, 2), ignore)
    h.step()  # one page each (4 tokens)
    h.step()  # all three decode into a second page: the pool (6 pages) is full
    assert h.allocator.num_free == 0 and h.scheduler.num_preemptions == 0
    for _ in range(3):
        h.step()
    batch = h.step()  # a needs a third page: c, admitted last, is preempted; then b fits
    assert [s.num_preemptions for s in (a, b, c)] == [0, 0, 1]
    assert c.status is SequenceStatus.WAITING and c.num_computed == 0 and c.pages == []
    assert batch.seq_ids == [a.seq_id, b.seq_id]
    assert h.scheduler.waiting[0] is c
    h.run()
    for rid, s in [("a", a), ("b", b), ("c", c)]:
        assert h.result(rid) == [(solo_tokens(s.prompt_ids, 0, 12), "length", None)]
    assert h.allocator.num_used == 0


# ----------------------------------------------------------------------------- stress


def test_random_stress_with_preemption_and_aborts_matches_solo_runs():
    rng = random.Random(1234)
    page_size, max_model_len = 4, 48
    kw = {"page_size": page_size, "max_model_len": max_model_len}
    h = Harness(num_pages=14, max_num_seqs=6, max_num_batched_tokens=24, **kw)
    specs = {}
    for i in range(200):
        plen = rng.randint(1, 30)
        p = params(
            n=rng.choice([1, 1, 1, 2, 3]),
            max_tokens=rng.randint(1, max_model_len - plen),
            min_tokens=0,
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.2 else None,
        )
        arrival = int(i * 1.5) + rng.randint(0, 3)
        abort_at = arrival + rng.randint(0, 30) if rng.random() < 0.15 else None
        specs[f"r{i}"] = ([rng.randrange(1, VOCAB) for _ in range(plen)], p, i, arrival, abort_at)

    arrivals = collections.defaultdict(list)
    aborts = collections.defaultdict(list)
    for rid, (_, _, _, arrival, abort_at) in specs.items():
        arrivals[arrival].append(rid)
        if abort_at is not None:
            aborts[abort_at].append(rid)
    last_arrival = max(arrivals)

    def on_step(step: int) -> None:
        for rid in aborts.get(step, ()):
            h.scheduler.abort(rid)
            h.check_pages()
        for rid in arrivals.get(step, ()):
            prompt, p, seed, _, _ = specs[rid]
            h.add(rid, prompt, p, seed)

    step = 0
    while step <= last_arrival or h.scheduler.has_work:
        on_step(step)
        if h.scheduler.has_work:
            h.step()
        step += 1
        assert step < 20_000

    assert h.scheduler.num_preemptions > 0
    assert h.allocator.num_used == 0 and h.allocator.num_free == h.allocator.num_pages - 1
    assert check_against_solo(h, specs, **kw) > 0


def test_a_request_with_many_samples_does_not_queue_a_later_one_behind_them_all():
    """Fairness: a request's n samples count against it. A one-sample request that arrives
    while an n=16 request fills every slot runs in the next wave, not after all 16."""
    h = Harness(max_num_seqs=8, num_pages=128, max_model_len=64)
    h.add("hog", prompt_of(6), params(n=16, max_tokens=20, ignore_eos=True))
    for _ in range(3):  # the leader's prefill, then its forks fill the 8 slots
        h.step()
    assert sum(s.request_id == "hog" for s in h.scheduler.running) == 8
    h.add("small", prompt_of(5, salt=1), params(max_tokens=3, ignore_eos=True))
    finished_at: dict[str, int] = {}
    for step in range(200):
        if not h.scheduler.has_work:
            break
        h.step()
        for rid, seqs in h.requests.items():
            if rid not in finished_at and all(s.is_finished for s in seqs):
                finished_at[rid] = step
    first_wave = 20  # the 8 running samples' remaining decodes, at most
    assert finished_at["small"] <= first_wave + 3 + 2, finished_at
    assert finished_at["small"] < finished_at["hog"] - 15, finished_at
    assert h.result("small") == solo_result("small", prompt_of(5, salt=1),
                                            params(max_tokens=3, ignore_eos=True), 0)
