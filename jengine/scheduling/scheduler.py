"""Continuous batching at iteration level (host-side; no JAX).

Every step `schedule()` builds one `ScheduledBatch`: running decodes first (one token each),
then prefill chunks of running and waiting sequences within `max_num_batched_tokens` and
`max_num_seqs`. KV pages are allocated as sequences grow; when none are left, the most recently
admitted sequence is preempted by recompute (its pages freed, its tokens prefilled again later,
which reproduces the same output), and failing that the forked samples still waiting on shared
prompt pages give those up. `postprocess()` appends the sampled tokens, applies token-level
stop rules and frees the pages of finished sequences.

With a `PrefixCache`, a sequence being admitted first takes the cached pages of its longest
cached prefix (by reference) and starts its prefill after them; if another sequence's prefill
chunk in the same step fills the next page it would reuse, it waits a step for that page
instead of computing it twice. Every page enters the cache in the step that fills it, so pages
outlive their sequences (finished, aborted or preempted: a recompute finds its own pages
again). Cached pages that nobody holds count as free: `_allocate` evicts them when the free
list runs short.

With a proposer (speculative decoding, jengine/scheduling/speculation.py), decodes whose last
token is known then get proposed tokens appended to their query, from what the token budget, the
row limit (`max_num_seqs` sampled rows in all) and free pages leave after every decode and
prefill chunk has its share: speculation only ever uses room nothing else wanted. `finalize`
keeps the confirmed proposals and the bonus token, and gives back pages that only rejected ones
needed.
"""

from __future__ import annotations

import collections

import numpy as np

from jengine.scheduling.batch import ScheduledBatch, build_batch
from jengine.scheduling.fairness import fair_order
from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.prefix_reuse import (
    cache_pages,
    chunk_limit,
    count_lookup,
    plan_snapshots,
    prefix_in_flight,
    reuse_cached,
    settle_snapshot,
)
from jengine.scheduling.sequence import PENDING, Sequence, SequenceStatus
from jengine.scheduling.speculation import Speculator
from jengine.scheduling.speculative import (
    NgramProposer,
    SpecCounters,
    num_accepted,
)
from jengine.scheduling.state_slots import StateSlots
from jengine.scheduling.state_snapshots import StateCopies


class Scheduler:
    """Decides which tokens of which sequences run in each step, and owns their KV pages."""

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        prefix_cache: PrefixCache | None = None,
        proposer: NgramProposer | None = None,
        state_slots: StateSlots | None = None,
        max_loras: int | None = None,
    ):
        """`state_slots`: a hybrid model's recurrent-state slots (one per running sequence,
        taken at admission, given back with its pages). `max_loras` (LoRA serving): the most
        distinct adapters among the running sequences; a sequence under another one waits."""
        self.allocator = allocator
        self.state_slots, self.max_loras = state_slots, max_loras
        # Speculative decoding (None: off); `finalize` accepts what its proposals confirmed.
        self.speculator = Speculator(proposer) if proposer is not None else None
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_pages_per_seq = allocator.pages_for(max_model_len)
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission and removal -------------------------------------------------------------

    def add(self, seqs: list[Sequence]) -> None:
        """Queues a request's samples. With n > 1 the first sample prefills the prompt and the
        others wait to share its full prompt pages (see `_fork`)."""
        leader, *rest = seqs
        leader.pending_forks = list(rest)
        self.waiting.append(leader)

    def abort(self, request_id: str) -> list[Sequence]:
        """Removes every sequence of a request at once and frees its pages."""
        removed = []
        for seq in list(self.running) + list(self.waiting):
            if seq.request_id == request_id:
                removed.append(seq)
                removed.extend(seq.pending_forks)
                seq.pending_forks = []
        for seq in removed:
            self.finish(seq, "abort")
        return removed

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Marks a sequence finished and releases its pages."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """Picks this step's work; None when nothing can run."""
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        copies = StateCopies()  # a hybrid's state copies to / from prefix-cache snapshots
        for seq in list(self.running):
            if seq.num_uncomputed != 1 or seq not in self.running:
                continue
            if len(chosen) >= self.max_num_seqs or budget == 0:
                break
            if self._reserve(seq, seq.num_tokens, chosen):
                chosen.append((seq, 1))
                budget -= 1
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        prefills += fair_order(self.waiting, self.running, self.max_num_seqs)
        deferred = 0
        adapters = {s.lora_id for s in self.running if s.lora_id}
        for seq in prefills:
            if len(chosen) >= self.max_num_seqs or budget == 0:
                break
            if (seq.status is SequenceStatus.WAITING and seq.lora_id
                    and seq.lora_id not in adapters and len(adapters) >= (self.max_loras or 0)):
                continue  # every adapter slot is taken by running sequences' adapters
            hit = reuse_cached(self.prefix_cache, seq, copies)
            if (hit is not None and deferred < self.max_num_seqs
                    and prefix_in_flight(seq, chosen, self.allocator.page_size)):
                # Another sequence fills this one's next uncached page in this very step: it
                # waits a step and reuses the page instead of computing it a second time.
                self._unreuse(seq, hit)
                deferred += 1
                continue
            n = chunk_limit(self.prefix_cache, seq, budget)
            if seq.status is SequenceStatus.RUNNING:
                # Part-way through its prompt (chunked, or its last page left to this step): it
                # preempts later-admitted work for its pages as a decode does, or sequences
                # that each hold part of the pool and wait for one more page deadlock.
                if seq not in self.running or not self._reserve(seq, seq.num_computed + n,
                                                                chosen):
                    continue
            else:
                need = self.allocator.pages_for(seq.num_computed + n) - len(seq.pages)
                no_slot = self.state_slots is not None and not self.state_slots.num_free
                if no_slot or not self._can_allocate(need):
                    self._unreuse(seq, hit)
                    break
                seq.pages += self._allocate(need)
            if hit is not None:
                count_lookup(self.prefix_cache, seq, hit)
            if seq.status is SequenceStatus.WAITING:
                if self.state_slots is not None:
                    seq.state_slot = self.state_slots.allocate()
                    if seq.resume_from is not None:  # its state after the cached pages
                        copies.into.append((seq.resume_from, seq.state_slot))
                        seq.resume_from = None
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if seq.lora_id:
                    adapters.add(seq.lora_id)
            chosen.append((seq, n))
            budget -= n
        if not chosen:
            # Nothing fits: the pages the queue's head needs may be held by waiting forked
            # siblings (`_fork`), which nothing else would ever release. Drop them and retry.
            return self.schedule() if self._release_waiting_pages() else None
        if self.speculator is not None:
            self.speculator.extend(chosen, budget, self.max_num_seqs, self.allocator,
                                   self.max_model_len)
        plan_snapshots(self.prefix_cache, chosen, copies)
        return build_batch(chosen, self.allocator.page_size,
                           copies.array() if copies.into or copies.out else None)

    @property
    def spec_counters(self) -> SpecCounters:
        """Speculative decoding's counters (all zero while it is off)."""
        return self.speculator.counters if self.speculator is not None else SpecCounters()

    def may_speculate(self, seq: Sequence) -> bool:
        """Whether `seq` may verify proposals (see `Speculator.may_speculate`)."""
        return self.speculator is not None and self.speculator.may_speculate(seq)

    def _reserve(self, seq: Sequence, num_tokens: int, chosen: list) -> bool:
        """Makes sure `seq` has pages for `num_tokens`, preempting later-admitted sequences
        (never one already chosen this step) when the pool runs dry. False if `seq` itself had
        to be preempted."""
        need = self.allocator.pages_for(num_tokens) - len(seq.pages)
        while not self._can_allocate(need):
            scheduled = {id(s) for s, _ in chosen}
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if victims:
                self._preempt(victims[-1])
            elif not self._release_waiting_pages():
                self._preempt(seq)
                return False
        if need > 0:
            seq.pages += self._allocate(need)
        return True

    def _can_allocate(self, n: int) -> bool:
        evictable = self.allocator.num_evictable if self.prefix_cache is not None else 0
        return n <= self.allocator.num_free + evictable

    def _allocate(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.allocate(n)

    # -- prefix cache --------------------------------------------------------------------------

    def _unreuse(self, seq: Sequence, hit: int | None) -> None:
        """Undoes `reuse_cached` for a sequence that is not admitted after all."""
        seq.resume_from = None
        if hit:
            self._release(seq)
            seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release_waiting_pages(self) -> bool:
        """Preempts (to recompute) every waiting sequence that holds pages; True if any did.

        Only forked siblings wait while holding pages (the prompt pages `_fork` shared). Nothing
        else frees those pages, so when they are all that blocks progress they must go: without
        this a lone decode preempts itself and re-prefills forever, and a blocked queue head
        leaves `schedule()` with nothing to run while work remains."""
        holders = [s for s in self.waiting if s.pages]
        for seq in holders:
            self._release(seq)
            seq.num_computed = 0
            seq.num_preemptions += 1
            self.num_preemptions += 1
        return bool(holders)

    def _release(self, seq: Sequence) -> None:
        """Lets go of a sequence's pages (the prefix cache holds its full ones, up to
        `own_pages_from`) and of its recurrent-state slot."""
        if seq.state_slot is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None
        if seq.pages:
            self.allocator.free(seq.pages)
            seq.pages = []
            seq.num_cached_pages = 0
            seq.own_pages_from = None

    # -- after the step ----------------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, tokens: np.ndarray) -> list[Sequence]:
        """Appends sampled tokens and applies token-level stops. Returns the sequences that
        received a token this step (finished ones included). `tokens`: [R] one per row."""
        sampled = self.advance(batch)
        self.finalize(sampled, tokens)
        return [seq for seq, _ in sampled]

    def advance(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """The first half of `postprocess`, possible before the step's tokens are known: the
        computed counts move on and every sampling sequence gets a `PENDING` token, so the next
        step can be scheduled while this one runs. Length limits need no token and finish
        sequences here. Returns (sequence, its first row) of each sampling sequence. Proposals
        are not counted as computed here: `finalize` does it for those it accepts."""
        sampled = []
        rows = batch.row_starts
        spec_lens = batch.spec_lens if batch.spec_lens is not None else np.zeros(batch.num_seqs)
        for i, seq in enumerate(batch.seqs):
            if seq.is_finished:  # aborted while the step ran
                settle_snapshot(self.prefix_cache, seq)
                continue
            full_before = seq.num_computed // self.allocator.page_size
            seq.num_computed += int(batch.q_lens[i] - spec_lens[i])
            if (self.prefix_cache is not None
                    and seq.num_computed // self.allocator.page_size > full_before):
                # Pages this step fills are cached now: the next step, which may reuse them,
                # runs after this one on the device.
                cache_pages(self.prefix_cache, seq)
            settle_snapshot(self.prefix_cache, seq)
            if not batch.sample[i]:
                continue
            if seq.spec is not None:
                seq.spec.tick()
            first = not seq.output_ids
            seq.output_ids.append(PENDING)
            sampled.append((seq, int(rows[i])))
            if first and seq.pending_forks:
                self._fork(seq)
            if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
        return sampled

    def finalize(self, sampled: list[tuple[Sequence, int]], tokens: np.ndarray) -> list[int]:
        """The second half: each PENDING token becomes the sampled one, then stop tokens apply
        (a stop token on the last allowed position still reports "stop", as it would have).
        A verifying sequence then keeps each further row's token while the row before it drew
        the proposal it was fed. Returns how many tokens each of `sampled` received."""
        counts = []
        for seq, row in sampled:
            if seq.finish_reason == "abort":
                counts.append(0)
                continue
            token = int(tokens[row])
            seq.output_ids[-1] = token
            self._check_stop(seq, token)
            proposal = seq.spec.proposal if seq.spec is not None else []
            counts.append(1 + (self._accept(seq, proposal, tokens[row:row + len(proposal) + 1])
                               if proposal else 0))
        return counts

    def _accept(self, seq: Sequence, proposal: list[int], drawn: np.ndarray) -> int:
        """Appends the drawn tokens after the confirmed proposals (stopping where the sequence
        finishes), caches the pages they fill and frees the pages only rejected proposals
        used. Returns the tokens appended."""
        confirmed = num_accepted(proposal, drawn)
        added = 0
        ps = self.allocator.page_size
        full_before = seq.num_computed // ps
        while added < confirmed and not seq.is_finished:
            seq.num_computed += 1  # the proposal's K/V, written this step, is now the token's
            token = int(drawn[added + 1])
            seq.output_ids.append(token)
            added += 1
            if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
            self._check_stop(seq, token)
        self.speculator.verified(seq, added)
        if seq.is_finished:
            return added
        if self.prefix_cache is not None and seq.num_computed // ps > full_before:
            cache_pages(self.prefix_cache, seq)
        keep = self.allocator.pages_for(seq.num_tokens)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
        return added

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if len(seq.output_ids) <= params.min_tokens:
            return
        if token in (params.stop_token_ids or ()):
            reason, stop = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason, stop = "stop", None
        else:
            return
        if seq.finish_reason == "length":  # finished by `advance`: the token decides the reason
            seq.finish_reason, seq.stop_reason = reason, stop
        else:
            self.finish(seq, reason, stop)

    def _fork(self, leader: Sequence) -> None:
        """Gives the leader's waiting siblings its full prompt pages by reference; each then
        prefills only the prompt's last partial page (at least the last prompt token)."""
        shared = leader.pages[: (len(leader.prompt_ids) - 1) // self.allocator.page_size]
        if self.state_slots is not None:  # pages hold no state: each resumes via the cache
            shared = []
        for seq in reversed(leader.pending_forks):
            self.allocator.share(shared)
            seq.pages = list(shared)
            seq.num_cached_pages = min(len(shared), leader.num_cached_pages)
            own = leader.own_pages_from  # pages the leader keeps out of the cache stay out
            seq.own_pages_from = own if own is not None and own < len(shared) else None
            seq.num_computed = len(shared) * self.allocator.page_size
            self.waiting.appendleft(seq)
        leader.pending_forks = []
