"""An engine core's start-up: its config resolved (dtype, backends, mesh, quantization), the
model opened, and the parts an `EngineCore` steps built from them, in that order.

The order matters: the multi-host runtime starts before anything touches JAX's backend, the
backends and the tp split are checked before any weight is read, and the KV pool is sized from
what is left once the weights are placed. `CoreParts` is what comes out; `EngineCore` keeps it
and adds the request table, admission and the step loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from converters import LoadedModel, load_config
from converters.source import auto_quantization
from converters.vision import load_vision
from jengine.config import EngineConfig
from jengine.core import auto_dtype
from jengine.core.build import (
    Phases,
    check_sinks,
    chunk_for_context,
    eos_ids,
    kv_pages,
    max_model_len,
    open_model,
    place_weights,
    resolve_backends,
    resolve_dtype,
    resolve_kv_cache_dtype,
    step_buckets,
)
from jengine.core.draft import proposer_for
from jengine.core.kv_budget import host_kv_budget
from jengine.core.lora_cache import HostLoras
from jengine.core.pooling import Pooling, resolve_pooling
from jengine.models import KVCache, family_module
from jengine.models.config import ModelConfig
from jengine.models.fused import can_fuse, fuse_projections
from jengine.models.idefics3 import VISION_MODEL_TYPES as IDEFICS3_TYPES
from jengine.models.layers import resolve_layer_layout
from jengine.models.quant import resolve_quantization
from jengine.models.qwen2_5_vl import QWEN2_5_VL
from jengine.models.qwen3_vl import QWEN3_VL, vision_config_from_hf
from jengine.runtime.buckets import Buckets
from jengine.runtime.executables import ExecutableStore, default_store_dir
from jengine.runtime.lora_slots import LoraSlots
from jengine.runtime.runner import Runner
from jengine.runtime.vision import (
    MAX_TOWER_PATCHES,
    QwenVisionEncoder,
    VisionEncoder,
    patch_buckets,
)
from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.scheduler import Scheduler
from jengine.scheduling.state_slots import StateSlots
from jengine.scheduling.state_snapshots import StateSnapshots
from jengine.sharding import MeshSpec, ShardingRules, check_divisible, padded_config
from jengine.sharding.distributed import DistributedSpec, StepChannel, initialize
from jengine.vision.idefics3_processor import Idefics3Processor
from jengine.vision.inputs import ImagePrompter, parse_image_limit
from jengine.vision.qwen2_vl_processor import Qwen2VLProcessor
from jengine.vision.qwen_inputs import QwenImagePrompter

log = logging.getLogger("jengine")

QWEN_VL_TYPES = frozenset(QWEN2_5_VL.model_type_names + QWEN3_VL.model_type_names)
VISION_MODEL_TYPES = IDEFICS3_TYPES | QWEN_VL_TYPES

LORA_NETWORKS = ("llama", "gemma3")  # the networks whose projections add adapter updates


@dataclasses.dataclass
class CoreParts:
    """One engine replica's resolved settings and built parts."""

    distributed: DistributedSpec  # this process's place among the hosts
    dtype: Any  # the weights' and activations' dtype (`dtype: auto` resolved)
    kv_cache_dtype: Any
    mesh_spec: MeshSpec
    layer_layout: str  # unstacked | stacked
    quantization: str  # as configured, or as the source was stored
    loaded: LoadedModel  # the opened checkpoint (config, tokenizer, weights' source)
    model_config: ModelConfig  # padded for tp, with the resolved backends
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    allocator: PageAllocator
    prefix_cache: PrefixCache | None
    scheduler: Scheduler
    runner: Runner
    pooling: Pooling | None  # task embed / score: how hidden states become a vector
    loras: HostLoras | None = None  # enable_lora: the adapters read on the host
    # A vision model's image tower (compiled per bucket) and its prompts' images ->
    # placeholders and tiles (or patches).
    vision: VisionEncoder | QwenVisionEncoder | None = None
    images: ImagePrompter | QwenImagePrompter | None = None


def build_parts(
    cfg: EngineConfig, phases: Phases, *, progress: bool, replica: int,
    loaded: LoadedModel | None, make_runner: Callable[..., Runner] | None,
    draft_core: Callable[[EngineConfig], Any],
) -> CoreParts:
    """Resolves `cfg` and builds replica `replica`'s parts, timing each phase into `phases`.
    `draft_core(cfg)` builds the draft model's core (speculative method `draft`);
    `make_runner` is `EngineCore`'s stand-in for placing the weights (tests/fake_runner.py)."""
    par = cfg.parallel
    distributed = DistributedSpec(coordinator=par.coordinator, num_processes=par.num_processes,
                                  process_id=par.process_id)
    initialize(distributed)  # before anything starts JAX's backend
    resolve_pooling(cfg.model.task, cfg.model.pooling, cfg.model.normalize, None, 0)  # names
    mesh_spec = MeshSpec.parse(par.mesh)
    mesh = mesh_spec.replica_mesh(replica) if mesh_spec.num_devices > 1 else None
    platform, tp = jax.default_backend(), mesh_spec.tp
    backends = resolve_backends(cfg.model, platform, tp)  # before any weight is read
    # The settings are checked before `auto` measures anything or the model is opened.
    quantization = resolve_quantization(cfg.model.quantization, platform, tp)
    layer_layout = resolve_layer_layout(cfg.model.layer_layout, platform)
    if quantization == "auto":  # the source's own precision, where a kernel reads it in place
        quantization = auto_quantization(loaded.source if loaded else cfg.model.model, tp)
    dtype = model_dtype(cfg, loaded, backends["matmul_backend"])
    kv_cache_dtype = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, dtype)
    if mesh is not None:  # before any weight is read
        check_divisible(load_config(cfg.model.model), tp)
    loaded = loaded or open_model(cfg.model, dtype, quantization, progress)
    phases.end("open model")
    source = Path(loaded.source)
    pooling = resolve_pooling(cfg.model.task, cfg.model.pooling, cfg.model.normalize,
                              str(source) if source.is_dir() else None,
                              loaded.config.hidden_size)
    if quantization == "none":  # a source stored quantized: as stored
        quantization = loaded.quantization
    model_config = dataclasses.replace(padded_config(loaded.config, tp), **backends)
    loras = host_loras(cfg, model_config, quantization)
    context = max_model_len(loaded, cfg.model.max_model_len)
    model_config = chunk_for_context(model_config, context)
    model_config = check_sinks(model_config, cfg.model.attention_backend)
    backends["attention_backend"] = model_config.attention_backend
    eos = eos_ids(loaded)
    state_slots = hybrid_state_slots(cfg, model_config)
    # An embedding pools every prompt token's hidden state, so none may come from the cache.
    caching = cfg.cache.enable_prefix_caching and cfg.model.task == "generate"
    snapshots = (snapshot_slots(cfg, model_config, mesh_spec, loaded.config.num_kv_heads,
                                state_slots) if caching and state_slots else 0)
    num_pages = kv_pages(cfg, mesh_spec, model_config, loaded.config.num_kv_heads,
                         kv_cache_dtype, context, state_slots=state_slots + snapshots)
    buckets = step_buckets(cfg, context, backends["attention_backend"])
    allocator = PageAllocator(num_pages, cfg.cache.page_size)
    if state_slots:
        log.info("recurrent state: %d slots + %d prefix-cache snapshots x %.2f MiB (%s's %d "
                 "linear layers) from kv_cache_memory, %d KV pages left", state_slots,
                 snapshots, KVCache.bytes_per_state_slot(model_config) / 2**20,
                 model_config.model_type, model_config.num_linear_layers, num_pages)
    prefix_cache = None
    if caching:
        prefix_cache = PrefixCache(allocator, StateSnapshots(state_slots, snapshots)
                                   if snapshots else None)
    scheduler = Scheduler(
        allocator, max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens, max_model_len=context,
        eos_token_ids=eos, prefix_cache=prefix_cache,
        proposer=proposer_for(cfg, loaded, draft_core),
        state_slots=StateSlots(state_slots) if state_slots else None,
        max_loras=cfg.lora.max_loras if loras is not None else None,
    )
    phases.end("set up")
    if make_runner is not None:
        runner = make_runner(model_config, num_pages=num_pages, page_size=cfg.cache.page_size,
                             buckets=buckets)
    else:
        runner = _runner(cfg, loaded, model_config, mesh, num_pages, buckets, distributed,
                         dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                         layer_layout=layer_layout, progress=progress, phases=phases,
                         state_slots=state_slots + snapshots)
    phases.end("kv cache")
    vision, images = _vision(cfg, loaded, model_config, dtype, make_runner is None)
    return CoreParts(distributed=distributed, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     mesh_spec=mesh_spec, layer_layout=layer_layout, quantization=quantization,
                     loaded=loaded, model_config=model_config, max_model_len=context,
                     eos_token_ids=eos, allocator=allocator, prefix_cache=prefix_cache,
                     scheduler=scheduler, runner=runner, pooling=pooling, loras=loras,
                     vision=vision, images=images)


def host_loras(cfg: EngineConfig, model_config: ModelConfig,
               quantization: str) -> HostLoras | None:
    """The host side of `enable_lora` (None when off), after checking the settings: adapters
    change the generating projections of the Llama and Gemma networks only, and `int8`'s
    smoothing folds factors into the inputs the adapters read, so it must be off there."""
    lo = cfg.lora
    if not lo.enable_lora:
        return None
    if cfg.model.task != "generate":
        raise ValueError("enable_lora needs task 'generate'")
    name = family_module(model_config).name
    if name not in LORA_NETWORKS:
        raise ValueError(f"LoRA adapters on the {name} network are not built (built: "
                         f"{', '.join(LORA_NETWORKS)})")
    if model_config.model_type == "llama4_text":  # its q/k dims are reordered at load
        raise ValueError("LoRA adapters on llama4_text are not built")
    if cfg.parallel.num_processes > 1:  # followers would never see a slot filled
        raise ValueError("LoRA adapters across several hosts are not built (num_processes 1)")
    if quantization == "int8" and cfg.model.smoothing_alpha:
        raise ValueError("LoRA adapters read the projections' inputs, which int8 smoothing "
                         "rescales: use smoothing_alpha 0 with int8, or w8a16")
    if lo.max_loras < 1 or lo.max_lora_rank < 1:
        raise ValueError("max_loras and max_lora_rank must be at least 1")
    return HostLoras(model_config, max_rank=lo.max_lora_rank,
                     max_cpu_loras=lo.max_cpu_loras or lo.max_loras)


def _vision(cfg: EngineConfig, loaded: LoadedModel, model_config: ModelConfig, dtype,
            real: bool) -> tuple[VisionEncoder | None, ImagePrompter | None]:
    """A vision model's image tower (on the devices when `real`) and prompt preparer; a
    text model has neither. The tower reads the HF checkpoint the text model came from."""
    limit = parse_image_limit(cfg.model.limit_mm_per_prompt)
    if model_config.model_type not in VISION_MODEL_TYPES or loaded.kind != "hf":
        return None, None
    vc, params = load_vision(loaded.source)
    if model_config.model_type in QWEN_VL_TYPES:
        return _qwen_vision(loaded, vc, params, dtype, real, limit)
    prompter = ImagePrompter(loaded.tokenizer, Idefics3Processor.from_dir(loaded.source), vc,
                             max_images=limit)
    return (VisionEncoder(vc, params, dtype) if real else None), prompter


def _qwen_vision(loaded: LoadedModel, vc, params, dtype, real: bool, limit: int
                 ) -> tuple[QwenVisionEncoder | None, QwenImagePrompter]:
    """Qwen2.5-VL's tower, bucketed by patch count from the processor's smallest image to its
    largest; a `max_pixels` past the tower's largest run is lowered to it (and logged), so a
    large image is scaled down rather than refused."""
    processor = Qwen2VLProcessor.from_dir(loaded.source)
    area = processor.patch_size ** 2
    if processor.max_pixels > MAX_TOWER_PATCHES * area:
        log.warning("max_pixels %d lowered to %d: the image tower runs at most %d patches",
                    processor.max_pixels, MAX_TOWER_PATCHES * area, MAX_TOWER_PATCHES)
        processor = dataclasses.replace(processor, max_pixels=MAX_TOWER_PATCHES * area)
    buckets = patch_buckets(processor.min_pixels // area, processor.max_pixels // area)
    prompter = QwenImagePrompter(loaded.tokenizer, processor, vc, max_images=limit)
    return (QwenVisionEncoder(vc, params, dtype, buckets) if real else None), prompter


def _deepstack_rows(loaded: LoadedModel) -> int:
    """Qwen3-VL: how many DeepStack rows each image token carries into the step."""
    hf = json.loads((Path(loaded.source) / "config.json").read_text())
    return len(vision_config_from_hf(hf).deepstack_visual_indexes)


def hybrid_state_slots(cfg: EngineConfig, model_config: ModelConfig) -> int:
    """The recurrent-state slots a hybrid model's cache holds: one per sequence that may run
    (`max_num_seqs`) plus the scratch slot; 0 for a pure-attention model.

    Raises:
      ValueError: speculative decoding with a hybrid model (a rejected proposal's state
        cannot be rolled back).
    """
    if not model_config.num_linear_layers:
        return 0
    if cfg.speculative.method is not None:
        raise ValueError(f"speculative decoding is not supported for {model_config.model_type}: "
                         "its linear layers' recurrent state cannot roll back rejected tokens")
    return cfg.scheduler.max_num_seqs + 1


def snapshot_slots(cfg: EngineConfig, model_config: ModelConfig, mesh_spec: MeshSpec,
                   num_kv_heads: int, state_slots: int) -> int:
    """The prefix cache's recurrent-state snapshots for a hybrid model: one per sequence that
    may run, or as many as fit in a quarter of `kv_cache_memory` after the running ones'
    states, whichever is fewer (at least one: a prefix hit needs one).

    Raises:
      ValueError: the budget holds no snapshot beside the running states.
    """
    per_slot = KVCache.bytes_per_state_slot(model_config)
    budget = host_kv_budget(cfg.cache.kv_cache_memory, mesh_spec, num_kv_heads,
                            cfg.parallel.num_processes) - state_slots * per_slot
    count = min(cfg.scheduler.max_num_seqs, budget // 4 // per_slot)
    if count < 1:
        raise ValueError(f"kv_cache_memory {cfg.cache.kv_cache_memory} leaves no room for a "
                         "prefix-cache state snapshot: raise it or --no-enable-prefix-caching")
    return count


def model_dtype(cfg: EngineConfig, loaded: LoadedModel | None, matmul_backend: str, *,
                store_dir: Path | None = None,
                timer: auto_dtype.Timer = auto_dtype.time_projections) -> str:
    """`cfg.model.dtype` resolved; `auto` on CPU as `auto_dtype.choose` decides for this model
    under `matmul_backend`: read from `store_dir` (the step programs' store by default), or
    measured with `timer` and stored there. Several processes keep float32 unmeasured: each
    would measure on its own, and their programs must agree."""
    def measured() -> str:
        if cfg.parallel.num_processes > 1:
            log.info("dtype auto -> float32: not measured across %d processes",
                     cfg.parallel.num_processes)
            return "float32"
        config = loaded.config if loaded is not None else load_config(cfg.model.model)
        return auto_dtype.choose(config, matmul_backend, store_dir or default_store_dir(),
                                 timer=timer).dtype

    return resolve_dtype(cfg.model.dtype, measured)


def _runner(cfg: EngineConfig, loaded: LoadedModel, model_config: ModelConfig, mesh,
            num_pages: int, buckets: Buckets, distributed: DistributedSpec, *, dtype,
            kv_cache_dtype, quantization: str, layer_layout: str, progress: bool,
            phases: Phases, state_slots: int = 0) -> Runner:
    """The weights on the devices and the runner around them (with its KV cache)."""
    rules = ShardingRules.for_model(mesh, model_config) if mesh is not None else None
    params = place_weights(
        loaded, model_config, rules, dtype=dtype, quantization=quantization,
        layer_layout=layer_layout, quantize_lm_head=cfg.model.quantize_lm_head,
        smoothing_alpha=cfg.model.smoothing_alpha, progress=progress)
    # Accelerators run q/k/v and gate/up as one GEMM each (jengine.models.fused); XLA:CPU's
    # small dots run side by side instead, and LoRA adds its updates to the separate ones.
    if (not model_config.branches and not cfg.lora.enable_lora
            and can_fuse(params, model_config, family_module(model_config))):
        params = fuse_projections(params, model_config)
    phases.end("weights")
    loras = None
    if cfg.lora.enable_lora:
        loras = LoraSlots(model_config, dtype, max_loras=cfg.lora.max_loras,
                          max_rank=cfg.lora.max_lora_rank, rules=rules)
    vision = model_config.model_type in VISION_MODEL_TYPES and loaded.kind == "hf"
    return Runner(
        model_config, params, num_pages=num_pages, page_size=cfg.cache.page_size, loras=loras,
        buckets=buckets, kv_cache_dtype=kv_cache_dtype, rules=rules,
        channel=StepChannel(distributed) if distributed.num_processes > 1 else None,
        store=ExecutableStore(default_store_dir()), embed=cfg.model.task != "generate",
        state_slots=state_slots,
        image_width=model_config.hidden_size if vision else None,
        mrope=vision and model_config.model_type in QWEN_VL_TYPES,  # its steps' rope positions
        deepstack=_deepstack_rows(loaded) if vision and model_config.model_type == "qwen3_vl"
        else 0,
    )
