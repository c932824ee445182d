"""What a runner's warm-up builds and with what: every (bucket shape, variant) a step can
need (`programs`), and the dummy batches whose inputs select each program (`dummy_step`,
`dummy_inputs`: every token writes the scratch page 0, so running one changes no sequence).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jengine.runtime.step_io import (
    EMBED_VARIANTS,
    GREEDY_VARIANT,
    VARIANTS,
    SamplingRows,
    StepInputs,
    Variant,
)
from jengine.scheduling.batch import ScheduledBatch


def programs(runner) -> list[tuple[tuple[int, int, int], Variant]]:
    """Every (bucket shape, variant) `runner.warmup` builds: its task's variants (the
    accelerators' greedy twin of the plain one; with adapters a lora twin of each, and the
    narrow lora widths of the plain ones) for every bucket."""
    if runner.embed:
        variants = EMBED_VARIANTS
    else:
        plain = (Variant(),) + (() if runner.branches else (GREEDY_VARIANT,))
        variants = VARIANTS + plain[1:]
        if runner.loras is not None:
            variants += tuple(dataclasses.replace(v, lora=True) for v in variants)
            # plain-sampling steps that compute only the slots their batch uses
            variants += tuple(dataclasses.replace(v, lora=True, lora_width=w) for v in plain
                              for w in runner.loras.widths if w < runner.loras.max_loras)
    return [(shape, variant) for shape in runner.buckets.shapes() for variant in variants]


def dummy_inputs(runner, shape: tuple[int, int, int],
                 variant: Variant) -> tuple[StepInputs, Variant]:
    """A warm-up step's inputs for (`shape`, `variant`) on `runner`: its rows drawn for an
    accelerator's plain (not greedy) program; a narrow lora variant's slot pick forced to its
    width (the dummy batch uses no adapter)."""
    sampled = not runner.branches and not variant.greedy
    host, got = runner.host_inputs(*dummy_step(shape, variant, sampled=sampled))
    if variant.lora_width:
        host = dataclasses.replace(host, lora_pick=np.zeros((variant.lora_width,), np.int32))
    elif variant.lora and runner.loras.widths[0] < runner.loras.max_loras:
        # every slot in place (the dummy batch, using none, would gather the narrowest)
        host = dataclasses.replace(host, lora_pick=None)
    return host, variant if variant.lora else got


def dummy_batch(t: int, s: int, p: int) -> ScheduledBatch:
    """A batch of exactly bucket shape whose tokens all write the scratch page 0."""
    q_lens = np.full((s,), t // s, np.int32)
    q_lens[-1] += t - q_lens.sum()
    return ScheduledBatch(
        seq_ids=list(range(s)),
        token_ids=np.zeros((t,), np.int32),
        positions=np.zeros((t,), np.int32),
        slot_mapping=np.zeros((t,), np.int32),
        q_lens=q_lens,
        kv_lens=q_lens.copy(),
        page_table=np.zeros((s, p), np.int32),
        sample=np.ones((s,), bool),
    )


def dummy_step(shape: tuple[int, int, int], variant: Variant, *,
               sampled: bool = False) -> tuple[ScheduledBatch, SamplingRows]:
    """A batch of bucket `shape` (T, S, P) whose rows run `variant`'s program (warm-up). A
    plain variant's rows are greedy (the branch XLA:CPU's first run then sets up); `sampled`
    gives them temperature 1, which is what picks the accelerators' plain program over its
    greedy twin (`host_variant`)."""
    t, s, p = shape
    batch = dummy_batch(t, s, p)
    if variant.lora:  # adapter id 0 on every row: the lora program, no adapter applied
        batch.lora_ids = np.zeros((s,), np.int64)
    rows = SamplingRows.for_variant(s, t, variant)
    if sampled:
        rows.temperature = np.ones((s,), np.float32)
    return batch, rows
