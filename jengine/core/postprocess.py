"""`Postprocessor`: a fetched step's tokens become its requests' deltas.

In order: prompt logprobs recorded, the sampled sequences' tokens accepted by the scheduler
(stops, proposals verified), each constrained sequence's grammar fed its token, the new tokens
detokenized into their requests (`core.emit`), and the deltas taken. A request whose host-side
handling raises fails alone (`fail_request`); every other request goes on.
"""

from __future__ import annotations

import logging
import time

from jengine.core.emit import emit_tokens
from jengine.core.logprobs import record_prompt_logprobs
from jengine.core.pooling import Pooling
from jengine.core.request import RequestState
from jengine.outputs import RequestOutput
from jengine.runtime.step_io import StepResult
from jengine.scheduling.batch import ScheduledBatch
from jengine.scheduling.scheduler import Scheduler
from jengine.scheduling.sequence import Sequence

log = logging.getLogger("jengine")


class Postprocessor:
    """Owns nothing: it works on the core's scheduler and request table."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, RequestState], tokenizer,
                 pooling: Pooling | None = None):
        self.scheduler = scheduler
        self.requests = requests
        self.tokenizer = tokenizer
        self.pooling = pooling  # an embedding engine's (its steps return hidden rows)

    def step(self, batch: ScheduledBatch, sampled: list[tuple[Sequence, int]],
             result: StepResult) -> list[RequestOutput]:
        """The deltas of the requests this step touched; finished requests leave the table."""
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(batch, result, self.requests, self.piece)
        if result.hidden is not None:
            self._pool(batch, result.hidden)
        counts = self.scheduler.finalize(sampled, result.tokens)
        self._advance_grammars([seq for seq, _ in sampled])
        touched: dict[str, RequestState] = {}
        for (seq, row), count in zip(sampled, counts):
            state = self.requests.get(seq.request_id)
            if state is None or state.error is not None or count == 0:
                continue
            if state.pooled is not None:  # its prompt has run: the vector, no token
                state.embedding = self.pooling.finish(state.pooled.vector(),
                                                      state.pooled.params)
                touched[seq.request_id] = state
                continue
            try:
                emit_tokens(state, state.samples[seq.index], result, row, count,
                            self.scheduler.finish, self.piece)
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's
                self.fail_request(state, e)
            touched[seq.request_id] = state
        outputs = []
        for rid, state in touched.items():
            delta = state.take_delta()
            if delta is not None:
                outputs.append(delta)
            if state.finished:
                state.finish_time = time.perf_counter()
                del self.requests[rid]
        return outputs

    def fail_request(self, state: RequestState, error: Exception) -> None:
        """Ends one request whose host-side handling raised (a bug or input nothing checked):
        its sequences stop and free their pages, its delta carries the error, and every other
        request goes on."""
        if state.error is not None:  # already failed (and aborted) earlier in this step
            return
        log.exception("request %s failed and was aborted: %s", state.request_id, error)
        self.scheduler.abort(state.request_id)
        state.error = f"{type(error).__name__}: {error}"
        for s in state.samples:  # a failed request reports "abort", however far it got
            if not s.reported_finish:
                s.seq.finish_reason, s.seq.stop_reason = "abort", None

    def _advance_grammars(self, updated: list[Sequence]) -> None:
        """Feeds each constrained sequence its new token; a completed grammar ends it ("stop")."""
        for seq in updated:
            if seq.matcher is None or seq.is_finished:
                continue
            try:
                accepted = seq.matcher.accept(seq.output_ids[-1])
            except Exception as e:  # noqa: BLE001 - as in `step`: this request alone fails
                self.fail_request(self.requests[seq.request_id], e)
                continue
            if not accepted:
                # The mask allows only tokens the grammar accepts, so this is a bug somewhere.
                log.error("request %s: grammar rejected token %d: %s", seq.request_id,
                          seq.output_ids[-1], seq.matcher.error)
                self.scheduler.finish(seq, "abort")
            elif seq.matcher.is_stopped:
                self.scheduler.finish(seq, "stop")

    def _pool(self, batch: ScheduledBatch, hidden) -> None:
        """Folds each embedding request's rows of this step ([num_tokens, E]) into its pool."""
        bounds = batch.cu_q_lens
        for i, seq in enumerate(batch.seqs):
            state = self.requests.get(seq.request_id)
            if state is None or state.pooled is None:
                continue
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            state.pooled.add(batch.positions[lo:hi], hidden[lo:hi])

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token])
