"""LoRA adapters as models of their own: the names the server answers to besides the base
model's, and vLLM's routes that add and remove them while serving.

Each adapter is a `LoRARequest` under a name, with an id the server gives it (a fresh id per
load, so an id never names two directories). A request's `model` picks its adapter in every
generating route (`pipeline.accept`). `--lora-modules NAME=PATH` are read when the engine
starts (a bad one stops the start); `POST /v1/load_lora_adapter` reads and checks an adapter
before its name answers (a bad one is a 400), and `POST /v1/unload_lora_adapter` takes the
name away at once while the requests already running under it finish. Both routes answer only
with `--allow-runtime-lora-updating` (a 404 otherwise, as a server without them).
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from jengine.lora_request import LoRARequest
from jengine.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from jengine.async_engine import AsyncEngine


class ServedLoras:
    """Adapter name -> `LoRARequest`, safe from the event loop and the loading thread."""

    def __init__(self, modules: tuple[str, ...] = ()):
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._modules = [parse_module(m) for m in modules]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def all(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())

    def start(self, engine: AsyncEngine) -> None:
        """Reads every `--lora-modules` adapter into `engine` (ValueError for a bad one)."""
        for name, path in self._modules:
            self._add(engine.core.add_lora(self._request(name, path)))

    async def load(self, engine: AsyncEngine, name: str, path: str) -> None:
        request = self._request(name, path)
        await engine.add_lora(request)  # ValueError for a bad adapter
        self._add(request)

    async def unload(self, engine: AsyncEngine, name: str) -> None:
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name", code="model_not_found")
        await engine.remove_lora(request.lora_int_id)

    def _request(self, name: str, path: str) -> LoRARequest:
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            return LoRARequest(name, next(self._ids), path)

    def _add(self, request: LoRARequest) -> None:
        with self._lock:
            if request.lora_name in self._by_name:
                raise ValueError(f"The lora adapter '{request.lora_name}' has already been "
                                 "loaded.")
            self._by_name[request.lora_name] = request


def parse_module(text: str) -> tuple[str, str]:
    """`--lora-modules` 'NAME=PATH' -> (name, path); ValueError otherwise."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


def _updating(request: Request):
    """The server state and its engine, when runtime updating is allowed (else a 404)."""
    state = request.app.state.server
    if not state.config.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off (start the server with "
                       "--allow-runtime-lora-updating)", code="not_found")
    return state, state.ready_engine()


async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> PlainTextResponse:
    state, engine = _updating(request)
    if body.lora_name in state.model_names:
        raise bad_request(f"'{body.lora_name}' is the base model's name", "lora_name")
    try:
        await state.loras.load(engine, body.lora_name, body.lora_path)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> PlainTextResponse:
    state, engine = _updating(request)
    await state.loras.unload(engine, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
