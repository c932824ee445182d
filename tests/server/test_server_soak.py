"""`jengine bench soak` against the session's server (a short soak: the hour-long run and its
figures are in docs/server.md): the report's shape, and the end state it checks, which is the
point of a soak: after mixed load with aborts and bad input, every KV page is back, nothing is
running, and no request failed except the bad ones, each with the 4xx it was due."""

from __future__ import annotations

import csv
import json

import pytest
from serve_process import KEY  # tests/serve_process.py

from jengine.bench.soak_requests import KINDS
from jengine.cli.main import main


# ~17 s of load on the shared server; CI: the hardening and abort tests' end state (pages
# back, nothing running)
@pytest.mark.slow
def test_short_soak_reports_samples_and_returns_to_idle(server, capsys, tmp_path):
    """12 s of `jengine bench soak` (every request kind, hang-ups, bad input) on the session
    server: no client error, every abort counted, memory sampled, and the server idle with no KV
    page held afterwards. The 12 s is the shortest run that gives the trend its samples."""
    out = tmp_path / "soak.csv"
    rc = main(["bench", "soak", "--url", server.url, "--api-key", KEY,
               "--pid", str(server.proc.pid), "--duration", "12", "--concurrency", "16",
               "--interval", "3", "--csv", str(out)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)

    assert report["errors"] == {}, report["errors"]
    assert set(report["by_kind"]) == set(KINDS) and min(report["by_kind"].values()) > 0
    assert report["requests"] == sum(report["by_kind"].values())
    assert report["expected_4xx"] == report["by_kind"]["bad_input"]
    finishes = report["server_finish_reasons"]
    assert finishes.get("error", 0) == 0 and finishes.get("timeout", 0) == 0
    assert finishes["abort"] == report["by_kind"]["abort"]  # each hang-up aborted its request

    end = report["end_state"]
    assert end["idle"] and end["kv_pages_used"] == 0 and end["num_requests_running"] == 0
    assert end["num_requests_waiting"] == 0 and end["num_requests_queued"] == 0

    samples = report["samples"]
    assert len(samples) >= 5  # one before the load, one per 3 s, and the settled one
    times = [s["t_s"] for s in samples]
    assert times == sorted(times)
    assert all(s["rss_mb"] > 100 for s in samples)  # a loaded SmolLM2 server
    assert samples[-1]["kv_pages_used"] == 0 and samples[-1]["requests_done"] == report["requests"]
    assert max(s["kv_pages_used"] for s in samples) > 0  # the load held pages while it ran
    trend = report["rss"]
    assert trend["peak_mb"] >= trend["start_mb"] > 0
    assert isinstance(trend["levels_off"], bool)

    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(samples) and float(rows[-1]["kv_pages_used"]) == 0


def test_soak_refuses_a_remote_url(capsys):
    assert main(["bench", "soak", "--url", "http://example.com:8000", "--duration", "1"]) == 2
    assert "127.0.0.1" in capsys.readouterr().err
