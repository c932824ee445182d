"""The gRPC service (proto/jengine.proto): Generate (server streaming), Health, ListModels.

It runs on the HTTP server's event loop, over the same `ServerState`: the same engine, the same
admission (queue limit, draining, dead engine), the same metrics and books. Like the HTTP
routes it is a view over the generation pipeline (pipeline.py), here for protobuf messages.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import AsyncIterator

import grpc

from jengine.outputs import CompletionOutput, Usage
from jengine.sampling_params import SamplingParams
from jengine.server.errors import APIError, invalid_value
from jengine.server.middleware import clean_request_id
from jengine.server.pipeline import Job, start
from jengine.server.proto import jengine_pb2 as pb
from jengine.server.proto import jengine_pb2_grpc as pb_grpc
from jengine.server.state import ServerState

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_SAMPLING_FIELDS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens",
)


def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    """Set fields of `options` -> SamplingParams (unset: its defaults, max_tokens 16)."""
    given = {name: getattr(options, name) for name in _SAMPLING_FIELDS if options.HasField(name)}
    return SamplingParams(**given, stop=list(options.stop) or None,
                          stop_token_ids=list(options.stop_token_ids) or None)


class JengineService(pb_grpc.JengineServicer):
    def __init__(self, state: ServerState):
        self.state = state
        self.api_key = state.config.api_key.encode() if state.config.api_key else None

    async def Generate(self, request: pb.GenerateRequest,  # CamelCase: gRPC method names
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        rid = clean_request_id(request.request_id) or uuid.uuid4().hex
        try:
            self._authorize(context)
            self.state.check_model(request.model or None)
            prompt = self._prompt(request)
            job = Job(sampling_params(request.sampling), lambda _: [prompt], 1, rid,
                      lora=self.state.loras.get(request.model))  # `model` names an adapter
            stream = await start(self.state, None, job)
        except ValueError as e:
            await _abort(context, invalid_value(e))
        except APIError as e:
            await _abort(context, e)
        async with stream:
            try:
                async for _, delta in stream:
                    for out in delta.outputs:
                        yield _message(rid, out, delta.usage if out is delta.outputs[-1] else None)
            except APIError as e:
                await _abort(context, e)

    async def Health(self, request: pb.HealthRequest,
                     context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        _, body = self.state.health()
        return pb.HealthResponse(status=body["status"])

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        try:
            self._authorize(context)
        except APIError as e:
            await _abort(context, e)
        engine = self.state.engine
        card = pb.ModelCard(id=self.state.model_name,
                            max_model_len=engine.core.model.max_model_len if engine else 0)
        return pb.ListModelsResponse(models=[card])

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self.api_key):
            raise APIError(401, "missing or incorrect API key (metadata 'authorization: "
                           "Bearer <key>')", code="invalid_api_key")

    @staticmethod
    def _prompt(request: pb.GenerateRequest) -> str | list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return request.text
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise ValueError("prompt is empty: set text or token_ids")


def _message(rid: str, out: CompletionOutput, usage: Usage | None) -> pb.GenerateResponse:
    """One choice's delta as a message; the request's usage goes on its very last."""
    return pb.GenerateResponse(
        request_id=rid, index=out.index, text=out.text, token_ids=out.token_ids,
        finish_reason=out.finish_reason or "", usage=None if usage is None else pb.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens, cached_tokens=usage.cached_tokens))


async def _abort(context: grpc.aio.ServicerContext, error: APIError) -> None:
    """Ends the RPC with the status matching the HTTP one (raises)."""
    await context.abort(_STATUS.get(error.status, grpc.StatusCode.INTERNAL), error.message)


async def start_grpc_server(state: ServerState, host: str, port: int) -> grpc.aio.Server:
    """Starts the service on the running event loop; stop it with `await server.stop(grace)`."""
    server = grpc.aio.server()
    pb_grpc.add_JengineServicer_to_server(JengineService(state), server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise ValueError(f"cannot listen for gRPC on {address}")
    await server.start()
    return server
