"""Wall seconds from process start to the first token (`generate`) or to `/health` 200 (`serve`),
and the time to first content of a fresh server's first requests.

    python scripts/start_times.py --runs 3 generate "Hi" --max-tokens 16 --config cpu
    python scripts/start_times.py --runs 3 serve --config cpu
    PYTHONPATH=. python scripts/start_times.py --runs 2 --first-requests 6 \
        --tree /tmp/before --tree . serve

Runs `python -P -m jengine.cli ARGS...` `--runs` times and prints JSON: each run's seconds and
their median. `generate`: until the first byte of generated text on stdout; `serve`: until
`/health` answers 200 (polled every 50 ms; the server is then stopped with SIGTERM). With
`--first-requests N`, a served run then sends N streaming chat requests of `jengine bench
serve`'s shape one after another (`--output-len` tokens each) and records each one's time to
first content in ms: the first is the one that meets the server's first pass through the request
path. `--tree PATH` (repeatable): the jengine tree each run is started from (its PYTHONPATH),
taking turns within each run so that trees share the machine's moods; without it, whichever
jengine this Python finds. A run that exits early or takes over `--timeout` seconds fails the
script. Run it on a quiet machine, after one start has filled the caches for a warm figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-P", "-m", "jengine.cli", *args]


def _env(tree: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree)
    return env


def time_generate(args: list[str], timeout: float, tree: str | None) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(_command(args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=_env(tree))
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready or not os.read(proc.stdout.fileno(), 1):
            raise RuntimeError(f"no output within {timeout}s (exit status {proc.poll()})")
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()


def time_serve(args: list[str], timeout: float, tree: str | None, first_requests: int = 0,
               output_len: int = 128) -> tuple[float, list[float]]:
    """Seconds to /health 200, and the TTFT (ms) of each of the first requests after it."""
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(_command([*args, "--port", str(port)]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(tree))
    try:
        ready = _wait_healthy(proc, port, start, timeout)
        url = f"http://127.0.0.1:{port}"
        return ready, asyncio.run(_first_ttfts(url, first_requests, output_len))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, port: int, start: float, timeout: float) -> float:
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"not healthy within {timeout}s")


async def _first_ttfts(url: str, num: int, output_len: int) -> list[float]:
    """TTFT (ms) of `num` streaming chat requests of the bench's shape, one after another."""
    if not num:
        return []
    from openai import AsyncOpenAI

    from jengine.bench.serve import bench_prompt, timed_request

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600) as client:
        model = (await client.models.list()).data[0].id
        ttfts = []
        for i in range(num):
            result = await timed_request(client, model, bench_prompt(i), output_len, 0.0)
            ttfts.append(round(result["ttft"] * 1000, 1))
        return ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--tree", action="append", help="a jengine tree to start (repeatable)")
    parser.add_argument("--first-requests", type=int, default=0,
                        help="serve: streaming chat requests to time after ready")
    parser.add_argument("--output-len", type=int, default=128,
                        help="serve: tokens each of those requests asks for")
    parser.add_argument("command", choices=["generate", "serve"])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    ns = parser.parse_args()
    if ns.first_requests and ns.command != "serve":
        parser.error("--first-requests goes with serve")
    trees = ns.tree or [None]
    seconds: dict[str | None, list[float]] = {t: [] for t in trees}
    ttfts: dict[str | None, list[list[float]]] = {t: [] for t in trees}
    for _ in range(ns.runs):
        for tree in trees:
            args = [ns.command, *ns.args]
            if ns.command == "generate":
                took, first = time_generate(args, ns.timeout, tree), []
            else:
                took, first = time_serve(args, ns.timeout, tree, ns.first_requests,
                                         ns.output_len)
            seconds[tree].append(round(took, 2))
            ttfts[tree].append(first)
    results = {str(tree): {"seconds": seconds[tree], "median_s": statistics.median(seconds[tree]),
                           **({"first_ttft_ms": ttfts[tree]} if ns.first_requests else {})}
               for tree in trees}
    print(json.dumps({"command": ["jengine", ns.command, *ns.args],
                      **(results["None"] if ns.tree is None else {"trees": results})}))


if __name__ == "__main__":
    main()
