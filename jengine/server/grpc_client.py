"""A gRPC client for `jengine serve --grpc-port P` (from the shell: `python -m
jengine.cli.grpc_client PROMPT --port P`):

```python
from jengine.server.grpc_client import generate_stream
for msg in generate_stream("127.0.0.1:50051", "Hello", max_tokens=16, temperature=0):
    print(msg.text, end="", flush=True)
```
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from jengine.server.proto import jengine_pb2 as pb
from jengine.server.proto import jengine_pb2_grpc as pb_grpc


def generate_stream(target: str, prompt: str | list[int], *, api_key: str | None = None,
                    model: str = "", request_id: str = "", timeout: float | None = None,
                    **sampling) -> Iterator[pb.GenerateResponse]:
    """Streams `GenerateResponse` deltas; `sampling` takes `SamplingOptions` field names."""
    request = pb.GenerateRequest(model=model, request_id=request_id,
                                 sampling=pb.SamplingOptions(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.JengineStub(channel)
        yield from stub.Generate(request, metadata=metadata, timeout=timeout)
