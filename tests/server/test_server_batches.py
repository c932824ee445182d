"""OpenAI's Files and Batch API against the session's `jengine serve` process (its batch store
in the test's tmp dir, tests/serve_process.py), with the official `openai` SDK: files, a batch
through to its output and error files (bodies equal to the interactive answers, greedy),
interactive requests ahead of a running batch, cancel, pagination and errors. A batch that
survives a restart is test_server_batch_restart.py."""

from __future__ import annotations

import json
import time

import openai
import pytest
from serve_process import MODEL  # tests/serve_process.py

CHAT = "/v1/chat/completions"
DONE = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, content: str, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **extra}}


def upload(client: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                   for line in lines)
    return client.files.create(file=("input.jsonl", text.encode()), purpose="batch").id


def wait(client: openai.OpenAI, batch_id: str, until=lambda b: b.status in DONE,
         timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def comparable(body: dict) -> dict:
    """An answer without what differs between two runs of one request: its id and time, and
    the cached prompt tokens (a later run finds more of its prompt in the prefix cache)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    usage = dict(body["usage"])
    usage.pop("prompt_tokens_details", None)
    return {**body, "usage": usage}


def test_files_upload_list_retrieve_content_delete(server):
    client = server.client()
    data = b'{"custom_id": "a"}\n{"custom_id": "b\\u00e9"}\r\n'
    file = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert file.id.startswith("file-") and file.object == "file"
    assert (file.bytes, file.filename, file.purpose) == (len(data), "mine.jsonl", "batch")
    assert abs(file.created_at - time.time()) < 60
    assert client.files.retrieve(file.id) == file
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(file.id).content == data
    deleted = client.files.delete(file.id)
    assert (deleted.id, deleted.deleted) == (file.id, True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    assert file.id not in [f.id for f in client.files.list()]


def test_a_batch_answers_as_the_routes_do_and_reports_bad_lines(server):
    client = server.client()
    good = [chat_line("c0", "Name a color."), chat_line("c1", "Name a fruit.", 6),
            chat_line("c2", "Say hello.", 5, seed=3, stop=["."])]
    bad = ["{this is not json",
           chat_line("bad-body", "x", max_tokens=-1),  # the route's own 400
           {**chat_line("bad-url", "x"), "url": "/v1/completions"},
           chat_line("c0", "a second line with c0")]  # custom_id reused
    lines = [good[0], bad[0], good[1], bad[1], bad[2], good[2], bad[3]]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT,
                                  completion_window="24h", metadata={"job": "colors"})
    assert batch.id.startswith("batch_") and batch.status in ("validating", "in_progress")
    assert batch.metadata == {"job": "colors"} and batch.endpoint == CHAT
    batch = wait(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (7, 3, 4)
    assert batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = jsonl(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == ["c0", "c1", "c2"]
    for record, line in zip(output, good):
        assert record["id"].startswith("batch_req_") and record["error"] is None
        assert record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["id"] == f"chatcmpl-{record['response']['request_id']}"
        interactive = server.post(CHAT, json=line["body"]).json()
        assert comparable(body) == comparable(interactive)
    errors = {r["custom_id"]: r for r in jsonl(client, batch.error_file_id)}
    assert len(errors) == 4 and errors[None]["error"]["code"] == "invalid_json_line"
    assert errors[None]["response"] is None and "line 2" in errors[None]["error"]["message"]
    response = errors["bad-body"]["response"]
    assert response["status_code"] == 400 and errors["bad-body"]["error"] is None
    with pytest.raises(openai.BadRequestError) as interactive:  # the same 400 interactively
        client.chat.completions.create(**bad[1]["body"])
    assert response["body"] == interactive.value.response.json()
    assert errors["bad-url"]["error"]["code"] == "invalid_url"
    assert errors["c0"]["error"]["code"] == "duplicate_custom_id"
    file = client.files.retrieve(batch.output_file_id)
    assert file.purpose == "batch_output" and file.filename == f"{batch.id}_output.jsonl"


def test_completions_batch(server):
    client = server.client()
    line = {"custom_id": "p", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "The sky is", "max_tokens": 6,
                     "temperature": 0}}
    batch = client.batches.create(input_file_id=upload(client, [line]),
                                  endpoint="/v1/completions", completion_window="24h")
    batch = wait(client, batch.id)
    [record] = jsonl(client, batch.output_file_id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert comparable(record["response"]["body"]) == comparable(
        server.post("/v1/completions", json=line["body"]).json())


def test_responses_batch(server):
    client = server.client()
    body = {"model": MODEL, "input": "Name a planet.", "max_output_tokens": 6,
            "temperature": 0}
    line = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}
    batch = wait(client, client.batches.create(input_file_id=upload(client, [line]),
                                               endpoint="/v1/responses",
                                               completion_window="24h").id)
    [record] = jsonl(client, batch.output_file_id)
    answer = record["response"]["body"]
    assert answer["id"] == f"resp_{record['response']['request_id']}"

    def text(response: dict) -> str:
        return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                       for part in item["content"])

    assert text(answer) and text(answer) == text(server.post("/v1/responses", json=body).json())


def test_interactive_requests_go_ahead_of_a_running_batch_which_cancels(server):
    """At most 4 lines of a batch run at once, each admitted only while nobody waits in the
    queue: a chat request sent while a 12-line batch runs is answered long before the batch
    ends. Then the batch is cancelled: the lines in flight stop, those answered stay."""
    client = server.client()
    lines = [chat_line(f"l{i}", f"Tell a long story about the number {i}.", 24,
                       ignore_eos=True) for i in range(12)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT,
                                  completion_window="24h")
    samples = []  # (in the engine, waiting for a first token) while the batch alone runs
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        m = server.metrics()
        samples.append((m.get("jengine_num_requests_running", 0) +
                        m.get("jengine_num_requests_waiting", 0),
                        m["jengine_num_requests_queued"]))
    assert max(n for n, _ in samples) == 4 and max(q for _, q in samples) <= 1, samples
    answer = client.chat.completions.create(**chat_line("x", "Say yes.", 4)["body"])
    assert answer.choices[0].finish_reason == "length"
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.request_counts.completed < 8, running
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at, batch
    done = batch.request_counts.completed
    assert 1 <= done < 12 and batch.request_counts.failed == 0
    assert len(jsonl(client, batch.output_file_id)) == done
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change


def test_batches_list_pages_newest_first(server):
    client = server.client()
    file_id = upload(client, [chat_line("one", "Hi.", 1)])
    made = [client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                  completion_window="24h").id for _ in range(3)]
    for batch_id in made:
        assert wait(client, batch_id).status == "completed"
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0]
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK follows `after` itself
    assert listed[:3] == made[::-1] and len(listed) == len(set(listed))


def test_errors_are_openai_shaped(server):
    client = server.client()
    cases = [
        (openai.NotFoundError, lambda: client.files.retrieve("file-nope"), "id"),
        (openai.NotFoundError, lambda: client.files.content("file-nope"), "id"),
        (openai.NotFoundError, lambda: client.files.delete("file-nope"), "id"),
        (openai.NotFoundError, lambda: client.batches.retrieve("batch_nope"), "batch_id"),
        (openai.NotFoundError, lambda: client.batches.cancel("batch_nope"), "batch_id"),
        (openai.BadRequestError, lambda: client.files.create(
            file=("x.jsonl", b"{}\n"), purpose="fine-tune"), "purpose"),
        (openai.NotFoundError, lambda: client.batches.create(
            input_file_id="file-nope", endpoint=CHAT, completion_window="24h"), "id"),
    ]
    file_id = upload(client, [chat_line("a", "Hi.", 1)])
    for endpoint in ("/v1/embeddings", "/v1/nope"):  # this server generates: no embeddings
        cases.append((openai.BadRequestError, lambda e=endpoint: client.batches.create(
            input_file_id=file_id, endpoint=e, completion_window="24h"), "endpoint"))
    cases.append((openai.BadRequestError, lambda: client.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="1h"), "completion_window"))
    for kind, call, param in cases:
        with pytest.raises(kind) as e:
            call()
        error = e.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                              completion_window="24h")
    assert "/v1/embeddings" in e.value.message
    done = wait(client, client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                              completion_window="24h").id)
    with pytest.raises(openai.ConflictError) as e:
        client.batches.cancel(done.id)
    assert "completed" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # an output file is no batch input
        client.batches.create(input_file_id=done.output_file_id, endpoint=CHAT,
                              completion_window="24h")
    assert e.value.response.json()["error"]["param"] == "input_file_id"


@pytest.mark.parametrize(("data", "code"), [(b"\xff\xfe{}\n", "invalid_file"),
                                            (b"\n  \n", "empty_file")])
def test_an_unreadable_input_file_fails_the_batch(server, data, code):
    client = server.client()
    file_id = client.files.create(file=("bad.jsonl", data), purpose="batch").id
    batch = wait(client, client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                               completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    [error] = batch.errors.data
    assert error.code == code and error.param == "input_file_id" and error.message
