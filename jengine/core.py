"""`EngineCore`: one model, its scheduler and runner, stepped by whoever owns it.

`Engine` steps it in the caller's thread; `AsyncEngine` steps it in its own engine thread. It is
not thread-safe by itself: exactly one thread calls `add_request`, `abort` and `step`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import random
import sys
import threading
import time

import jax
import numpy as np
from tqdm import tqdm

from converters import LoadedModel, load_config, load_source
from jengine.compilation import compile_count, enable_persistent_cache
from jengine.config import EngineConfig
from jengine.detokenizer import IncrementalDetokenizer
from jengine.executables import ExecutableStore, default_store_dir
from jengine.kv_budget import host_kv_budget
from jengine.logprobs import prompt_targets, ranked, record_prompt_logprobs
from jengine.models import KVCache, family_module
from jengine.models.layers import resolve_layer_layout, resolve_matmul_backend, unstack_layers
from jengine.models.quant import quantize_params, resolve_quantization
from jengine.outputs import RequestOutput
from jengine.page_allocator import PageAllocator
from jengine.pallas_kernels import resolve_backend
from jengine.prefix_cache import PrefixCache
from jengine.request import RequestState, SampleState
from jengine.runner import Buckets, Runner, SamplingRows, StepResult
from jengine.sampling_params import SamplingParams, check_text
from jengine.scheduler import Scheduler
from jengine.sequence import PENDING, Sequence
from jengine.sharding import (
    MeshSpec,
    ShardingRules,
    check_divisible,
    load_params_sharded,
    padded_config,
)
from jengine.sharding.distributed import DistributedSpec, StepChannel, initialize
from jengine.speculative import NgramProposer, StepCosts
from jengine.stats import EngineStats
from jengine.structured import Grammar, GrammarCompiler
from jengine.structured.bitmask import StepMasks

log = logging.getLogger("jengine")

DEFAULT_MAX_MODEL_LEN = 2048


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """auto -> the model dtype (so greedy tokens stay those of the model's own precision)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"unsupported kv_cache_dtype {kv_cache_dtype!r}; use auto, float32 or bfloat16")
    return kv_cache_dtype


def resolve_dtype(dtype: str) -> str:
    """auto -> float32 on CPU (XLA:CPU bfloat16 is several times slower), bfloat16 elsewhere."""
    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return dtype


class _Phases:
    """Wall seconds between successive `end(name)` calls."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


class EngineCore:
    """Owns the model on device, the scheduler, and every in-flight request."""

    def __init__(
        self, cfg: EngineConfig, *, progress: bool = True, replica: int = 0,
        loaded: LoadedModel | None = None, warmup: bool = True, require_warm: bool = False,
    ):
        """One engine replica. `replica` picks its devices under `dp` (see jengine.sharding);
        `loaded` lets data-parallel replicas share one read of the weights from disk.
        `warmup`: build every bucket's program before returning (a server must not compile
        while it serves); False builds each on its first step (offline runs that use a few).
        `require_warm` (implies `warmup`): raise `ProgramsNotStoredError` rather than compile
        any of them (`jengine serve --require-warm`)."""
        phases = _Phases()
        enable_persistent_cache()
        self.cfg = cfg
        par = cfg.parallel
        self.distributed = DistributedSpec(
            coordinator=par.coordinator, num_processes=par.num_processes,
            process_id=par.process_id,
        )
        initialize(self.distributed)  # before anything starts JAX's backend
        self.dtype = resolve_dtype(cfg.model.dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        self.mesh_spec = MeshSpec.parse(cfg.parallel.mesh)
        mesh = self.mesh_spec.replica_mesh(replica) if self.mesh_spec.num_devices > 1 else None
        backend = resolve_backend(cfg.model.attention_backend, jax.default_backend())
        self.layer_layout = resolve_layer_layout(cfg.model.layer_layout, jax.default_backend())
        self.quantization = resolve_quantization(cfg.model.quantization, jax.default_backend())
        if mesh is not None:  # before any weight is read
            check_divisible(load_config(cfg.model.model), self.mesh_spec.tp)
        if loaded is None:
            loaded = load_source(cfg.model.model, dtype=self.dtype, progress=progress, lazy=True)
        phases.end("open model")
        self.loaded_source = loaded.source
        if self.quantization == "none":  # a checkpoint converted with --quantization: as stored
            self.quantization = loaded.quantization
        self.model_config = dataclasses.replace(
            padded_config(loaded.config, self.mesh_spec.tp), attention_backend=backend,
            matmul_backend=resolve_matmul_backend(cfg.model.matmul_backend,
                                                  jax.default_backend(), self.mesh_spec.tp),
        )
        self.tokenizer = loaded.tokenizer
        self.max_model_len = self._max_model_len(loaded)
        self.eos_token_ids = self._eos_ids(loaded)
        page_size = cfg.cache.page_size
        budget = host_kv_budget(cfg.cache.kv_cache_memory, self.mesh_spec,
                                loaded.config.num_kv_heads, par.num_processes)
        num_pages = budget // KVCache.bytes_per_page(
            self.model_config, page_size, self.kv_cache_dtype)
        max_pages = -(-self.max_model_len // page_size)
        if num_pages < max_pages + 1:
            raise ValueError(
                f"kv_cache_memory {cfg.cache.kv_cache_memory} holds {num_pages} pages; one "
                f"sequence of max_model_len {self.max_model_len} needs {max_pages + 1}"
            )
        sched = cfg.scheduler
        if sched.max_num_seqs > sched.max_num_batched_tokens:
            raise ValueError("max_num_seqs cannot exceed max_num_batched_tokens")
        default = Buckets.default(sched.max_num_batched_tokens, sched.max_num_seqs, max_pages,
                                  min_tokens=1 if jax.default_backend() == "cpu" else 8)
        buckets = Buckets(
            tokens=sched.token_buckets or default.tokens,
            seqs=sched.seq_buckets or default.seqs,
            pages=sched.page_buckets or default.pages,
        )
        if (buckets.tokens[-1] < sched.max_num_batched_tokens
                or buckets.seqs[-1] < min(sched.max_num_seqs, sched.max_num_batched_tokens)
                or buckets.pages[-1] < max_pages):
            raise ValueError(f"buckets {buckets} do not cover the scheduler limits")
        self.allocator = PageAllocator(num_pages, page_size)
        self.prefix_cache = PrefixCache(self.allocator) if cfg.cache.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            prefix_cache=self.prefix_cache,
            proposer=_proposer(cfg),
        )
        phases.end("set up")
        rules = ShardingRules.for_model(mesh, self.model_config) if mesh is not None else None
        params = self._place_weights(loaded, rules, progress)
        phases.end("weights")
        self.runner = Runner(
            self.model_config, params, num_pages=num_pages, page_size=page_size,
            buckets=buckets, kv_cache_dtype=self.kv_cache_dtype, rules=rules,
            channel=StepChannel(self.distributed) if self.distributed.num_processes > 1 else None,
            store=ExecutableStore(default_store_dir()),
        )
        phases.end("kv cache")
        if self.scheduler.proposer is not None:
            self.scheduler.step_costs = StepCosts(
                lambda n: self.runner.buckets.pick(n, 1, 1)[0])
        self._last_done = 0.0  # when the last fetched step's outputs reached the host
        self.requests: dict[str, RequestState] = {}
        self._rng = random.Random(cfg.model.seed)  # None: seeded from the OS
        self._seq_counter = 0
        self._grammars: GrammarCompiler | None = None  # built on first use (~0.5 s)
        self._grammars_lock = threading.Lock()
        self._masks: StepMasks | None = None
        # A multi-host follower compiles as it follows the leader's warm-up steps.
        warm = (warmup or require_warm) and self.distributed.is_leader
        self.warmup_seconds = self._warmup(progress, require_warm) if warm else 0.0
        phases.end("step programs")
        # Seconds per start-up phase, in order (what `jengine generate` prints on stderr).
        self.start_phases = phases.seconds
        log.info("engine ready in %.1fs (%s)", sum(phases.seconds.values()), self.phase_summary())
        if self.distributed.num_processes > 1 and self.distributed.is_leader:
            atexit.register(self.runner.stop_followers)
        self.compiles_at_ready = compile_count()
        self.num_steps = 0
        # Wall time inside Runner.execute (device work + transfers) vs. the host work around it
        # (schedule, sampling rows, postprocess, detokenize): the gap between device steps.
        self.device_seconds = 0.0
        self.host_seconds = 0.0
        # The step dispatched ahead (async scheduling): (batch, device outputs), not yet read.
        self._inflight: tuple | None = None
        self.num_steps_ahead = 0  # steps dispatched before the previous step's tokens arrived

    # -- set-up ---------------------------------------------------------------------------------

    def _place_weights(self, loaded: LoadedModel, rules: ShardingRules | None,
                       progress: bool) -> dict:
        """`loaded`'s weights on the devices, quantized and in the model's layer layout."""
        cfg = self.model_config
        family = family_module(cfg)
        specs = family.param_specs(cfg)
        host = {name: loaded.params.get(name) for name in specs}
        if (rules is None and self.quantization == "none" and self.layer_layout == "unstacked"
                and loaded.kind != "checkpoint"
                and all(w is not None and tuple(w.shape) == specs[name].shape
                        for name, w in host.items())):
            # One device, float weights on the host: split the layers there (views) and place
            # each once. Placing the stacks and splitting them on the device costs a jitted
            # split per weight and a second copy of every layer (~1 s for SmolLM2 on CPU).
            stacked = {name: np.asarray(w) for name, w in host.items()}
            return jax.device_put(unstack_layers(stacked, family.LAYER_KEYS, cfg.num_layers))
        # Each device's slice is read on its own (safetensors slices; Orbax onto shardings).
        params = load_params_sharded(
            loaded, cfg, rules.param_shardings(specs) if rules else None, self.dtype,
            progress=progress,
        )
        # Quantized from the float weights, whatever their source, shard by shard in place.
        params = quantize_params(
            params, specs, self.quantization, tied_embeddings=cfg.tie_word_embeddings,
            lm_head=self.cfg.model.quantize_lm_head, delete_float=True,
        )
        if self.layer_layout == "unstacked":
            params = unstack_layers(params, family.LAYER_KEYS, cfg.num_layers,
                                    delete_stacked=True)
        return params

    def phase_summary(self) -> str:
        """One line: each start-up phase's seconds, and how the step programs were obtained."""
        r = self.runner
        parts = [f"{name} {sec:.1f}s" for name, sec in self.start_phases.items()]
        return (", ".join(parts) + f"; programs: {r.programs_loaded} loaded, "
                f"{r.programs_compiled} compiled")

    def _max_model_len(self, loaded: LoadedModel) -> int:
        limit = loaded.config.max_position_embeddings
        wanted = self.cfg.model.max_model_len
        if wanted is None:
            if limit > DEFAULT_MAX_MODEL_LEN:
                log.info("max_model_len %d by default (the model allows %d; --max-model-len "
                         "raises it, at the cost of KV pages per sequence)",
                         DEFAULT_MAX_MODEL_LEN, limit)
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if wanted < 2 or wanted > limit:
            raise ValueError(f"max_model_len {wanted} must be between 2 and the model's {limit}")
        return wanted

    def _eos_ids(self, loaded: LoadedModel) -> tuple[int, ...]:
        ids = set(loaded.config.eos_token_ids)
        gen_eos = loaded.generation_config.get("eos_token_id")
        if gen_eos is not None:
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        if loaded.tokenizer.eos_token_id is not None:
            ids.add(int(loaded.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def _warmup(self, progress: bool, require_stored: bool) -> float:
        bar = tqdm(total=len(self.runner.buckets.shapes()), desc="step programs (load/compile)",
                   disable=not progress, file=sys.stderr, unit="program")

        def tick(done: int, total: int) -> None:
            bar.update(done - bar.n)

        try:
            seconds = self.runner.warmup(tick, require_stored=require_stored)
        finally:
            bar.close()
        return seconds

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (thread-safe; any thread may submit)."""
        with self._grammars_lock:
            if self._grammars is None:
                from jengine.structured.llguidance_backend import LLGuidanceBackend

                backend = LLGuidanceBackend(self.tokenizer, self.model_config.vocab_size,
                                            self.eos_token_ids)
                self._masks = StepMasks(backend, self.cfg.scheduler.max_num_seqs,
                                        self.model_config.vocab_size)
                self._grammars = GrammarCompiler(backend)
            return self._grammars

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters. Safe to call from another thread:
        it only reads (the scheduler's lists are copied first, atomically under the GIL)."""
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        cache = self.prefix_cache
        stats = EngineStats(
            num_requests_running=len({s.request_id for s in running}),
            num_requests_waiting=len({s.request_id for s in waiting}),
            kv_pages_total=self.allocator.num_pages - 1,  # page 0 is the scratch page
            kv_pages_used=self.allocator.num_used - self.allocator.num_evictable,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            compiles_since_ready=self.compiles_since_ready,
            spec_num_drafts=self.scheduler.spec_counters.num_drafts,
            spec_num_draft_tokens=self.scheduler.spec_counters.num_draft_tokens,
            spec_num_accepted_tokens=self.scheduler.spec_counters.num_accepted_tokens,
        )
        if cache is not None:
            c = cache.stats
            stats.prefix_cache_pages = cache.num_pages
            stats.prefix_cache_queries = c.queries
            stats.prefix_cache_query_tokens = c.query_tokens
            stats.prefix_cache_hit_tokens = c.hit_tokens
            stats.prefix_cache_evicted_pages = c.evicted_pages
            stats.prefix_cache_duplicate_pages = c.duplicate_pages
        return stats

    @property
    def compiles_since_ready(self) -> int:
        """Programs compiled after warm-up; anything but 0 means a step shape was missed."""
        return compile_count() - self.compiles_at_ready

    # -- requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, prompt = check_text("prompt", prompt), self.tokenizer(prompt).input_ids
        elif not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string or a list of token ids")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        # Also guards text: a GGUF tokenizer may add special tokens the embedding table lacks.
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return text, ids

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
        text, ids = self.encode_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        self._check_token_ids(params)
        bad_words = self._bad_word_ids(params.bad_words)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"length {self.max_model_len}"
            )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        samples = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=self._next_seq_id(), request_id=request_id, index=index,
                prompt_ids=ids, params=params, seed=(base_seed + index) % (1 << 32),
                max_tokens=max_tokens, arrival=time.perf_counter(),
                matcher=grammar.matcher() if params.structured_outputs is not None else None,
                bad_words=bad_words,
            )
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop or (),
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            samples.append(SampleState(seq=seq, detok=detok))
        state = RequestState(request_id, text, ids, params, samples)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(ids)
        self.requests[request_id] = state
        self.scheduler.add([s.seq for s in samples])
        return state

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = sorted(t for t in ids if not 0 <= t < vocab)
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): "
                                 f"{bad[:5]}")

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, as written alone and after a space (vLLM does both)."""
        found = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids:
                    found.add(ids)
        return tuple(sorted(found))

    def _next_seq_id(self) -> int:
        self._seq_counter += 1
        return self._seq_counter

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees its pages; returns its final (aborted) delta."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        return state.take_delta()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def follow(self) -> int:
        """Multi-host follower (process_id > 0): runs the leader's step programs until the
        leader shuts down; returns the number of steps run."""
        if self.distributed.is_leader:
            raise RuntimeError("process 0 leads; only the other processes follow")
        return self.runner.follow()

    @property
    def replicas(self) -> list[EngineCore]:
        """The engine replicas behind this core (one; `jengine.replicas.ReplicaSet` has dp)."""
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
        batch, out, launched = self._inflight
        self._inflight = None
        sampled = self.scheduler.advance(batch)
        if self._can_run_ahead(sampled):
            # Async scheduling: the next step is scheduled and dispatched now, reading this
            # step's tokens on the device, so the host work below overlaps the device's.
            self._inflight = self._launch(prev=(out, sampled))
            self.num_steps_ahead += self._inflight is not None
        t0 = time.perf_counter()
        result = self.runner.fetch(out, batch.num_rows, batch.num_tokens)
        done = time.perf_counter()
        self.device_seconds += done - t0
        if self.scheduler.step_costs is not None:
            # The device ran this step from its launch or the previous step's end, if later.
            self.scheduler.step_costs.observe(batch.num_tokens,
                                              done - max(launched, self._last_done))
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
                self._emit_tokens(state, state.samples[seq.index], result, row, count)
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
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"

    def _launch(self, prev: tuple | None = None) -> tuple | None:
        """Schedules one step and dispatches it without waiting; None when nothing can run.
        `prev` = (the in-flight step's device outputs, its sampling rows): rows of this step
        whose last token is still PENDING read it from there."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        rows = self._sampling_rows(batch)
        rows.prompt_targets = prompt_targets(batch, self.requests)
        if self._masks is not None:
            mask = self._masks.build(batch.seqs, batch.sample)  # [S, W]; proposals: no grammar
            rows.allowed_mask = mask if batch.spec_lens is None else mask[batch.row_seq]
        feed = self._feed(batch, prev[1]) if prev is not None else None
        t0 = time.perf_counter()
        out = self.runner.launch(batch, rows, feed, prev[0] if feed is not None else None)
        self.device_seconds += time.perf_counter() - t0
        costs = self.scheduler.step_costs
        if costs is not None and prev is None and self._last_done:
            costs.observe_gap(t0 - self._last_done)  # nothing ran on the device meanwhile
        return batch, out, t0

    @staticmethod
    def _feed(batch, sampled: list[tuple[Sequence, int]]) -> np.ndarray | None:
        """Per token of `batch`, the previous step's row holding its token (-1: known here)."""
        pending = np.flatnonzero(batch.token_ids == PENDING)
        if pending.size == 0:
            return None
        row_of = {id(seq): row for seq, row in sampled}
        owners = np.searchsorted(batch.cu_q_lens[1:], pending, side="right")
        feed = np.full((batch.num_tokens,), -1, np.int32)
        for t, i in zip(pending.tolist(), owners.tolist()):
            feed[t] = row_of[id(batch.seqs[i])]  # only the step in flight leaves PENDING
        return feed

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

    def _emit_tokens(self, state: RequestState, sample: SampleState, result: StepResult,
                     row: int, count: int) -> None:
        """Hands the sequence's `count` new tokens (rows `row`, `row + 1`, ...) to its output,
        one at a time: a stop string ends it at the token that completes it, and any accepted
        tokens after that one are dropped, as plain decoding would never have made them."""
        seq = sample.seq
        if state.first_token_time is None:
            state.first_token_time = time.perf_counter()
        first = len(seq.output_ids) - count
        for j in range(count):
            token = seq.output_ids[first + j]
            r = row + j
            sample.new_ids.append(token)
            if state.params.logprobs is not None:
                top = result.top_ids is not None
                sample.new_logprobs.append(ranked(
                    token, result.logprobs[r], result.top_ids[r] if top else None,
                    result.top_logprobs[r] if top else None, state.params.logprobs,
                    self._piece,
                ))
            delta = sample.detok.add_tokens([token])
            text = delta.text
            last = j == count - 1
            if delta.stop_string is not None:
                del seq.output_ids[first + j + 1:]
                self.scheduler.finish(seq, "stop", delta.stop_string)
                last = True
            elif last and seq.is_finished:
                text += sample.detok.flush().text
            sample.new_text += text
            sample.text += text
            if last:
                break
        if seq.is_finished:
            sample.finish_reason, sample.stop_reason = seq.finish_reason, seq.stop_reason

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _sampling_rows(self, batch) -> SamplingRows:
        """One row per sampled row of `batch`: a verifying sequence's row j draws its output
        token len(output_ids) + j, with that step's key (jengine/speculative.py)."""
        seqs = batch.seqs
        offsets = np.zeros((batch.num_rows,), np.int32)
        if batch.spec_lens is not None:
            row_seq = batch.row_seq
            seqs = [seqs[i] for i in row_seq]
            offsets = np.arange(batch.num_rows, dtype=np.int32) - batch.row_starts[row_seq]
        n = len(seqs)
        ps = [s.params for s in seqs]
        rows = SamplingRows(
            temperature=np.asarray([p.temperature for p in ps], np.float32),
            top_k=np.asarray([p.top_k for p in ps], np.int32),
            top_p=np.asarray([p.top_p for p in ps], np.float32),
            min_p=np.asarray([p.min_p for p in ps], np.float32),
            presence_penalty=np.asarray([p.presence_penalty for p in ps], np.float32),
            frequency_penalty=np.asarray([p.frequency_penalty for p in ps], np.float32),
            repetition_penalty=np.asarray([p.repetition_penalty for p in ps], np.float32),
            seeds=np.asarray([s.seed for s in seqs], np.uint32),
            steps=np.asarray([len(s.output_ids) for s in seqs], np.int32) + offsets,
        )
        if any(p.logprobs is not None for p in ps):
            rows.num_top_logprobs = 20
        if any(p.uses_token_history for p in ps):
            rows.history = [(s.prompt_ids + s.output_ids, len(s.prompt_ids)) for s in seqs]
        banned = [self._banned_now(s) | _bad_word_tokens(s) for s in seqs]
        allowed = [p.allowed_token_ids for p in ps]
        if any(p.logit_bias for p in ps) or any(banned) or any(allowed):
            bias = np.zeros((n, self.model_config.vocab_size), np.float32)
            for i, (p, ban, allow) in enumerate(zip(ps, banned, allowed)):
                if allow is not None:
                    bias[i] = -np.inf
                    bias[i, list(allow)] = 0.0
                for tid, b in (p.logit_bias or {}).items():  # ids checked at admission
                    bias[i, tid] += b
                bias[i, list(ban)] = -np.inf
            rows.logit_bias = bias
        return rows

    def _banned_now(self, seq: Sequence) -> set[int]:
        """Stop tokens masked while a sequence is still short of min_tokens."""
        p = seq.params
        if len(seq.output_ids) >= p.min_tokens or seq.matcher is not None:
            return set()  # a grammar decides itself when EOS may come
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops |= set(self.eos_token_ids)
        return stops


def _proposer(cfg: EngineConfig) -> NgramProposer | None:
    """The proposer of `cfg.speculative` (None: speculation off)."""
    spec = cfg.speculative
    if spec.method is None:
        return None
    if spec.method == "draft":
        raise ValueError("speculative 'draft' (a draft model) is not supported yet; use 'ngram'")
    if spec.method != "ngram":
        raise ValueError(f"unknown speculative method {spec.method!r}; use 'ngram'")
    return NgramProposer(num_tokens=spec.num_tokens, ngram_min=spec.ngram_min,
                         ngram_max=spec.ngram_max)


def _bad_word_tokens(seq: Sequence) -> set[int]:
    """The tokens that would complete one of the sequence's bad words now: a word's last
    token when the tokens generated just before are the rest of the word."""
    if not seq.bad_words:
        return set()
    out = seq.output_ids
    banned = set()
    for word in seq.bad_words:
        head = list(word[:-1])
        if len(head) <= len(out) and (not head or out[len(out) - len(head):] == head):
            banned.add(word[-1])
    return banned
