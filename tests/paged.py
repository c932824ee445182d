"""Test helper: run sequences through a model's paged KV path the way the engine does.

`run_paged` prefills the prompt in fixed-size chunks (the last one padded, padding tokens
writing into the scratch page 0), then feeds the remaining tokens one decode step at a time
(teacher forcing), and returns the float32 logits at every position. The sequence's pages are
drawn shuffled from the pool and never include page 0, so page boundaries and out-of-order
pages are both exercised. `greedy_paged` runs several prompts the same way, then decodes them
together (one ragged step of S tokens), argmax feeding each step.

Only JAX and numpy are used here: the real-model tests run this in a process without torch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import AttentionMetadata, KVCache, ModelConfig, family_module, layer_offsets
from jengine.models.layers import unstack_layers

PAD_TOKEN = 0  # token id of padding slots (any valid id works: their rows are discarded)


def _forward(params, kv, md, *, cfg: ModelConfig, all_logits: bool):
    return family_module(cfg).forward(params, cfg, kv, md, all_logits=all_logits)


# jit caches one program per (cfg, all_logits, shapes): a chunk shape and a decode shape.
_step = jax.jit(_forward, static_argnames=("cfg", "all_logits"), donate_argnames=("kv",))


def _unpack(model: Any, layer_layout: str = "as_given") -> tuple[ModelConfig, dict]:
    """(config, device params); `layer_layout="unstacked"` splits stacked layer weights into
    per-layer arrays (the CPU default's layout), "as_given" keeps whichever the params have."""
    cfg, params = (model.config, model.params) if hasattr(model, "config") else model
    params = jax.tree.map(jnp.asarray, dict(params))
    if layer_layout == "unstacked" and "layers" not in params:
        params = unstack_layers(params, family_module(cfg).layer_keys, cfg.num_layers,
                                first_layer=layer_offsets(cfg))
    return cfg, params


class _PagedBatch:
    """Page tables of S sequences over one shuffled pool, and the metadata of each step."""

    def __init__(self, cfg: ModelConfig, max_lens: list[int], page_size: int, seed: int):
        self.page_size = page_size
        counts = [-(-n // page_size) for n in max_lens]
        num_pages = 2 * sum(counts) + 3  # spare pages, so each sequence's ids are scattered
        pool = iter(np.random.default_rng(seed).permutation(np.arange(1, num_pages)))
        # One padding entry (page 0) past the longest row, as a bucketed page table has.
        self.page_table = np.zeros((len(max_lens), max(counts) + 1), np.int32)  # [S, Pmax]
        for row, count in enumerate(counts):
            pages = [next(pool) for _ in range(count)]
            if count > 1 and pages == sorted(pages):
                pages.reverse()  # always out of order
            self.page_table[row, :count] = pages
        self.kv = KVCache.zeros(cfg, num_pages, page_size, jnp.float32,
                                state_slots=len(max_lens) + 1)  # hybrids: slot r + 1

    def metadata(self, rows: list[tuple[int, list[int], int]], bucket: int) -> AttentionMetadata:
        """One step's metadata: (sequence, tokens, first position) per row, flattened and
        padded to `bucket` tokens with padding tokens that write into the scratch page 0."""
        seqs = np.zeros(bucket, np.int32)
        positions = np.zeros(bucket, np.int32)
        slots = np.arange(bucket, dtype=np.int32) % self.page_size  # padding: scratch page 0
        ids = np.full(bucket, PAD_TOKEN, np.int32)
        last = []
        at = 0
        for seq, tokens, start in rows:
            n = len(tokens)
            pos = np.arange(start, start + n)
            seqs[at:at + n] = seq
            positions[at:at + n] = pos
            pages = self.page_table[seq, pos // self.page_size]
            slots[at:at + n] = pages * self.page_size + pos % self.page_size
            ids[at:at + n] = tokens
            at += n
            last.append(at - 1)
        return AttentionMetadata(
            token_ids=jnp.asarray(ids),
            positions=jnp.asarray(positions),
            slot_mapping=jnp.asarray(slots),
            token_seq=jnp.asarray(seqs),
            page_table=jnp.asarray(self.page_table),
            logits_indices=jnp.asarray(last, jnp.int32),
        )


def _prefill(
    params, cfg, batch: _PagedBatch, seq: int, prompt: list[int], chunk: int, all_logits: bool,
    images: tuple[np.ndarray, np.ndarray] | None = None, mrope: np.ndarray | None = None,
) -> np.ndarray:
    """Prefills sequence `seq` in chunks; returns its [len(prompt), V] logits with `all_logits`,
    else the [V] logits of its last token (the engine's `logits_indices` path). `images`:
    encoded image rows [M, E] ([1 + K, M, E] with DeepStack's) and, per prompt token, the row it
    takes or -1 (chunks may cut an image anywhere). `mrope`: the prompt's [3, P] multimodal
    rope positions."""
    rows = []
    for start in range(0, len(prompt), chunk):
        tokens = prompt[start:start + chunk]
        md = batch.metadata([(seq, tokens, start)], chunk)
        if images is not None:
            at = np.full(chunk, -1, np.int32)
            at[: len(tokens)] = images[1][start:start + len(tokens)]
            md.embeds, md.embeds_at = jnp.asarray(images[0]), jnp.asarray(at)
            if images[0].ndim == 3:  # [1 + K, M, E]: Qwen3-VL's rows, then its DeepStack rows
                md.embeds, md.deepstack = jnp.asarray(images[0][0]), jnp.asarray(images[0][1:])
        if mrope is not None:
            rope = np.zeros((3, chunk), np.int32)
            rope[:, : len(tokens)] = mrope[:, start:start + len(tokens)]
            md.mrope_positions = jnp.asarray(rope)
        logits, batch.kv = _step(params, batch.kv, md, cfg=cfg, all_logits=all_logits)
        rows.append(np.asarray(logits[: len(tokens)]))
    return np.concatenate(rows) if all_logits else rows[-1][0]


def run_paged(
    model: Any,
    token_ids: list[int],
    *,
    prefill_chunk: int = 7,
    decode_steps: int = 8,
    page_size: int = 4,
    seed: int = 0,
    layer_layout: str = "as_given",
    images: tuple[np.ndarray, np.ndarray] | None = None,
    mrope: tuple[np.ndarray, int] | None = None,
) -> np.ndarray:
    """Float32 logits [N, V] for every position of `token_ids` through the paged path.

    Args:
      model: a `LoadedModel`, or a `(ModelConfig, params)` pair.
      token_ids: the N tokens; the first N - decode_steps are prefilled in chunks of
        `prefill_chunk`, the rest go through single-token decode steps.
      page_size: tokens per KV page (small, so a short sequence spans many pages).
      seed: shuffles the sequence's page ids.
      layer_layout: "unstacked" runs the per-layer loop instead of the scan (see `_unpack`).
      images: encoded image rows and the row each prompt token takes (see `_prefill`).
      mrope: multimodal rope positions [3, N - decode_steps] of the prompt and the offset a
        decoded token's three positions take over its index (Qwen2.5-VL's rope_deltas).
    """
    cfg, params = _unpack(model, layer_layout)
    token_ids = [int(t) for t in token_ids]
    num_prompt = len(token_ids) - decode_steps
    if num_prompt < 1:
        raise ValueError("decode_steps must leave at least one prompt token")
    batch = _PagedBatch(cfg, [len(token_ids)], page_size, seed)
    rows = [_prefill(params, cfg, batch, 0, token_ids[:num_prompt], prefill_chunk, True, images,
                     mrope[0] if mrope else None)]
    for pos in range(num_prompt, len(token_ids)):
        md = batch.metadata([(0, [token_ids[pos]], pos)], 1)
        if mrope is not None:
            md.mrope_positions = jnp.full((3, 1), pos + mrope[1], jnp.int32)
        logits, batch.kv = _step(params, batch.kv, md, cfg=cfg, all_logits=False)
        rows.append(np.asarray(logits))
    return np.concatenate(rows).astype(np.float32)


def greedy_paged(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    prefill_chunk: int = 16,
    page_size: int = 16,
    seed: int = 0,
    layer_layout: str = "as_given",
) -> list[list[int]]:
    """Greedy continuations of several prompts: each prompt prefilled in chunks, then every
    sequence decoded together, one token per sequence per step (a ragged decode batch);
    `layer_layout` as `run_paged`'s."""
    cfg, params = _unpack(model, layer_layout)
    prompts = [[int(t) for t in p] for p in prompts]
    batch = _PagedBatch(cfg, [len(p) + max_new_tokens for p in prompts], page_size, seed)
    outs = [
        [int(np.argmax(_prefill(params, cfg, batch, i, p, prefill_chunk, False)))]
        for i, p in enumerate(prompts)
    ]
    for k in range(max_new_tokens - 1):
        rows = [(i, [out[-1]], len(p) + k) for i, (p, out) in enumerate(zip(prompts, outs))]
        logits, batch.kv = _step(
            params, batch.kv, batch.metadata(rows, len(rows)), cfg=cfg, all_logits=False
        )
        for out, row in zip(outs, np.asarray(logits)):
            out.append(int(np.argmax(row)))
    return outs
