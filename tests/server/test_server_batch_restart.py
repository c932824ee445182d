"""A batch survives a restart: `jengine serve --batch-dir D` is stopped with SIGTERM while a
batch runs, a new `jengine serve` on the same D resumes it, and every line is answered exactly
once; the lines answered before the stop are not run again (their records, read from the
store, come back unchanged in the output file)."""

from __future__ import annotations

import json
import signal
import sqlite3
import time

import pytest
from serve_process import MODEL, running_server  # tests/serve_process.py

CHAT = "/v1/chat/completions"
LINES = 12


# ~37 s: two `jengine serve` processes; CI: test_batch_store's resume (a line answered
# once, the store reopened)
@pytest.mark.slow
def test_a_batch_stopped_by_sigterm_is_resumed_by_the_next_server(tmp_path):
    batch_dir = tmp_path / "batches"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT,
              "body": {"model": MODEL, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                       "messages": [{"role": "user", "content": f"Count up from {i}."}]}}
             for i in range(LINES)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with running_server(tmp_path / "first.log", batch_dir) as first:
        client = first.client()
        file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
        batch_id = client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                         completion_window="24h").id
        deadline = time.monotonic() + 240
        while client.batches.retrieve(batch_id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=90) == 0
    with sqlite3.connect(batch_dir / "store.sqlite3") as db:  # what the first server answered
        before = {json.loads(r)["custom_id"]: json.loads(r) for (r,) in db.execute(
            "SELECT record FROM batch_lines WHERE batch_id = ?", (batch_id,))}
        status = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
    assert 2 <= len(before) < LINES and status == ("in_progress",)

    with running_server(tmp_path / "second.log", batch_dir) as second:
        client = second.client()
        deadline = time.monotonic() + 240
        while (batch := client.batches.retrieve(batch_id)).status != "completed":
            assert time.monotonic() < deadline, batch
            assert batch.status in ("in_progress", "finalizing"), batch
            time.sleep(0.1)
        output = [json.loads(line) for line in
                  client.files.content(batch.output_file_id).text.splitlines()]
    assert batch.request_counts.completed == LINES and batch.error_file_id is None
    assert sorted(r["custom_id"] for r in output) == sorted(f"r{i}" for i in range(LINES))
    assert all(r["response"]["status_code"] == 200 for r in output)
    again = {r["custom_id"]: r for r in output if r["custom_id"] in before}
    assert again == before  # the same records: not run a second time
    assert f"batch {batch_id}: {LINES - len(before)} of {LINES} lines to run" in \
        second.log.read_text()
