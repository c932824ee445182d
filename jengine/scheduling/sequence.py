"""`Sequence`: one sample of one request as the scheduler tracks it (host-side state only)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

# A sampled token the host has not received yet (async scheduling): the step that samples it
# is still running, and the next step reads it on the device (`Runner.launch(feed=...)`).
PENDING = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs (re)prefill; holds no pages unless it shares a parent's
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, eq=False)
class ImageRows:
    """A prompt's images as the text model takes them: the vision encoder's output rows and
    the prompt tokens they replace."""

    rows: np.ndarray  # [M, E] float32, the placeholders' rows in prompt order ([1 + K, M, E]
    # with Qwen3-VL's DeepStack rows after them)
    row_at: np.ndarray  # [P] int32 per prompt token: its row of `rows`, -1 for text
    cache_ids: list[int]  # the prompt ids, placeholders keyed by image content (negative ids)
    # Multimodal rope (Qwen2.5-VL): the prompt's [3, P] int32 (time, row, column) positions,
    # and what a later token adds to its index (HF's rope_deltas); None: one position a token.
    mrope: np.ndarray | None = None
    rope_delta: int = 0


@dataclasses.dataclass(eq=False)
class Sequence:
    """Tokens, pages and progress of one sequence.

    `num_computed` counts tokens whose K/V are in the cache; the sequence still has to run
    `num_tokens - num_computed` tokens through the model (1 for a plain decode).
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's `n` samples this is
    prompt_ids: list[int]
    params: Any  # SamplingParams
    seed: int
    max_tokens: int  # resolved: never past the context length
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    arrival: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache when first admitted
    num_cached_pages: int = 0  # leading `pages` known to be the prefix cache's (not re-compared)
    # The first of `pages` the prefix cache does not take (it holds another copy that a running
    # sequence holds): from there on the sequence's pages stay its own. None: it takes them all.
    own_pages_from: int | None = None
    # Set on a request's first sample while its siblings wait to share its prompt pages.
    pending_forks: list[Sequence] = dataclasses.field(default_factory=list)
    # The grammar state of a constrained sequence (`jengine.structured.Matcher`): it has consumed
    # exactly `output_ids`, so preemption by recompute keeps it as it is.
    matcher: Any = None
    # SamplingParams.bad_words as token ids (each word alone and after a space).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Speculative decoding (`jengine.scheduling.speculative.SpecState`); None while it never
    # speculated.
    spec: Any = None
    # A hybrid model's recurrent-state slot (`jengine.scheduling.state_slots`) while it runs.
    state_slot: int | None = None
    # Prefix caching on a hybrid model (`state_snapshots`): the snapshot slot it resumes from
    # when admitted, the one its current step's chunk snapshots into, and where the cached
    # prefix it matched ended without a snapshot (its prefill stops there once, to take one).
    resume_from: int | None = None
    snapshot_to: int | None = None
    snapshot_cut: int | None = None
    # The LoRA adapter it runs under (`LoRARequest.lora_int_id`); 0: the base model.
    lora_id: int = 0
    # The prompt's encoded images (vision models); kept until the sequence ends, as a preempted
    # sequence computes its prompt again.
    images: ImageRows | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def cache_tokens(self, start: int, end: int) -> list[int]:
        """`tokens`, with each image placeholder replaced by a key of its image's content: what
        the prefix cache matches, so a page of one image's rows is never another image's."""
        if self.images is None:
            return self.tokens(start, end)
        return (self.images.cache_ids + self.output_ids)[start:end]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]
