"""Prefix caching on a hybrid model in the scheduler (no JAX): recurrent-state snapshots taken
at page-aligned prefill chunk ends, owned by the prefix cache's pages, resumed from by later
sequences, never leaked.

The fake hybrid runner keeps, per state slot, the running (weighted sum, length) of the tokens
that slot has consumed, honours the batch's copies before and after the step as the device
does, and samples from that state rather than from the pages: a sequence resumed from a wrong
snapshot, or from none, draws other tokens than `solo_tokens`, and one resumed at another
position fails an assert.
"""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import FakeRunner, Harness, _mix, params, prompt_of, solo_tokens

from jengine.scheduling.state_slots import StateSlots
from jengine.scheduling.state_snapshots import MAX_COPIES, StateSnapshots


class FakeHybridRunner(FakeRunner):
    """`FakeRunner`'s page checks, plus a recurrent state per slot that the samples come from."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        super().__init__(num_pages, page_size)
        self.sums = np.zeros(num_slots, np.int64)
        self.lens = np.zeros(num_slots, np.int64)
        self.resumed = 0  # copies into a sequence's slot

    def _copy(self, pairs: np.ndarray) -> int:
        for src, dst in pairs.T.tolist():
            if dst:
                self.sums[dst], self.lens[dst] = self.sums[src], self.lens[src]
        return int((pairs[1] > 0).sum())

    def __call__(self, batch):
        copies = batch.state_copies
        if copies is not None:
            self.resumed += self._copy(copies[0])
        out = super().__call__(batch)
        cu, rows = batch.cu_q_lens, batch.row_starts
        for i, seq in enumerate(batch.seqs):
            slot, lo = int(batch.state_slots[i]), int(cu[i])
            if batch.positions[lo] == 0:
                self.sums[slot] = self.lens[slot] = 0
            assert self.lens[slot] == batch.positions[lo], "state resumed at another position"
            for token in batch.token_ids[lo:cu[i + 1]].tolist():
                self.lens[slot] += 1
                self.sums[slot] += self.lens[slot] * token
            if batch.sample[i]:
                out[rows[i]] = _mix(int(self.sums[slot]), int(self.lens[slot]), seq.seed)
        if copies is not None:
            self._copy(copies[1])
        return out


def _hybrid(num_snapshots: int = 8, max_num_seqs: int = 4, **kw) -> Harness:
    h = Harness(prefix_caching=True, max_num_seqs=max_num_seqs, **kw)
    running = max_num_seqs + 1
    h.scheduler.state_slots = StateSlots(running)
    h.cache.snapshots = StateSnapshots(running, num_snapshots)
    h.runner = FakeHybridRunner(h.allocator.num_pages, h.allocator.page_size,
                                running + num_snapshots)
    return h


def _all_free(h: Harness) -> bool:
    h.cache.reset()
    snaps = h.cache.snapshots
    return (snaps.num_free == snaps.count and not snaps.num_held
            and h.scheduler.state_slots.num_free == h.scheduler.state_slots.num_slots - 1)


def test_a_shared_prefix_resumes_from_the_deepest_snapshot():
    h = _hybrid(page_size=4, max_num_batched_tokens=32)
    ignore = params(max_tokens=4, ignore_eos=True)
    first = prompt_of(14)
    a, = h.add("a", first, ignore)
    batch = h.step()
    assert batch.q_lens.tolist() == [12]  # cut at its last full page: snapshot after page 3
    assert batch.state_copies[1, :, 0].tolist() == [a.state_slot, h.cache.snapshots.first]
    h.run()
    second = first[:13] + [7, 7, 7]
    b, = h.add("b", second, ignore)
    batch = h.step()
    assert b.num_cached_tokens == 12 and batch.q_lens.tolist() == [4]
    assert batch.state_copies[0, :, 0].tolist() == [h.cache.snapshots.first, b.state_slot]
    h.run()
    assert h.result("b")[0][0] == solo_tokens(second, 0, 4)
    other, = h.add("c", [2] + first[1:], ignore)
    h.run()
    assert other.num_cached_tokens == 0
    assert h.runner.resumed == 1
    assert _all_free(h)


def test_a_match_without_a_snapshot_takes_one_where_it_ends():
    """A system prompt of 10 tokens (2 pages and 2) before 6 tokens of each request's own:
    the first request's one snapshot is at 12 (its chunk runs to its last full page), past
    the shared part, so the second computes from 0 and stops at 8, where its match ended,
    to take one; the third resumes there."""
    h = _hybrid(page_size=4, max_num_batched_tokens=32)
    ignore = params(max_tokens=2, ignore_eos=True)
    system = prompt_of(10)
    prompts = [system + prompt_of(6, salt) for salt in (1, 2, 3)]
    a, = h.add("a", prompts[0], ignore)
    assert h.step().q_lens.tolist() == [12]
    h.run()
    b, = h.add("b", prompts[1], ignore)
    assert h.step().q_lens.tolist() == [8]  # no snapshot at 8: from 0 to there
    h.run()
    c, = h.add("c", prompts[2], ignore)
    h.run()
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 8)
    for rid, prompt in zip("abc", prompts):
        assert h.result(rid)[0][0] == solo_tokens(prompt, 0, 2)
    assert _all_free(h)


def test_no_snapshot_no_hit_and_the_lru_snapshot_gives_way():
    snaps = StateSnapshots(first=3, count=2)
    assert snaps.deepest([10, 11]) == (0, None)
    s1, s2 = snaps.reserve(), snaps.reserve()
    snaps.attach(10, s1)
    snaps.attach(11, s2)
    assert snaps.deepest([10, 12]) == (1, s1)  # 10 used: 11 is the least recent now
    assert snaps.reserve() == s2 and snaps.deepest([10, 11]) == (1, s1)
    snaps.attach(10, s2)  # 10 has one already: s2 is freed
    assert snaps.num_free == 1
    snaps.moved(10, 20)
    assert snaps.deepest([20]) == (1, s1)
    snaps.dropped([20])
    assert snaps.num_free == 2 and not snaps.num_held
    with pytest.raises(ValueError, match="not reserved"):
        snaps.release(s1)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_every_sequence_exact(seed):
    """Shared system prompts, forks, a small page pool (preemption and eviction), few
    snapshot slots (LRU) and aborts: every output equals the sequence run alone, and every
    slot and snapshot is free once the cache is reset."""
    rng = np.random.default_rng(seed)
    h = _hybrid(num_snapshots=3, max_num_seqs=4, num_pages=24, page_size=4,
                max_num_batched_tokens=16, max_model_len=48)
    systems = [prompt_of(int(rng.integers(5, 14)), k) for k in range(3)]
    added = {}
    for r in range(14):
        prompt = systems[r % 3] + prompt_of(int(rng.integers(1, 8)), 10 + r)
        n = 2 if r % 5 == 0 else 1
        added[f"r{r}"] = (prompt, n)
        h.add(f"r{r}", prompt, params(n=n, max_tokens=int(rng.integers(1, 10)), ignore_eos=True),
              seed=r)

    def maybe_abort(step):
        if step == 6:
            h.scheduler.abort("r3")
            added.pop("r3")

    h.run(on_step=maybe_abort)
    for rid, (prompt, _n) in added.items():
        for i, (out, _, _) in enumerate(h.result(rid)):
            assert out == solo_tokens(prompt, (int(rid[1:]) + i) % (1 << 32), len(out)), rid
    assert h.runner.resumed > 0
    assert h.cache.stats.hit_tokens > 0
    assert _all_free(h)


def test_copies_per_step_are_bounded():
    h = _hybrid(num_snapshots=16, max_num_seqs=8, page_size=4, max_num_batched_tokens=64)
    ignore = params(max_tokens=2, ignore_eos=True)
    shared = prompt_of(9)
    h.add("lead", shared, ignore)
    h.run()
    for r in range(MAX_COPIES + 2):
        h.add(f"f{r}", shared + [r + 1], ignore)
    batch = h.step()
    assert int((batch.state_copies[0, 1] > 0).sum()) == MAX_COPIES  # the others recompute
    h.run()
    for r in range(MAX_COPIES + 2):
        assert h.result(f"f{r}")[0][0] == solo_tokens(shared + [r + 1], 0, 2)
    assert _all_free(h)
