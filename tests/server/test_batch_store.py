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


def test_an_app_without_a_batch_dir_keeps_its_files_until_shutdown():
    """`create_app` from Python (no `batch_dir`): a temporary store, made on first use and
    removed at shutdown; `jengine serve` always names a directory (the user's cache)."""
    from fastapi.testclient import TestClient

    from jengine.config import ServerConfig
    from jengine.server.app import create_app

    def no_engine():
        raise RuntimeError("this test needs no engine")

    app = create_app(load_engine=no_engine, config=ServerConfig())
    service = app.state.batches
    with TestClient(app) as client:
        assert service.root is None  # nothing made before it is needed
        r = client.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")},
                        data={"purpose": "batch"})
        assert r.status_code == 200 and r.json()["bytes"] == 3
        root = service.root
        assert (root / "files" / r.json()["id"]).read_bytes() == b"{}\n"
        r = client.post("/v1/files", content=b"{}", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    assert not root.exists()
