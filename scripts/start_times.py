"""Wall seconds from process start to the first token (`generate`) or to `/health` 200 (`serve`).

    python scripts/start_times.py --runs 3 generate "Hi" --max-tokens 16 --config cpu
    python scripts/start_times.py --runs 3 serve --config cpu

Runs `python -P -m jengine.cli ARGS...` (the tree on PYTHONPATH decides which jengine) `--runs`
times and prints JSON: each run's seconds and their median. `generate`: until the first byte of
generated text on stdout; `serve`: until `/health` answers 200 (polled every 50 ms; the server is
then stopped with SIGTERM). A run that exits early or takes over `--timeout` seconds fails the
script. Run it on a quiet machine, after one start has filled the caches for a warm figure.
"""

from __future__ import annotations

import argparse
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


def time_generate(args: list[str], timeout: float) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(_command(args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready or not os.read(proc.stdout.fileno(), 1):
            raise RuntimeError(f"no output within {timeout}s (exit status {proc.poll()})")
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()


def time_serve(args: list[str], timeout: float) -> float:
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(_command([*args, "--port", str(port)]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
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
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("command", choices=["generate", "serve"])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    ns = parser.parse_args()
    timer = time_generate if ns.command == "generate" else time_serve
    seconds = [round(timer([ns.command, *ns.args], ns.timeout), 2) for _ in range(ns.runs)]
    print(json.dumps({"command": ["jengine", ns.command, *ns.args], "seconds": seconds,
                      "median_s": statistics.median(seconds)}))


if __name__ == "__main__":
    main()
