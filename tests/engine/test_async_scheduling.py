"""Async scheduling (step N+1 dispatched before step N's tokens reach the host, its PENDING
tokens read on the device) must change nothing but timing: the same workload gives identical
outputs with it on and off, including stops that the host only sees one step late (EOS, stop
ids, stop strings), n > 1, logprobs, seeded sampling, penalties (which turn it off per step),
and preemption."""

from __future__ import annotations

import contextlib
import dataclasses

from kv_pool import small_kv_pool  # tests/kv_pool.py

from jengine import SamplingParams

PROMPTS = [
    "The capital of France is", "List three colors:", "def add(a, b):",
    "Q: What is 2+2?\nA:", "Write a haiku about rain.", "Once upon a time",
]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0),  # may stop at EOS
    SamplingParams(max_tokens=20, temperature=0, stop=["\n"]),  # stop string
    SamplingParams(max_tokens=18, temperature=0.8, seed=7, n=2, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[28], min_tokens=2),
    SamplingParams(max_tokens=16, temperature=0.7, seed=3, top_p=0.9, top_k=40),
    SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3),  # no run-ahead
]


@contextlib.contextmanager
def _async_scheduling(core, on: bool):
    saved = core.cfg
    core.cfg = dataclasses.replace(
        saved, scheduler=dataclasses.replace(saved.scheduler, async_scheduling=on)
    )
    try:
        yield
    finally:
        core.cfg = saved


def _summary(outputs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          [sorted((t, round(lp.logprob, 4)) for t, lp in d.items()) for d in (c.logprobs or [])])
         for c in o.outputs]
        for o in outputs
    ]


def test_async_scheduling_changes_no_output(smol_engine):
    core = smol_engine.core
    with _async_scheduling(core, False):
        before = core.num_steps_ahead
        expected = _summary(smol_engine.generate(PROMPTS, PARAMS))
        assert core.num_steps_ahead == before
    with _async_scheduling(core, True):
        before = core.num_steps_ahead
        got = _summary(smol_engine.generate(PROMPTS, PARAMS))
        ran_ahead = core.num_steps_ahead - before
    assert got == expected
    assert ran_ahead > 5, ran_ahead
    assert {c[2] for o in expected for c in o} >= {"stop", "length"}


def test_async_scheduling_with_preemption(smol_engine):
    core = smol_engine.core
    params = SamplingParams(max_tokens=20, temperature=0)
    with _async_scheduling(core, False):
        expected = _summary(smol_engine.generate(PROMPTS * 2, params))
    preempted = core.scheduler.num_preemptions
    with small_kv_pool(core, 8), _async_scheduling(core, True):  # 7 usable pages, 12 requests
        assert _summary(smol_engine.generate(PROMPTS * 2, params)) == expected
        assert core.scheduler.num_preemptions > preempted
        assert core.stats().kv_pages_used == 0
