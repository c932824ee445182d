"""The accelerators' step programs hold no conditional and no loop (issue 51): on a GPU each
`lax.cond` / `lax.switch` copies its predicate to the host and waits, stalling the dispatch of
the steps queued behind it, and a `while` does so every iteration.

Each step variant of a tiny random Llama is lowered with `jax.export` for CUDA (Pallas GPU
attention: a Triton custom call) and for TPU (Pallas TPU attention, per-layer weights), here on
the CPU; the kernels are custom calls whose bodies are not StableHLO, so any `case`, `if` or
`while` in the module is the step's own. The CPU's program, lowered the same way, keeps its
conditionals (the check can see them).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.models import ModelConfig, family_module
from jengine.models.config import RopeConfig
from jengine.models.fused import fuse_projections
from jengine.models.layers import random_params, unstack_layers
from jengine.runtime.buckets import Buckets
from jengine.runtime.lowering import export
from jengine.runtime.packed_inputs import PACK_MAX_BYTES, PackedInputs
from jengine.runtime.runner import Runner
from jengine.runtime.step_io import SamplingRows
from jengine.runtime.warmup_plan import dummy_inputs
from jengine.scheduling.batch import ScheduledBatch

CONTROL_FLOW = re.compile(r"stablehlo\.(case|if|while)\b")
SHAPE = (8, 8, 4)  # T, S, P: one decode-sized bucket
TARGETS = {"cuda": ("gpu", "pallas_gpu"), "tpu": ("tpu", "pallas_tpu")}


def tiny_runner(platform: str, attention_backend: str, dtype=jnp.bfloat16,
                scale: float = 1.0) -> Runner:
    """A 2-layer Llama (8 q / 2 kv heads of 64, vocab 512) with random weights (N(0, 0.02)
    times `scale`), per-layer (fused q/k/v and gate/up off the CPU), whose steps are built for
    `platform`."""
    cfg = ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
        sliding_layers=(False, False), attention_backend=attention_backend, platform=platform,
    )
    family = family_module(cfg)
    params = jax.tree.map(lambda w: w * scale, random_params(family.param_specs(cfg), dtype))
    params = unstack_layers(params, family.layer_keys, cfg.num_layers)
    if platform != "cpu":  # as the engine loads them there
        params = fuse_projections(params, cfg)
    buckets = Buckets(tokens=(SHAPE[0],), seqs=(SHAPE[1],), pages=(SHAPE[2],))
    return Runner(cfg, params, num_pages=16, page_size=16, buckets=buckets,
                  kv_cache_dtype=dtype)


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return request.param, tiny_runner(*TARGETS[request.param])


def test_accelerator_steps_hold_no_control_flow(target):
    platform, runner = target
    variants = [variant for _, variant in runner.warmup_programs()]
    assert any(v.greedy for v in variants)  # the host's pick for all-greedy batches
    for variant in variants:
        module = export(runner, SHAPE, variant, (platform,)).mlir_module()
        found = sorted(set(CONTROL_FLOW.findall(module)))
        assert not found, f"{platform} step {variant} holds {found}"
        kernel = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
        assert kernel in module  # the real kernel, not its interpreted loops


def test_cpu_step_keeps_its_branches():
    """XLA:CPU keeps the conditionals that skip unused work (the rope tables' barrier, the
    all-greedy check, the sampled rows' widths), and no greedy twin is built there."""
    runner = tiny_runner("cpu", "reference")
    variants = [variant for _, variant in runner.warmup_programs()]
    assert not any(v.greedy for v in variants)
    module = export(runner, SHAPE, variants[0], ("cpu",)).mlir_module()
    assert "case" in CONTROL_FLOW.findall(module)


def generate(runner: Runner, prompts: list[list[int]], temperature: list[float],
             steps: int) -> list[list[int]]:
    """The prompts prefilled in one step (sequence i on page i + 1), then `steps` decode steps
    of them all; each row greedy or drawn (top-p 0.9, seed i) at its temperature."""
    n = len(prompts)

    def rows(index: int) -> SamplingRows:
        r = SamplingRows.empty(n)
        r.temperature = np.float32(temperature)
        r.top_p = np.full(n, 0.9, np.float32)
        r.seeds = np.arange(n, dtype=np.uint32)
        r.steps = np.full(n, index, np.int32)
        return r

    def step(tokens: list[list[int]], start: list[int], index: int) -> list[int]:
        positions = np.concatenate([np.arange(s, s + len(t)) for s, t in zip(start, tokens)])
        owner = np.repeat(np.arange(n), [len(t) for t in tokens])
        batch = ScheduledBatch(
            seq_ids=list(range(n)), token_ids=np.int32(np.concatenate(tokens)),
            positions=np.int32(positions), slot_mapping=np.int32((owner + 1) * 16 + positions),
            q_lens=np.int32([len(t) for t in tokens]),
            kv_lens=np.int32([s + len(t) for s, t in zip(start, tokens)]),
            page_table=np.int32(np.arange(1, n + 1)[:, None]), sample=np.ones(n, bool))
        return runner.execute(batch, rows(index)).tokens.tolist()

    out = [[t] for t in step(prompts, [0] * n, 0)]
    for k in range(steps):
        new = step([[o[-1]] for o in out], [len(p) + k for p in prompts], k + 1)
        for o, t in zip(out, new):
            o.append(t)
    return out


@pytest.mark.slow  # CI: the lowering above, and the sampler without branches against the CPU's
def test_branch_free_step_generates_as_the_cpu_step():
    """The accelerators' program (no conditional: the greedy variant for an all-greedy batch,
    selects and the full-vocabulary filter for a sampled one; its inputs in one packed buffer),
    run here on the reference attention, gives the CPU program's tokens, greedy and seeded."""
    prompts = [[5, 9, 13, 2, 7], [11, 3, 60]]
    cpu = tiny_runner("cpu", "reference", jnp.float32, 3.0)
    accelerator = tiny_runner("gpu", "reference", jnp.float32, 3.0)
    greedy = generate(cpu, prompts, [0.0, 0.0], 3)
    sampled = generate(cpu, prompts, [0.0, 1.0], 3)
    assert sampled[0] == greedy[0] and sampled[1] != greedy[1]  # row 1 really draws
    assert generate(accelerator, prompts, [0.0, 0.0], 3) == greedy
    assert accelerator.programs_built == 1  # the greedy variant
    assert generate(accelerator, prompts, [0.0, 1.0], 3) == sampled
    assert accelerator.programs_built == 2  # and the plain one


def test_packed_inputs_round_trip():
    """A features step's inputs (every dtype a step sends) come out of the one buffer as they
    went in; the logit bias past PACK_MAX_BYTES travels apart."""
    runner = tiny_runner("gpu", "reference")
    variant = next(v for _, v in runner.warmup_programs() if v.features)
    host, _ = dummy_inputs(runner, SHAPE, variant)
    host.sampling = dataclasses.replace(
        host.sampling, history_is_output=np.eye(*host.sampling.history.shape, dtype=bool),
        temperature=np.linspace(0, 2, SHAPE[1], dtype=np.float32))
    packed = PackedInputs.of(host)
    assert packed.words.dtype == np.int32 and packed.apart == ()
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(jax.jit(PackedInputs.unpack)(packed)),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, np.asarray(b))
    big = PackedInputs.of({"bias": np.ones((PACK_MAX_BYTES // 4 + 1,), np.float32)})
    assert big.words.size == 0 and len(big.apart) == 1
