"""Building an `EngineCore`'s parts: dtypes, the context length, the KV page pool and the
buckets it implies, and the weights placed on the devices. Each is a function of the config and
the loaded model, so `EngineCore.__init__` reads as the order of start-up and each rule can be
read (and tested) alone."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from converters import LoadedModel, load_params_sharded, load_source
from jengine.config import EngineConfig, ModelSection
from jengine.core.kv_budget import host_kv_budget
from jengine.models import KVCache, ModelConfig, family_module, layer_offsets
from jengine.models.layers import random_params, unstack_layers
from jengine.models.matmul import pack_projections, packs_bf16, resolve_matmul_backend
from jengine.models.quant import quantize_params, quantize_params_w4
from jengine.models.smoothing import smooth_for_int8
from jengine.pallas_kernels import resolve_backend
from jengine.pallas_kernels.kv_quant import check_reader
from jengine.progress import progress_bar
from jengine.runtime.buckets import Buckets
from jengine.runtime.runner import Runner
from jengine.sharding import MeshSpec, ShardingRules

log = logging.getLogger("jengine")

DEFAULT_MAX_MODEL_LEN = 2048


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """auto -> the model dtype (so greedy tokens stay those of the model's own precision);
    int8 and fp8 (float8_e4m3fn; rows with one f32 scale per token and kv head,
    `pallas_kernels.kv_quant`) are opt-in. Returns a JAX dtype name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in ("float32", "bfloat16", "int8", "fp8"):
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; use auto, float32, "
                         "bfloat16, int8 or fp8")
    return "float8_e4m3fn" if kv_cache_dtype == "fp8" else kv_cache_dtype


def resolve_backends(model: ModelSection, platform: str, tp: int) -> dict[str, str]:
    """The attention and matmul backends `auto` (or the preset) means here, checked."""
    return dict(attention_backend=resolve_backend(model.attention_backend, platform),
                matmul_backend=resolve_matmul_backend(model.matmul_backend, platform, tp))


def resolve_dtype(dtype: str, measured: Callable[[], str] | None = None) -> str:
    """auto -> bfloat16 on GPU/TPU; on CPU what `measured()` says (`startup.model_dtype` passes
    `jengine.core.auto_dtype.choose`: bf16 where the CPU has AVX-512-BF16 or AMX-BF16 and the
    model's bf16 projections measured faster, else float32), float32 without one. A named dtype
    is taken as given."""
    if dtype == "auto":
        if jax.default_backend() != "cpu":
            return "bfloat16"
        return measured() if measured is not None else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return dtype


class Phases:
    """Wall seconds between successive `end(name)` calls."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def kv_pages(cfg: EngineConfig, mesh_spec: MeshSpec, model_config: ModelConfig,
             num_kv_heads: int, kv_cache_dtype: str, max_model_len: int, *,
             state_slots: int = 0) -> int:
    """The pages `cache.kv_cache_memory` holds (per device); at least one full sequence's.
    A hybrid model's `state_slots` recurrent states come out of the same budget first. A
    quantized cache's dtype is checked against the attention backend first (the native `cpu`
    kernel reads no fp8)."""
    check_reader(kv_cache_dtype, model_config.attention_backend)
    page_size = cfg.cache.page_size
    budget = host_kv_budget(cfg.cache.kv_cache_memory, mesh_spec, num_kv_heads,
                            cfg.parallel.num_processes)
    budget -= state_slots * KVCache.bytes_per_state_slot(model_config)
    num_pages = budget // KVCache.bytes_per_page(model_config, page_size, kv_cache_dtype)
    max_pages = -(-max_model_len // page_size)
    if num_pages < max_pages + 1:
        raise ValueError(
            f"kv_cache_memory {cfg.cache.kv_cache_memory} holds {num_pages} pages; one "
            f"sequence of max_model_len {max_model_len} needs {max_pages + 1}"
        )
    return num_pages


def step_buckets(cfg: EngineConfig, max_model_len: int, attention_backend: str) -> Buckets:
    """The preset's buckets, or the defaults for the scheduler limits; checked to cover them.

    The native `cpu` attention kernel reads a sequence's pages up to its position, whatever
    the page table's width, so by default it gets one page bucket (the longest): a quarter of
    the CPU preset's programs to compile or load, for a page table of 32 KiB at 64 rows. The
    other backends' work (the reference's gather) or their on-chip page tables grow with it.
    """
    sched = cfg.scheduler
    if sched.max_num_seqs > sched.max_num_batched_tokens:
        raise ValueError("max_num_seqs cannot exceed max_num_batched_tokens")
    max_pages = -(-max_model_len // cfg.cache.page_size)
    default = Buckets.default(sched.max_num_batched_tokens, sched.max_num_seqs, max_pages,
                              min_tokens=1 if jax.default_backend() == "cpu" else 8,
                              min_pages=max_pages if attention_backend == "cpu" else 16)
    buckets = Buckets(
        tokens=sched.token_buckets or default.tokens,
        seqs=sched.seq_buckets or default.seqs,
        pages=sched.page_buckets or default.pages,
    )
    if (buckets.tokens[-1] < sched.max_num_batched_tokens
            or buckets.seqs[-1] < min(sched.max_num_seqs, sched.max_num_batched_tokens)
            or buckets.pages[-1] < max_pages):
        raise ValueError(f"buckets {buckets} do not cover the scheduler limits")
    return buckets


def max_model_len(loaded: LoadedModel, wanted: int | None) -> int:
    """The context length: `wanted`, or the model's own up to DEFAULT_MAX_MODEL_LEN."""
    limit = loaded.config.max_position_embeddings
    if wanted is None:
        if limit > DEFAULT_MAX_MODEL_LEN:
            log.info("max_model_len %d by default (the model allows %d; --max-model-len "
                     "raises it, at the cost of KV pages per sequence)",
                     DEFAULT_MAX_MODEL_LEN, limit)
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if wanted < 2 or wanted > limit:
        raise ValueError(f"max_model_len {wanted} must be between 2 and the model's {limit}")
    return wanted


def chunk_for_context(cfg: ModelConfig, context: int) -> ModelConfig:
    """Llama 4's chunked attention (`attention_chunk_size`) only matters for a context longer
    than one chunk: below that it is causal attention, on any backend.

    Raises:
      ValueError: a longer context on a backend other than `reference` (the only one whose
        mask knows chunks).
    """
    chunk = cfg.attention_chunk_size
    if chunk is None:
        return cfg
    if context <= chunk:
        return dataclasses.replace(cfg, attention_chunk_size=None)
    if cfg.attention_backend != "reference":
        raise ValueError(f"{cfg.model_type} attends in chunks of {chunk} tokens, which only the "
                         f"'reference' attention backend builds: set max_model_len <= {chunk} "
                         "or attention_backend reference")
    return cfg


def check_sinks(cfg: ModelConfig, requested: str) -> ModelConfig:
    """gpt-oss's attention sinks are built into the `reference` and `cpu` backends only: a
    Pallas backend that `auto` picked (TPU, GPU) gives way to `reference`, with a warning.

    Raises:
      ValueError: a Pallas backend asked for by name.
    """
    backend = cfg.attention_backend
    if not cfg.attention_sinks or backend in ("reference", "cpu"):
        return cfg
    if requested != "auto":
        raise ValueError(f"{cfg.model_type} has attention sinks, which the {backend!r} attention "
                         "backend does not take: use attention_backend cpu or reference")
    logging.getLogger("jengine").warning(
        "%s has attention sinks, which %r does not take; using the 'reference' attention "
        "backend", cfg.model_type, backend)
    return dataclasses.replace(cfg, attention_backend="reference")


def eos_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """Every id that ends a sequence: the config's, generation_config's and the tokenizer's."""
    ids = set(loaded.config.eos_token_ids)
    gen_eos = loaded.generation_config.get("eos_token_id")
    if gen_eos is not None:
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    return tuple(sorted(ids))


def open_model(model: ModelSection, dtype: str, quantization: str,
               progress: bool) -> LoadedModel:
    """The model's source opened lazily (each device reads its own slices when the weights are
    placed). An int8 / w8a16 engine reads a GGUF's Q8_0 projections as int8 straight away."""
    return load_source(model.model, dtype=dtype, progress=progress, lazy=True,
                       quantization=quantization, quantize_lm_head=model.quantize_lm_head,
                       load_format=model.load_format)


def place_weights(loaded: LoadedModel, cfg: ModelConfig, rules: ShardingRules | None, *,
                  dtype: str, quantization: str, layer_layout: str, quantize_lm_head: bool,
                  smoothing_alpha: float, progress: bool) -> dict:
    """`loaded`'s weights on the devices, quantized and in the model's layer layout."""
    family = family_module(cfg)
    specs = family.param_specs(cfg)
    host = {name: loaded.params.get(name) for name in specs}
    if (rules is None and quantization == "none" and layer_layout == "unstacked"
            and loaded.kind not in ("checkpoint", "dummy")
            and all(w is not None and tuple(w.shape) == specs[name].shape
                    for name, w in host.items())):
        # One device, float weights on the host: split the layers there (views) and place
        # each once. Placing the stacks and splitting them on the device costs a jitted
        # split per weight and a second copy of every layer (~1 s for SmolLM2 on CPU).
        stacked = {name: np.asarray(w) for name, w in host.items()}
        params = jax.device_put(unstack_layers(stacked, family.layer_keys, cfg.num_layers,
                                               first_layer=layer_offsets(cfg)))
        return _packed_for_amx(params, cfg, specs)
    shardings = rules.param_shardings(specs) if rules else None
    if loaded.kind == "dummy":
        params = random_params(specs, jnp.dtype(dtype), shardings)
    else:  # each device's slice read on its own (safetensors slices; Orbax onto shardings)
        params = load_params_sharded(loaded, cfg, shardings, dtype, progress=progress)
    # Float weights only: a source stored quantized (a converted checkpoint, compressed-tensors,
    # a GGUF's Q8_0 read as int8) has no float weights to smooth, so none of it is smoothed;
    # random weights have nothing to calibrate for.
    if quantization == "int8" and loaded.quantization == "none" and loaded.kind != "dummy":
        params = smooth_for_int8(params, cfg, family, loaded.tokenizer, smoothing_alpha,
                                 delete_float=True)
    # Quantized from the float weights, whatever their source, shard by shard in place.
    if quantization == "w4a16":
        params = quantize_params_w4(params, specs, tied_embeddings=cfg.tie_word_embeddings)
    else:
        params = quantize_params(
            params, specs, quantization, tied_embeddings=cfg.tie_word_embeddings,
            lm_head=quantize_lm_head, delete_float=True,
        )
    if layer_layout == "unstacked":
        params = unstack_layers(params, family.layer_keys, cfg.num_layers,
                                delete_stacked=True, first_layer=layer_offsets(cfg))
        params = _packed_for_amx(params, cfg, specs)
    return params


def _packed_for_amx(params: dict, cfg: ModelConfig, specs: dict) -> dict:
    """Under `matmul_backend` `amx`, a model's bf16 projections and output head packed for the
    AMX kernel, and its `int8` (W8A8) projections for the AMX-INT8 one where the CPU has it
    (jengine.models.matmul.pack_projections); other weights stay as they are. A quantized
    model's bf16 head is packed too (XLA's bf16 dot took 1.6x the kernel's time for SmolLM2's
    tied head at 32 rows). Under `native` on a CPU without AMX the bf16 ones are packed the same
    way for the packed-bf16 kernel (AVX-512-BF16 / AVX-512F / AVX2: `packs_bf16`)."""
    if not packs_bf16(cfg.matmul_backend):
        return params
    return pack_projections(params, specs, amx=cfg.matmul_backend == "amx")


def warm_up(runner: Runner, progress: bool, require_stored: bool) -> float:
    """Builds every variant of every bucket's step program, with a progress bar; returns the
    seconds taken."""
    bar = progress_bar(total=len(runner.warmup_programs()), desc="step programs (load/compile)",
                       enabled=progress, unit="program")

    def tick(done: int, total: int) -> None:
        bar.update(done - bar.n)

    try:
        return runner.warmup(tick, require_stored=require_stored)
    finally:
        bar.close()
