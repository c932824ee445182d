"""`jengine bench soak --url URL --pid PID`: hold a server on this machine under a mixed load
(jengine/bench/soak_requests.py) for a long time and watch its memory: the server process's RSS
and the KV pages in use (`/metrics`) are sampled every `--interval` seconds.

It answers two questions a short benchmark cannot: does RSS level off (its growth rate over the
last half of the run, against the first half), and once the load stops, does the server return
to idle (no KV page in use, no request running, waiting or queued)? Traffic goes to the loopback
interface only (the RSS is read from /proc, so the server is local anyway); every loop is bounded
in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from jengine.bench.soak_requests import KINDS, send

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
LEVEL_MB_PER_MIN = 0.5  # "levels off": RSS grows slower than this over the run's last half
SETTLE_S = 60.0  # how long the server gets to return to idle after the load stops
IDLE_GAUGES = ("jengine_kv_pages_used", "jengine_num_requests_running",
               "jengine_num_requests_waiting", "jengine_num_requests_queued")


def rss_mb(pid: int | None) -> float | None:
    """The resident set of process `pid` in MB (VmRSS of /proc/PID/status), or None."""
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def scrape(http, url: str) -> dict[str, float]:
    """The server's /metrics samples, keyed `name` or `name{label=value}`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get(url + "/metrics", timeout=30)).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            values[s.name + labels] = s.value
    return values


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mt) * (r - mr) for t, r in points) / var


def rss_trend(samples: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """RSS at the start, end and peak, and its growth rate over each half of the load."""
    points = [(s["t_s"], s["rss_mb"]) for s in samples if s["rss_mb"] is not None]
    if not points:
        return {"levels_off": None}
    half = duration / 2
    first = slope_mb_per_min([p for p in points if p[0] <= half])
    second = slope_mb_per_min([p for p in points if half <= p[0] <= duration])
    return {"start_mb": points[0][1], "end_mb": points[-1][1],
            "peak_mb": max(r for _, r in points),
            "first_half_mb_per_min": first, "second_half_mb_per_min": second,
            "levels_off": None if second is None else second < LEVEL_MB_PER_MIN}


class Soak:
    """One soak's load, its counters and its samples."""

    def __init__(self, args: argparse.Namespace, client, http, model: str):
        self.args, self.client, self.http, self.model = args, client, http, model
        self.next_index = 0
        self.done = 0
        self.by_kind = {k: 0 for k in KINDS}
        self.errors: dict[str, int] = {}
        self.samples: list[dict[str, Any]] = []
        self.start = time.monotonic()

    async def worker(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.next_index < self.args.max_requests:
            i = self.next_index
            self.next_index += 1
            try:
                kind, error = await asyncio.wait_for(
                    send(self.client, self.model, i), self.args.request_timeout)
            except TimeoutError:
                kind, error = KINDS[i % len(KINDS)], f"{KINDS[i % len(KINDS)]}:client_timeout"
            self.done += 1
            self.by_kind[kind] += 1
            if error:
                self.errors[error] = self.errors.get(error, 0) + 1

    async def sample(self) -> dict[str, Any]:
        try:
            m = await scrape(self.http, self.args.url)
        except Exception:  # noqa: BLE001 - a peer's server may have no /metrics
            m = {}
        row = {"t_s": round(time.monotonic() - self.start, 1), "requests_done": self.done,
               "errors": sum(self.errors.values()), "rss_mb": rss_mb(self.args.pid),
               "kv_pages_used": m.get("jengine_kv_pages_used"),
               # pages that hold cached prefixes: the part of the KV pool touched so far (its
               # RSS grows until the pool is full of them, a growth that is not a leak)
               "kv_pages_cached": m.get("jengine_prefix_cache_pages"),
               "running": m.get("jengine_num_requests_running")}
        self.samples.append(row)
        rss = "-" if row["rss_mb"] is None else f"{row['rss_mb']:.0f}"
        print(f"soak {row['t_s']:7.0f}s  done {self.done:6d}  errors {row['errors']:3d}  "
              f"rss {rss} MB  kv_pages_used {row['kv_pages_used']}  "
              f"cached {row['kv_pages_cached']}", file=sys.stderr)
        return m

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():  # the first sample is taken before the load starts
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.interval)
            if not stop.is_set():
                await self.sample()

    async def settle(self) -> dict[str, Any]:
        """Waits (at most SETTLE_S) for the server to go idle; its gauges then."""
        began = time.monotonic()
        while True:
            m = await self.sample()
            idle = bool(m) and all(m.get(g) == 0 for g in IDLE_GAUGES)
            if idle or time.monotonic() - began > SETTLE_S:
                state = {g.removeprefix("jengine_"): m.get(g) for g in IDLE_GAUGES}
                return {**state, "idle": idle, "seconds_to_idle": round(
                    time.monotonic() - began, 1) if idle else None}
            await asyncio.sleep(0.5)


async def _soak(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from openai import AsyncOpenAI

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(headers=headers) as http, AsyncOpenAI(
            base_url=args.url + "/v1", api_key=args.api_key or "none", max_retries=0,
            timeout=args.request_timeout) as client:
        model = args.served_model or (await client.models.list()).data[0].id
        soak = Soak(args, client, http, model)
        before = await soak.sample()
        stop = asyncio.Event()
        sampler = asyncio.create_task(soak.sampler(stop))
        deadline = soak.start + args.duration
        await asyncio.gather(*(soak.worker(deadline) for _ in range(args.concurrency)))
        load_s = time.monotonic() - soak.start
        stop.set()
        await sampler
        end_state = await soak.settle()
        after = await scrape(http, args.url) if before else {}
    finishes = {k.split("=")[1].rstrip("}"): after[k] - before.get(k, 0) for k in after
                if k.startswith("jengine_requests_total{")}
    return {
        "url": args.url, "model": model, "pid": args.pid, "concurrency": args.concurrency,
        "duration_s": args.duration, "load_s": round(load_s, 1), "requests": soak.done,
        "by_kind": soak.by_kind, "errors": soak.errors,
        "expected_4xx": soak.by_kind["bad_input"] - sum(
            n for k, n in soak.errors.items() if k.startswith("bad_input:")),
        "server_finish_reasons": finishes, "rss": rss_trend(soak.samples, load_s),
        "end_state": end_state, "samples": soak.samples,
    }


def check_loopback(url: str) -> str:
    """The URL without a trailing slash; ValueError unless it is on the loopback interface."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK:
        raise ValueError(f"bench soak loads a server on this machine only (127.0.0.1), not {url}")
    return url.rstrip("/")


def start_server(args: argparse.Namespace) -> subprocess.Popen:
    """`jengine serve` on the --url's port of 127.0.0.1, waited for until /health is 200."""
    import httpx

    port = urlsplit(args.url).port or 8000
    log = Path(tempfile.mkstemp(prefix="jengine-soak-server-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "jengine.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), *args.serve_arg]
    print(f"soak: starting {' '.join(cmd)} (log: {log})", file=sys.stderr)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(args.url + "/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise ValueError(f"the server did not become healthy; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()


def write_csv(path: str, samples: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(samples[0]))
        w.writeheader()
        w.writerows(samples)


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import openai  # noqa: F401
    except ImportError as e:
        raise ValueError("bench soak needs the openai package: pip install openai") from e
    if args.duration <= 0 or args.concurrency < 1 or args.interval <= 0:
        raise ValueError("--duration and --interval must be positive, --concurrency at least 1")
    args.url = check_loopback(args.url)
    proc = start_server(args) if args.start else None
    if proc is not None:
        args.pid = proc.pid
    try:
        result = asyncio.run(_soak(args))
    finally:
        if proc is not None:
            stop_server(proc)
    if args.csv:
        write_csv(args.csv, result["samples"])
    return result
