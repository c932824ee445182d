"""`BatchRunner`: runs the accepted batches' lines through the interactive routes' handlers,
behind the interactive traffic.

A line's body is validated by the request model of the route its `url` names and executed by
that route's handler (chat.py, completions.py, responses.py: the same `pipeline.start`,
admission, bounds and view as an HTTP request), with a `Request` made for it; the JSON the
handler answers is the line's `response.body`. So a line and the same request sent
interactively are checked and answered alike, including their errors.

Priority: at most `LINES_IN_FLIGHT` lines of all batches are in the engine at once, and a line
is admitted only while no request waits in the server's queue (`ServerState.num_queued == 0`:
every admitted request, interactive or batch, has its first token). So an interactive request
never queues behind more than one batch line's prefill, and the engine's other
`max_num_seqs - LINES_IN_FLIGHT` sequence slots stay for interactive requests. A line refused
with a 503 (the queue filled between the check and the admission, the server draining), or
failed by a dead engine thread, is not answered: it waits and is tried again, or, when the
server stops, left for the next start.

One batch runs at a time, oldest first. Its states: validating (the input file is read and its
lines counted) -> in_progress -> finalizing (output and error files written) -> completed; or
failed (an input file that cannot be read as lines), cancelling -> cancelled, expired (past its
completion window at a start). Every state and every answered line is committed in the store
(batch_store.py) as it happens: at start the runner resumes the unfinished batches, skipping
the lines already answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, get_type_hints

import anyio
from pydantic import ValidationError
from starlette.requests import Request

from jengine.server.batch_store import BatchStore
from jengine.server.errors import APIError, bad_request, invalid_value, validation_message

if TYPE_CHECKING:
    from jengine.server.state import ServerState

log = logging.getLogger("jengine.server")

LINES_IN_FLIGHT = 4
IDLE_POLL_S = 0.05  # how often a line waiting for the queue to empty looks again
MAX_LINES = 50_000  # OpenAI's limit on one batch's requests
RETRY_CODES = ("queue_full", "draining", "loading")  # 503s: not an answer, try again later


class LineError(Exception):
    """A line that is no request at all (bad JSON, wrong url): OpenAI's `error` object."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class BatchRunner:
    """The background task that owns every batch's progress (one per app)."""

    def __init__(self, app: Any, state: ServerState, store: BatchStore,
                 handlers: dict[str, Callable[..., Any]]):
        self.app = app
        self.state = state
        self.store = store
        self.handlers = handlers  # endpoint -> the route's handler
        # endpoint -> the route's request model (the handler's `body` annotation)
        self.models = {path: get_type_hints(h)["body"] for path, h in handlers.items()}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._running: str | None = None  # the batch whose lines are in flight
        self._lines: set[asyncio.Task] = set()  # its lines' tasks

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="jengine-batches")

    async def stop(self) -> None:
        """Cancels the lines in flight (unanswered: rerun at the next start)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        """A batch was created or cancelled: look at the store again."""
        self._wake.set()

    def stop_lines(self, batch_id: str) -> None:
        """The batch was set to cancelling: its lines in flight stop now (unanswered)."""
        if self._running == batch_id:
            for task in self._lines:
                task.cancel()
        self.wake()

    async def _loop(self) -> None:
        while True:
            pending = self.store.unfinished()
            if not pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._run(pending[0])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug must not stop every later batch
                log.exception("batch %s failed", pending[0])
                self.store.set_status(pending[0], "failed", errors=[
                    {"code": "server_error", "message": str(e), "param": None, "line": None}])

    # -- one batch -------------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if batch["status"] in ("cancelling", "finalizing"):
            await self._finish(batch_id, "cancelled" if batch["status"] == "cancelling"
                               else "completed")
            return
        if time.time() > batch["expires_at"]:
            await self._finish(batch_id, "expired")
            return
        lines = await asyncio.to_thread(self._read_lines, batch)
        if lines is None:
            return
        if batch["status"] == "validating" and not self.store.set_status(
                batch_id, "in_progress", only_from=("validating",), total=len(lines)):
            return  # cancelled meanwhile: the next pass finishes it
        done = self.store.answered(batch_id)
        log.info("batch %s: %d of %d lines to run", batch_id, len(lines) - len(done), len(lines))
        self._running = batch_id
        try:
            cancelled = await self._run_lines(batch_id, batch["endpoint"], lines, done)
        finally:
            self._running = None
        await self._finish(batch_id, "cancelled" if cancelled else "completed")

    def _read_lines(self, batch: dict) -> list[str] | None:
        """The input file's non-blank lines, or None after failing the batch."""
        try:
            text = self.store.content(batch["input_file_id"]).decode("utf-8")
        except FileNotFoundError:
            return self._fail(batch["id"], "file_not_found", "the input file was deleted")
        except UnicodeDecodeError as e:
            return self._fail(batch["id"], "invalid_file", f"the input file is not UTF-8: {e}")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            return self._fail(batch["id"], "empty_file", "the input file has no lines")
        if len(lines) > MAX_LINES:
            return self._fail(batch["id"], "too_many_requests",
                              f"the input file has {len(lines)} lines; the limit is {MAX_LINES}")
        return lines

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        self.store.set_status(batch_id, "failed", only_from=("validating", "in_progress"),
                              errors=[{"code": code, "message": message,
                                       "param": "input_file_id", "line": None}])

    async def _run_lines(self, batch_id: str, endpoint: str, lines: list[str],
                         done: set[int]) -> bool:
        """Runs the unanswered lines, `LINES_IN_FLIGHT` at a time; True if it was cancelled."""
        slots = asyncio.Semaphore(LINES_IN_FLIGHT)
        tasks = self._lines
        seen: set[str] = set()
        try:
            for index, raw in enumerate(lines):
                custom_id = _custom_id(raw)
                duplicate = custom_id is not None and custom_id in seen
                seen.add(custom_id)
                if index in done:
                    continue
                await slots.acquire()
                if self._cancelled(batch_id):
                    slots.release()
                    return True
                task = asyncio.create_task(self._line(batch_id, endpoint, index, raw, duplicate))
                tasks.add(task)
                task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
            while tasks:
                await asyncio.wait(set(tasks), timeout=0.5)
                if self._cancelled(batch_id):
                    return True
            return self._cancelled(batch_id)  # (its lines stopped by `stop_lines`)
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _cancelled(self, batch_id: str) -> bool:
        return self.store.status(batch_id) == "cancelling"

    async def _finish(self, batch_id: str, status: str) -> None:
        """Writes the output and error files (those with lines) and ends the batch."""
        if status == "completed":
            self.store.set_status(batch_id, "finalizing", only_from=("in_progress",))
        ids = {}
        for ok, column in ((True, "output_file_id"), (False, "error_file_id")):
            records = self.store.records(batch_id, ok)
            if records:
                data = ("\n".join(records) + "\n").encode()
                name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
                file = await asyncio.to_thread(self.store.add_file, data, name, "batch_output")
                ids[column] = file["id"]
        self.store.set_status(batch_id, status, **ids)
        log.info("batch %s %s", batch_id, status)

    # -- one line --------------------------------------------------------------------------------

    async def _line(self, batch_id: str, endpoint: str, index: int, raw: str,
                    duplicate: bool) -> None:
        record: dict[str, Any] = {"id": "batch_req_" + uuid.uuid4().hex[:24],
                                  "custom_id": _custom_id(raw), "response": None, "error": None}
        try:
            if duplicate:
                raise LineError("duplicate_custom_id",
                                f"custom_id {record['custom_id']!r} is used by an earlier line")
            body = _request_body(raw, endpoint)
            status, answer, request_id = await self._execute(endpoint, body)
        except LineError as e:
            record["error"] = {"code": e.code, "message": f"line {index + 1}: {e.message}"}
            self.store.record_line(batch_id, index, False, record)
            return
        record["response"] = {"status_code": status, "request_id": request_id, "body": answer}
        self.store.record_line(batch_id, index, 200 <= status < 300, record)

    async def _execute(self, endpoint: str, body: dict) -> tuple[int, dict, str]:
        """The route's answer to `body`: (status, JSON body, request id)."""
        request_id = uuid.uuid4().hex
        try:
            if body.get("stream"):
                raise bad_request("stream is not supported in a batch", "stream")
            try:
                parsed = self.models[endpoint].model_validate(body)
            except ValidationError as e:
                raise bad_request(*validation_message(e.errors())) from None
            response = await self._admitted(endpoint, parsed, request_id)
        except APIError as e:
            return e.status, e.body(), request_id
        except ValueError as e:
            error = invalid_value(e)
            return error.status, error.body(), request_id
        except Exception as e:  # noqa: BLE001 - a bug answers this line (as the app's handler
            # answers an HTTP request), never stops the batch
            log.exception("batch line %s failed", request_id)
            error = APIError(500, f"internal server error: {e}", type="server_error")
            return error.status, error.body(), request_id
        return response.status_code, json.loads(response.body), request_id


    def _engine_alive(self) -> bool:
        engine = self.state.engine
        return engine is not None and engine.is_alive

    async def _admitted(self, endpoint: str, parsed: Any, request_id: str) -> Any:
        """The handler's response, admitted behind the interactive requests. What refuses a
        line for the server's state, not the line's (a 503 `RETRY_CODES`: the queue filled
        in between, the server draining; the engine thread dead: a restart runs the line),
        is no answer: the line waits and is tried again (or cancelled at shutdown)."""
        handler = self.handlers[endpoint]
        while True:
            while self.state.num_queued > 0 or not self._engine_alive():
                await asyncio.sleep(IDLE_POLL_S)
            try:  # no await between the check above and the handler's admission
                return await handler(parsed, _line_request(self.app, endpoint, request_id))
            except APIError as e:
                if not (e.status == 503 and e.code in RETRY_CODES) and self._engine_alive():
                    raise
            await asyncio.sleep(IDLE_POLL_S)


def _custom_id(raw: str) -> str | None:
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _request_body(raw: str, endpoint: str) -> dict:
    """A line's request body, once the line is OpenAI's request object for `endpoint`."""
    try:
        line = json.loads(raw)
    except ValueError as e:
        raise LineError("invalid_json_line", f"not valid JSON ({e})") from None
    if not isinstance(line, dict):
        raise LineError("invalid_json_line", "a line must be a JSON object")
    for name in ("custom_id", "method", "url", "body"):
        if name not in line:
            raise LineError("missing_required_parameter", f"missing {name!r}")
    if not isinstance(line["custom_id"], str):
        raise LineError("invalid_request", "custom_id must be a string")
    if line["method"] != "POST":
        raise LineError("invalid_method", f"method must be POST, got {line['method']!r}")
    if line["url"] != endpoint:
        raise LineError("invalid_url", f"url {line['url']!r} is not the batch's endpoint "
                                       f"{endpoint!r}")
    if not isinstance(line["body"], dict):
        raise LineError("invalid_request", "body must be a JSON object")
    return line["body"]


def _line_request(app: Any, path: str, request_id: str) -> Request:
    """The `Request` a route handler gets for a batch line: the app, the line's request id,
    and a client that never goes away (the batch, not a connection, owns the line)."""

    async def receive() -> dict:
        await anyio.sleep_forever()
        return {}

    scope = {"type": "http", "app": app, "method": "POST", "path": path, "raw_path":
             path.encode(), "root_path": "", "query_string": b"", "headers": [],
             "state": {"request_id": request_id, "warmup": False}}
    return Request(scope, receive)
