"""`jengine serve` as a real process on 127.0.0.1 (SmolLM2, `--config test`, `--api-key`), for
the server tests: `Server` is the handle they talk through, `running_server` starts and stops it.

One such process serves the whole session (conftest's `server` fixture): a start costs an
interpreter, a model load and a warm-up, and the modules that use it only read its answers and
the deltas of its metrics.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from local_server import free_port  # tests/local_server.py
from prometheus_client.parser import text_string_to_metric_families

from jengine.bench.soak import stop_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key-123"
START_TIMEOUT_S = 600


try:
    import grpc
except ImportError:  # the gRPC service is optional at run time
    grpc = None


class Server:
    """A started server: its process, URLs and log, and clients that carry the API key."""

    def __init__(self, proc: subprocess.Popen, port: int, grpc_port: int | None, log: Path,
                 health_seen: list):
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.grpc_target = f"127.0.0.1:{grpc_port}" if grpc_port else None
        self.log = log
        self.health_seen = health_seen  # (status, body) of /health while starting
        self.ready_at = time.time()  # when /health first answered 200 (this is made then)
        self.metrics_at_ready = self.metrics()  # before any test sent anything

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0,
                             timeout=120, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=300)

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
                key = sample.name + labels
                values[key] = sample.value
        return values


@contextlib.contextmanager
def running_server(log: Path, batch_dir: Path | None = None) -> Iterator[Server]:
    """Starts the server (its output to `log`; its batch store in `batch_dir`, default beside
    the log, never the user's cache), waits until /health is 200, and stops it with SIGTERM at
    the end unless a test already did."""
    port = free_port()
    grpc_port = free_port() if grpc is not None else None
    cmd = [sys.executable, "-m", "jengine.cli", "serve", "--config", "test", "--port", str(port),
           "--api-key", KEY, "--batch-dir", str(batch_dir or log.parent / "batches")]
    if grpc_port:
        cmd += ["--grpc-port", str(grpc_port)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT)
    seen: list[tuple[int, dict]] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    try:
        yield Server(proc, port, grpc_port, log, seen)
    finally:
        stop_server(proc)  # SIGTERM (a drain), then a kill after 90 s
