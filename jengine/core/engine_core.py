"""`EngineCore`: one model, its scheduler and runner, stepped by whoever owns it.

`Engine` steps it in the caller's thread; `AsyncEngine` steps it in its own engine thread. It is
not thread-safe by itself: exactly one thread calls `add_request`, `abort` and `step`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from collections.abc import Callable

from converters import LoadedModel
from jengine.config import EngineConfig
from jengine.core.admission import Admission, EncodedImagePrompt
from jengine.core.build import Phases, warm_up
from jengine.core.contract import ModelInfo
from jengine.core.grammars import LazyGrammars
from jengine.core.logprobs import prompt_targets
from jengine.core.pooling import PooledState
from jengine.core.postprocess import Postprocessor
from jengine.core.request import RequestState
from jengine.core.sampling_rows import sampling_rows
from jengine.core.startup import build_parts
from jengine.core.stats import EngineStats
from jengine.core.step_clock import StepClock
from jengine.lora_request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.pooling_params import PoolingParams
from jengine.runtime.compilation import enable_persistent_cache
from jengine.runtime.executables import ProgramReport
from jengine.runtime.runner import Runner
from jengine.runtime.step_io import StepOutputs, feed_rows
from jengine.sampling_params import SamplingParams
from jengine.scheduling.batch import ScheduledBatch
from jengine.scheduling.sequence import ImageRows, Sequence
from jengine.scheduling.speculative import StepCosts
from jengine.structured import Grammar, GrammarCompiler
from jengine.vision.inputs import ImagePrompt

log = logging.getLogger("jengine")


@dataclasses.dataclass
class _InFlight:
    """A step dispatched to the device whose outputs the host has not read yet."""

    batch: ScheduledBatch
    outputs: StepOutputs
    launched: float  # time.perf_counter() at dispatch


class EngineCore:
    """Owns the model on device, the scheduler, and every in-flight request; keeps the engine
    contract (`jengine.core.contract`)."""

    def __init__(
        self, cfg: EngineConfig, *, progress: bool = True, replica: int = 0,
        loaded: LoadedModel | None = None, warmup: bool = True, require_warm: bool = False,
        make_runner: Callable[..., Runner] | None = None,
    ):
        """One engine replica. `replica` picks its devices under `dp` (see jengine.sharding);
        `loaded` lets data-parallel replicas share one read of the weights from disk.
        `warmup`: build every bucket's program before returning (a server must not compile
        while it serves); False builds each on its first step (offline runs that use a few).
        `require_warm` (implies `warmup`): raise `ProgramsNotStoredError` rather than compile
        any of them (`jengine serve --require-warm`). `make_runner(model_config, num_pages=,
        page_size=, buckets=)` stands in for placing the weights and building the `Runner`: a
        model with predictable arithmetic under the real scheduler, detokenizer and server
        (tests/fake_runner.py)."""
        phases = Phases()
        enable_persistent_cache()
        self.cfg = cfg
        parts = build_parts(cfg, phases, progress=progress, replica=replica, loaded=loaded,
                            make_runner=make_runner, draft_core=lambda c: EngineCore(
                                c, progress=progress, replica=replica, warmup=warmup))
        self.distributed, self.mesh_spec = parts.distributed, parts.mesh_spec
        self.dtype, self.kv_cache_dtype = parts.dtype, parts.kv_cache_dtype
        self.layer_layout, self.quantization = parts.layer_layout, parts.quantization
        self.model_config, self.tokenizer = parts.model_config, parts.loaded.tokenizer
        self.max_model_len, self.eos_token_ids = parts.max_model_len, parts.eos_token_ids
        self.allocator, self.prefix_cache = parts.allocator, parts.prefix_cache
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.loras = parts.loras  # enable_lora: adapters on the host (runner.loras: on device)
        if self.loras is not None:
            self.loras.in_use = self._loras_in_use
        # Verification is weighed against measured step times (no costs: speculation off).
        costs = None
        if self.scheduler.speculator is not None:
            costs = StepCosts(lambda n: self.runner.buckets.pick(n, 1, 1)[0])
            self.scheduler.speculator.step_costs = costs
        self.clock = StepClock(costs)
        self.requests: dict[str, RequestState] = {}
        self.postprocess = Postprocessor(self.scheduler, self.requests, self.tokenizer,
                                         parts.pooling)
        self.pooling = parts.pooling
        self.vision, self.images = parts.vision, parts.images
        self.model = ModelInfo(parts.loaded.source, self.model_config.vocab_size,
                               self.max_model_len, self.eos_token_ids, task=cfg.model.task,
                               pooling=parts.pooling, takes_images=parts.vision is not None)
        self.admission = Admission(self.tokenizer, self.model_config.vocab_size,
                                   self.max_model_len, cfg.model.seed)
        self._grammars = LazyGrammars(self.tokenizer, self.model_config.vocab_size,
                                      self.eos_token_ids, cfg.scheduler.max_num_seqs)
        # A multi-host follower compiles as it follows the leader's warm-up steps.
        warm = (warmup or require_warm) and self.distributed.is_leader
        self.warmup_seconds = warm_up(self.runner, progress, require_warm) if warm else 0.0
        if self.vision is not None and warm:
            self.warmup_seconds += self.vision.warmup()
        phases.end("step programs")
        self.start_phases = phases.seconds  # per start-up phase, in order (`generate` prints them)
        log.info("engine ready in %.1fs (%s)", sum(phases.seconds.values()), self.phase_summary())
        if self.distributed.num_processes > 1 and self.distributed.is_leader:
            atexit.register(self.runner.stop_followers)
        self._built_at_ready = self.runner.programs_built + (
            self.vision.programs_compiled if self.vision is not None else 0)
        # The step dispatched ahead (async scheduling): (batch, device outputs), not yet read.
        self._inflight: _InFlight | None = None

    def phase_summary(self) -> str:
        """One line: each start-up phase's seconds, and how the step programs were obtained."""
        r = self.runner
        parts = [f"{name} {sec:.1f}s" for name, sec in self.start_phases.items()]
        return (", ".join(parts) + f"; programs: {r.programs_loaded} loaded, "
                f"{r.programs_compiled} compiled")

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (thread-safe; any thread may submit)."""
        return self._grammars.compiler

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters (safe from another thread)."""
        return EngineStats.of(self.scheduler, self.prefix_cache, num_steps=self.clock.num_steps,
                              compiles_since_ready=self.compiles_since_ready)

    @property
    def compiles_since_ready(self) -> int:
        """Step programs this engine built after warm-up (after construction without one);
        anything but 0 means a step shape or variant was missed."""
        vision = self.vision.programs_compiled if self.vision is not None else 0
        return self.runner.programs_built + vision - self._built_at_ready

    # -- requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt text or None, its token ids), checked against the vocabulary."""
        return self.admission.encode_prompt(prompt)

    def add_request(
        self, request_id: str, prompt: str | list[int],
        params: SamplingParams | PoolingParams | None, grammar: Grammar | None = None, *,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        """Validates and queues a request. Raises ValueError for bad input (nothing is queued).

        A constrained request compiles its grammar here unless `grammar` is given: callers that
        must not block (AsyncEngine) compile it first with `grammars.submit`. `PoolingParams`
        make an embedding request, which only an engine of task embed or score runs (and
        those run nothing else). `lora_request`: the adapter the request runs under, read
        here on its first use (a bad one is a ValueError).
        """
        if self.pooling is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("LoRA adapters apply to generation, not to embeddings")
            return self._add_pooled(request_id, prompt, params)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:
            # `self.grammars` also builds this core's mask buffer, which a grammar compiled
            # elsewhere (another data-parallel replica's compiler) does not.
            compiler = self.grammars
            grammar = grammar or compiler.compile(params.structured_outputs)
        lora_id = self.add_lora(lora_request).lora_int_id if lora_request is not None else 0
        images = None
        if isinstance(prompt, ImagePrompt):
            prompt = self.encode_images(prompt)
        if isinstance(prompt, EncodedImagePrompt):
            prompt, images = prompt.token_ids, prompt.images
        state = self.admission.request(request_id, prompt, params, grammar, images=images)
        for sample in state.samples:
            sample.seq.lora_id = lora_id
        self.requests[request_id] = state
        self.scheduler.add([s.seq for s in state.samples])
        return state

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Reads and checks an adapter (thread-safe: the server's load route calls it on its
        own thread). Raises ValueError for a bad adapter or an engine without LoRA."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError("lora_request must be a LoRARequest")
        if self.loras is None:
            raise ValueError("this engine was started without enable_lora (--enable-lora)")
        self.loras.add(lora_request)
        return lora_request

    def remove_lora(self, lora_id: int) -> None:
        """Drops an adapter's host copy. Its running requests keep their slot; one that must
        refill it reads the directory again."""
        if self.loras is not None:
            self.loras.remove(lora_id)

    def _loras_in_use(self) -> set[int]:
        """The adapter ids of queued and running requests (their host copies are kept). Any
        thread: the snapshot of `requests` is taken in one C call, under the GIL."""
        return {s.seq.lora_id for state in tuple(self.requests.values())
                for s in state.samples if s.seq.lora_id}

    def encode_images(self, prompt: ImagePrompt) -> EncodedImagePrompt:
        """An image prompt's token ids and its images through the tower (ValueError for a bad
        prompt). Safe from any thread: `AsyncEngine` calls it on its own tower thread, so the
        engine thread goes on stepping while an image encodes; `add_request` calls it for an
        `ImagePrompt` handed to it directly (offline `Engine.generate`)."""
        if self.images is None:
            if prompt.images:
                raise ValueError(f"model {self.model.source!r} does not take images")
            return EncodedImagePrompt(self.admission.encode_prompt(prompt.text)[1], None)
        ready = self.images.prepare(prompt)
        if not prompt.images:
            return EncodedImagePrompt(ready.token_ids, None)
        if self.vision is None:
            raise ValueError("this engine has no image tower on its devices")
        rows = self.vision.encode_images(ready)
        return EncodedImagePrompt(ready.token_ids, ImageRows(
            rows=rows, row_at=ready.row_at, cache_ids=ready.cache_ids, mrope=ready.mrope,
            rope_delta=ready.rope_delta))

    def _add_pooled(self, request_id: str, prompt: str | list[int],
                    params: PoolingParams | None) -> RequestState:
        """An embedding request: a one-token "generation" whose step samples nothing, so it
        ends (and frees its pages) in the step that runs its prompt's last chunk."""
        task = self.cfg.model.task
        if self.pooling is None:
            raise ValueError(f"this engine runs task {task!r}: embeddings need an engine "
                             "started with task='embed' (--task embed)")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this engine runs task {task!r}: it embeds and scores, it does "
                             "not generate (start it with task='generate')")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.pooling.check(params)
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                  truncate_prompt_tokens=params.truncate_prompt_tokens)
        state = self.admission.request(request_id, prompt, sampling, None, prefill_only=True)
        state.pooled = PooledState(self.pooling.method, len(state.prompt_ids), params)
        self.requests[request_id] = state
        self.scheduler.add([s.seq for s in state.samples])
        return state

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees its pages; returns its final (aborted) delta."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)  # every unfinished sequence ends with "abort"
        return state.take_delta()

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def follow(self) -> int:
        """Multi-host follower (process_id > 0): runs the leader's step programs until the
        leader shuts down; returns the number of steps run."""
        if self.distributed.is_leader:
            raise RuntimeError("process 0 leads; only the other processes follow")
        return self.runner.follow()

    def program_reports(self) -> list[ProgramReport]:
        r = self.runner
        return [ProgramReport.of(r.store, r.warmup_keys(), loaded=r.programs_loaded,
                                 compiled=r.programs_compiled)]

    @property
    def replicas(self) -> list[EngineCore]:
        """The engine replicas behind this core (one; `jengine.core.replicas.ReplicaSet` has dp)."""
        return [self]

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess -> detokenize; returns the deltas of this step."""
        with self.clock.step():
            return self._step()

    @property
    def num_steps(self) -> int:
        return self.clock.num_steps

    @property
    def num_steps_ahead(self) -> int:
        return self.clock.num_steps_ahead

    @property
    def device_seconds(self) -> float:
        return self.clock.device_seconds

    @property
    def host_seconds(self) -> float:
        return self.clock.host_seconds

    def _step(self) -> list[RequestOutput]:
        if self._inflight is None:
            self._inflight = self._launch()
            if self._inflight is None:
                if self.requests and not self.scheduler.has_work:
                    raise RuntimeError("requests are pending but the scheduler has no work")
                return []
        step, self._inflight = self._inflight, None
        batch = step.batch
        sampled = self.scheduler.advance(batch)
        if self._can_run_ahead(sampled):
            # Async scheduling: the next step is scheduled and dispatched now, reading this
            # step's tokens on the device, so the host work below overlaps the device's.
            self._inflight = self._launch(step.outputs, sampled)
        t0 = time.perf_counter()
        result = self.runner.fetch(step.outputs, batch.num_rows, batch.num_tokens)
        self.clock.fetched(batch.num_tokens, step.launched, t0)
        outputs = self.postprocess.step(batch, sampled, result)
        if not self.requests:
            self.clock.idle()
        return outputs

    def _launch(self, prev: StepOutputs | None = None,
                prev_rows: list[tuple[Sequence, int]] = ()) -> _InFlight | None:
        """Schedules one step and dispatches it without waiting; None when nothing can run.
        `prev` (the in-flight step's device outputs) and `prev_rows` (its sampled sequences and
        their rows): tokens of this step that are still PENDING read it from there."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        if batch.lora_ids is not None:  # its adapters into device slots, before it runs
            self.runner.loras.ensure(set(batch.lora_ids.tolist()), self.loras.layers)
        rows = sampling_rows(batch, self.model_config.vocab_size, self.eos_token_ids)
        rows.prompt_targets = prompt_targets(batch, self.requests)
        masks = self._grammars.masks
        if masks is not None:
            mask = masks.build(batch.seqs, batch.sample)  # [S, W]; proposals: no grammar
            rows.allowed_mask = mask if batch.spec_lens is None else mask[batch.row_seq]
        feed = feed_rows(batch, prev_rows) if prev is not None else None
        t0 = time.perf_counter()
        out = self.runner.launch(batch, rows, feed, prev if feed is not None else None)
        self.clock.launched(t0, ahead=prev is not None)
        return _InFlight(batch, out, t0)

    def _can_run_ahead(self, sampled: list[tuple[Sequence, int]]) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host: not
        when a sampled sequence needs its token on the host first (a grammar fills its next
        mask from it; penalties read the token history from the host)."""
        if not self.cfg.scheduler.async_scheduling or self.distributed.num_processes > 1:
            return False
        # A sequence that may speculate proposes from its last token, so it must be known.
        return not any(seq.matcher is not None or seq.params.uses_token_history
                       or seq.bad_words or self.scheduler.may_speculate(seq)
                       for seq, _ in sampled)
