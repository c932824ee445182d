"""`Runner`: pads a `ScheduledBatch` to a declared bucket, runs the jitted step, returns tokens.

All `jax.jit` objects of the serving path are built here. One step program is
`forward (embed -> scanned layers over the paged cache -> last-token logits) -> sample`, with
the KV cache donated so XLA updates the pages in place. Shapes come from a small set of buckets
(tokens T, sequences S, pages per sequence P) that `warmup()` compiles up front (in threads) or
that the first step of each shape compiles (lazily, for offline use); sampling features that
need extra inputs (penalties, logit bias, grammar masks, top logprobs) are step variants
compiled on first use.

Every program is compiled ahead of time (`lower().compile()`) and kept per input signature, so a
step is dispatched without jit's retracing checks, and an `ExecutableStore` can hand back the
program a previous process compiled without tracing it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import AttentionMetadata, KVCache, ModelConfig, family_module
from jengine.pallas_kernels import num_query_blocks, query_blocks
from jengine.runtime.compilation import record_program_load
from jengine.runtime.executables import (
    ExecutableStore,
    ProgramsNotStoredError,
    compile_fresh,
    store_key,
)
from jengine.runtime.sampler import SamplingArrays, sample
from jengine.scheduling.batch import ScheduledBatch
from jengine.sharding import ShardingRules
from jengine.sharding.distributed import StepChannel

log = logging.getLogger("jengine")

MAX_TOP_LOGPROBS = 20
QUERY_BLOCK = 32  # query rows per block in prefill-heavy steps (see pallas_kernels/reference.py)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes the engine compiles: token counts, sequence counts, pages per sequence."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    @classmethod
    def default(cls, max_tokens: int, max_seqs: int, max_pages: int,
                min_tokens: int = 8) -> Buckets:
        """Powers of two from `min_tokens` (1 on CPU: XLA:CPU's dots run near memory speed
        for 1-2 rows but at half that for 8, so a lone decode padded to 8 took twice as long
        in its GEMMs) to `max_tokens`; pages likewise from 16."""
        tokens = _powers_of_two(min(min_tokens, max_tokens), max_tokens)
        pages = _powers_of_two(min(16, max_pages), max_pages)
        return cls(
            tokens=tokens,
            seqs=tuple(sorted({min(t, max_seqs) for t in tokens})),
            pages=pages,
        )

    def pick(self, num_tokens: int, num_rows: int, num_pages: int) -> tuple[int, int, int]:
        """The bucket of a batch; `num_rows` (sampled rows, at least one per sequence) sizes S,
        which is both the page table's rows and the sampler's."""
        t = _first_at_least(self.tokens, max(num_tokens, num_rows, 1))
        return t, self.seqs_for(t), _first_at_least(self.pages, num_pages)

    def seqs_for(self, t: int) -> int:
        """The sequence bucket of token bucket `t`: the smallest seq bucket >= t, capped at the
        largest. Tying S to T keeps the program count at |tokens| x |pages|; a prefill-heavy
        step pays only for a few extra rows of logits."""
        return next((s for s in self.seqs if s >= t), self.seqs[-1])

    def blocked(self, t: int) -> bool:
        """Whether token bucket `t` groups queries into per-sequence blocks: only when it can
        hold more tokens than sequences (prefill chunks), where it saves re-reading KV."""
        return t > self.seqs_for(t)

    def num_blocks(self, t: int) -> int:
        """The block count of blocked bucket `t`: enough for any batch it holds (a sequence of
        n tokens fills ceil(n / B) blocks, at most (T + S (B - 1)) / B in all). One bound per
        bucket, not a bucket of its own: the attention stops after the last live block, so the
        bound's empty blocks cost no work and no extra program."""
        return num_query_blocks(t, self.seqs_for(t), QUERY_BLOCK)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, P) `pick` can return."""
        return sorted({(t, self.seqs_for(t), p) for t in self.tokens for p in self.pages})


def _first_at_least(values: tuple[int, ...], n: int) -> int:
    for v in values:
        if v >= n:
            return v
    raise ValueError(f"{n} exceeds the largest bucket {values[-1]}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """Static features of a step program (each combination compiles once)."""

    num_top_logprobs: int = 0
    history: bool = False
    logit_bias: bool = False
    mask: bool = False
    prompt_logprobs: bool = False  # also return every token's logprob of its successor


@dataclasses.dataclass
class StepResult:
    """What comes back to the host: only per-sequence values, never logits."""

    tokens: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] f32 raw logprob of the chosen token
    top_ids: np.ndarray | None  # [S, K] int32
    top_logprobs: np.ndarray | None  # [S, K] f32
    # Only from the prompt_logprobs variant, one row per query token:
    prompt_logprobs: np.ndarray | None = None  # [T] f32 logprob of `targets[t]` given tokens <= t
    prompt_top_ids: np.ndarray | None = None  # [T, MAX_TOP_LOGPROBS] int32
    prompt_top_logprobs: np.ndarray | None = None  # [T, MAX_TOP_LOGPROBS] f32


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
    ):
        """`rules` (tensor parallelism): `params` already sit on their shardings; the KV cache
        is created on its kv-head sharding and each step's inputs are replicated on the mesh.
        `channel` (multi-host): the leader sends every step's inputs through it; a follower
        runs `follow()` instead of being driven by a scheduler. `store`: compiled programs
        are loaded from and saved to it (single-process runs only)."""
        self.cfg = cfg
        self.params = params
        self.page_size = page_size
        self.num_pages = num_pages
        self.buckets = buckets
        self.kv_cache_dtype = kv_cache_dtype
        self._input_sharding = rules.replicated() if rules else None
        self._channel = channel if channel is not None and channel.is_leader else None
        self._follower_channel = channel if channel is not None and not channel.is_leader else None
        self._no_tokens = self._to_device(np.zeros((buckets.seqs[-1],), np.int32))
        # Pallas kernels under tensor parallelism run in shard_map over the heads, which they
        # find from the mesh in context (jengine.pallas_kernels.backends).
        self._kernel_mesh = rules.mesh if rules and cfg.attention_backend != "reference" else None
        kv_sharding = rules.kv_cache_sharding() if rules else None
        self.kv = jax.jit(
            lambda: KVCache.zeros(cfg, num_pages, page_size, kv_cache_dtype),
            out_shardings=KVCache(k=kv_sharding, v=kv_sharding) if rules else None,
        )()
        forward = family_module(cfg).forward

        max_seqs = buckets.seqs[-1]

        def step(params, kv, md, arrays, targets, feed, prev_tokens, variant: Variant):
            # Token rows the host could not fill yet (async scheduling) take the token that the
            # previous step sampled for their sequence: feed[t] is its row there, else -1.
            fed = prev_tokens[jnp.maximum(feed, 0)]
            md = dataclasses.replace(md, token_ids=jnp.where(feed >= 0, fed, md.token_ids))
            (out, prompt), kv = _forward_and_sample(params, kv, md, arrays, targets, variant)
            # The sampled tokens, padded to one shape, stay on device for the next step's `feed`.
            tokens = jnp.zeros((max_seqs,), jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
            return (out, prompt, tokens), kv

        def _forward_and_sample(params, kv, md, arrays, targets, variant: Variant):
            if not variant.prompt_logprobs:
                logits, kv = forward(params, cfg, kv, md)
                with jax.named_scope("sample"):
                    out = sample(logits, arrays, needs_sort=True,
                                 num_top_logprobs=variant.num_top_logprobs)
                return (out, None), kv
            all_logits, kv = forward(params, cfg, kv, md, all_logits=True)  # [T, V]
            out = sample(
                all_logits[md.logits_indices], arrays, needs_sort=True,
                num_top_logprobs=variant.num_top_logprobs,
            )
            logprobs = jax.nn.log_softmax(all_logits, axis=-1)
            chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)
            top_lp, top_ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
            return (out, (chosen[:, 0], top_ids.astype(jnp.int32), top_lp)), kv

        # Under a mesh the sampled tokens come back replicated, so every process can read them.
        out_shardings = None
        if rules:
            out_shardings = (rules.replicated(), KVCache(k=kv_sharding, v=kv_sharding))
        self._step_fn = step
        self._jit_kwargs = dict(donate_argnames=("kv",), static_argnames=("variant",),
                                out_shardings=out_shardings)
        self._programs: dict[tuple, jax.stages.Compiled] = {}
        self._programs_lock = threading.Lock()
        self._store = store if jax.process_count() == 1 else None
        self._devices = (tuple(rules.mesh.devices.flat) if rules
                         else tuple(jax.tree.leaves(params)[0].devices()))  # QArrays too
        # What decides the step program besides its inputs' shapes (ExecutableStore's key).
        self._description = {
            "model": cfg, "kv_cache_dtype": str(kv_cache_dtype), "max_seqs": max_seqs,
            "state": jax.tree.map(_aval, (params, self.kv)),
            "out_shardings": repr(out_shardings), "kernel_mesh": repr(self._kernel_mesh),
        }
        self.ready = False  # set by warmup(); a program built after it is logged as a stall
        self.programs_loaded = 0  # from the store
        self.programs_compiled = 0  # traced, lowered and compiled (or found by XLA's cache)

    # -- host -> device --------------------------------------------------------------------------

    def host_inputs(
        self, batch: ScheduledBatch, rows: SamplingRows, feed: np.ndarray | None = None
    ) -> tuple[tuple, Variant]:
        """The padded step inputs as NumPy (what a multi-host leader broadcasts). `feed` [n_tok]:
        per token, the previous step's row whose sampled token it takes (-1: its own id)."""
        n_tok, n_seq, n_row = batch.num_tokens, batch.num_seqs, batch.num_rows
        t, s, p = self.buckets.pick(n_tok, n_row, batch.page_table.shape[1])
        if s < n_row:
            raise ValueError(f"{n_row} sampled rows exceed the sequence bucket {s} of {t} tokens")
        ints = np.zeros((5, t), np.int32)
        ints[4] = -1
        if feed is not None:
            ints[4, :n_tok] = feed
        ints[0, :n_tok] = batch.token_ids
        ints[1, :n_tok] = batch.positions
        ints[2, :n_tok] = batch.slot_mapping
        ints[3, :n_tok] = np.repeat(np.arange(n_seq, dtype=np.int32), batch.q_lens)
        page_table = np.zeros((s, p), np.int32)
        page_table[:n_seq, : batch.page_table.shape[1]] = batch.page_table
        logits_idx = np.zeros((s,), np.int32)
        logits_idx[:n_row] = batch.logits_indices
        host_arrays, variant = rows.padded(s)
        blocks = None  # only the reference backend reads them; the kernels block on device
        if self.cfg.attention_backend == "reference" and self.buckets.blocked(t):
            blocks = query_blocks(batch.q_lens, t, self.buckets.num_blocks(t), QUERY_BLOCK)
        targets = None
        if rows.prompt_targets is not None:
            targets = np.full((t,), -1, np.int32)
            targets[:n_tok] = rows.prompt_targets
            variant = dataclasses.replace(variant, prompt_logprobs=True)
        return (ints, page_table, logits_idx, blocks, host_arrays, targets), variant

    def device_inputs(
        self, host: tuple
    ) -> tuple[AttentionMetadata, SamplingArrays, jax.Array | None, jax.Array]:
        dev = self._to_device(host)
        ints_d, page_table_d, logits_idx_d, blocks_d, arrays_d, targets_d = dev
        md = AttentionMetadata(
            token_ids=ints_d[0], positions=ints_d[1], slot_mapping=ints_d[2],
            token_seq=ints_d[3], page_table=page_table_d, logits_indices=logits_idx_d,
            block_tokens=blocks_d[0] if blocks_d else None,
            block_seq=blocks_d[1] if blocks_d else None,
        )
        return md, SamplingArrays(**arrays_d), targets_d, ints_d[4]

    def _to_device(self, host):
        if self._input_sharding is None:
            return jax.device_put(host)
        # One global array per input, replicated: works across processes too.
        sharding = self._input_sharding
        return jax.tree.map(
            lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]), host
        )

    # -- the step --------------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch, rows: SamplingRows) -> StepResult:
        return self.fetch(self.launch(batch, rows), batch.num_seqs, batch.num_tokens)

    def launch(self, batch: ScheduledBatch, rows: SamplingRows, feed: np.ndarray | None = None,
               prev: tuple | None = None) -> tuple:
        """Dispatches one step without waiting for it (JAX runs it asynchronously). `feed` and
        `prev` (the previous `launch`'s result) let rows take tokens the host has not seen."""
        prev_tokens = prev[2] if prev is not None else None
        return self._launch(*self.host_inputs(batch, rows, feed), prev_tokens)

    def _launch(self, host: tuple, variant: Variant, prev_tokens: jax.Array | None = None):
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

    def _run(self, host: tuple, variant: Variant, prev_tokens: jax.Array | None = None):
        md, arrays, targets, feed = self.device_inputs(host)
        if prev_tokens is None:
            prev_tokens = self._no_tokens
        args = (md, arrays, targets, feed, prev_tokens)
        out, self.kv = self._program(host, variant, args)(self.params, self.kv, *args)
        return out

    # -- programs --------------------------------------------------------------------------------

    @staticmethod
    def _signature(host: tuple, variant: Variant) -> tuple:
        leaves, tree = jax.tree.flatten(host)
        return variant, tree, tuple((a.shape, a.dtype.str) for a in leaves)

    def program_key(self, batch: ScheduledBatch, rows: SamplingRows) -> str | None:
        """The store key of the program `batch` runs (None without a store): equal keys
        mean the same executable, so anything that changes the program must change it."""
        if self._store is None:
            return None
        return self._key(self._signature(*self.host_inputs(batch, rows)))

    def _key(self, signature: tuple) -> str:
        variant, tree, shapes = signature
        described = {"variant": variant, "tree": str(tree), "shapes": shapes}
        return store_key({**self._description, "inputs": described}, self._devices)

    def _program(self, host: tuple, variant: Variant, args: tuple) -> jax.stages.Compiled:
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
        if self._store is not None:
            key = self._key(signature)
            program = self._store.load(key, self._devices)
            if program is not None:
                record_program_load()
                self._built("loaded", signature, start)
                return program
        name = f"step_{key[:16]}" if key else "step"  # a new key misses the persistent cache
        mesh = self._kernel_mesh
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            program, fresh = compile_fresh(
                self._step_fn, name, (self.params, self.kv, *args), {"variant": variant},
                **self._jit_kwargs)
        if key is not None and fresh:
            self._store.save(key, program)
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
        t, p = shapes[0][0][1], shapes[1][0][1]  # ints [5, T], page table [S, P]
        s = shapes[1][0][0]
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
    def fetch(out: tuple, n: int, num_tokens: int) -> StepResult:
        """Waits for a launched step and brings its per-sequence results to the host."""
        # Outputs are replicated over the mesh; reading one local copy works on every process.
        host, prompt = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), out[:2])
        k = host.top_ids.shape[-1] if host.top_ids is not None else 0
        result = StepResult(
            tokens=np.asarray(host.tokens[:n]),
            logprobs=np.asarray(host.logprobs[:n]),
            top_ids=np.asarray(host.top_ids[:n]) if k else None,
            top_logprobs=np.asarray(host.top_logprobs[:n]) if k else None,
        )
        if prompt is not None:
            result.prompt_logprobs = np.asarray(prompt[0][:num_tokens])
            result.prompt_top_ids = np.asarray(prompt[1][:num_tokens])
            result.prompt_top_logprobs = np.asarray(prompt[2][:num_tokens])
        return result

    def warmup(self, progress: Callable[[int, int], None] | None = None,
               threads: int | None = None, *, require_stored: bool = False) -> float:
        """Builds (loads, or compiles in `threads` threads: one per core by default) the base
        step of every bucket, then runs the smallest once. A multi-host leader instead runs
        every bucket, one by one, so that its followers compile the same programs.

        Raises:
          ProgramsNotStoredError: with `require_stored`, some program is not in the store
            (checked before anything is built) or could not be loaded from it.
        """
        start = time.perf_counter()
        shapes = self.buckets.shapes()
        if require_stored:
            self._check_stored(shapes)
        if self._channel is not None:
            for i, shape in enumerate(shapes):
                self._run_dummy(shape)
                if progress:
                    progress(i + 1, len(shapes))
        else:
            with ThreadPoolExecutor(threads or os.cpu_count() or 1,
                                    thread_name_prefix="jengine-compile") as pool:
                futures = [pool.submit(self._build_dummy, shape) for shape in shapes]
                for i, future in enumerate(as_completed(futures)):
                    future.result()
                    if progress:
                        progress(i + 1, len(shapes))
            self._run_dummy(shapes[0])
        if require_stored and self.programs_compiled:
            raise ProgramsNotStoredError(
                f"{self.programs_compiled} step programs were compiled: their stored files "
                "could not be loaded (see the warnings above); run `jengine compile` again")
        self.ready = True
        return time.perf_counter() - start

    def warmup_keys(self) -> list[str | None]:
        """The store key of each program `warmup` builds, in `buckets.shapes()` order: what
        `jengine compile` stores and `serve --require-warm` needs (None without a store)."""
        return [self.program_key(_dummy_batch(t, s, p), SamplingRows.empty(s))
                for t, s, p in self.buckets.shapes()]

    def _check_stored(self, shapes: list[tuple[int, int, int]]) -> None:
        if self._store is None:
            raise ProgramsNotStoredError(
                "--require-warm needs the executable store, which multi-process runs do not use")
        missing = [shape for shape, key in zip(shapes, self.warmup_keys(), strict=True)
                   if self._store.size(key) is None]
        if missing:
            t, s, p = missing[0]
            raise ProgramsNotStoredError(
                f"{len(missing)} of {len(shapes)} step programs are not stored in "
                f"{self._store.path} (the first: T={t} S={s} P={p}); run `jengine compile` "
                "with the same model and engine flags first")

    def program(self, batch: ScheduledBatch, rows: SamplingRows) -> jax.stages.Compiled:
        """The compiled step program that `batch` runs (built if need be): what warm-up
        builds, and what profiles read the HLO of."""
        host, variant = self.host_inputs(batch, rows)
        md, arrays, targets, feed = self.device_inputs(host)
        return self._program(host, variant, (md, arrays, targets, feed, self._no_tokens))

    def _build_dummy(self, shape: tuple[int, int, int]) -> None:
        t, s, p = shape
        self.program(_dummy_batch(t, s, p), SamplingRows.empty(s))

    def _run_dummy(self, shape: tuple[int, int, int]) -> None:
        t, s, p = shape
        out = self._launch(*self.host_inputs(_dummy_batch(t, s, p), SamplingRows.empty(s)))
        jax.block_until_ready(out[0].tokens)


def _dummy_batch(t: int, s: int, p: int) -> ScheduledBatch:
    """A batch of exactly bucket shape whose tokens all write the scratch page 0."""
    q_lens = np.full((s,), t // s, np.int32)
    q_lens[-1] += t - q_lens.sum()
    return ScheduledBatch(
        seq_ids=list(range(s)),
        token_ids=np.zeros((t,), np.int32),
        positions=np.zeros((t,), np.int32),
        slot_mapping=np.zeros((t,), np.int32),
        q_lens=q_lens,
        kv_lens=q_lens.copy(),
        page_table=np.zeros((s, p), np.int32),
        sample=np.ones((s,), bool),
    )


@dataclasses.dataclass
class SamplingRows:
    """Per-sequence sampling settings of one batch on the host, before padding."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    seeds: np.ndarray
    steps: np.ndarray
    num_top_logprobs: int = 0
    history: list[tuple[list[int], int]] | None = None  # (prompt+output ids, num prompt ids)
    logit_bias: np.ndarray | None = None  # [n, V]
    allowed_mask: np.ndarray | None = None  # [n, W] int32
    prompt_targets: np.ndarray | None = None  # [num_tokens] next prompt token per query, or -1

    @classmethod
    def empty(cls, n: int) -> SamplingRows:
        z = np.zeros((n,), np.float32)
        return cls(
            temperature=z, top_k=np.zeros((n,), np.int32), top_p=np.ones((n,), np.float32),
            min_p=z, presence_penalty=z, frequency_penalty=z,
            repetition_penalty=np.ones((n,), np.float32), seeds=np.zeros((n,), np.uint32),
            steps=np.zeros((n,), np.int32),
        )

    def padded(self, s: int) -> tuple[dict[str, np.ndarray | None], Variant]:
        n = len(self.temperature)

        def pad(a: np.ndarray, fill) -> np.ndarray:
            out = np.full((s, *a.shape[1:]), fill, a.dtype)
            out[:n] = a
            return out

        arrays: dict[str, np.ndarray | None] = {
            "temperature": pad(self.temperature, 0.0),
            "top_k": pad(self.top_k, 0),
            "top_p": pad(self.top_p, 1.0),
            "min_p": pad(self.min_p, 0.0),
            "presence_penalty": pad(self.presence_penalty, 0.0),
            "frequency_penalty": pad(self.frequency_penalty, 0.0),
            "repetition_penalty": pad(self.repetition_penalty, 1.0),
            "seeds": pad(self.seeds, 0),
            "steps": pad(self.steps, 0),
            "history": None, "history_is_output": None, "logit_bias": None, "allowed_mask": None,
        }
        if self.history is not None:
            width = _next_pow2(max(len(ids) for ids, _ in self.history))
            hist = np.full((s, width), -1, np.int32)
            is_out = np.zeros((s, width), bool)
            for i, (ids, num_prompt) in enumerate(self.history):
                hist[i, : len(ids)] = ids
                is_out[i, num_prompt: len(ids)] = True
            arrays["history"], arrays["history_is_output"] = hist, is_out
        if self.logit_bias is not None:
            arrays["logit_bias"] = pad(self.logit_bias, 0.0)
        if self.allowed_mask is not None:
            arrays["allowed_mask"] = pad(self.allowed_mask, -1)
        variant = Variant(
            num_top_logprobs=self.num_top_logprobs,
            history=self.history is not None,
            logit_bias=self.logit_bias is not None,
            mask=self.allowed_mask is not None,
        )
        return arrays, variant


def _aval(a: jax.Array) -> tuple:
    return (a.shape, a.dtype.str, repr(a.sharding))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def to_device_params(
    params: dict[str, np.ndarray], shardings: dict[str, jax.sharding.Sharding] | None = None
) -> dict[str, jax.Array]:
    """Host params -> device arrays. With shardings, each device receives only its own slice
    (`make_array_from_callback`), so no device ever holds a whole tensor it does not own."""
    if shardings is None:
        return {k: jnp.asarray(v) for k, v in params.items()}
    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda index, v=v: v[index])
        for k, v in params.items()
    }
