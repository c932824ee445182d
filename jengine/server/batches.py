"""`/v1/batches`: OpenAI's Batch API over the batch store and runner.

`BatchService` is the app's one batch store (batch_store.py, under `--batch-dir`) and runner
(batch_runner.py). The store is opened when the app starts if the directory already holds one
(so that accepted batches resume at once), else on the first Files or Batch request: a server
nobody sends batches to creates no directory. An app made without a `batch_dir`
(`create_app` from Python; `jengine serve` always names one) keeps its batches in a temporary
directory removed at shutdown: they do not outlive the app, and it never touches the user's.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from jengine.server.batch_runner import BatchRunner
from jengine.server.batch_store import BatchDirBusy, BatchStore
from jengine.server.errors import APIError, bad_request, unavailable
from jengine.server.files import no_such_file, store_of

if TYPE_CHECKING:
    from jengine.server.state import ServerState

log = logging.getLogger("jengine.server")

# OpenAI's batch endpoints; a server runs those of them its route table serves.
BATCH_ENDPOINTS = ("/v1/responses", "/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
STORE_FILE = "store.sqlite3"


class BatchService:
    """The batch store and runner of one app, opened once."""

    def __init__(self, root: Path | None, state: ServerState,
                 handlers: dict[str, Callable[..., Any]]):
        self.root = root  # None: a temporary directory, made when first needed
        self._temporary = root is None
        self.state = state
        self.handlers = handlers  # batch endpoint -> its route's handler
        self._store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self._error: str | None = None

    def endpoints(self) -> list[str]:
        """The batch endpoints this server runs: the generating routes, or on an embedding
        server (task embed / score) `/v1/embeddings` alone, as its interactive routes do."""
        engine = self.state.engine
        pools = engine is not None and engine.core.model.pooling is not None
        return [e for e in BATCH_ENDPOINTS
                if e in self.handlers and (e == "/v1/embeddings") == pools]

    def store(self, app: Any) -> BatchStore:
        """The open store (opened now if need be), or a 503 saying why there is none."""
        if self._store is None and self._error is None:
            self._open(app)
        if self._store is None:
            raise unavailable(self._error, "batch_store_unavailable", 60)
        return self._store

    def _open(self, app: Any) -> None:
        try:
            if self.root is None:
                self.root = Path(tempfile.mkdtemp(prefix="jengine-batches-"))
            self._store = BatchStore(self.root)
        except (BatchDirBusy, OSError) as e:
            self._error = str(e)
            log.warning("the Files and Batch API is off: %s", e)
            return
        self.runner = BatchRunner(app, self.state, self._store, self.handlers)
        self.runner.start()
        log.info("batch store: %s", self.root)

    def resume(self, app: Any) -> None:
        """At start: opens an existing store, and with it the runner resumes its batches."""
        if self.root is not None and (self.root / STORE_FILE).exists():
            self._open(app)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self._store is not None:
            self._store.close()
            self._store = None
            self._error = "the server is shutting down"
        if self._temporary and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _service(request: Request) -> BatchService:
    return request.app.state.batches


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def no_such_batch(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param="batch_id",
                    code="not_found")


async def create_batch(body: BatchCreateRequest, request: Request) -> dict:
    service = _service(request)
    store = store_of(request)
    if body.endpoint not in service.endpoints():
        served = ", ".join(service.endpoints())
        raise bad_request(f"endpoint {body.endpoint!r} is not served by this server; a batch "
                          f"runs one of: {served}", "endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise bad_request(f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got "
                          f"{body.completion_window!r}", "completion_window")
    if body.metadata is not None and len(body.metadata) > 16:
        raise bad_request("metadata has at most 16 keys", "metadata")
    file = store.file(body.input_file_id)
    if file is None:
        raise no_such_file(body.input_file_id)
    if file["purpose"] != "batch":
        raise bad_request(f"the input file must have purpose 'batch', not {file['purpose']!r}",
                          "input_file_id")
    batch = store.add_batch(body.endpoint, body.input_file_id, body.completion_window,
                            body.metadata, COMPLETION_WINDOWS[body.completion_window])
    service.runner.wake()
    return batch


async def retrieve_batch(batch_id: str, request: Request) -> dict:
    batch = store_of(request).batch(batch_id)
    if batch is None:
        raise no_such_batch(batch_id)
    return batch


async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict:
    if not 1 <= limit <= 100:
        raise bad_request("limit must be between 1 and 100", "limit")
    page, more = store_of(request).batches(after, limit)
    return {"object": "list", "data": page, "has_more": more,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


async def cancel_batch(batch_id: str, request: Request) -> dict:
    """A batch not yet started is cancelled at once; a running one goes to cancelling, and to
    cancelled once its lines in flight are stopped and the files of those answered written."""
    service = _service(request)
    store = store_of(request)
    batch = store.batch(batch_id)
    if batch is None:
        raise no_such_batch(batch_id)
    if store.set_status(batch_id, "cancelled", only_from=("validating",)):
        return store.batch(batch_id)
    if store.set_status(batch_id, "cancelling", only_from=("in_progress",)):
        service.runner.stop_lines(batch_id)
        return store.batch(batch_id)
    batch = store.batch(batch_id)
    if batch["status"] in ("cancelling", "cancelled"):
        return batch
    raise APIError(409, f"Cannot cancel a batch with status '{batch['status']}'.",
                   code="batch_not_cancellable")
