"""`ServerState`: what one app knows about its engine, and who may reach it.

The engine is built in a background thread while the server already listens, so that `/health`
can say 503 during warm-up; with `warmup_url` set, the thread then sends the server's start-up
requests (`jengine.server.warmup`) before the engine serves anyone else. Admission (`admit`) is
the one place that turns the server's state into 503s and 500s: still loading, draining after
SIGTERM, engine dead, waiting queue full.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jengine.config import ServerConfig
from jengine.sampling_params import SamplingParams, check_text
from jengine.server.errors import APIError, bad_request, engine_failed, unavailable
from jengine.server.loras import ServedLoras
from jengine.server.metrics import ServerMetrics
from jengine.server.middleware import clean_request_id
from jengine.server.warmup import MAX_TOKENS, warm_up
from jengine.text.reasoning import ReasoningFormat, resolve_format, thinking_off
from jengine.text.tool_parsers import resolve_tool_parser
from jengine.vision.media import MediaPolicy

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine

log = logging.getLogger("jengine.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MAX_PROMPTS = 2048  # OpenAI's limit on the prompts of one completions request


def served_model_name(model: str | None) -> str:
    """The model id clients use: the bundled default's name, a path's basename (without .gguf),
    or a hub id as given."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve().name.removesuffix(".gguf")
    return model


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template`: a file's path (read now) or the Jinja text itself."""
    if template is None:
        return None
    path = Path(template).expanduser()
    if "{" not in template and len(template) < 4096 and path.is_file():
        return path.read_text()
    if "{" not in template:
        raise ValueError(f"chat template {template!r} is neither a file nor a Jinja template")
    return template


class ServerState:
    """The engine (once loaded), the server config, and the live counters of one app."""

    def __init__(self, config: ServerConfig, model_name: str, *,
                 request_timeout: float | None = None):
        self.config = config
        self.model_name = config.served_model_name[0] if config.served_model_name else model_name
        # create_app's argument wins over the config's (None there: the config decides)
        self.request_timeout = (request_timeout if request_timeout is not None
                                else config.request_timeout)
        self.engine: AsyncEngine | None = None
        self.owns_engine = False
        self.load_error: BaseException | None = None
        self.draining = False
        self.num_queued = 0  # admitted requests without a first token (bounded by max_queue)
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine, lambda: self.num_queued)
        self.on_load_error: Callable[[], None] | None = None
        # The start-up requests: sent to `warmup_url` (None: none, the caller's choice) with
        # `warmup_token`; admitted to `_warming` alone, and counted in metrics nobody reads.
        self.warmup_url: str | None = None
        self.warmup_token = secrets.token_urlsafe(24)
        self.warmup_metrics = ServerMetrics(lambda: None, lambda: 0)
        self._warming: AsyncEngine | None = None
        self._ids = itertools.count()
        self.chat_template = load_chat_template(config.chat_template)
        self.media = MediaPolicy(
            allowed_local_media_path=config.allowed_local_media_path,
            allow_remote_media=config.allow_remote_media, max_bytes=config.max_image_bytes,
            fetch_timeout=config.media_fetch_timeout)
        self.request_log_level = logging.INFO if config.log_requests else logging.DEBUG
        self._auto_reasoning: dict[str | None, ReasoningFormat | None] = {}  # template -> format
        self.loras = ServedLoras(config.lora_modules)  # adapters served as models (loras.py)

    # -- the engine ------------------------------------------------------------------------------

    def attach(self, engine: AsyncEngine, *, owned: bool) -> None:
        self.engine = engine
        self.owns_engine = owned

    def load_in_background(self, build: Callable[[], AsyncEngine]) -> threading.Thread:
        """Builds the engine in a daemon thread (compiling may take minutes)."""
        thread = threading.Thread(target=self._load, args=(build,), name="jengine-load",
                                  daemon=True)
        thread.start()
        return thread

    def _load(self, build: Callable[[], AsyncEngine]) -> None:
        start = time.perf_counter()
        try:
            engine = build()
        except Exception as e:  # noqa: BLE001 - any failure to start is reported, not raised
            self._fail(e)
            return
        try:
            self.loras.start(engine)
        except ValueError as e:
            engine.shutdown()
            self._fail(e)
            return
        if self.warmup_url is not None:
            try:
                self._warm_up(engine)
            except Exception as e:  # noqa: BLE001 - as above: the server does not start
                engine.shutdown()
                self._fail(e)
                return
        self.attach(engine, owned=True)
        log.info("engine ready in %.1f s: serving %r (max_model_len %d)",
                 time.perf_counter() - start, self.model_name, engine.core.model.max_model_len)

    def _warm_up(self, engine: AsyncEngine) -> None:
        self._warming = engine
        try:
            warm_up(engine, self.warmup_url, token=self.warmup_token, model=self.model_name,
                    api_key=self.config.api_key, chat_template=self.chat_template,
                    max_tokens=min(MAX_TOKENS, self.config.max_tokens_per_request))
        finally:
            self._warming = None

    def _fail(self, error: Exception) -> None:
        self.load_error = error
        log.error("the server failed to start: %s", error)
        if self.on_load_error is not None:
            self.on_load_error()

    def shutdown(self) -> None:
        if self.engine is not None and self.owns_engine:
            self.engine.shutdown()

    # -- health and admission --------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.load_error is not None:
            return 503, {"status": "failed", "error": str(self.load_error)}
        if self.engine is None:
            return 503, {"status": "loading"}
        if not self.engine.is_alive:
            return 503, {"status": "engine_dead", "error": str(self.engine.error)}
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok"}

    def ready_engine(self) -> AsyncEngine:
        """The engine, or the error that says why there is none to use."""
        if self.load_error is not None:
            raise engine_failed(f"failed to start: {self.load_error}")
        if self.engine is None:
            self.metrics.rejected.labels(reason="loading").inc()
            raise unavailable("the model is still loading; retry shortly", "loading", 5)
        if not self.engine.is_alive:
            self.metrics.rejected.labels(reason="engine_dead").inc()
            raise engine_failed(self.engine.error or "the engine thread stopped")
        return self.engine

    def admit(self, request: Any = None) -> QueueSlot:
        """A slot in the waiting queue (and the engine) for a new generation request, or a
        503/500 that says why not. `request`: the HTTP request, so that a start-up request gets
        in before the server is ready. Checked and taken with no await in between: the event
        loop runs one handler at a time, so the count is exact under any burst."""
        if self._warming is not None and is_warmup(request):
            return QueueSlot(self._warming, None)
        engine = self.ready_engine()
        if self.draining:
            self.metrics.rejected.labels(reason="draining").inc()
            raise unavailable("the server is shutting down", "draining")
        if self.num_queued >= self.config.max_queue:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise unavailable(f"the waiting queue is full ({self.config.max_queue} requests); "
                              "retry later", "queue_full")
        self.num_queued += 1
        return QueueSlot(engine, self)

    def metrics_for(self, request: Any) -> ServerMetrics:
        """The metrics a request's latencies and tokens go to: the scratch set for a start-up
        request, the served one for everyone else."""
        return self.warmup_metrics if is_warmup(request) else self.metrics

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to (`--served-model-name`); the first is reported."""
        return self.config.served_model_name or (self.model_name,)

    def reported_model(self, model: str | None) -> str:
        """The `model` an answer carries: the adapter's name for a LoRA adapter's request
        (as vLLM answers), else the base model's reported name."""
        return model if model is not None and model in self.loras else self.model_name

    def check_model(self, model: str | None) -> None:
        """A 404 for a model this server does not serve; a 400 naming `model` for a name that
        is not text (a lone surrogate: checked first, as the 404's message would repeat it)."""
        if model is None:
            return
        try:
            check_text("model", model)
        except ValueError as e:
            raise bad_request(str(e), "model") from None
        if model not in self.model_names and model not in self.loras:
            raise APIError(404, f"The model '{model}' does not exist.", param="model",
                           code="model_not_found")

    def check_limits(self, params: SamplingParams, num_prompts: int, max_model_len: int,
                     max_tokens_field: str = "max_tokens") -> None:
        """The per-request bounds of `ServerConfig`: `n`, prompts, and generated tokens
        (`max_tokens_field`: the name the client bounded them with)."""
        cfg = self.config
        if params.n > cfg.max_n:
            raise bad_request(f"n must be at most {cfg.max_n}, got {params.n}", "n")
        if num_prompts > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {num_prompts}",
                              "prompt")
        total = num_prompts * params.n * params.max_tokens_for(max_model_len)
        if total > cfg.max_tokens_per_request:
            what = f"{max_tokens_field} {params.max_tokens}" if params.max_tokens is not None else (
                f"up to {max_model_len} tokens each (no max_tokens: to the context's end)")
            raise bad_request(
                f"this request could generate {total} tokens ({num_prompts} prompt(s) x n "
                f"{params.n} x {what}); the limit is {cfg.max_tokens_per_request} per request: "
                f"lower n or {max_tokens_field}", max_tokens_field)

    def chat_template_for(self, requested: str | None) -> str | None:
        """The template a chat request renders with: its own only if the server trusts request
        templates (a template is code: loops can burn the CPU), else the server's (or None: the
        model's)."""
        if requested is not None and not self.config.trust_request_chat_template:
            raise bad_request("chat_template in a request is refused: the server was not started "
                              "with --trust-request-chat-template", "chat_template")
        return requested or self.chat_template

    def tool_parser(self, template: str | None) -> str | None:
        """The call format of `--tool-call-parser` for a chat rendered with `template` (None:
        the model's own; `auto` reads that template's text)."""
        name = self.config.tool_call_parser
        if name == "auto" and template is None and self.engine is not None:
            template = getattr(self.engine.tokenizer, "chat_template", None)
        return resolve_tool_parser(name, template)

    def reasoning_format(self, tokenizer: Any, template: str | None,
                         template_kwargs: dict[str, Any] | None) -> ReasoningFormat | None:
        """The format a chat answer's reasoning is read with (`--reasoning-parser`); None
        without the flag or when the request turned thinking off. `auto` decides once per
        template (`template` None: the model's) and logs its choice."""
        name = self.config.reasoning_parser
        if name != "auto" or thinking_off(template_kwargs):
            return resolve_format(name, tokenizer, template, template_kwargs)
        if template not in self._auto_reasoning:
            fmt = resolve_format("auto", tokenizer, template)
            self._auto_reasoning[template] = fmt
            log.info("--reasoning-parser auto: %s for %s", fmt.name if fmt else "none",
                     "the model's chat template" if template is None else "a chat template")
        return self._auto_reasoning[template]

    def response_id(self, request: Any, body_id: str | None) -> str:
        """The id a response carries: the body's `request_id` (vLLM's field) when it is a
        clean id, else the edge's (the client's X-Request-Id or a made-up one)."""
        return clean_request_id(body_id) or request.state.request_id

    def new_request_id(self, client_id: str | None) -> str:
        """An id unique in the engine that starts with the client's X-Request-Id, if any."""
        base = client_id or uuid.uuid4().hex
        return f"{base}-{next(self._ids)}"


class QueueSlot:
    """One admitted request's place in the waiting queue that `--max-queue` bounds.

    Taken by `ServerState.admit`, given back exactly once (`release` is idempotent): by the
    request's `EngineStream` at its first token or when it closes, or, when the request fails
    before a stream takes it over (a 400 from the limits, the tokenizer or the grammar, a client
    gone while tokenizing), by the `with` block `pipeline.start` holds it in.
    """

    def __init__(self, engine: AsyncEngine, state: ServerState | None):
        self.engine = engine
        self._state = state  # None: not counted (the server's own start-up requests)

    def release(self) -> None:
        if self._state is not None:
            self._state.num_queued -= 1
            self._state = None

    def __enter__(self) -> QueueSlot:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None:
            self.release()


def is_warmup(request: Any) -> bool:
    """Whether an HTTP request is one of the server's own start-up requests (the edge
    middleware found the secret token on it)."""
    return request is not None and getattr(request.state, "warmup", False)
