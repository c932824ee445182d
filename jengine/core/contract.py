"""The engine contract: what `Engine`, `AsyncEngine`, the server, the CLI and the benchmarks may
use of a core. Two classes keep it: `EngineCore` (one replica) and `ReplicaSet` (`dp`
replicas), so everything above them works the same with one replica or eight. Whatever is not
here is a core's own business; tests/test_layers.py checks that nothing above reaches past it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from jengine.config import EngineConfig
from jengine.core.admission import EncodedImagePrompt
from jengine.core.pooling import Pooling
from jengine.core.request import RequestState
from jengine.core.stats import EngineStats
from jengine.lora_request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.pooling_params import PoolingParams
from jengine.runtime.executables import ProgramReport
from jengine.sampling_params import SamplingParams
from jengine.structured import Grammar, GrammarCompiler
from jengine.vision.inputs import ImagePrompt


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What callers need to know of the model served, whatever its source."""

    source: str  # the file or directory the weights came from
    vocab_size: int  # token ids are in [0, vocab_size) (tensor-parallel padding included)
    max_model_len: int  # prompt + output tokens of one sequence, at most
    eos_token_ids: tuple[int, ...]  # every id that ends a sequence unless ignore_eos
    task: str = "generate"  # generate | embed | score (jengine.core.pooling)
    pooling: Pooling | None = None  # how an embedding task pools; None when it generates
    takes_images: bool = False  # a vision model: prompts may hold images


class CoreContract(Protocol):
    """One thread owns a core and calls `add_request`, `abort` and `step`; `stats`,
    `grammars` and the read-only attributes are safe from any thread."""

    cfg: EngineConfig  # the settings it was built with (a preset and keywords resolved)
    model: ModelInfo
    tokenizer: Any  # a transformers tokenizer: chat templates, tokenizing prompts for callers

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars off the engine thread (AsyncEngine submits them
        first, so a slow grammar never stalls the step loop)."""

    @property
    def replicas(self) -> list[Any]:
        """The `EngineCore` of each data-parallel replica (one without dp): per-replica
        reports such as `program_report`."""

    @property
    def has_unfinished(self) -> bool:
        """Whether any request still runs or waits: the step loop's condition."""

    @property
    def warmup_seconds(self) -> float:
        """Seconds spent building step programs at start-up (reported by the CLI)."""

    @property
    def compiles_since_ready(self) -> int:
        """Step programs built after warm-up: nonzero means a serving stall (a metric)."""

    @property
    def num_steps(self) -> int:
        """Engine steps run (benchmarks divide host and device time by it)."""

    @property
    def host_seconds(self) -> float:
        """Wall seconds of host work between device steps (scheduling, detokenizing)."""

    @property
    def device_seconds(self) -> float:
        """Wall seconds inside device calls and transfers."""

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """A prompt's text and checked token ids, for callers that count or route tokens."""

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None,
                    grammar: Grammar | None = None, *,
                    lora_request: LoRARequest | None = None) -> RequestState:
        """Validates and queues one request (ValueError, and nothing queued, on bad input);
        `lora_request`: the LoRA adapter it runs under."""

    def encode_images(self, prompt: ImagePrompt) -> EncodedImagePrompt:
        """An image prompt prepared and through the tower (any thread; ValueError for a bad
        one), for `add_request` to admit without encoding on the engine thread."""

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Reads and checks a LoRA adapter (any thread); ValueError for a bad one."""

    def remove_lora(self, lora_id: int) -> None:
        """Forgets an adapter (any thread); requests using it finish first."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees what it holds; its final delta, if it ran."""

    def reset_prefix_cache(self) -> int:
        """Drops the cached pages no request holds and zeroes the prefix-cache counters (so
        the server's start-up requests leave nothing behind); returns the pages freed."""

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; the deltas of the requests it advanced."""

    def stats(self) -> EngineStats:
        """A snapshot of load and counters (`/metrics`, benchmarks, `Engine.stats()`)."""

    def follow(self) -> int:
        """Multi-host followers: run the leader's steps until it stops."""

    def program_reports(self) -> list[ProgramReport]:
        """Per replica, how its step programs were obtained (`jengine compile`)."""


CONTRACT_MEMBERS = frozenset(
    {"cfg", "model", "tokenizer"}
    | {name for name in vars(CoreContract) if not name.startswith("_")}
)
