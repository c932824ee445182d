"""`BatchStore`: the Files and Batch API's state under `--batch-dir`, kept across restarts.

SQLite (the standard library's `sqlite3`) holds the records: files (`id`, `bytes`,
`created_at`, `filename`, `purpose`), batches (OpenAI's batch object as columns) and one row per
answered batch line. A line's answer is one committed row, so a server killed mid-batch has
every finished line on disk and none half-written, and a resumed batch skips exactly the lines
with a row (`INSERT OR IGNORE` on `(batch_id, line)`: a line is answered once). The request
counts are read from those rows, never kept beside them, so they cannot disagree. The files'
contents are plain files (`files/<id>`, written to a temporary name and renamed): uploads and
outputs can be large and are only ever read whole, which a file does better than a BLOB.

One server owns a directory at a time (an exclusive `flock` on `lock`): two servers sharing
one would run the same batches twice.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
    total INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL, expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
"""
# A batch in one of these still has work for the runner (cancelling: its files to write).
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")


def default_batch_dir() -> Path:
    """`--batch-dir`'s default: beside jengine's other caches."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jengine" / "batches"


class BatchDirBusy(RuntimeError):
    """Another process holds the batch directory."""


class BatchStore:
    """The records and file contents under one directory; each method is one transaction.

    Thread-safe (one connection behind a lock): the handlers call it from the event loop, and
    file contents are written from worker threads."""

    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "lock", "w")  # noqa: SIM115 - held for our lifetime
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise BatchDirBusy(f"the batch directory {self.root} is in use by another server; "
                               "give this one its own --batch-dir") from None
        self._db = sqlite3.connect(self.root / "store.sqlite3", check_same_thread=False,
                                   isolation_level=None)
        self._db.row_factory = sqlite3.Row
        # WAL + NORMAL: a commit survives the process dying at any point, without an fsync
        # per answered line (a power loss may drop the last few answers: they run again).
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._mutex = threading.Lock()

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        self._lock_file.close()  # releases the flock

    def _run(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._mutex:
            return self._db.execute(sql, args).fetchall()

    def _next_seq(self, table: str) -> int:
        return self._run(f"SELECT COALESCE(MAX(seq), 0) + 1 FROM {table}")[0][0]

    # -- files -----------------------------------------------------------------------------------

    def path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(self, data: bytes, filename: str, purpose: str, prefix: str = "file-") -> dict:
        """Writes `data` and its record (the record last: a crash leaves no record without its
        bytes). Returns the file object."""
        file_id = prefix + uuid.uuid4().hex[:24]
        tmp = self.path(file_id + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(self.path(file_id))
        with self._mutex:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                             (file_id, len(data), int(time.time()), filename, purpose, seq))
        return self.file(file_id)

    def file(self, file_id: str) -> dict | None:
        rows = self._run("SELECT * FROM files WHERE id = ?", (file_id,))
        return _file_object(rows[0]) if rows else None

    def files(self, purpose: str | None = None) -> list[dict]:
        rows = self._run("SELECT * FROM files ORDER BY seq DESC")
        return [_file_object(r) for r in rows if purpose is None or r["purpose"] == purpose]

    def content(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete_file(self, file_id: str) -> bool:
        with self._mutex:
            gone = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if gone:  # only a name the store made (never a client's path) is unlinked
            self.path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # -- batches ---------------------------------------------------------------------------------

    def add_batch(self, endpoint: str, input_file_id: str, completion_window: str,
                  metadata: dict[str, str] | None, window_s: int) -> dict:
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        now = int(time.time())
        with self._mutex:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self._db.execute(
                "INSERT INTO batches (id, seq, endpoint, input_file_id, completion_window, "
                "status, metadata, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, seq, endpoint, input_file_id, completion_window, "validating",
                 json.dumps(metadata) if metadata is not None else None, now, now + window_s))
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict | None:
        rows = self._run("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return self._batch_object(rows[0]) if rows else None

    def batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, those created before `after` (an id); and whether more follow."""
        if after is not None:
            rows = self._run("SELECT seq FROM batches WHERE id = ?", (after,))
            if not rows:
                return [], False
            below = rows[0]["seq"]
        else:
            below = self._next_seq("batches")
        rows = self._run("SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                         (below, limit + 1))
        return [self._batch_object(r) for r in rows[:limit]], len(rows) > limit

    def status(self, batch_id: str) -> str | None:
        rows = self._run("SELECT status FROM batches WHERE id = ?", (batch_id,))
        return rows[0]["status"] if rows else None

    def unfinished(self) -> list[str]:
        """The batches the runner still owes work, oldest first."""
        marks = ",".join("?" * len(UNFINISHED))
        rows = self._run(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq",
                         UNFINISHED)
        return [r["id"] for r in rows]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = (),
                   **fields: Any) -> bool:
        """Moves a batch to `status` (stamping `<status>_at`), with other columns; with
        `only_from`, only if it is in one of those (returns whether it moved)."""
        columns = {"status": status, f"{status}_at": int(time.time()), **fields}
        if "errors" in columns and columns["errors"] is not None:
            columns["errors"] = json.dumps(columns["errors"])
        sets = ", ".join(f"{name} = ?" for name in columns)
        sql, args = f"UPDATE batches SET {sets} WHERE id = ?", (*columns.values(), batch_id)
        if only_from:
            sql += f" AND status IN ({','.join('?' * len(only_from))})"
            args += only_from
        with self._mutex:
            return bool(self._db.execute(sql, args).rowcount)

    # -- batch lines -----------------------------------------------------------------------------

    def record_line(self, batch_id: str, line: int, ok: bool, record: dict) -> None:
        """One line's answer, committed; a second answer for the line is ignored."""
        with self._mutex:
            self._db.execute("INSERT OR IGNORE INTO batch_lines VALUES (?, ?, ?, ?)",
                             (batch_id, line, int(ok), json.dumps(record, ensure_ascii=False)))

    def answered(self, batch_id: str) -> set[int]:
        rows = self._run("SELECT line FROM batch_lines WHERE batch_id = ?", (batch_id,))
        return {r["line"] for r in rows}

    def records(self, batch_id: str, ok: bool) -> list[str]:
        rows = self._run("SELECT record FROM batch_lines WHERE batch_id = ? AND ok = ? "
                         "ORDER BY line", (batch_id, int(ok)))
        return [r["record"] for r in rows]

    def _batch_object(self, row: sqlite3.Row) -> dict:
        """OpenAI's batch object."""
        counts = self._run("SELECT ok, COUNT(*) AS n FROM batch_lines WHERE batch_id = ? "
                           "GROUP BY ok", (row["id"],))
        by_ok = {r["ok"]: r["n"] for r in counts}
        errors = json.loads(row["errors"]) if row["errors"] else None
        return {
            "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{name: row[name] for name in (
                "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
            "request_counts": {"total": row["total"], "completed": by_ok.get(1, 0),
                               "failed": by_ok.get(0, 0)},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        }


def _file_object(row: sqlite3.Row) -> dict:
    """OpenAI's file object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "status_details": None}
