"""`jengine serve`: its command line read into an `EngineConfig` and a `ServerConfig`, then the
server run (`jengine.server.app.serve`, which parses nothing)."""

from __future__ import annotations

import argparse
import dataclasses

from jengine.config import ServerConfig
from jengine.engine import build_config, check_kv_memory
from jengine.engine_flags import engine_kwargs
from jengine.server.app import DEFAULT_DRAIN_TIMEOUT_S, check_server_config, serve


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
