"""Uploaded and produced files (`/v1/files`): contents in the data folder, records in Redis.

A file's record `mlxq:gw:file:<id>` (OpenAI's file object plus its owner's key digest) says it exists;
its bytes are `<data_dir>/files/<id>`. Batch inputs are uploaded here; batch output and error files are
written here by whichever instance finishes the batch, so every instance that shares the folder serves
them. `mlxq:gw:files:owner:<key digest>` lists each key's files by creation time (`GET /v1/files`).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio

FILE_PREFIX = "mlxq:gw:file:"
OWNER_PREFIX = "mlxq:gw:files:owner:"  # a key's files, scored by creation time (for the list)
PURPOSES = ("batch", "batch_output")


def record_key(file_id: str) -> str:
    return FILE_PREFIX + file_id


def owner_key(key_digest: str) -> str:
    return OWNER_PREFIX + key_digest


@dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    owner: str

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }

    def fields(self) -> dict[str, str]:
        return {
            "filename": self.filename,
            "purpose": self.purpose,
            "bytes": str(self.bytes),
            "created_at": str(self.created_at),
            "owner": self.owner,
        }


class FileStore:
    def __init__(self, conn: redis.asyncio.Redis, data_dir: Path) -> None:
        self.conn = conn
        self.folder = data_dir / "files"

    def path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or "/" in file_id or file_id in ("file-", ".", ".."):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.folder / file_id

    async def add(self, content: bytes, filename: str, purpose: str, owner: str) -> StoredFile:
        """Keep `content` (written in full, then renamed into place, then recorded)."""
        stored = StoredFile(
            f"file-{uuid.uuid4().hex}", filename, purpose, len(content), int(time.time()), owner
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f".{stored.id}.part"
        partial.write_bytes(content)
        os.replace(partial, self.path(stored.id))
        async with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(record_key(stored.id), mapping=stored.fields())  # type: ignore[arg-type]
            pipe.zadd(owner_key(owner), {stored.id: time.time()})
            await pipe.execute()
        return stored

    async def delete(self, stored: StoredFile) -> None:
        """Forget the file and remove its bytes (a batch keeps its own copy of its input's rows)."""
        async with self.conn.pipeline(transaction=True) as pipe:
            pipe.delete(record_key(stored.id))
            pipe.zrem(owner_key(stored.owner), stored.id)
            await pipe.execute()
        self.path(stored.id).unlink(missing_ok=True)

    async def page(
        self, owner: str, limit: int, after: str | None, newest_first: bool, purpose: str | None
    ) -> tuple[list[StoredFile], bool]:
        """An owner's files in creation order (or newest first), from the one after `after`, those of
        `purpose` only if given: at most `limit`, and whether more follow."""
        members: list[Any] = list(await self.conn.zrange(owner_key(owner), 0, -1))
        ids = [str(m.decode() if isinstance(m, bytes) else m) for m in members]
        if newest_first:
            ids.reverse()
        if after is not None:
            if after not in ids:
                raise KeyError(after)
            ids = ids[ids.index(after) + 1 :]
        out: list[StoredFile] = []
        for file_id in ids:
            stored = await self.get(file_id)
            if stored is None or (purpose is not None and stored.purpose != purpose):
                continue
            if len(out) == limit:
                return out, True
            out.append(stored)
        return out, False

    async def get(self, file_id: str) -> StoredFile | None:
        raw = await self.conn.hgetall(record_key(file_id))
        if not raw:
            return None
        f = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        return StoredFile(
            file_id, f["filename"], f["purpose"], int(f["bytes"]), int(f["created_at"]), f["owner"]
        )
