"""The OpenAI-compatible HTTP server: `create_app` (the FastAPI app) and `serve` (what
`jengine serve` runs once `jengine.cli.serve` has read and checked its flags).

`serve` starts listening at once and builds the engine in a background thread (warm-up
compiles show a progress bar on stderr), then sends itself a few real requests through its own
socket, so that the first client does not pay Python's first pass through the request path
(`warmup.py`); `/health` answers 503 until all that is done. SIGTERM stops admission (new
requests get 503, `/health` 503), lets in-flight requests finish within `drain_timeout`
seconds, then shuts the engine down.

The routes, and what each needs (API key, streaming, error shape), are the table in routes.py;
the generating ones are views over the one generation pipeline (pipeline.py), which gRPC
(grpc_service.py) shares.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import jengine
from jengine.config import EngineConfig, ServerConfig
from jengine.server.batch_store import default_batch_dir
from jengine.server.batches import BATCH_ENDPOINTS, BatchService
from jengine.server.connections import raise_open_file_limit, uvicorn_config
from jengine.server.errors import install_error_handlers
from jengine.server.middleware import EdgeMiddleware
from jengine.server.openapi import install_openapi
from jengine.server.routes import ROUTES, error_shape, needs_key
from jengine.server.state import ServerState, served_model_name
from jengine.server.warmup import loopback_url

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine

log = logging.getLogger("jengine.server")

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def create_app(
    engine: AsyncEngine | None = None,
    config: ServerConfig | None = None,
    *,
    load_engine: Callable[[], AsyncEngine] | None = None,
    model_name: str | None = None,
    request_timeout: float | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
) -> FastAPI:
    """The FastAPI app serving `engine`, or the engine `load_engine` builds once the app starts.

    Args:
      engine: a running engine (the caller keeps ownership: the app does not shut it down).
      config: `api_key`, `max_queue` and `batch_dir` (the Files and Batch API's store,
        batches.py) are used here (host and port are the caller's).
      load_engine: builds the engine in a background thread when the app starts (`serve`).
      model_name: the model id clients send; default: derived from the engine's model.
      request_timeout: seconds after which a generation request is aborted (None: the
        config's `request_timeout`, itself None for never).
      drain_timeout: seconds in-flight gRPC calls may take to finish at shutdown (uvicorn has
        its own bound for HTTP requests).
    """
    if (engine is None) == (load_engine is None):
        raise ValueError("pass exactly one of engine and load_engine")
    config = config or ServerConfig()
    if model_name is None:
        model_name = served_model_name(engine.core.cfg.model.model if engine else None)
    state = ServerState(config, model_name, request_timeout=request_timeout)
    if engine is not None:
        state.loras.start(engine)  # --lora-modules: a bad adapter is the caller's ValueError
        state.attach(engine, owned=False)
    batches = BatchService(
        Path(config.batch_dir).expanduser() if config.batch_dir else None, state,
        {r.path: r.handler for r in ROUTES if r.method == "POST" and r.path in BATCH_ENDPOINTS})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_engine is not None:
            state.load_in_background(load_engine)
        batches.resume(app)
        grpc_server = None
        if config.grpc_port is not None:
            from jengine.server.grpc_service import start_grpc_server

            grpc_server = await start_grpc_server(state, config.host, config.grpc_port)
            log.info("gRPC service listening on %s:%d", config.host, config.grpc_port)
        yield
        if grpc_server is not None:
            await grpc_server.stop(grace=drain_timeout)
        await batches.stop()
        state.shutdown()

    app = FastAPI(title="jengine", version=jengine.__version__, lifespan=lifespan,
                  root_path=config.root_path)
    app.state.server = state
    app.state.batches = batches
    install_error_handlers(app, error_shape)
    app.add_middleware(EdgeMiddleware, api_key=config.api_key, needs_key=needs_key,
                       error_shape=error_shape,
                       max_body_bytes=config.max_body_bytes, log_requests=config.log_requests,
                       warmup_token=state.warmup_token,
                       on_connection_limit=state.metrics.rejected.labels(
                           reason="connection_limit").inc)
    if config.allowed_origins:  # added last, so outermost: preflights need no API key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
    for route in ROUTES:
        app.add_api_route(route.path, route.handler, methods=[route.method],
                          include_in_schema=route.documented)
    install_openapi(app)
    return app


# -- `jengine serve` ----------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT also closing admission before uvicorn drains connections."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.state.draining:
            log.info("signal %s: draining in-flight requests (up to %ss), then exiting", sig,
                     self.config.timeout_graceful_shutdown)
        self.state.draining = True
        super().handle_exit(sig, frame)


LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
               "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads: a busy port is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(cfg: EngineConfig, config: ServerConfig, *, model: str | None, preset: str | None,
          engine_kwargs: dict, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
          require_warm: bool = False) -> int:
    """Runs the server until SIGTERM: listens first, loads the engine (`AsyncEngine(model,
    config=preset, **engine_kwargs)`, already checked as `cfg`) in the background, drains on
    SIGTERM. `jengine.cli.serve` reads the command line into these."""
    from jengine.async_engine import AsyncEngine

    _configure_logging(config.uvicorn_log_level)
    if config.batch_dir is None:  # a server's batches outlive it (create_app's need not)
        config = dataclasses.replace(config, batch_dir=str(default_batch_dir()))
    app = create_app(
        None, config, model_name=served_model_name(cfg.model.model),
        load_engine=lambda: AsyncEngine(model, config=preset, progress=True,
                                        require_warm=require_warm, **engine_kwargs),
        drain_timeout=drain_timeout,
    )
    state: ServerState = app.state.server
    sock = _listen(config.host, config.port)
    state.warmup_url = loopback_url(sock, tls=bool(config.ssl_certfile))
    raise_open_file_limit(config.limit_concurrency)
    uv_config = uvicorn_config(
        app, config, access_log=False, log_config=None, timeout_graceful_shutdown=drain_timeout,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
        root_path=config.root_path,
    )
    server = _Server(uv_config, state)

    def stop_after_load_error() -> None:
        server.should_exit = True

    state.on_load_error = stop_after_load_error
    # uvicorn re-raises a caught SIGTERM once it has drained, to die of it; a graceful drain is
    # a clean exit here, so the signal it re-raises lands on this no-op and serve returns 0.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    scheme = "https" if config.ssl_certfile else "http"
    log.info("jengine %s listening on %s://%s:%d (model %r loading)", jengine.__version__,
             scheme, config.host, config.port, state.model_name)
    server.run(sockets=[sock])
    if state.load_error is not None:
        raise state.load_error
    return 0


def _configure_logging(uvicorn_level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name, level in (("jengine", logging.INFO), ("uvicorn", LOG_LEVELS[uvicorn_level])):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
