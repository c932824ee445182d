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

import jax

from converters import LoadedModel, load_config
from jengine.config import EngineConfig
from jengine.core.admission import Admission
from jengine.core.build import (
    Phases,
    eos_ids,
    kv_pages,
    max_model_len,
    open_model,
    place_weights,
    resolve_backends,
    resolve_dtype,
    resolve_kv_cache_dtype,
    step_buckets,
    warm_up,
)
from jengine.core.contract import ModelInfo
from jengine.core.draft import proposer_for
from jengine.core.emit import emit_tokens
from jengine.core.grammars import LazyGrammars
from jengine.core.logprobs import prompt_targets, record_prompt_logprobs
from jengine.core.request import RequestState
from jengine.core.sampling_rows import sampling_rows
from jengine.core.stats import EngineStats
from jengine.models.layers import resolve_layer_layout
from jengine.models.quant import resolve_quantization
from jengine.outputs import RequestOutput
from jengine.runtime.buckets import Buckets
from jengine.runtime.compilation import enable_persistent_cache
from jengine.runtime.executables import ExecutableStore, ProgramReport, default_store_dir
from jengine.runtime.runner import Runner
from jengine.runtime.step_io import StepOutputs, feed_rows
from jengine.sampling_params import SamplingParams
from jengine.scheduling.batch import ScheduledBatch
from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.scheduler import Scheduler
from jengine.scheduling.sequence import Sequence
from jengine.scheduling.speculative import StepCosts
from jengine.sharding import MeshSpec, ShardingRules, check_divisible, padded_config
from jengine.sharding.distributed import DistributedSpec, StepChannel, initialize
from jengine.structured import Grammar, GrammarCompiler

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
        par = cfg.parallel
        self.distributed = DistributedSpec(coordinator=par.coordinator,
                                           num_processes=par.num_processes,
                                           process_id=par.process_id)
        initialize(self.distributed)  # before anything starts JAX's backend
        self.dtype = resolve_dtype(cfg.model.dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        self.mesh_spec = MeshSpec.parse(cfg.parallel.mesh)
        mesh = self.mesh_spec.replica_mesh(replica) if self.mesh_spec.num_devices > 1 else None
        platform, tp = jax.default_backend(), self.mesh_spec.tp
        backends = resolve_backends(cfg.model, platform, tp)  # before any weight is read
        self.layer_layout = resolve_layer_layout(cfg.model.layer_layout, platform)
        self.quantization = resolve_quantization(cfg.model.quantization, platform)
        if mesh is not None:  # before any weight is read
            check_divisible(load_config(cfg.model.model), self.mesh_spec.tp)
        loaded = loaded or open_model(cfg.model, self.dtype, self.quantization, progress)
        phases.end("open model")
        if self.quantization == "none":  # a source stored quantized: as stored
            self.quantization = loaded.quantization
        self.model_config = dataclasses.replace(padded_config(loaded.config, tp), **backends)
        self.tokenizer = loaded.tokenizer
        self.max_model_len = max_model_len(loaded, cfg.model.max_model_len)
        self.eos_token_ids = eos_ids(loaded)
        page_size = cfg.cache.page_size
        num_pages = kv_pages(cfg, self.mesh_spec, self.model_config, loaded.config.num_kv_heads,
                             self.kv_cache_dtype, self.max_model_len)
        buckets = step_buckets(cfg, self.max_model_len, backends["attention_backend"])
        sched = cfg.scheduler
        self.allocator = PageAllocator(num_pages, page_size)
        self.prefix_cache = PrefixCache(self.allocator) if cfg.cache.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            prefix_cache=self.prefix_cache,
            proposer=proposer_for(cfg, loaded, lambda c: EngineCore(
                c, progress=progress, replica=replica, warmup=warmup)),
        )
        phases.end("set up")
        if make_runner is not None:
            self.runner = make_runner(self.model_config, num_pages=num_pages,
                                      page_size=page_size, buckets=buckets)
        else:
            self.runner = self._runner(loaded, mesh, num_pages, buckets, progress, phases)
        phases.end("kv cache")
        # Verification is weighed against measured step times (None: speculation off).
        self._step_costs = None
        if self.scheduler.speculator is not None:
            self._step_costs = StepCosts(lambda n: self.runner.buckets.pick(n, 1, 1)[0])
            self.scheduler.speculator.step_costs = self._step_costs
        self._last_done = 0.0  # when the last fetched step's outputs reached the host
        self.requests: dict[str, RequestState] = {}
        self.model = ModelInfo(loaded.source, self.model_config.vocab_size, self.max_model_len,
                               self.eos_token_ids)
        self.admission = Admission(self.tokenizer, self.model_config.vocab_size,
                                   self.max_model_len, cfg.model.seed)
        self._grammars = LazyGrammars(self.tokenizer, self.model_config.vocab_size,
                                      self.eos_token_ids, cfg.scheduler.max_num_seqs)
        # A multi-host follower compiles as it follows the leader's warm-up steps.
        warm = (warmup or require_warm) and self.distributed.is_leader
        self.warmup_seconds = warm_up(self.runner, progress, require_warm) if warm else 0.0
        phases.end("step programs")
        self.start_phases = phases.seconds  # per start-up phase, in order (`generate` prints them)
        log.info("engine ready in %.1fs (%s)", sum(phases.seconds.values()), self.phase_summary())
        if self.distributed.num_processes > 1 and self.distributed.is_leader:
            atexit.register(self.runner.stop_followers)
        self._built_at_ready = self.runner.programs_built
        self.num_steps = 0
        # Wall time inside Runner.execute (device work + transfers) vs. the host work around it
        # (schedule, sampling rows, postprocess, detokenize): the gap between device steps.
        self.device_seconds = 0.0
        self.host_seconds = 0.0
        # The step dispatched ahead (async scheduling): (batch, device outputs), not yet read.
        self._inflight: _InFlight | None = None
        self.num_steps_ahead = 0  # steps dispatched before the previous step's tokens arrived

    def _runner(self, loaded: LoadedModel, mesh, num_pages: int, buckets: Buckets,
                progress: bool, phases: Phases) -> Runner:
        """The weights on the devices and the runner around them (with its KV cache)."""
        rules = ShardingRules.for_model(mesh, self.model_config) if mesh is not None else None
        params = place_weights(
            loaded, self.model_config, rules, dtype=self.dtype, quantization=self.quantization,
            layer_layout=self.layer_layout, quantize_lm_head=self.cfg.model.quantize_lm_head,
            smoothing_alpha=self.cfg.model.smoothing_alpha, progress=progress)
        phases.end("weights")
        return Runner(
            self.model_config, params, num_pages=num_pages, page_size=self.cfg.cache.page_size,
            buckets=buckets, kv_cache_dtype=self.kv_cache_dtype, rules=rules,
            channel=StepChannel(self.distributed) if self.distributed.num_processes > 1 else None,
            store=ExecutableStore(default_store_dir()),
        )

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
        return EngineStats.of(self.scheduler, self.prefix_cache, num_steps=self.num_steps,
                              compiles_since_ready=self.compiles_since_ready)

    @property
    def compiles_since_ready(self) -> int:
        """Step programs this engine built after warm-up (after construction without one);
        anything but 0 means a step shape or variant was missed."""
        return self.runner.programs_built - self._built_at_ready

    # -- requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt text or None, its token ids), checked against the vocabulary."""
        return self.admission.encode_prompt(prompt)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
        grammar: Grammar | None = None,
    ) -> RequestState:
        """Validates and queues a request. Raises ValueError for bad input (nothing is queued).

        A constrained request compiles its grammar here unless `grammar` is given: callers that
        must not block (AsyncEngine) compile it first with `grammars.submit`.
        """
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
        state = self.admission.request(request_id, prompt, params, grammar)
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
        t0 = time.perf_counter()
        device_before = self.device_seconds
        outputs = self._step()
        device = self.device_seconds - device_before
        self.host_seconds += time.perf_counter() - t0 - device
        return outputs

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
            self.num_steps_ahead += self._inflight is not None
        t0 = time.perf_counter()
        result = self.runner.fetch(step.outputs, batch.num_rows, batch.num_tokens)
        done = time.perf_counter()
        self.device_seconds += done - t0
        if self._step_costs is not None:
            # The device ran this step from its launch or the previous step's end, if later.
            self._step_costs.observe(batch.num_tokens, done - max(step.launched, self._last_done))
        self._last_done = done
        self.num_steps += 1
        if result.prompt_logprobs is not None:
            record_prompt_logprobs(batch, result, self.requests, self._piece)
        counts = self.scheduler.finalize(sampled, result.tokens)
        updated = [seq for seq, _ in sampled]
        self._advance_grammars(updated)
        touched: dict[str, RequestState] = {}
        for (seq, row), count in zip(sampled, counts):
            state = self.requests.get(seq.request_id)
            if state is None or state.error is not None or count == 0:
                continue
            try:
                emit_tokens(state, state.samples[seq.index], result, row, count,
                            self.scheduler.finish, self._piece)
            except Exception as e:  # noqa: BLE001 - one request's failure is that request's
                self._fail_request(state, e)
            touched[seq.request_id] = state
        outputs = []
        for rid, state in touched.items():
            delta = state.take_delta()
            if delta is not None:
                outputs.append(delta)
            if state.finished:
                state.finish_time = time.perf_counter()
                del self.requests[rid]
        if not self.requests:
            self._last_done = 0.0  # idle from here: the next step's wait is not a host gap
        return outputs

    def _fail_request(self, state: RequestState, error: Exception) -> None:
        """Ends one request whose host-side handling raised (a bug or input nothing checked):
        its sequences stop and free their pages, its delta carries the error, and every other
        request goes on."""
        if state.error is not None:  # already failed (and aborted) earlier in this step
            return
        log.exception("request %s failed and was aborted: %s", state.request_id, error)
        self.scheduler.abort(state.request_id)
        state.error = f"{type(error).__name__}: {error}"
        for s in state.samples:  # a failed request reports "abort", however far it got
            if not s.reported_finish:
                s.seq.finish_reason, s.seq.stop_reason = "abort", None

    def _launch(self, prev: StepOutputs | None = None,
                prev_rows: list[tuple[Sequence, int]] = ()) -> _InFlight | None:
        """Schedules one step and dispatches it without waiting; None when nothing can run.
        `prev` (the in-flight step's device outputs) and `prev_rows` (its sampled sequences and
        their rows): tokens of this step that are still PENDING read it from there."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        rows = sampling_rows(batch, self.model_config.vocab_size, self.eos_token_ids)
        rows.prompt_targets = prompt_targets(batch, self.requests)
        masks = self._grammars.masks
        if masks is not None:
            mask = masks.build(batch.seqs, batch.sample)  # [S, W]; proposals: no grammar
            rows.allowed_mask = mask if batch.spec_lens is None else mask[batch.row_seq]
        feed = feed_rows(batch, prev_rows) if prev is not None else None
        t0 = time.perf_counter()
        out = self.runner.launch(batch, rows, feed, prev if feed is not None else None)
        self.device_seconds += time.perf_counter() - t0
        costs = self._step_costs
        if costs is not None and prev is None and self._last_done:
            costs.observe_gap(t0 - self._last_done)
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

    def _advance_grammars(self, updated: list[Sequence]) -> None:
        """Feeds each constrained sequence its new token; a completed grammar ends it ("stop")."""
        for seq in updated:
            if seq.matcher is None or seq.is_finished:
                continue
            try:
                accepted = seq.matcher.accept(seq.output_ids[-1])
            except Exception as e:  # noqa: BLE001 - as in _step: this request alone fails
                self._fail_request(self.requests[seq.request_id], e)
                continue
            if not accepted:
                # The mask allows only tokens the grammar accepts, so this is a bug somewhere.
                log.error("request %s: grammar rejected token %d: %s", seq.request_id,
                          seq.output_ids[-1], seq.matcher.error)
                self.scheduler.finish(seq, "abort")
            elif seq.matcher.is_stopped:
                self.scheduler.finish(seq, "stop")

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])
