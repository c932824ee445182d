"""A stand-in for the `Runner` with predictable arithmetic, so the real `EngineCore`, scheduler,
detokenizer, `AsyncEngine` and server run end to end without a model or a compile.

It is the scheduler harness's fake model (`scheduler_harness.FakeRunner`: a fake paged cache,
each sampled row's token a fixed function of the tokens read back through its page table and of
the sequence's seed), mapped onto ordinary vocabulary ids, behind the runner's interface:
`launch` resolves the tokens an async step left PENDING from the previous launch's outputs, as
the device does, and `fetch` returns a `StepResult`. A sequence's output therefore depends on its
prompt and seed alone, however the engine batches, chunks, preempts or runs ahead, and
`expected_ids` says what it must be.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scheduler_harness import FakeRunner, solo_tokens

from jengine.async_engine import AsyncEngine
from jengine.core.engine_core import EngineCore
from jengine.engine import build_config
from jengine.runtime.step_io import MAX_TOP_LOGPROBS, StepResult
from jengine.scheduling.sequence import PENDING

BASE = 1000  # fake tokens are BASE + [0, 50): ordinary words in SmolLM2's vocabulary


def expected_ids(prompt_ids: list[int], seed: int, num: int) -> list[int]:
    """The tokens a sequence with this prompt and seed generates, run alone."""
    out, context = [], list(prompt_ids)
    for _ in range(num):
        [token] = solo_tokens(context, seed, 1)
        out.append(BASE + token)
        context.append(BASE + token)
    return out


@dataclasses.dataclass
class _Launched:
    result: StepResult
    next_tokens: np.ndarray  # [R] what a later launch's `feed` reads


class ArithmeticRunner:
    """The engine's runner interface over the fake model (see the module docstring)."""

    def __init__(self, model_config, *, num_pages: int, page_size: int, buckets):
        self.buckets = buckets
        self.model = FakeRunner(num_pages, page_size)
        self.programs_loaded = self.programs_compiled = 0
        self.programs_built = 0
        self.steps = 0

    def warmup(self, progress=None, threads=None, *, require_stored: bool = False) -> float:
        return 0.0

    def warmup_programs(self) -> list:
        return []

    def warmup_keys(self) -> list[str | None]:
        return []

    def launch(self, batch, rows, feed=None, prev: _Launched | None = None) -> _Launched:
        token_ids = batch.token_ids
        if feed is not None:
            token_ids = np.where(feed >= 0, prev.next_tokens[np.maximum(feed, 0)], token_ids)
        assert PENDING not in token_ids, "a PENDING token was left for the step"
        fed = dataclasses.replace(batch, token_ids=token_ids)
        tokens = self.model(fed).astype(np.int32) + BASE
        self.steps += 1
        n, k = batch.num_rows, rows.num_top_logprobs
        result = StepResult(tokens=tokens, logprobs=np.zeros(n, np.float32),
                            top_ids=None, top_logprobs=None)
        if k:
            result.top_ids = tokens[:, None] + np.arange(k, dtype=np.int32)
            result.top_logprobs = -np.arange(k, dtype=np.float32)[None].repeat(n, 0)
        if rows.prompt_targets is not None:
            t = batch.num_tokens
            result.prompt_logprobs = np.zeros(t, np.float32)
            result.prompt_top_ids = np.zeros((t, MAX_TOP_LOGPROBS), np.int32)
            result.prompt_top_logprobs = np.zeros((t, MAX_TOP_LOGPROBS), np.float32)
        return _Launched(result, tokens)

    @staticmethod
    def fetch(out: _Launched, n: int, num_tokens: int) -> StepResult:
        return out.result

    def stop_followers(self) -> None:
        pass

    def follow(self) -> int:
        raise RuntimeError("the fake runner has no followers")


def fake_async_engine(**overrides) -> AsyncEngine:
    """The real `EngineCore` (`--config test`, plus `build_config` keyword overrides such as
    `seed`) and engine thread over `ArithmeticRunner`."""
    core = EngineCore(build_config(None, "test", **overrides), progress=False,
                      make_runner=ArithmeticRunner)
    engine = AsyncEngine.__new__(AsyncEngine)
    engine._start(core)  # the real engine thread, over the fake model
    return engine
