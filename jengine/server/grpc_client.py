"""A gRPC client for `jengine serve --grpc-port P`, usable as an example and from the shell:

    python -m jengine.server.grpc_client "Explain paged attention" --port 50051 --max-tokens 64

```python
from jengine.server.grpc_client import generate_stream
for msg in generate_stream("127.0.0.1:50051", "Hello", max_tokens=16, temperature=0):
    print(msg.text, end="", flush=True)
```
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Stream a completion from jengine over gRPC.")
    p.add_argument("prompt")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--api-key")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    try:
        for msg in generate_stream(f"{args.host}:{args.port}", args.prompt, api_key=args.api_key,
                                   max_tokens=args.max_tokens, temperature=args.temperature):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
