"""Speculative decoding's side of a schedule: who may propose, and how many proposed tokens each
chosen decode verifies in the room the step leaves (`Speculator.extend`). The proposer, the
acceptance rule and the cost model are in `jengine.scheduling.speculative`; accepting what a
verification confirmed is the scheduler's (`Scheduler.finalize`), which owns the pages."""

from __future__ import annotations

import time
from typing import Protocol

from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.sequence import PENDING, Sequence
from jengine.scheduling.speculative import (
    DECLINED_PAUSE,
    AcceptanceByMatch,
    NgramProposer,
    Proposal,
    SpecCounters,
    SpecState,
    StepCosts,
    best_cap,
)


class Proposer(Protocol):
    """What proposes tokens: `NgramProposer` (host lookup) or a draft model
    (`jengine.core.draft.DraftProposer`), asked once per step for every candidate at once."""

    # Whether a round runs a model (steps that cost what a verification could gain): such a
    # proposer is weighed by the cost model before its round, not only after.
    drafts: bool
    num_tokens: int  # the most it proposes for one sequence

    def propose_many(self, requests: list[tuple[list[int], int]]) -> list[Proposal]:
        """For each (the sequence's tokens, the most it may propose): its proposal, maybe empty."""
        ...


class Speculator:
    """The proposer, the step costs and acceptance estimates it is weighed with, and the
    counters it reports."""

    def __init__(self, proposer: Proposer | NgramProposer):
        self.proposer = proposer
        self.counters = SpecCounters()
        # Measured step seconds per token bucket (the engine fills it); None: verify everything.
        self.step_costs: StepCosts | None = None
        self.paused = 0  # steps left in which nobody proposes (DECLINED_PAUSE)
        self.acceptance = AcceptanceByMatch()  # of n-gram proposals, per match length

    def may_speculate(self, seq: Sequence) -> bool:
        """Whether `seq` may verify proposals when its last token is known (so its next step
        waits for that token: no async scheduling), unless it pauses. Not: grammars (the
        mask of each row would need the grammar advanced over the proposals), penalties and bad
        words (they read the token history, which proposals would change per row), and a
        sequence still short of min_tokens (its stop tokens are banned by the step count)."""
        p = seq.params
        return (seq.matcher is None and not p.uses_token_history
                and not seq.bad_words and len(seq.output_ids) >= p.min_tokens
                and self.paused == 0 and (seq.spec is None or seq.spec.may_propose()))

    def extend(self, chosen: list[tuple[Sequence, int]], budget: int, max_rows: int,
               allocator: PageAllocator, max_model_len: int) -> None:
        """Appends proposals to the chosen decodes, within the room left: `budget` tokens,
        `max_rows` rows in all (`max_num_seqs`), and free pages (speculation never preempts or
        evicts).
        With step costs measured (`step_costs`), proposals are cut to the length that gives the
        most expected tokens per second, which is none where verifying costs more than it
        gains (`jengine.scheduling.speculative.best_cap`)."""
        if self.paused > 0:
            self.paused -= 1
            return
        room = min(budget, max_rows - len(chosen))  # rows and tokens alike
        eligible = []  # the proposer's work only for as many sequences as can verify
        for i, (seq, n) in enumerate(chosen):
            if len(eligible) >= room:
                break
            if (n != 1 or seq.num_uncomputed != 1 or seq.output_ids[-1:] in ([], [PENDING])
                    or not self.may_speculate(seq)):
                continue
            if seq.spec is None:
                seq.spec = SpecState()
            limit = min(seq.max_tokens - len(seq.output_ids) - 1,
                        max_model_len - seq.num_tokens - 1)
            eligible.append((i, seq, limit))
        tokens = sum(n for _, n in chosen)
        sampling = sum(1 for seq, n in chosen if seq.num_computed + n == seq.num_tokens)
        if eligible and self.proposer.drafts and not self._drafting_may_pay(
                tokens, sampling, eligible, room):
            for _, seq, _ in eligible:
                seq.spec.decline()
            self.paused = DECLINED_PAUSE
            return
        start = time.perf_counter()
        proposals = self.proposer.propose_many(
            [(seq.tokens(0, seq.num_tokens), limit) for _, seq, limit in eligible])
        if eligible and self.step_costs is not None:
            self.step_costs.observe_proposing(time.perf_counter() - start)
        candidates = []
        # In order, as much as the room still takes (so the cost model weighs step sizes that
        # exist); one cut to nothing is declined below.
        fits = in_room([len(found.tokens) for found in proposals], room)
        for (i, seq, _), found, n in zip(eligible, proposals, fits):
            if found.tokens:
                seq.spec.match = found.match
                candidates.append((i, seq, found.tokens[:n]))
        if not candidates:
            return
        cap = best_cap(tokens, sampling, [(len(p), self._estimate(seq))
                                          for _, seq, p in candidates], self.step_costs)
        if cap == 0:
            self.paused = DECLINED_PAUSE
            for match in {seq.spec.match for _, seq, _ in candidates} - {0}:
                self.acceptance.declined(match)  # once a step, however many sequences
        rows = len(chosen)
        for i, seq, proposal in candidates:
            proposal = proposal[:max(0, min(cap, budget, max_rows - rows))]
            need = allocator.pages_for(seq.num_tokens + len(proposal)) - len(seq.pages)
            if need > 0:
                if need <= allocator.num_free:
                    seq.pages += allocator.allocate(need)
                else:  # only what the pages it holds can take
                    held = len(seq.pages) * allocator.page_size
                    proposal = proposal[: held - seq.num_tokens]
            if not proposal:
                seq.spec.decline()
                continue
            seq.spec.proposal = proposal
            chosen[i] = (seq, 1 + len(proposal))
            rows += len(proposal)
            budget -= len(proposal)

    def verified(self, seq: Sequence, accepted: int) -> None:
        """Counts a verification of `seq.spec.proposal` that accepted `accepted` tokens and
        updates the estimates with it."""
        spec, c = seq.spec, self.counters
        c.num_drafts += 1
        c.num_draft_tokens += len(spec.proposal)
        c.num_accepted_tokens += accepted
        if spec.match:
            self.acceptance.observe(spec.match, len(spec.proposal), accepted)
        spec.verified(accepted)

    def _drafting_may_pay(self, tokens: int, sampling: int,
                          eligible: list[tuple[int, Sequence, int]], room: int) -> bool:
        """Whether a draft model's round may pay for itself, asked before it runs (its steps
        cost what a verification could gain): the cost model on proposals of the full length
        at each sequence's rate, with the rounds' measured seconds (`StepCosts.proposing`).
        Without those, yes: the first round measures them."""
        costs = self.step_costs
        if costs is None or costs.proposing is None:
            return True
        fits = in_room([min(self.proposer.num_tokens, limit) for _, _, limit in eligible], room)
        lengths = [(n, seq.spec.acceptance) for (_, seq, _), n in zip(eligible, fits) if n]
        return bool(lengths) and best_cap(tokens, sampling, lengths, costs) > 0

    def _estimate(self, seq: Sequence) -> float | list[float]:
        """The chance that each token of `seq`'s proposal is accepted once those before it were:
        its match length's curve, or a draft model's sequence's own rate."""
        spec = seq.spec
        return self.acceptance.curve(spec.match) if spec.match else spec.acceptance


def in_room(lengths: list[int], room: int) -> list[int]:
    """Each of `lengths` cut to what `room` still holds after the ones before it."""
    fits = []
    for n in lengths:
        fits.append(max(0, min(n, room)))
        room -= fits[-1]
    return fits
