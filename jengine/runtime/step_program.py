"""The function every step program traces: the inputs unpacked (accelerators), the token rows
that async scheduling left pending filled from the previous step's samples, a hybrid model's
prefix-cache state copies in, the family's forward, the tail (sample, embed, or prompt
logprobs: `step_io.Variant`), the copies out. `Runner` jits and compiles it per bucket and
variant; nothing here runs on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jengine.models import ModelConfig, family_module
from jengine.runtime.lora_slots import pick_slots, with_slots
from jengine.runtime.packed_inputs import PackedInputs
from jengine.runtime.sampler import sample
from jengine.runtime.step_io import (
    MAX_TOP_LOGPROBS,
    PromptLogprobs,
    StepInputs,
    StepOutputs,
    Variant,
)
from jengine.runtime.step_tail import embed_tail, head_and_sample


def step_function(cfg: ModelConfig, max_seqs: int) -> Callable:
    """`step(params, kv, inputs, prev_tokens, lora, variant) -> (StepOutputs, kv)` for `cfg`'s
    family; `max_seqs` (the largest sequence bucket) sizes the sampled tokens it keeps on the
    device for the next step's pending rows."""
    family = family_module(cfg)
    forward, head = family.forward, family.logits

    def step(params, kv, inputs: StepInputs | PackedInputs, prev_tokens, lora,
             variant: Variant):
        if isinstance(inputs, PackedInputs):  # accelerators: one transfer a step
            inputs = inputs.unpack()
        if variant.lora_width:  # a narrow lora step: only the slots its batch uses
            lora = pick_slots(lora, inputs.lora_pick)
        params = with_slots(params, lora) if variant.lora else params
        md = inputs.attention_metadata()
        # Token rows the host could not fill yet (async scheduling) take the token that the
        # previous step sampled for their sequence: feed[t] is its row there, else -1.
        feed = inputs.feed
        fed = prev_tokens[jnp.maximum(feed, 0)]
        md = dataclasses.replace(md, token_ids=jnp.where(feed >= 0, fed, md.token_ids))
        copies = inputs.state_copies  # prefix-cache snapshots in and out (hybrid models)
        kv = kv.copy_state_slots(copies[0]) if copies is not None else kv
        (out, prompt), kv, hidden = forward_and_sample(params, kv, md, inputs, variant)
        kv = kv.copy_state_slots(copies[1]) if copies is not None else kv
        # The sampled tokens, padded to one shape, stay on device for the next step's `feed`.
        tokens = jnp.zeros((max_seqs,), jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
        return StepOutputs(sampled=out, prompt=prompt, next_tokens=tokens, hidden=hidden), kv

    def forward_and_sample(params, kv, md, inputs: StepInputs, variant: Variant):
        if variant.embed:
            return embed_tail(family, params, cfg, kv, md, inputs.logits_indices.shape[0])
        k = variant.num_top_logprobs
        if not variant.prompt_logprobs:
            hidden, kv = forward(params, cfg, kv, md, head=False)  # [S, E]
            out = head_and_sample(lambda h: head(params, cfg, h), hidden, inputs.num_rows,
                                  inputs.sampling, variant, branches=cfg.branches)
            return (out, None), kv, None
        all_logits, kv = forward(params, cfg, kv, md, all_logits=True)  # [T, V]
        out = sample(all_logits[md.logits_indices], inputs.sampling, num_top_logprobs=k,
                     branches=cfg.branches)
        logprobs = jax.nn.log_softmax(all_logits, axis=-1)
        targets = jnp.maximum(inputs.targets, 0)[:, None]
        chosen = jnp.take_along_axis(logprobs, targets, axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
        prompt = PromptLogprobs(chosen=chosen, top_ids=top_ids.astype(jnp.int32),
                                top_logprobs=top_lp)
        return (out, prompt), kv, None

    return step
