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

import re

import jax.numpy as jnp
import pytest

from jengine.models import ModelConfig, family_module
from jengine.models.config import RopeConfig
from jengine.models.fused import fuse_projections
from jengine.models.layers import random_params, unstack_layers
from jengine.runtime.buckets import Buckets
from jengine.runtime.runner import Runner

CONTROL_FLOW = re.compile(r"stablehlo\.(case|if|while)\b")
SHAPE = (8, 8, 4)  # T, S, P: one decode-sized bucket
TARGETS = {"cuda": ("gpu", "pallas_gpu"), "tpu": ("tpu", "pallas_tpu")}


def tiny_runner(platform: str, attention_backend: str) -> Runner:
    """A 2-layer Llama (8 q / 2 kv heads of 64, vocab 512) with random bf16 weights, per-layer
    (fused q/k/v and gate/up off the CPU), whose steps are built for `platform`."""
    cfg = ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0),
        sliding_layers=(False, False), attention_backend=attention_backend, platform=platform,
    )
    family = family_module(cfg)
    params = random_params(family.param_specs(cfg), jnp.bfloat16)
    params = unstack_layers(params, family.layer_keys, cfg.num_layers)
    if platform != "cpu":  # as the engine loads them there
        params = fuse_projections(params, cfg)
    buckets = Buckets(tokens=(SHAPE[0],), seqs=(SHAPE[1],), pages=(SHAPE[2],))
    return Runner(cfg, params, num_pages=16, page_size=16, buckets=buckets,
                  kv_cache_dtype=jnp.bfloat16)


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return request.param, tiny_runner(*TARGETS[request.param])


def test_accelerator_steps_hold_no_control_flow(target):
    platform, runner = target
    variants = [variant for _, variant in runner.warmup_programs()]
    assert any(v.greedy for v in variants)  # the host's pick for all-greedy batches
    for variant in variants:
        module = runner.export(SHAPE, variant, (platform,)).mlir_module()
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
    module = runner.export(SHAPE, variants[0], ("cpu",)).mlir_module()
    assert "case" in CONTROL_FLOW.findall(module)
