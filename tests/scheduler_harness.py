"""A scheduler harness with a fake runner of predictable arithmetic (no JAX), for the scheduler
and prefix-cache tests.

The fake runner keeps a fake KV cache: every slot remembers the token id and position written
into it. A sampled row's next token is a fixed function of the tokens read back through that
row's page table (positions 0..kv_len-1) and of the sequence's seed, so a sequence's output
depends on its own tokens only: it is the same however it is batched, chunked, preempted or
forked, and any wrong slot, page table, page reuse or write into a shared page changes it.

Every step the harness also checks the batch against the scheduler's state (q_lens, positions,
slot mapping, page table, kv_lens, sample flags, budgets, decodes first) and, after
postprocess, that every page's refcount equals the number of live sequences holding it.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from jengine.sampling_params import SamplingParams
from jengine.scheduling.batch import ScheduledBatch
from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.scheduler import Scheduler
from jengine.scheduling.sequence import Sequence, SequenceStatus
from jengine.scheduling.speculative import Proposal

VOCAB = 50
EOS = 0
GARBAGE = 999  # what the fake runner returns for rows that sample nothing


def _mix(weighted_sum: int, length: int, seed: int) -> int:
    x = (weighted_sum + 1_000_003 * seed + length) * 2_654_435_761 % (1 << 32)
    return (x >> 7) % VOCAB


def next_token(context: np.ndarray, seed: int) -> int:
    """The fake model: a deterministic function of a sequence's tokens and its seed."""
    ctx = np.asarray(context, np.int64)
    weighted_sum = int(ctx @ np.arange(1, len(ctx) + 1, dtype=np.int64))
    return _mix(weighted_sum, len(ctx), seed)


def solo_tokens(prompt: list[int], seed: int, num: int) -> list[int]:
    """What `next_token` generates for one sequence run alone, without any engine."""
    weighted_sum = sum((i + 1) * t for i, t in enumerate(prompt))
    length, out = len(prompt), []
    for _ in range(num):
        token = _mix(weighted_sum, length, seed)
        out.append(token)
        length += 1
        weighted_sum += length * token
    return out


class FakeRunner:
    """Writes each step's tokens into a fake paged cache and "samples" from what it reads back."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.tokens = np.full(num_pages * page_size, -1, np.int64)
        self.positions = np.full(num_pages * page_size, -1, np.int64)

    def __call__(self, batch: ScheduledBatch) -> np.ndarray:
        """[R] one token per sampled row (a verifying sequence has one row per query token)."""
        self.tokens[batch.slot_mapping] = batch.token_ids
        self.positions[batch.slot_mapping] = batch.positions
        out = np.full(batch.num_rows, GARBAGE, np.int32)
        ps = self.page_size
        for r, (i, t) in enumerate(zip(batch.row_seq, batch.logits_indices)):
            if not batch.sample[i]:
                continue
            pos = np.arange(batch.positions[t] + 1)
            slots = batch.page_table[i, pos // ps] * ps + pos % ps
            assert (self.positions[slots] == pos).all(), "context slot holds another position"
            out[r] = next_token(self.tokens[slots], batch.seqs[i].seed)
        return out


class OracleProposer:
    """Proposes what `next_token` would generate for seed `seed`, with the token at a random
    place swapped for a wrong one half of the time: every count of accepted tokens happens."""

    def __init__(self, num_tokens: int, seed: int = 0, rng_seed: int = 0):
        self.num_tokens, self.seed = num_tokens, seed
        self.drafts = False  # weighed like a host lookup, unless a test makes it a draft model
        self.rng = np.random.default_rng(rng_seed)
        self.proposed: list[list[int]] = []

    def propose_many(self, requests: list[tuple[list[int], int]]) -> list[Proposal]:
        return [Proposal(self.propose(tokens, limit)) for tokens, limit in requests]

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        out = solo_tokens(tokens, self.seed, k)
        if self.rng.random() < 0.5:
            j = int(self.rng.integers(k))
            out[j] = (out[j] + 1) % VOCAB or 1
        self.proposed.append(out)
        return out


class Harness:
    """A scheduler, its allocator and a fake runner, stepped by a tiny driver loop."""

    def __init__(
        self,
        *,
        num_pages: int = 64,
        page_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_model_len: int = 64,
        eos_token_ids: tuple[int, ...] = (EOS,),
        prefix_caching: bool = False,
        proposer=None,
    ):
        self.allocator = PageAllocator(num_pages, page_size)
        self.cache = PrefixCache(self.allocator) if prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            prefix_cache=self.cache,
            proposer=proposer,
        )
        self.runner = FakeRunner(num_pages, page_size)
        self.max_model_len = max_model_len
        self.requests: dict[str, list[Sequence]] = {}
        self.batches: list[ScheduledBatch] = []
        self._ids = itertools.count(1)

    # -- driving ---------------------------------------------------------------------------------

    def add(self, rid: str, prompt: list[int], params: SamplingParams, seed: int = 0):
        """Builds the request's sequences as `EngineCore.add_request` does and queues them."""
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        assert 1 <= max_tokens <= room
        seqs = [
            Sequence(next(self._ids), rid, i, list(prompt), params, (seed + i) % (1 << 32),
                     max_tokens)
            for i in range(params.n)
        ]
        self.requests[rid] = seqs
        self.scheduler.add(seqs)
        return seqs

    def step(self) -> ScheduledBatch:
        sched = self.scheduler
        decode_candidates = [(s, s.num_preemptions) for s in sched.running
                             if s.num_uncomputed == 1]
        batch = sched.schedule()
        assert batch is not None, "the scheduler has work but scheduled nothing (deadlock)"
        self._check_batch(batch, decode_candidates)
        tokens = self.runner(batch)
        sched.postprocess(batch, tokens)
        self.batches.append(batch)
        self.check_pages()
        return batch

    def run(self, max_steps: int = 10_000, on_step=None) -> int:
        """Steps until no work is left; `on_step(step_index)` runs before each step."""
        for n in range(max_steps):
            if on_step is not None:
                on_step(n)
            if not self.scheduler.has_work:
                return n
            self.step()
        raise AssertionError("did not finish")

    def result(self, rid: str) -> list[tuple[list[int], str | None, int | str | None]]:
        return [(s.output_ids, s.finish_reason, s.stop_reason) for s in self.requests[rid]]

    # -- invariants ------------------------------------------------------------------------------

    def _check_batch(
        self, batch: ScheduledBatch, candidates: list[tuple[Sequence, int]]
    ) -> None:
        """`candidates`: the sequences that were due a decode, with their preemption counts."""
        sched, ps = self.scheduler, self.allocator.page_size
        num_seqs = batch.num_seqs
        assert 1 <= num_seqs <= batch.num_rows <= sched.max_num_seqs
        assert batch.num_tokens <= sched.max_num_batched_tokens
        spec = batch.spec_lens if batch.spec_lens is not None else np.zeros(num_seqs, int)
        assert batch.seq_ids == [s.seq_id for s in batch.seqs]
        assert len(set(batch.seq_ids)) == num_seqs
        for arr, shape in [(batch.token_ids, (batch.num_tokens,)),
                           (batch.positions, (batch.num_tokens,)),
                           (batch.slot_mapping, (batch.num_tokens,)),
                           (batch.q_lens, (num_seqs,)), (batch.kv_lens, (num_seqs,)),
                           (batch.sample, (num_seqs,))]:
            assert arr.shape == shape
        assert batch.page_table.shape[0] == num_seqs
        assert int(batch.q_lens.sum()) == batch.num_tokens
        cu = batch.cu_q_lens
        assert cu[0] == 0 and cu[-1] == batch.num_tokens and (np.diff(cu) == batch.q_lens).all()

        # Decodes first, in running order; a left-out decode was preempted or the batch is full.
        # (A preempted one may come back in the same step, as a prefill from position 0.)
        decode_candidates = [s for s, n in candidates if s.num_preemptions == n]
        preempted = [s for s, n in candidates if s.num_preemptions != n]
        is_decode = [any(s is d for d in decode_candidates) for s in batch.seqs]
        assert is_decode == sorted(is_decode, reverse=True), "a prefill row precedes a decode"
        decoded = [s for s, d in zip(batch.seqs, is_decode) if d]
        assert decoded == [d for d in decode_candidates if any(d is s for s in decoded)]
        full = num_seqs == sched.max_num_seqs or batch.num_tokens == sched.max_num_batched_tokens
        for d in decode_candidates:
            if not any(d is s for s in decoded):
                assert full
        for s in preempted:  # waiting, or restarted from 0 (or from its cached pages)
            restart = 0 if self.cache is None else s.num_computed // ps * ps
            assert s.status is SequenceStatus.WAITING or s.num_computed == restart

        for i, seq in enumerate(batch.seqs):
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            start, q, k = seq.num_computed, int(batch.q_lens[i]), int(spec[i])
            lo, hi = cu[i], cu[i + 1]
            assert q >= 1 and (not is_decode[i] or q == 1 + k)
            assert k == 0 or (q == 1 + k and start + 1 == seq.num_tokens)  # proposals: decodes
            pos = np.arange(start, start + q)
            assert (batch.positions[lo:hi] == pos).all()
            proposal = seq.spec.proposal if k else []
            assert len(proposal) == k
            assert batch.token_ids[lo:hi].tolist() == seq.tokens(start, start + q - k) + proposal
            assert batch.kv_lens[i] == start + q <= seq.num_tokens + k
            assert bool(batch.sample[i]) == (start + q - k == seq.num_tokens)
            assert len(seq.pages) == self.allocator.pages_for(start + q), "pages over/under"
            assert batch.page_table[i, : len(seq.pages)].tolist() == seq.pages
            assert (batch.page_table[i, len(seq.pages):] == 0).all()
            pages = np.asarray(seq.pages)
            assert (batch.slot_mapping[lo:hi] == pages[pos // ps] * ps + pos % ps).all()
        written_pages = set((batch.slot_mapping // ps).tolist())
        assert len(set(batch.slot_mapping.tolist())) == batch.num_tokens
        assert 0 not in written_pages
        assert all(self.allocator.refcount(p) == 1 for p in written_pages), "wrote a shared page"

    def cache_pages(self) -> set[int]:
        """Every page in the prefix cache's tree (a walk over the nodes)."""
        if self.cache is None:
            return set()
        pages = [p for node in self.cache._iter_nodes() for p in node.pages]
        assert len(pages) == len(set(pages)), "a page is in the tree twice"
        return set(pages)

    def live_seqs(self) -> list[Sequence]:
        sched = self.scheduler
        live = list(sched.running) + list(sched.waiting)
        for seq in list(live):
            live.extend(seq.pending_forks)
        return live

    def check_pages(self) -> None:
        """Every page's refcount is the number of live sequences holding it, plus one if the
        prefix cache holds it; nothing leaks."""
        alloc = self.allocator
        held = collections.Counter(p for s in self.live_seqs() for p in s.pages)
        cached = self.cache_pages()
        assert 0 not in held and 0 not in cached
        for page in range(alloc.num_pages):
            want = held.get(page, 0) + (page in cached)
            assert alloc.refcount(page) == want, f"page {page}"
            assert alloc.is_cached(page) == (page in cached), f"page {page}"
        assert alloc.num_free + alloc.num_used == alloc.num_pages - 1
        assert alloc.num_used == len(set(held) | cached)
        assert alloc.num_evictable == len(cached - set(held))
        if self.cache is not None:
            assert self.cache.num_pages == len(cached)
        for seqs in self.requests.values():
            for s in seqs:
                assert not s.is_finished or s.pages == []
                assert len(set(s.pages)) == len(s.pages)
        for s in self.live_seqs():
            assert not s.is_finished
            assert s.status is SequenceStatus.RUNNING or s.num_computed == len(s.pages) * (
                alloc.page_size
            ), "a waiting sequence holds pages it has not filled"


def params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 * salt + 1) % VOCAB or 1 for i in range(length)]  # never EOS


def solo_result(rid, prompt, p, seed, **harness_kw):
    """The request's result when it runs alone in a pool with plenty of pages."""
    kw = {**harness_kw, "num_pages": 200}
    h = Harness(**kw)
    h.add(rid, prompt, p, seed)
    h.run()
    assert h.allocator.num_used == 0
    return h.result(rid)


def rows(batch: ScheduledBatch) -> list[tuple[int, int, int, bool]]:
    """(seq_id, first position, q_len, sample) of every row."""
    return [(sid, int(batch.positions[batch.cu_q_lens[i]]), int(batch.q_lens[i]),
             bool(batch.sample[i])) for i, sid in enumerate(batch.seq_ids)]


def check_against_solo(h: Harness, specs: dict, **harness_kw) -> int:
    """Every request's result equals its solo run; an aborted sample produced a prefix of it.
    `specs[rid]` starts with (prompt, params, seed). Returns the number of aborted samples."""
    num_aborted = 0
    for rid, (prompt, p, seed, *_) in specs.items():
        solo = solo_result(rid, prompt, p, seed, **harness_kw)
        for got, want in zip(h.result(rid), solo):
            if got[1] == "abort":
                num_aborted += 1
                assert got[0] == want[0][: len(got[0])]  # what it produced before the abort
            else:
                assert got == want, rid
    return num_aborted
