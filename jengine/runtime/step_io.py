"""The types that cross the host/device line in a step, and the host-side padding between them.

host -> device: `SamplingRows` (the sampler's per-row settings, unpadded) and a
`ScheduledBatch` become one `StepInputs` (NumPy, padded to a bucket; sent whole to multi-host
followers), which `Runner` transfers in one `device_put` (on accelerators packed into one
buffer first: `packed_inputs`); its `Variant` (static) picks the step
program. device -> host: the program returns `StepOutputs` (on device; its `next_tokens` feed
the step dispatched after it); `Runner.fetch` brings back a `StepResult` with only per-row
values, never logits.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jengine.models import AttentionMetadata
from jengine.pallas_kernels import query_blocks
from jengine.runtime.buckets import QUERY_BLOCK, Buckets
from jengine.runtime.image_inputs import image_rows, mrope_rows
from jengine.runtime.sampler import SamplerOutput, SamplingArrays
from jengine.sampling_params import GREEDY_TEMPERATURE
from jengine.scheduling.batch import ScheduledBatch
from jengine.scheduling.sequence import PENDING, Sequence
from jengine.scheduling.state_snapshots import MAX_COPIES

MAX_TOP_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit too)


@dataclasses.dataclass(frozen=True)
class Variant:
    """Static features of a step program: three programs per bucket shape serve every request.

    `features` turns on everything a request may add to plain sampling at once: the top
    `MAX_TOP_LOGPROBS` logprobs, the token history (penalties, at a fixed width), a logit bias
    and a grammar mask, each given neutral values (-1 ids, zeros, all ones) for rows that do
    not use them, so a batch never needs a program of its own for its mix of features and
    `serve` can build all of them before it is ready. They cost a few [S, V] passes that plain
    steps skip. `prompt_logprobs` (with `features`) also returns every query token's logprob
    of its successor: logits for all T tokens, too costly to fold into the others.

    `embed` (an engine of task embed or score runs only this one) samples nothing: it returns
    every token's final hidden state, after the final norm, for the host to pool
    (`jengine.core.pooling`).

    `lora` (an engine with `enable_lora`) adds every projection's low-rank update from the
    adapter slots (`jengine.models.lora`); a step whose sequences use no adapter runs the
    program without it, so the base model pays nothing for the slots. `lora_width` W > 0
    (plain sampling only): the step computes only W slots, gathered by
    `StepInputs.lora_pick` (a batch using few adapters pays for those, not for every slot);
    0: all slots, in place.

    `greedy` (accelerators only: `ModelConfig.branches` False) is the plain variant for a batch
    whose rows are all greedy: the argmax, no draw. XLA:CPU skips the draw with a conditional
    inside the plain program instead, which on a GPU would wait on the host every step.
    """

    features: bool = False
    prompt_logprobs: bool = False
    embed: bool = False
    lora: bool = False
    lora_width: int = 0
    greedy: bool = False

    @property
    def num_top_logprobs(self) -> int:
        return MAX_TOP_LOGPROBS if self.features else 0


VARIANTS = (Variant(), Variant(features=True), Variant(features=True, prompt_logprobs=True))
EMBED_VARIANTS = (Variant(embed=True),)
GREEDY_VARIANT = Variant(greedy=True)  # accelerators' plain steps whose rows are all greedy


def host_variant(variant: Variant, temperature: np.ndarray, *, branches: bool) -> Variant:
    """The program a batch runs: `variant`, or its greedy twin on an accelerator (no
    `branches`) when it is the plain one and every row's `temperature` [n] is greedy."""
    if branches or variant.features or variant.embed or variant.greedy:
        return variant
    if np.all(np.asarray(temperature) < GREEDY_TEMPERATURE):
        return dataclasses.replace(variant, greedy=True)
    return variant


@dataclasses.dataclass
class SamplingRows:
    """Per-sequence sampling settings of one batch on the host, before padding."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    num_top_logprobs: int = 0
    history: list[tuple[list[int], int]] | None = None  # (prompt+output ids, num prompt ids)
    logit_bias: np.ndarray | None = None  # [n, V]
    allowed_mask: np.ndarray | None = None  # [n, W] int32
    prompt_targets: np.ndarray | None = None  # [num_tokens] next prompt token per query, or -1

    @classmethod
    def empty(cls, n: int) -> SamplingRows:
        z = np.zeros((n,), np.float32)
        return cls(
            temperature=z, top_k=np.zeros((n,), np.int32), top_p=np.ones((n,), np.float32),
            min_p=z, presence_penalty=z, frequency_penalty=z,
            repetition_penalty=np.ones((n,), np.float32), seeds=np.zeros((n,), np.uint32),
            steps=np.zeros((n,), np.int32),
        )

    @classmethod
    def for_variant(cls, n: int, num_tokens: int, variant: Variant) -> SamplingRows:
        """`n` no-op rows, for a batch of `num_tokens`, that run `variant`'s program."""
        rows = cls.empty(n)
        if variant.features:
            rows.num_top_logprobs = MAX_TOP_LOGPROBS
        if variant.prompt_logprobs:
            rows.prompt_targets = np.full((num_tokens,), -1, np.int32)
        return rows

    @property
    def has_features(self) -> bool:
        """Whether any row needs the `features` program (see `Variant`)."""
        return (self.num_top_logprobs > 0 or self.history is not None
                or self.logit_bias is not None or self.allowed_mask is not None
                or self.prompt_targets is not None)

    def padded(self, s: int, vocab_size: int, history_width: int) -> tuple[SamplingArrays, bool]:
        """These rows padded to `S = s` with no-op rows, and whether they use the features
        program; if so every feature input is present, neutral where unused, the history
        `history_width` wide (prompt + output ids never exceed it)."""

        def pad(a: np.ndarray, fill) -> np.ndarray:
            out = np.full((s, *a.shape[1:]), fill, a.dtype)
            out[: len(a)] = a
            return out

        arrays: dict[str, np.ndarray | None] = {
            "temperature": pad(self.temperature, 0.0),
            "top_k": pad(self.top_k, 0),
            "top_p": pad(self.top_p, 1.0),
            "min_p": pad(self.min_p, 0.0),
            "presence_penalty": pad(self.presence_penalty, 0.0),
            "frequency_penalty": pad(self.frequency_penalty, 0.0),
            "repetition_penalty": pad(self.repetition_penalty, 1.0),
            "seeds": pad(self.seeds, 0),
            "steps": pad(self.steps, 0),
            "history": None, "history_is_output": None, "logit_bias": None, "allowed_mask": None,
        }
        if not self.has_features:
            return SamplingArrays(**arrays), False
        hist = np.full((s, history_width), -1, np.int32)
        is_out = np.zeros((s, history_width), bool)
        for i, (ids, num_prompt) in enumerate(self.history or ()):
            hist[i, : len(ids)] = ids
            is_out[i, num_prompt: len(ids)] = True
        arrays["history"], arrays["history_is_output"] = hist, is_out
        arrays["logit_bias"] = np.zeros((s, vocab_size), np.float32)
        if self.logit_bias is not None:
            arrays["logit_bias"][: len(self.logit_bias)] = self.logit_bias
        arrays["allowed_mask"] = np.full((s, -(-vocab_size // 32)), -1, np.int32)
        if self.allowed_mask is not None:
            arrays["allowed_mask"][: len(self.allowed_mask)] = self.allowed_mask
        return SamplingArrays(**arrays), True


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    """One step's inputs, padded to its bucket (T tokens, S rows, P pages per row): NumPy on the
    host, the same tree of arrays on the device.

    The five per-token rows share one [5, T] buffer, so the step's token data is one transfer;
    `attention_metadata` and `feed` name them.
    """

    token_rows: np.ndarray  # [5, T] int32: token id, position, KV slot, sequence row, feed
    page_table: np.ndarray  # [S, P] int32 (padding rows and pages: the scratch page 0)
    logits_indices: np.ndarray  # [S] int32 flat token of each sampled row
    num_rows: np.ndarray  # [] int32 the sampled rows (the first); the rest of S is padding
    sampling: SamplingArrays  # [S] rows (see SamplingArrays)
    # Reference backend, prefill-heavy buckets only: (block_tokens [NB, B], block_seq [NB]).
    blocks: tuple[np.ndarray, np.ndarray] | None = None
    targets: np.ndarray | None = None  # [T] int32 prompt_logprobs' next prompt token, or -1
    # Hybrid models: [S] int32 each row's recurrent-state slot (padding rows: the scratch 0).
    state_slots: np.ndarray | None = None
    # Hybrid models: [2, 2, M] int32 state slot copies before / after the forward (source,
    # destination), for prefix caching's snapshots; (0, 0) pairs do nothing.
    state_copies: np.ndarray | None = None
    # lora only: [T] int32 each token's LoRA slot (its place in lora_pick, if given), -1: none
    lora_slots: np.ndarray | None = None
    lora_pick: np.ndarray | None = None  # [W] int32 the slots a narrow lora step gathers
    # Vision models only (every step, so one program per bucket serves text and images):
    # (rows [T, E] f32, at [T] int32): token t takes rows[t] where at[t] >= 0 (an image row).
    images: tuple[np.ndarray, np.ndarray] | None = None
    # Multimodal-rope models with images only (Qwen2.5-VL; every step, as `images`): each
    # token's (time, row, column) rope positions (`mrope_rows`).
    mrope_positions: np.ndarray | None = None  # [3, T] int32
    # Qwen3-VL only (every step, as `images`): the DeepStack rows of the tokens `images` names,
    # added after the first K layers.
    deepstack: np.ndarray | None = None  # [K, T, E] f32

    @property
    def feed(self):  # [T] the previous step's row whose sampled token this token is, or -1
        return self.token_rows[4]

    def attention_metadata(self) -> AttentionMetadata:
        rows = self.token_rows
        return AttentionMetadata(
            token_ids=rows[0], positions=rows[1], slot_mapping=rows[2], token_seq=rows[3],
            page_table=self.page_table, logits_indices=self.logits_indices,
            block_tokens=self.blocks[0] if self.blocks else None,
            block_seq=self.blocks[1] if self.blocks else None, lora_slots=self.lora_slots,
            state_slots=self.state_slots,
            embeds=self.images[0] if self.images else None,
            embeds_at=self.images[1] if self.images else None,
            mrope_positions=self.mrope_positions, deepstack=self.deepstack,
        )


def step_inputs(batch: ScheduledBatch, rows: SamplingRows, buckets: Buckets, *,
                blocked_queries: bool, vocab_size: int, history_width: int,
                feed: np.ndarray | None = None,
                lora_slots: np.ndarray | None = None,
                lora_pick: np.ndarray | None = None,
                image_width: int | None = None,
                state_slots: bool = False,
                mrope: bool = False, deepstack: int = 0) -> tuple[StepInputs, Variant]:
    """`batch` padded to its bucket. `feed` [num_tokens]: per token, the previous step's row
    whose sampled token it takes (-1: its own id). `lora_slots` [num_tokens]: each token's
    adapter slot (-1: none), given for a batch with adapters (the lora variant's input);
    `lora_pick` [W]: the slots the step gathers (`LoraSlots.token_slots`), None: all.
    `blocked_queries`: build the query blocks that the reference attention reads in
    prefill-heavy buckets. `vocab_size` and
    `history_width` size the features program's inputs (`SamplingRows.padded`).
    `state_slots` (a hybrid model's steps, warm-up included): pass each row's recurrent-state
    slot.
    `image_width` (a vision model's hidden size): carry the image rows of the prompt tokens
    this step computes (`image_rows`). `mrope` (Qwen2.5-VL): carry three rope positions per
    token (`mrope_rows`). `deepstack` (Qwen3-VL): the K DeepStack rows per image token too.

    Raises:
      ValueError: the batch has more sampled rows than its bucket's S.
    """
    n_tok, n_seq, n_row = batch.num_tokens, batch.num_seqs, batch.num_rows
    t, s, p = buckets.pick(n_tok, n_row, batch.page_table.shape[1])
    if s < n_row:
        raise ValueError(f"{n_row} sampled rows exceed the sequence bucket {s} of {t} tokens")
    token_rows = np.zeros((5, t), np.int32)
    token_rows[4] = -1
    if feed is not None:
        token_rows[4, :n_tok] = feed
    token_rows[0, :n_tok] = batch.token_ids
    token_rows[1, :n_tok] = batch.positions
    token_rows[2, :n_tok] = batch.slot_mapping
    token_rows[3, :n_tok] = np.repeat(np.arange(n_seq, dtype=np.int32), batch.q_lens)
    page_table = np.zeros((s, p), np.int32)
    page_table[:n_seq, : batch.page_table.shape[1]] = batch.page_table
    logits_indices = np.zeros((s,), np.int32)
    logits_indices[:n_row] = batch.logits_indices
    sampling, features = rows.padded(s, vocab_size, history_width)
    blocks = None  # only the reference backend reads them; the kernels block on device
    if blocked_queries and buckets.blocked(t):
        blocks = query_blocks(batch.q_lens, t, buckets.num_blocks(t), QUERY_BLOCK)
    targets = None
    if rows.prompt_targets is not None:
        targets = np.full((t,), -1, np.int32)
        targets[:n_tok] = rows.prompt_targets
    slots = None
    state = copies = None
    if state_slots:
        state = np.zeros((s,), np.int32)
        if batch.state_slots is not None:
            state[:n_seq] = batch.state_slots
        copies = (batch.state_copies if batch.state_copies is not None
                  else np.zeros((2, 2, MAX_COPIES), np.int32))
    if lora_slots is not None:
        slots = np.full((t,), -1, np.int32)
        slots[:n_tok] = lora_slots
    variant = Variant(features=features, prompt_logprobs=targets is not None,
                      lora=slots is not None,
                      lora_width=len(lora_pick) if lora_pick is not None else 0)
    images = deep = None
    if image_width:
        rows, at = image_rows(batch, t, image_width, 1 + deepstack)
        images, deep = (rows[0], at), (rows[1:] if deepstack else None)
    inputs = StepInputs(token_rows=token_rows, page_table=page_table,
                        logits_indices=logits_indices, num_rows=np.asarray(n_row, np.int32),
                        sampling=sampling, blocks=blocks, targets=targets, lora_slots=slots,
                        lora_pick=lora_pick,
                        images=images, state_slots=state, state_copies=copies,
                        mrope_positions=mrope_rows(batch, t) if mrope else None,
                        deepstack=deep)
    return inputs, variant


def feed_rows(batch: ScheduledBatch,
              sampled: list[tuple[Sequence, int]]) -> np.ndarray | None:
    """Per token of `batch`, the previous step's row holding its token (-1: known here)."""
    pending = np.flatnonzero(batch.token_ids == PENDING)
    if pending.size == 0:
        return None
    row_of = {id(seq): row for seq, row in sampled}
    owners = np.searchsorted(batch.cu_q_lens[1:], pending, side="right")
    feed = np.full((batch.num_tokens,), -1, np.int32)
    for t, i in zip(pending.tolist(), owners.tolist()):
        feed[t] = row_of[id(batch.seqs[i])]  # only the step in flight leaves PENDING
    return feed


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs:
    """The prompt_logprobs variant's extra outputs, one row per query token."""

    chosen: jax.Array  # [T] f32 logprob of `targets[t]` given the tokens up to t
    top_ids: jax.Array  # [T, MAX_TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_TOP_LOGPROBS] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutputs:
    """What a step program returns (besides the donated KV cache), on the device."""

    sampled: SamplerOutput  # [S] rows
    prompt: PromptLogprobs | None
    next_tokens: jax.Array  # [max S] int32 the sampled tokens, padded: the next step's `feed`
    hidden: jax.Array | None = None  # [T, E] f32 normed final hidden states (embed variant)


@dataclasses.dataclass
class StepResult:
    """What comes back to the host: only per-sequence values, never logits."""

    tokens: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] f32 raw logprob of the chosen token
    top_ids: np.ndarray | None  # [S, K] int32
    top_logprobs: np.ndarray | None  # [S, K] f32
    # Only from the prompt_logprobs variant, one row per query token:
    prompt_logprobs: np.ndarray | None = None  # [T] f32 logprob of `targets[t]` given tokens <= t
    prompt_top_ids: np.ndarray | None = None  # [T, MAX_TOP_LOGPROBS] int32
    prompt_top_logprobs: np.ndarray | None = None  # [T, MAX_TOP_LOGPROBS] f32
    hidden: np.ndarray | None = None  # [num_tokens, E] f32, the embed variant only

    @classmethod
    def of(cls, out: StepOutputs, n: int, num_tokens: int) -> StepResult:
        """Waits for a launched step's `out` and brings its first `n` rows' results (and
        the first `num_tokens` tokens' per-token ones) to the host."""
        # Outputs are replicated over the mesh; reading one local copy works on every process.
        host, prompt = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)),
                                    (out.sampled, out.prompt))
        k = host.top_ids.shape[-1] if host.top_ids is not None else 0
        result = cls(
            tokens=np.asarray(host.tokens[:n]),
            logprobs=np.asarray(host.logprobs[:n]),
            top_ids=np.asarray(host.top_ids[:n]) if k else None,
            top_logprobs=np.asarray(host.top_logprobs[:n]) if k else None,
        )
        if out.hidden is not None:
            result.hidden = np.asarray(out.hidden.addressable_data(0))[:num_tokens]
        if prompt is not None:
            result.prompt_logprobs = prompt.chosen[:num_tokens]
            result.prompt_top_ids = prompt.top_ids[:num_tokens]
            result.prompt_top_logprobs = prompt.top_logprobs[:num_tokens]
        return result
