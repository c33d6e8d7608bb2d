"""Runs the open batches: whichever gateway instance holds a batch's lease runs it; none is lost.

Every instance looks at `mlxq:gw:batches:active` every poll. A batch nobody runs (just created, or its
runner's instance died or restarted and stopped renewing its lease `mlxq:gw:batch-lease:<id>`) is taken
by the first instance whose `SET NX` wins, among those that see its folder (the data folder is shared).
The runner works the batch as a bulk run in a thread (`AsyncClient.generate_dataset`: bounded jobs in
flight, output in input order), renewing the lease and watching for a cancel. A bulk run resumes from
its output files, so a batch taken over after a crash goes on from the rows already written, each row's
result kept once; the jobs the dead runner left outstanding still run in the workers, and their rows
are submitted again. At the end the runner writes OpenAI's output and error files and marks the batch
completed (or cancelled).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from ..aio import AsyncClient
from . import batches
from .batches import BatchRecords
from .files import FileStore
from .settings import GatewaySettings

log = logging.getLogger(__name__)

LEASE_PREFIX = "mlxq:gw:batch-lease:"


def lease_key(batch_id: str) -> str:
    return LEASE_PREFIX + batch_id


class BatchRunner:
    def __init__(self, client: AsyncClient, files: FileStore, settings: GatewaySettings) -> None:
        self.client = client
        self.conn = client.connection
        self.records = BatchRecords(self.conn)
        self.files = files
        self.settings = settings
        self.instance = uuid.uuid4().hex
        self.lease_ms = int(settings.batch_lease_s * 1000)
        self.tick_s = min(0.5, settings.batch_lease_s / 3)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._warned: set[str] = set()

    async def run_forever(self) -> None:
        while True:
            try:
                await self.look()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("batch runner cannot reach Redis error=%s", e)
            await asyncio.sleep(self.tick_s)

    async def aclose(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def look(self) -> None:
        for batch_id in await self.records.active():
            if batch_id in self._running:
                continue
            if not (batches.folder(self.settings.data_dir, batch_id) / "rows.jsonl").exists():
                self._unseen(batch_id)  # another data folder's batch: left to instances that share it
                continue
            if await self.conn.set(lease_key(batch_id), self.instance, nx=True, px=self.lease_ms):
                log.info("batch taken batch=%s instance=%s", batch_id, self.instance)
                self._running[batch_id] = asyncio.create_task(self._run(batch_id))

    def _unseen(self, batch_id: str) -> None:
        if batch_id not in self._warned:
            self._warned.add(batch_id)
            log.warning(
                "batch %s is not in this gateway's data folder %s: instances that share batches must share "
                "that folder",
                batch_id,
                self.settings.data_dir,
            )

    async def _run(self, batch_id: str) -> None:
        try:
            await self._work(batch_id)
        except Exception:
            log.exception("batch run failed batch=%s (another look retries it)", batch_id)
        finally:
            self._running.pop(batch_id, None)
            if await self._ours(batch_id):
                await self.conn.delete(lease_key(batch_id))

    async def _ours(self, batch_id: str) -> bool:
        owner = await self.conn.get(lease_key(batch_id))
        return (owner.decode() if isinstance(owner, bytes) else owner) == self.instance

    async def _work(self, batch_id: str) -> None:
        fields = await self.records.get(batch_id)
        if fields is None or fields["status"] not in batches.OPEN:
            await self.conn.srem(batches.ACTIVE_KEY, batch_id)
            return
        if fields["status"] != "cancelling":
            d = batches.folder(self.settings.data_dir, batch_id)
            stop = threading.Event()
            keeper = asyncio.create_task(self._keep(batch_id, stop))
            try:
                summary = await self.client.generate_dataset(
                    d / "rows.jsonl",
                    d / "out.jsonl",
                    errors_path=d / "errors.jsonl",
                    queue=fields["queue"],
                    in_flight=self.settings.batch_in_flight,
                    stop=stop,
                )
            finally:
                keeper.cancel()
            if not await self._ours(batch_id):
                return  # the lease lapsed and another instance runs it now
            fields = await self.records.get(batch_id) or fields
            if summary.interrupted and fields["status"] != "cancelling":
                return
        await self._finalize(batch_id, fields)

    async def _keep(self, batch_id: str, stop: threading.Event) -> None:
        """Renew the lease while the run goes on; stop the run on a cancel or a lost lease."""
        while not stop.is_set():
            await asyncio.sleep(self.tick_s)
            if not await self._ours(batch_id):
                log.warning("batch lease lost batch=%s", batch_id)
                stop.set()
                return
            await self.conn.pexpire(lease_key(batch_id), self.lease_ms)
            status = await self.conn.hget(batches.record_key(batch_id), "status")
            if status in (b"cancelling", "cancelling"):
                stop.set()

    async def _finalize(self, batch_id: str, fields: dict[str, str]) -> None:
        cancelled = fields["status"] == "cancelling"
        await self.records.update(batch_id, status="finalizing", finalizing_at=str(int(time.time())))
        d = batches.folder(self.settings.data_dir, batch_id)
        kind = batches.ENDPOINTS[fields["endpoint"]]
        records = _records(d / "out.jsonl")
        usage = batches.batch_usage(records)
        prompts = {  # a text prompt's characters: where its completion's `text_offset`s start
            row["custom_id"]: len(row["prompt"])
            for row in _records(d / "rows.jsonl")
            if isinstance(row.get("prompt"), str)
        }
        out = [
            json.dumps(
                batches.output_line(
                    kind, fields["model"], fields["owner"], record, prompts.get(record["custom_id"], 0)
                )
            )
            for record in records
        ]
        errors = [json.dumps(line) for line in _records(d / "refused.jsonl")]
        errors += [json.dumps(batches.failed_line(record)) for record in _records(d / "errors.jsonl")]
        done: dict[str, str] = {}
        if out:
            stored = await self.files.add(
                _jsonl(out), f"{batch_id}_output.jsonl", "batch_output", fields["owner"]
            )
            done["output_file_id"] = stored.id
        if errors:
            stored = await self.files.add(
                _jsonl(errors), f"{batch_id}_error.jsonl", "batch_output", fields["owner"]
            )
            done["error_file_id"] = stored.id
        counts = {"total": int(fields["total"]), "completed": len(out), "failed": len(errors)}
        now = str(int(time.time()))
        status = (
            {"status": "cancelled", "cancelled_at": now}
            if cancelled
            else {"status": "completed", "completed_at": now}
        )
        await self.records.finish(
            batch_id, **done, **status, request_counts=json.dumps(counts), usage=json.dumps(usage)
        )
        log.info(
            "batch %s batch=%s completed=%d failed=%d", status["status"], batch_id, len(out), len(errors)
        )


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _records(path: Path) -> list[dict[str, Any]]:
    """A JSONL file's objects (none if it is not there: nothing was written to it)."""
    if not path.exists():
        return []
    return [json.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()]
