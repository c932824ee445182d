"""The batch store (jengine/server/batch_store.py) without a server: a line is answered once,
the counts come from the answers, the state survives reopening, one server per directory."""

from __future__ import annotations

import pytest

from jengine.server.batch_store import BatchDirBusy, BatchStore


def test_a_line_is_answered_once_and_the_store_reopens(tmp_path):
    store = BatchStore(tmp_path)
    file = store.add_file(b'{"a": 1}\n', "in.jsonl", "batch")
    assert store.content(file["id"]) == b'{"a": 1}\n' and file["bytes"] == 9
    batch = store.add_batch("/v1/completions", file["id"], "24h", {"k": "v"}, 60)
    assert batch["status"] == "validating" and batch["expires_at"] == batch["created_at"] + 60
    assert store.set_status(batch["id"], "in_progress", only_from=("validating",), total=3)
    assert not store.set_status(batch["id"], "cancelled", only_from=("validating",))
    store.record_line(batch["id"], 0, True, {"custom_id": "first"})
    store.record_line(batch["id"], 0, False, {"custom_id": "again"})  # ignored
    store.record_line(batch["id"], 2, False, {"custom_id": "bad"})
    store.close()
    store = BatchStore(tmp_path)
    batch = store.batch(batch["id"])
    assert batch["status"] == "in_progress" and batch["metadata"] == {"k": "v"}
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert store.answered(batch["id"]) == {0, 2} and store.unfinished() == [batch["id"]]
    assert store.records(batch["id"], True) == ['{"custom_id": "first"}']
    store.close()


def test_one_server_holds_a_directory(tmp_path):
    first = BatchStore(tmp_path)
    with pytest.raises(BatchDirBusy, match="in use by another server"):
        BatchStore(tmp_path)
    first.close()
    BatchStore(tmp_path).close()  # free again once the first let go
