"""`Runner`: pads a `ScheduledBatch` to a declared bucket, runs the jitted step, returns tokens.

All `jax.jit` objects of the serving path are built here. One step program is
`forward (embed -> scanned layers over the paged cache -> last-token logits) -> sample`, with
the KV cache donated so XLA updates the pages in place. Shapes come from a small set of buckets
(tokens T, sequences S, pages per sequence P), each with three step variants (plain sampling;
every sampling feature at once; that plus prompt logprobs: `step_io.Variant`), which
`warmup()` builds and runs up front, or the first step of each compiles (lazily, offline); an
embedding engine builds only the embed variant (`step_tail.embed_tail`).

Every program is compiled ahead of time (`lower().compile()`) and kept per input signature, so a
step is dispatched without jit's retracing checks, and an `ExecutableStore` can hand back the
program a previous process compiled without tracing it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import numpy as np

from jengine.models import KVCache, ModelConfig
from jengine.runtime import lowering, warmup_plan
from jengine.runtime.buckets import Buckets
from jengine.runtime.executables import (
    ExecutableStore,
    ProgramsNotStoredError,
    compile_fresh,
    store_key,
)
from jengine.runtime.lora_slots import LoraSlots, batch_slots
from jengine.runtime.packed_inputs import PackedInputs
from jengine.runtime.step_io import (
    EMBED_VARIANTS,
    SamplingRows,
    StepInputs,
    StepOutputs,
    StepResult,
    Variant,
    host_variant,
    step_inputs,
)
from jengine.runtime.step_program import step_function
from jengine.scheduling.batch import ScheduledBatch
from jengine.sharding import ShardingRules
from jengine.sharding.distributed import StepChannel

log = logging.getLogger("jengine")


class Runner:
    """Owns the device state (params, KV cache) and the compiled step programs."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, jax.Array],
        *,
        num_pages: int,
        page_size: int,
        buckets: Buckets,
        kv_cache_dtype,
        rules: ShardingRules | None = None,
        channel: StepChannel | None = None,
        store: ExecutableStore | None = None,
        embed: bool = False,
        state_slots: int = 0,
        loras: LoraSlots | None = None,
        image_width: int | None = None,
        mrope: bool = False,
        deepstack: int = 0,
    ):
        """`rules` (tensor parallelism): `params` already sit on their shardings; the KV cache
        is created on its kv-head sharding and each step's inputs are replicated on the mesh.
        `channel` (multi-host): the leader sends every step's inputs through it; a follower
        runs `follow()` instead of being driven by a scheduler. `store`: compiled programs
        are loaded from and saved to it (single-process runs only). `embed` (task embed or
        score): every step runs the embed variant, never a sampling one. `loras`
        (`enable_lora`): the adapter slots; a batch with adapters runs the lora variants.
        `image_width` (a vision model's hidden size): every step carries image rows
        (`image_inputs.image_rows`); `mrope` (Qwen2.5-VL's) three rope positions per token
        (`image_inputs.mrope_rows`), `deepstack` (Qwen3-VL's) its K DeepStack rows.
        `state_slots`: a hybrid model's recurrent-state slots in the
        cache (running sequences + scratch)."""
        self.cfg, self.params, self.embed = cfg, params, embed
        self.branches = cfg.branches  # XLA:CPU's conditionals, or none (accelerators)
        self.loras, self.image_width, self.state_slots = loras, image_width, state_slots
        self.mrope, self.deepstack = mrope, deepstack
        self.page_size, self.num_pages, self.buckets = page_size, num_pages, buckets
        self.kv_cache_dtype = kv_cache_dtype
        self._input_sharding = rules.replicated() if rules else None
        self._channel = channel if channel is not None and channel.is_leader else None
        self._follower_channel = channel if channel is not None and not channel.is_leader else None
        self._no_tokens = self._to_device(np.zeros((buckets.seqs[-1],), np.int32))
        # Pallas kernels under tensor parallelism run in shard_map over the heads, which they
        # find from the mesh in context (jengine.pallas_kernels.backends).
        self._kernel_mesh = rules.mesh if rules and cfg.attention_backend != "reference" else None
        kv_sharding = rules.kv_cache_sharding() if rules else None
        self._devices = (tuple(rules.mesh.devices.flat) if rules
                         else tuple(jax.tree.leaves(params)[0].devices()))  # QArrays too
        # On one CPU device the cache's pages are left for the OS to map as they are first
        # written (2 GiB of zero-fill page faults is seconds of start-up otherwise).
        untouched = rules is None and self._devices[0].platform == "cpu"
        self.kv = jax.jit(
            lambda: KVCache.zeros(cfg, num_pages, page_size, kv_cache_dtype, untouched=untouched,
                                  state_slots=state_slots),
            out_shardings=KVCache.of_each(kv_sharding, rules.replicated()) if rules else None,
        )()
        max_seqs = buckets.seqs[-1]
        step = step_function(cfg, max_seqs)

        # Under a mesh the sampled tokens come back replicated, so every process can read them.
        out_shardings = None
        if rules:
            out_shardings = (rules.replicated(), KVCache.of_each(kv_sharding, rules.replicated()))
        self._step_fn = step
        self._jit_kwargs = dict(donate_argnames=("kv",), static_argnames=("variant",),
                                out_shardings=out_shardings)
        self._programs: dict[tuple, jax.stages.Compiled] = {}
        self._programs_lock = threading.Lock()
        self.store = store if jax.process_count() == 1 else None
        # What decides the step program besides its inputs' shapes (ExecutableStore's key).
        self._description = {
            "model": cfg, "kv_cache_dtype": str(kv_cache_dtype), "max_seqs": max_seqs,
            "state": jax.tree.map(_aval, (params, self.kv)),
            "out_shardings": repr(out_shardings), "kernel_mesh": repr(self._kernel_mesh),
            "lora": jax.tree.map(_aval, loras.tree) if loras is not None else None,
        }
        self.ready = False  # set by warmup(); a program built after it is logged as a stall
        self.programs_loaded = 0  # from the store
        self.programs_compiled = 0  # traced, lowered and compiled (or found by XLA's cache)

    @property
    def programs_built(self) -> int:
        """Step programs this runner has built so far, loaded or compiled."""
        return self.programs_loaded + self.programs_compiled

    # -- host -> device --------------------------------------------------------------------------

    def host_inputs(self, batch: ScheduledBatch, rows: SamplingRows,
                    feed: np.ndarray | None = None) -> tuple[StepInputs, Variant]:
        """`batch`'s padded inputs as NumPy (what a multi-host leader broadcasts)."""
        plain = not rows.has_features and rows.prompt_targets is None  # narrow lora variants
        slots, pick = batch_slots(self.loras, batch, plain) or (None, None)
        inputs, variant = step_inputs(
            batch, rows, self.buckets, blocked_queries=self.cfg.attention_backend == "reference",
            vocab_size=self.cfg.vocab_size, history_width=self.buckets.pages[-1] * self.page_size,
            feed=feed, lora_slots=slots, lora_pick=pick, image_width=self.image_width,
            state_slots=self.state_slots > 0, mrope=self.mrope, deepstack=self.deepstack)
        if self.embed:
            return inputs, EMBED_VARIANTS[0]
        return inputs, host_variant(variant, rows.temperature, branches=self.branches)

    def _to_device(self, host):  # a pytree of NumPy arrays
        if self._input_sharding is None:
            return jax.device_put(host)
        # One global array per input, replicated: works across processes too.
        sharding = self._input_sharding
        return jax.tree.map(
            lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]), host
        )

    # -- the step --------------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch, rows: SamplingRows) -> StepResult:
        """Runs one step and waits for its results (benchmarks and tests; the engine
        launches and fetches apart, to overlap the host's work with the device's)."""
        return self.fetch(self.launch(batch, rows), batch.num_rows, batch.num_tokens)

    def launch(self, batch: ScheduledBatch, rows: SamplingRows, feed: np.ndarray | None = None,
               prev: StepOutputs | None = None) -> StepOutputs:
        """Dispatches one step without waiting for it (JAX runs it asynchronously). `feed` and
        `prev` (the previous `launch`'s result) let rows take tokens the host has not seen."""
        prev_tokens = prev.next_tokens if prev is not None else None
        return self._launch(*self.host_inputs(batch, rows, feed), prev_tokens)

    def _launch(self, host: StepInputs, variant: Variant,
                prev_tokens: jax.Array | None = None) -> StepOutputs:
        """Runs one step program; a multi-host leader first sends its inputs to the followers."""
        if self._channel is not None:
            assert prev_tokens is None, "multi-host steps carry every token from the host"
            self._channel.send((host, variant))
        return self._run(host, variant, prev_tokens)

    def follow(self) -> int:
        """A multi-host follower's loop: runs every step the leader sends until it says stop.
        Returns the number of steps run."""
        steps = 0
        while (message := self._follower_channel.receive()) is not None:
            jax.block_until_ready(self._run(*message))
            steps += 1
        return steps

    def _device_inputs(self, host: StepInputs) -> StepInputs | PackedInputs:
        """What the step program takes: on accelerators the inputs packed into one buffer (one
        host-to-device copy: `packed_inputs`), on XLA:CPU the arrays themselves."""
        return host if self.branches else PackedInputs.of(host)

    def _run(self, host: StepInputs, variant: Variant,
             prev_tokens: jax.Array | None = None) -> StepOutputs:
        prev = self._no_tokens if prev_tokens is None else prev_tokens
        args = (self._to_device(self._device_inputs(host)), prev,
                self.loras.tree if variant.lora else None)
        out, self.kv = self._program(host, variant, args)(self.params, self.kv, *args)
        return out

    # -- programs --------------------------------------------------------------------------------

    @staticmethod
    def _signature(host: StepInputs, variant: Variant) -> tuple:
        leaves, tree = jax.tree.flatten(host)
        return variant, tree, tuple((a.shape, a.dtype.str) for a in leaves)

    def program_key(self, batch: ScheduledBatch, rows: SamplingRows) -> str | None:
        """The store key of the program `batch` runs (None without a store): equal keys
        mean the same executable, so anything that changes the program must change it."""
        if self.store is None:
            return None
        return self._key(self._signature(*self.host_inputs(batch, rows)))

    def _key(self, signature: tuple) -> str:
        variant, tree, shapes = signature
        described = {"variant": variant, "tree": str(tree), "shapes": shapes}
        return store_key({**self._description, "inputs": described}, self._devices)

    def _program(self, host: StepInputs, variant: Variant,
                 args: tuple) -> jax.stages.Compiled:
        """The compiled step for these inputs' shapes: built once per signature."""
        signature = self._signature(host, variant)
        program = self._programs.get(signature)
        if program is None:
            program = self._build(signature, args)
            with self._programs_lock:
                self._programs[signature] = program
        return program

    def _build(self, signature: tuple, args: tuple) -> jax.stages.Compiled:
        """Loads the program from the store, or compiles it (and stores it when fresh)."""
        start = time.perf_counter()
        variant = signature[0]
        key = None
        if self.store is not None:
            key = self._key(signature)
            program = self.store.load(key, self._devices)
            if program is not None:
                self._built("loaded", signature, start)
                return program
        name = f"step_{key[:16]}" if key else "step"  # a new key misses the persistent cache
        mesh = self._kernel_mesh
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            program, fresh = compile_fresh(
                self._step_fn, name, (self.params, self.kv, *args), {"variant": variant},
                persistent_cache=key is None, **self._jit_kwargs)
        if key is not None and fresh:
            self.store.save(key, program)
        self._built("compiled", signature, start)
        return program

    def _built(self, how: str, signature: tuple, start: float) -> None:
        """Counts and logs one program built; after ready that is a stall worth a warning."""
        with self._programs_lock:
            if how == "loaded":
                self.programs_loaded += 1
            else:
                self.programs_compiled += 1
        variant, _, shapes = signature
        t, (s, p) = shapes[0][0][1], shapes[1][0]  # token_rows [5, T], page_table [S, P]
        level = logging.WARNING if self.ready else logging.DEBUG
        log.log(level, "%s step program T=%d S=%d P=%d %s%s in %.2fs", how, t, s, p, variant,
                " after ready (a shape or variant warm-up missed)" if self.ready else "",
                time.perf_counter() - start)

    def stop_followers(self) -> None:
        """Leader: releases the followers' `follow` loops (at shutdown)."""
        if self._channel is not None:
            self._channel.send(None)
            self._channel = None

    @staticmethod
    def fetch(out: StepOutputs, n: int, num_tokens: int) -> StepResult:
        """Waits for a launched step and brings its first `n` rows' results to the host."""
        return StepResult.of(out, n, num_tokens)

    def warmup(self, progress: Callable[[int, int], None] | None = None,
               threads: int | None = None, *, require_stored: bool = False) -> float:
        """Builds (loads, or compiles in `threads` threads: one per core by default) every
        variant of every bucket's step and runs each once, but those with prompt logprobs (a
        program's first run sets up its dots on XLA:CPU: 0.2-0.5 s that the first requests
        paid). A multi-host leader builds by running, one by one, for its followers to follow.

        Raises:
          ProgramsNotStoredError: with `require_stored`, some program is not in the store
            (checked before anything is built) or could not be loaded from it.
        """
        start = time.perf_counter()
        programs = self.warmup_programs()
        if require_stored:
            self._check_stored(programs)
        if self._channel is not None:
            for i, program in enumerate(programs):
                self._run_dummy(*program)
                if progress:
                    progress(i + 1, len(programs))
        else:  # the store writes once all compiles are done (ExecutableStore.deferred)
            # Sharded: one at a time (XLA's SPMD partitioner races on shardings, jax-ml/jax#28143)
            threads = threads or (1 if len(self._devices) > 1 else os.cpu_count() or 1)
            with (self.store.deferred() if self.store else contextlib.nullcontext(),
                  ThreadPoolExecutor(threads, thread_name_prefix="jengine-compile") as pool):
                futures = [pool.submit(self._build_dummy, *program) for program in programs]
                for i, future in enumerate(as_completed(futures)):
                    future.result()
                    if progress:
                        progress(i + 1, len(programs))
            for shape, variant in programs:  # rare and costly to run: left to first use
                if not variant.prompt_logprobs:
                    self._run_dummy(shape, variant)
        if require_stored and self.programs_compiled:
            raise ProgramsNotStoredError(
                f"{self.programs_compiled} step programs were compiled: their stored files "
                "could not be loaded (see the warnings above); run `jengine compile` again")
        self.ready = True
        return time.perf_counter() - start

    def warmup_programs(self) -> list[tuple[tuple[int, int, int], Variant]]:
        """Every (bucket shape, variant) that `warmup` builds: all a step can need."""
        return warmup_plan.programs(self)

    def warmup_keys(self) -> list[str | None]:
        """The store key of each program `warmup` builds, in `warmup_programs()` order: what
        `jengine compile` stores and `serve --require-warm` needs (None without a store)."""
        if self.store is None:
            return [None] * len(self.warmup_programs())
        return [self._key(self._signature(*warmup_plan.dummy_inputs(self, shape, variant)))
                for shape, variant in self.warmup_programs()]

    def _check_stored(self, programs: list[tuple[tuple[int, int, int], Variant]]) -> None:
        if self.store is None:
            raise ProgramsNotStoredError(
                "--require-warm needs the executable store, which multi-process runs do not use")
        missing = [program for program, key in zip(programs, self.warmup_keys(), strict=True)
                   if self.store.size(key) is None]
        if missing:
            (t, s, p), variant = missing[0]
            raise ProgramsNotStoredError(
                f"{len(missing)} of {len(programs)} step programs are not stored in "
                f"{self.store.path} (the first: T={t} S={s} P={p} {variant}); run "
                "`jengine compile` with the same model and engine flags first")

    def program(self, batch: ScheduledBatch, rows: SamplingRows) -> jax.stages.Compiled:
        """The compiled step program that `batch` runs (built if need be): what warm-up
        builds, and what profiles read the HLO of."""
        host, variant = self.host_inputs(batch, rows)
        lora = self.loras.tree if variant.lora else None
        return self._program(host, variant, (self._to_device(self._device_inputs(host)),
                                             self._no_tokens, lora))

    def compiled_programs(self) -> list[jax.stages.Compiled]:
        """Every step program built so far: what a profile maps device ops back to the named
        scopes of (their HLO's op metadata)."""
        with self._programs_lock:
            return list(self._programs.values())

    def for_platform(self, platform: str, attention_backend: str, params: dict) -> Runner:
        return lowering.for_platform(self, platform, attention_backend, params)

    def export(self, shape, variant: Variant, platforms: tuple[str, ...]) -> jax.export.Exported:
        return lowering.export(self, shape, variant, platforms)

    def _build_dummy(self, shape: tuple[int, int, int], variant: Variant) -> None:
        host, variant = warmup_plan.dummy_inputs(self, shape, variant)
        lora = self.loras.tree if variant.lora else None
        self._program(host, variant, (self._to_device(self._device_inputs(host)),
                                      self._no_tokens, lora))

    def _run_dummy(self, shape: tuple[int, int, int], variant: Variant) -> None:
        out = self._launch(*warmup_plan.dummy_inputs(self, shape, variant))
        jax.block_until_ready(out.sampled.tokens)


def _aval(a: jax.Array) -> tuple:
    return (a.shape, a.dtype.str, repr(a.sharding))

