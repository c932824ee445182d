"""The session's `jengine serve` over gRPC: the same text as HTTP, health, models, errors, and
a cancelled stream's pages freed."""

from __future__ import annotations

import time

import pytest
from serve_process import KEY, MODEL, grpc  # tests/serve_process.py


@pytest.fixture(scope="module")
def grpc_stub(server):
    if server.grpc_target is None:
        pytest.skip("grpcio is not installed")
    from jengine.server.proto import jengine_pb2_grpc

    with grpc.insecure_channel(server.grpc_target) as channel:
        yield jengine_pb2_grpc.JengineStub(channel)


AUTH = [("authorization", f"Bearer {KEY}")]


def test_grpc_streams_the_same_text_as_http(server, grpc_stub):
    from jengine.server.grpc_client import generate_stream

    prompt = "Write a list of fruits, one per line, with the colour and the month each ripens:"
    http = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                              temperature=0)
    msgs = list(generate_stream(server.grpc_target, prompt, api_key=KEY, request_id="g-1",
                                max_tokens=12, temperature=0))
    assert len(msgs) > 1 and all(m.request_id == "g-1" for m in msgs)
    assert "".join(m.text for m in msgs) == http.choices[0].text
    assert [m.finish_reason for m in msgs if m.finish_reason] == [http.choices[0].finish_reason]
    assert msgs[-1].usage.completion_tokens == http.usage.completion_tokens
    assert msgs[-1].usage.prompt_tokens == http.usage.prompt_tokens
    # The HTTP request left the prompt's whole pages in the prefix cache.
    whole_pages = (http.usage.prompt_tokens - 1) // 16 * 16
    assert msgs[-1].usage.cached_tokens == whole_pages > 0


def test_grpc_health_models_and_errors(server, grpc_stub):
    from jengine.server.proto import jengine_pb2 as pb

    assert grpc_stub.Health(pb.HealthRequest()).status == "ok"
    models = grpc_stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models
    assert [(m.id, m.max_model_len) for m in models] == [(MODEL, 512)]
    cases = [
        (pb.GenerateRequest(text="x"), None, grpc.StatusCode.UNAUTHENTICATED),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(temperature=-1)), AUTH,
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(text="word " * 600), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(text="x", model="gpt-4"), AUTH, grpc.StatusCode.NOT_FOUND),
    ]
    for request, metadata, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(grpc_stub.Generate(request, metadata=metadata, timeout=60))
        assert info.value.code() == code, info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.ListModels(pb.ListModelsRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_cancel_frees_pages(server, grpc_stub):
    from jengine.server.proto import jengine_pb2 as pb

    request = pb.GenerateRequest(text="A long tale:", sampling=pb.SamplingOptions(
        max_tokens=300, ignore_eos=True))
    call = grpc_stub.Generate(request, metadata=AUTH)
    next(call)
    assert server.metrics()["jengine_kv_pages_used"] > 0
    call.cancel()
    deadline = time.monotonic() + 30
    while server.metrics()["jengine_kv_pages_used"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_grpc_client_command(server, grpc_stub, capsys):
    """`python -m jengine.cli.grpc_client` (the command line over the client library): the
    stream's text on stdout; an RPC error one line on stderr and exit status 1."""
    from jengine.cli.grpc_client import main
    from jengine.server.grpc_client import generate_stream

    host, port = server.grpc_target.rsplit(":", 1)
    flags = ["--host", host, "--port", port, "--max-tokens", "8"]
    text = "".join(m.text for m in generate_stream(server.grpc_target, "Hi", api_key=KEY,
                                                    max_tokens=8, temperature=0))
    assert main(["Hi", *flags, "--api-key", KEY]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert main(["Hi", *flags, "--api-key", "wrong"]) == 1
    assert "error: UNAUTHENTICATED" in capsys.readouterr().err
