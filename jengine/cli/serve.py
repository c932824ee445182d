"""`jengine serve`: its command line read into an `EngineConfig` and a `ServerConfig` and checked
(`check_server_config`: one-line errors in the flags' terms), then the server run
(`jengine.server.app.serve`, which parses nothing)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from jengine.config import ServerConfig
from jengine.engine import build_config, check_kv_memory
from jengine.engine_flags import engine_kwargs
from jengine.server.app import DEFAULT_DRAIN_TIMEOUT_S, LOG_LEVELS, serve
from jengine.text.reasoning import REASONING_PARSERS
from jengine.text.tool_parsers import TOOL_PARSERS


def cmd_serve(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args)
    model, preset = kwargs.pop("model"), kwargs.pop("config")
    cfg = build_config(model, preset, **kwargs)  # bad flags or preset: a one-line error now
    config = server_config(args, cfg.server)
    check_kv_memory(cfg)
    return serve(cfg, config, model=model, preset=preset, engine_kwargs=kwargs,
                 drain_timeout=getattr(args, "drain_timeout", None) or DEFAULT_DRAIN_TIMEOUT_S,
                 require_warm=bool(getattr(args, "require_warm", False)))


def server_config(args: argparse.Namespace, preset: ServerConfig) -> ServerConfig:
    """The `server` section of the preset, with the command-line flags that were given on top
    (even one equal to its default)."""
    values = {}
    for field in dataclasses.fields(ServerConfig):
        flag = getattr(args, field.name, None)
        if isinstance(flag, list):
            flag = tuple(flag)
        # A flag given wins (None: not given); a store_true flag left False cannot say "off".
        given = flag is not None and not (flag is False and field.default is False)
        values[field.name] = flag if given else getattr(preset, field.name)
    if getattr(args, "disable_log_requests", False):
        values["log_requests"] = False
    if values["request_timeout"] is not None and values["request_timeout"] <= 0:
        values["request_timeout"] = None  # --request-timeout 0: never
    if values["limit_concurrency"] == 0:
        values["limit_concurrency"] = None  # --limit-concurrency 0: no bound
    config = ServerConfig(**values)
    check_server_config(config)
    return config


def check_server_config(config: ServerConfig) -> None:
    """The server settings that can be wrong before anything starts, as one-line errors."""
    if config.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {config.max_queue}")
    for name in ("max_n", "max_body_bytes", "max_tokens_per_request"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                             f"{getattr(config, name)}")
    if config.default_max_tokens is not None and config.default_max_tokens < 1:
        raise ValueError("--default-max-tokens must be at least 1")
    if bool(config.ssl_keyfile) != bool(config.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for path in (config.ssl_keyfile, config.ssl_certfile):
        if path and not Path(path).is_file():
            raise ValueError(f"TLS file {path!r} not found")
    if config.tool_call_parser not in (None, *TOOL_PARSERS):
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{config.tool_call_parser!r}")
    if config.reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {config.reasoning_parser!r}")
    if config.limit_concurrency is not None and config.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be positive (0: no bound), got "
                         f"{config.limit_concurrency}")
    if not config.timeout_keep_alive > 0:
        raise ValueError(f"--timeout-keep-alive must be positive, got "
                         f"{config.timeout_keep_alive}")
    if config.batch_dir and Path(config.batch_dir).expanduser().exists() and \
            not Path(config.batch_dir).expanduser().is_dir():
        raise ValueError(f"--batch-dir {config.batch_dir!r} is not a directory")
    if config.uvicorn_log_level not in LOG_LEVELS:
        raise ValueError(f"--uvicorn-log-level must be one of {sorted(LOG_LEVELS)}")
