"""A vision model's per-token step inputs, cut from the encoded images each sequence keeps on
the host (`ImageRows`): the rows of the placeholders a step computes and, for Qwen-VL's
multimodal rope, each token's three positions. `step_io.step_inputs` pads them into
`StepInputs.images` / `.deepstack` / `.mrope_positions`.
"""

from __future__ import annotations

import numpy as np

from jengine.scheduling.batch import ScheduledBatch


def image_rows(batch: ScheduledBatch, t: int, width: int,
               depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """([depth, T, width] f32, [T] int32): the encoded image row (and, depth > 1, its DeepStack
    rows) of each prompt placeholder this step computes (a prefill chunk may start or end
    inside an image), -1 / zeros elsewhere."""
    rows = np.zeros((depth, t, width), np.float32)
    at = np.full((t,), -1, np.int32)
    starts = batch.cu_q_lens[:-1]
    for seq, start, q in zip(batch.seqs, starts.tolist(), batch.q_lens.tolist()):
        images = seq.images
        if images is None:
            continue
        pos = batch.positions[start:start + q]
        prompt = pos < len(images.row_at)
        which = np.where(prompt, images.row_at[np.minimum(pos, len(images.row_at) - 1)], -1)
        hits = np.flatnonzero(which >= 0)
        encoded = images.rows if images.rows.ndim == 3 else images.rows[None]
        rows[:, start + hits] = encoded[:, which[hits]]
        at[start + hits] = start + hits
    return rows, at


def mrope_rows(batch: ScheduledBatch, t: int) -> np.ndarray:
    """[3, T] int32: each token's (time, row, column) rope positions: a prompt token of a
    sequence with images takes its precomputed ones (`ImageRows.mrope`), a later token its
    index plus the sequence's `rope_delta` in all three, any other token its index."""
    out = np.zeros((3, t), np.int32)
    n = batch.num_tokens
    out[:, :n] = batch.positions[:n]
    starts = batch.cu_q_lens[:-1]
    for seq, start, q in zip(batch.seqs, starts.tolist(), batch.q_lens.tolist()):
        images = seq.images
        if images is None or images.mrope is None:
            continue
        pos = batch.positions[start:start + q]
        prompt = pos < images.mrope.shape[1]
        table = images.mrope[:, np.minimum(pos, images.mrope.shape[1] - 1)]
        out[:, start:start + q] = np.where(prompt[None], table, pos[None] + images.rope_delta)
    return out
