"""OpenAI's Files and Batch API routes of the gateway: uploads, batches (create, list, get, cancel)
and their output files. A batch's work is done by the batch runner (`batch_runner`) over mlxq's bulk
runs; these routes read and write the records (`batches`) and files (`files`) every instance shares.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import batches
from .api_keys import ApiKey
from .errors import ApiError, bad_request
from .files import FileStore

if TYPE_CHECKING:
    from ..aio import AsyncClient
    from .settings import GatewaySettings


class GatewayParts(Protocol):
    """What the Files and Batch routes use of the gateway (`gateway.Gateway`): its key check, body reading,
    model routing, Redis client, settings and file store. A Protocol, so this module needs no import of
    the app that mounts it."""

    settings: GatewaySettings

    @property
    def client(self) -> AsyncClient: ...

    @property
    def files(self) -> FileStore: ...

    async def authorize(self, request: Request) -> ApiKey: ...

    async def body(self, request: Request) -> dict[str, Any]: ...

    async def route(self, key: ApiKey, model: str) -> str: ...


class BatchRoutes:
    """The routes, handed the gateway whose key checks, body reading, routing and Redis they use."""

    def __init__(self, gateway: GatewayParts) -> None:
        self.gateway = gateway

    async def upload(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            raise ApiError(411, "an upload needs a Content-Length header", code="length_required")
        if int(declared) > self.gateway.settings.max_file_bytes:
            raise ApiError(
                413,
                f"the file is over this gateway's limit of {self.gateway.settings.max_file_bytes} bytes",
                code="file_too_large",
            )
        async with request.form(max_files=1, max_fields=4) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                raise bad_request('`purpose` must be "batch" (the only use of files here)', "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("`file` must be an uploaded file", "file")
            content = await upload.read()
            name = upload.filename or "upload.jsonl"
        stored = await self.gateway.files.add(content, name, "batch", key.digest)
        return JSONResponse(stored.openai())

    async def _file(self, key: ApiKey, file_id: str) -> tuple[FileStore, Any]:
        store = self.gateway.files
        stored = await store.get(file_id) if file_id.startswith("file-") else None
        if stored is None or stored.owner != key.digest:
            raise ApiError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        return store, stored

    async def file_info(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        _, stored = await self._file(key, request.path_params["file_id"])
        return JSONResponse(stored.openai())

    async def file_content(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        store, stored = await self._file(key, request.path_params["file_id"])
        return Response(store.path(stored.id).read_bytes(), media_type="application/jsonl")

    async def delete_file(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        store, stored = await self._file(key, request.path_params["file_id"])
        await store.delete(stored)
        return JSONResponse({"id": stored.id, "object": "file", "deleted": True})

    async def list_files(self, request: Request) -> Response:
        """OpenAI's file list: `purpose`, `limit` (1..10000, default 10000), `order` (`desc`, the
        default, or `asc` by creation), `after` (a file id: the page after it)."""
        key = await self.gateway.authorize(request)
        q = request.query_params
        limit = _int_param(q.get("limit", "10000"), "limit", 10_000)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request('`order` must be "asc" or "desc"', "order")
        after = q.get("after") or None
        try:
            files, more = await self.gateway.files.page(
                key.digest, limit, after, order == "desc", q.get("purpose")
            )
        except KeyError:
            raise ApiError(
                404, f"no file {after!r} to list after", param="after", code="file_not_found"
            ) from None
        data = [f.openai() for f in files]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    async def create_batch(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        body = await self.gateway.body(request)
        endpoint = body.get("endpoint")
        if endpoint not in batches.ENDPOINTS:
            raise bad_request(f"`endpoint` must be one of {', '.join(batches.ENDPOINTS)}", "endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise bad_request('`completion_window` must be "24h"', "completion_window")
        metadata = batches.check_metadata(body.get("metadata"))
        store, stored = await self._file(key, str(body.get("input_file_id", "")))
        if stored.purpose != "batch":
            raise bad_request(f"file {stored.id} is not a batch input", "input_file_id")
        checked = batches.check(
            store.path(stored.id).read_bytes(), endpoint, self.gateway.settings.max_batch_lines
        )
        queue = await self.gateway.route(key, checked.model)
        batch_id = batches.new_id()
        d = batches.folder(self.gateway.settings.data_dir, batch_id)
        d.mkdir(parents=True)
        (d / "rows.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in checked.rows))
        (d / "refused.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in checked.refused)
        )
        now = int(time.time())
        fields = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": stored.id,
            "completion_window": "24h",
            "status": "in_progress",
            "created_at": str(now),
            "in_progress_at": str(now),
            "expires_at": str(now + 86_400),
            "owner": key.digest,
            "queue": queue,
            "model": checked.model,
            "total": str(checked.total),
            "metadata": json.dumps(metadata),
        }
        await batches.BatchRecords(self.gateway.client.connection).create(fields)
        return JSONResponse(batches.openai_batch(fields))

    async def _batch(self, key: ApiKey, batch_id: str) -> dict[str, str]:
        fields = await batches.BatchRecords(self.gateway.client.connection).get(batch_id)
        if fields is None or fields.get("owner") != key.digest:
            raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return fields

    async def get_batch(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        fields = await self._batch(key, request.path_params["batch_id"])
        return JSONResponse(self._batch_object(fields))

    async def list_batches(self, request: Request) -> Response:
        """OpenAI's cursor pages: `limit` (1..100, default 20) batches, newest first, after `after`."""
        key = await self.gateway.authorize(request)
        limit = _int_param(request.query_params.get("limit", "20"), "limit", 100)
        after = request.query_params.get("after") or None
        try:
            records, more = await batches.BatchRecords(self.gateway.client.connection).page(
                key.digest, limit, after
            )
        except KeyError:
            raise ApiError(
                404, f"no batch {after!r} to list after", param="after", code="batch_not_found"
            ) from None
        data = [self._batch_object(fields) for fields in records]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    def _batch_object(self, fields: dict[str, str]) -> dict[str, Any]:
        """A batch record as OpenAI's object, its counts read from its files while it runs."""
        counts = None
        if fields["status"] in batches.OPEN:
            d = batches.folder(self.gateway.settings.data_dir, fields["id"])
            failed = batches.count_lines(d / "errors.jsonl") + batches.count_lines(d / "refused.jsonl")
            counts = {
                "total": int(fields["total"]),
                "completed": batches.count_lines(d / "out.jsonl"),
                "failed": failed,
            }
        return batches.openai_batch(fields, counts)

    async def cancel_batch(self, request: Request) -> Response:
        key = await self.gateway.authorize(request)
        fields = await self._batch(key, request.path_params["batch_id"])
        if fields["status"] in ("validating", "in_progress"):
            update = {"status": "cancelling", "cancelling_at": str(int(time.time()))}
            await batches.BatchRecords(self.gateway.client.connection).update(fields["id"], **update)
            fields.update(update)
        return JSONResponse(batches.openai_batch(fields))


def _int_param(raw: str, name: str, most: int) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"`{name}` must be an integer from 1 to {most}", name)
    return int(raw)
