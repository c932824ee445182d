"""`python -m jengine.cli.grpc_client PROMPT --port P`: streams one completion from a
`jengine serve --grpc-port P` to stdout, through `jengine.server.grpc_client.generate_stream`
(the client library); an RPC error is one line on stderr and exit status 1."""

from __future__ import annotations

import argparse
import sys

import grpc

from jengine.server.grpc_client import generate_stream


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
