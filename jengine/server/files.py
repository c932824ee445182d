"""`/v1/files`: OpenAI's Files API, for the Batch API's input and output files.

Uploads are `multipart/form-data` (`file`, `purpose`), parsed by the standard library's
`email` parser (no `python-multipart` dependency) from the body the edge middleware has already
read and bounded by `--max-body-bytes`. Only `purpose: "batch"` is accepted (other purposes are
a 400); the batches' own results are files of purpose `batch_output`. The records and contents
live in the batch store (batch_store.py, under `--batch-dir`).
"""

from __future__ import annotations

import asyncio
from email.parser import BytesParser
from email.policy import HTTP

from fastapi import Request
from fastapi.responses import Response

from jengine.server.batch_store import BatchStore
from jengine.server.errors import APIError, bad_request

PURPOSES = ("batch",)  # what a client may upload


def store_of(request: Request) -> BatchStore:
    return request.app.state.batches.store(request.app)


def no_such_file(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="not_found")


def _form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart form's fields: name -> (filename or None, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("an upload must be multipart/form-data with the fields 'file' and "
                          f"'purpose' (got Content-Type {content_type or 'none'!r})")
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    message = BytesParser(policy=HTTP).parsebytes(head + body)
    if not message.is_multipart() or message.defects:
        raise bad_request("the multipart body could not be parsed")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


async def upload_file(request: Request) -> dict:
    store = store_of(request)
    # the standard library's parser is pure Python: a large upload is parsed off the loop
    fields = await asyncio.to_thread(_form, request.headers.get("content-type", ""),
                                     await request.body())
    if "purpose" not in fields:
        raise bad_request("Missing required parameter: 'purpose'.", "purpose")
    purpose = fields["purpose"][1].decode("utf-8", "replace")
    if purpose not in PURPOSES:
        raise bad_request(f"purpose must be one of {list(PURPOSES)} on this server (only the "
                          f"Batch API is served), got {purpose!r}", "purpose")
    if "file" not in fields or fields["file"][0] is None:
        raise bad_request("Missing required parameter: 'file'.", "file")
    filename, data = fields["file"]
    return await asyncio.to_thread(store.add_file, data, filename, purpose)


async def list_files(request: Request, purpose: str | None = None, limit: int = 10000,
                     after: str | None = None, order: str = "desc") -> dict:
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    if not 1 <= limit <= 10000:
        raise bad_request("limit must be between 1 and 10000", "limit")
    files = store_of(request).files(purpose)
    if order == "asc":
        files.reverse()
    if after is not None:
        ids = [f["id"] for f in files]
        files = files[ids.index(after) + 1:] if after in ids else []
    page = files[:limit]
    return {"object": "list", "data": page, "has_more": len(files) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


async def retrieve_file(file_id: str, request: Request) -> dict:
    file = store_of(request).file(file_id)
    if file is None:
        raise no_such_file(file_id)
    return file


async def file_content(file_id: str, request: Request) -> Response:
    store = store_of(request)
    if store.file(file_id) is None:
        raise no_such_file(file_id)
    data = await asyncio.to_thread(store.content, file_id)
    return Response(data, media_type="application/octet-stream")


async def delete_file(file_id: str, request: Request) -> dict:
    if not store_of(request).delete_file(file_id):
        raise no_such_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
