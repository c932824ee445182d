"""Engine configuration: frozen, keyword-only dataclasses split by concern, and the one function
that reads them from a YAML preset (`configs/*.yaml`, sections named like the dataclasses)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

import configs as _configs

CONFIG_DIR = Path(_configs.__file__).resolve().parent


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    # A path, GGUF file, converted checkpoint or cached hub id; None = the bundled SmolLM2.
    model: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on GPU/TPU and AMX-BF16 CPUs, else float32
    max_model_len: int | None = None  # None = min(model context, 2048)
    attention_backend: str = "auto"
    # How layer weights sit in memory: auto = unstacked (per-layer arrays, read in place) on CPU
    # and GPU, stacked (one lax.scan over a leading layer axis) on TPU; jengine.models.layers.
    layer_layout: str = "auto"
    # Projections: auto = on one CPU device the native kernels (`native`: a few rows), and on
    # a CPU with AMX-BF16 a bf16 model's projections packed for the tiles (`amx`); XLA's dot
    # (`xla`) elsewhere; see jengine.models.matmul.resolve_matmul_backend.
    matmul_backend: str = "auto"
    # none | int8 (W8A8: int8 weights per output channel, int8 activations per token) | w8a16
    # (int8 weights, float activations) | fp8 (e4m3 weights; GPU/TPU) | w4a16 (4-bit weights,
    # a scale and min per 32; the output head int8) | auto (a GGUF's precision kept: Q4_x ->
    # w4a16, Q8_0 -> w8a16, else none); see models/quant.py, models/quant4.py.
    quantization: str = "none"
    quantize_lm_head: bool = False  # also the output head (off: it stays in the model dtype)
    # auto: the source's weights | dummy: random weights of the source's shapes (vLLM's
    # `--load-format dummy`): only the config and tokenizer are read, for timing a model whose
    # weights are not at hand
    load_format: str = "auto"
    # int8 only: SmoothQuant's migration strength, calibrated and folded into the float weights
    # at load time (models/smoothing.py); 0 turns it off. 0.55: SmolLM2's teacher-forced KL was
    # flat over 0.5-0.65 (docs/quantization.md).
    smoothing_alpha: float = 0.55
    seed: int | None = None  # seeds the per-request seeds of requests that give none
    # generate | embed | score (vLLM's names): embed and score serve pooled final hidden states
    # (/v1/embeddings, /v1/rerank, /v1/score; `Engine.embed`) and refuse to generate.
    task: str = "generate"
    # Embedding tasks: last | mean | cls, and whether vectors are L2-normalised; None: as the
    # model dir's sentence-transformers files say (modules.json), else last token, normalised.
    pooling: str | None = None
    normalize: bool | None = None
    # Vision models: the most images one prompt may hold (vLLM's `--limit-mm-per-prompt`).
    limit_mm_per_prompt: str = "image=4"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    page_size: int = 16
    kv_cache_memory: str = "2GiB"
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto = the model dtype | float32 | bfloat16 | int8 | fp8


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Step shapes compiled at start-up. None = powers of two up to the maxima above.
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    # Schedule and dispatch step N+1 before step N's tokens reach the host (they are read on
    # the device), so host work overlaps device work. Off: strictly one step at a time.
    async_scheduling: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (jengine/scheduling/speculative.py): off unless `method` is set."""

    method: str | None = None  # None (off) | "ngram" (prompt lookup) | "draft" (draft_model)
    num_tokens: int | None = None  # proposed tokens per step (1-15); None: `proposal_tokens`
    ngram_min: int = 1  # the shortest suffix the n-gram proposer matches
    ngram_max: int = 4  # the longest, tried first
    draft_model: str | None = None  # the proposer model of method "draft"

    def proposal_tokens(self) -> int:
        """`num_tokens`, or the method's default: 15 for n-gram, whose proposals the cost model
        cuts to what pays (15 beat 3 in every case measured: docs/engine.md, session 22), and 3
        for a draft model, which drafts them one step at a time."""
        if self.num_tokens is not None:
            return self.num_tokens
        return 15 if self.method == "ngram" else 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    mesh: str = "tp=1"
    # Multi-host (jax.distributed): the coordinator's HOST:PORT, the process count, this rank.
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP/gRPC front end: where it listens, who may call it, and how much one request may
    ask for (each bound is a 400, or 413 for the body, in OpenAI's error shape)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    grpc_port: int | None = None
    max_queue: int = 1024
    # Bounds on one request.
    max_n: int = 128  # OpenAI's limit on `n`
    max_body_bytes: int = 4 * 2**20  # 413 before the body is parsed
    default_max_tokens: int | None = None  # chat without max_tokens; None: to the context end
    max_tokens_per_request: int = 65536  # n * max_tokens (summed over a request's prompts)
    request_timeout: float | None = 600.0  # seconds; None: never
    # Bounds on connections (uvicorn's names; jengine/server/connections.py).
    limit_concurrency: int | None = 2048  # open connections; past it 503; None: no bound
    timeout_keep_alive: float = 5.0  # seconds to a whole request header, or closed
    # Names and templates.
    served_model_name: tuple[str, ...] | None = None  # first is reported; all are accepted
    # LoRA adapters served from the start as models of their own: "NAME=PATH" each (needs the
    # engine's `enable_lora`); and whether /v1/load_lora_adapter and /v1/unload_lora_adapter
    # may add and remove others while serving (vLLM's --allow-runtime-lora-updating).
    lora_modules: tuple[str, ...] = ()
    allow_runtime_lora_updating: bool = False
    chat_template: str | None = None  # a Jinja template (text or file path) over the model's
    trust_request_chat_template: bool = False  # may a request send its own `chat_template`?
    # HTTP details, as vLLM's flags of the same names.
    root_path: str = ""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    log_requests: bool = True  # one INFO line per request; False: DEBUG
    uvicorn_log_level: str = "info"
    enable_auto_tool_choice: bool = False  # accepted for vLLM; `tool_choice: auto` always works
    tool_call_parser: str | None = None  # a call format or auto (jengine/text/tool_parsers.py)
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3 | granite | auto (jengine.text)
    # The Files and Batch API's store. `jengine serve` default: ~/.cache/jengine/batches;
    # None (create_app from Python): a temporary directory, removed at shutdown.
    batch_dir: str | None = None
    web_ui: bool = True  # the chat page at `/` (jengine/server/web_ui.py); False: `/` is a 404
    # Image URLs (vision models; jengine/vision/media.py): data: always; file: under this
    # directory only; http(s): only when allowed, each fetch bounded in bytes and seconds.
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    max_image_bytes: int = 20 * 2**20
    media_fetch_timeout: float = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Multi-LoRA serving (vLLM's names; docs/lora.md)."""

    enable_lora: bool = False
    max_loras: int = 4  # adapters in one step: the device slots
    max_lora_rank: int = 64  # every slot's rank; a smaller adapter is zero-padded
    max_cpu_loras: int | None = None  # adapters kept read on the host; None: max_loras


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: ModelSection = ModelSection()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()
    lora: LoraConfig = LoraConfig()


_SECTION_TYPES = {
    "model": ModelSection, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig, "parallel": ParallelConfig, "server": ServerConfig,
    "lora": LoraConfig,
}
# Keyword (Engine / CLI flag) names that differ from their config key: name -> (section, key).
_ALIASES = {
    "speculative": ("speculative", "method"),
    "num_speculative_tokens": ("speculative", "num_tokens"),
}


def load_config(name_or_path: str | None, **overrides: Any) -> EngineConfig:
    """Reads a preset by name (`configs/<name>.yaml`) or path, then applies keyword overrides
    (each a field name of any section, or an `_ALIASES` name; None values are ignored)."""
    data: dict[str, dict[str, Any]] = {}
    if name_or_path:
        path = Path(name_or_path)
        if not path.exists():
            path = CONFIG_DIR / f"{name_or_path.removesuffix('.yaml')}.yaml"
        if not path.exists():
            raise ValueError(f"config {name_or_path!r} not found (a path, or one of {presets()})")
        data = yaml.safe_load(path.read_text()) or {}
        unknown = set(data) - set(_SECTION_TYPES)
        if unknown:
            raise ValueError(f"unknown config sections {sorted(unknown)} in {path}")
    for name, (section, key) in _ALIASES.items():
        if overrides.get(name) is not None:
            data.setdefault(section, {})
            data[section] = {**(data[section] or {}), key: overrides[name]}
    overrides = {k: v for k, v in overrides.items() if k not in _ALIASES}
    sections = {}
    for section, cls in _SECTION_TYPES.items():
        values = dict(data.get(section) or {})
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(values) - names
        if bad:
            raise ValueError(f"unknown keys {sorted(bad)} in config section {section!r}")
        for key, value in overrides.items():
            if key in names and value is not None:
                values[key] = value
        for key in ("token_buckets", "seq_buckets", "page_buckets", "served_model_name",
                    "lora_modules", "allowed_origins", "allowed_methods", "allowed_headers"):
            if isinstance(values.get(key), str):
                values[key] = (values[key],)
            if values.get(key) is not None:
                values[key] = tuple(int(v) if key.endswith("buckets") else v
                                    for v in values[key])
        sections[section] = cls(**values)
    known = {f.name for cls in _SECTION_TYPES.values() for f in dataclasses.fields(cls)}
    stray = {k for k, v in overrides.items() if v is not None and k not in known}
    if stray:
        raise ValueError(f"unknown engine options {sorted(stray)}")
    return EngineConfig(**sections)


def presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def parse_memory(text: str) -> int:
    """'2GiB' / '512MiB' / '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([KMGT]i?B?)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse memory size {text!r} (e.g. '2GiB', '512MiB')")
    value = float(m.group(1))
    unit = (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(value * scale)
