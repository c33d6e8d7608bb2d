"""A read-only picture of queues and workers for `mlxq status`: RQ's registries plus mlxq's worker stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer
from rq.worker import BaseWorker

from jobs import keys


@dataclass(frozen=True)
class QueueReport:
    """Job counts of one RQ queue (registries read without RQ's cleanup, so nothing changes)."""

    name: str
    queued: int
    started: int
    finished: int
    failed: int
    deferred: int
    scheduled: int
    canceled: int


@dataclass(frozen=True)
class WorkerReport:
    """One registered RQ worker, with the fields of its `mlxq:worker:<name>` hash when it wrote one."""

    name: str
    state: str
    queues: list[str]
    current_job: str | None
    last_heartbeat: str | None
    successful_jobs: int
    failed_jobs: int
    stats: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StatusReport:
    queues: list[QueueReport]
    workers: list[WorkerReport]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _queue_report(queue: Queue) -> QueueReport:
    def count(registry: Any) -> int:
        return int(registry.get_job_count(cleanup=False))

    return QueueReport(
        name=queue.name,
        queued=queue.count,
        started=count(queue.started_job_registry),
        finished=count(queue.finished_job_registry),
        failed=count(queue.failed_job_registry),
        deferred=count(queue.deferred_job_registry),
        scheduled=count(queue.scheduled_job_registry),
        canceled=count(queue.canceled_job_registry),
    )


def _text_map(raw: dict[Any, Any]) -> dict[str, str]:
    def text(v: Any) -> str:
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    return {text(k): text(v) for k, v in sorted(raw.items())}


def _worker_report(conn: redis.Redis, worker: BaseWorker) -> WorkerReport:
    stats = _text_map(conn.hgetall(keys.worker_stats_key(worker.name)))
    beat = worker.last_heartbeat
    return WorkerReport(
        name=worker.name,
        state=worker.get_state(),
        queues=worker.queue_names(),
        current_job=worker.get_current_job_id() or stats.get("current_job") or None,
        last_heartbeat=beat.isoformat() if beat else None,
        successful_jobs=worker.successful_job_count,
        failed_jobs=worker.failed_job_count,
        stats=stats,
    )


def collect(conn: redis.Redis, queue_names: list[str] | None = None) -> StatusReport:
    """Every known queue (or those named) and every registered worker."""
    if queue_names:
        queues = [Queue(name, connection=conn, serializer=JSONSerializer) for name in queue_names]
    else:
        queues = sorted(Queue.all(connection=conn, serializer=JSONSerializer), key=lambda q: q.name)
    workers = sorted(Worker.all(connection=conn, serializer=JSONSerializer), key=lambda w: w.name)
    return StatusReport(
        queues=[_queue_report(q) for q in queues],
        workers=[_worker_report(conn, w) for w in workers],
    )


def render(report: StatusReport) -> str:
    """The report as aligned text for a terminal."""
    lines = ["queues:"]
    if not report.queues:
        lines.append("  (none)")
    for q in report.queues:
        lines.append(
            f"  {q.name:<16} queued={q.queued} started={q.started} finished={q.finished} "
            f"failed={q.failed} deferred={q.deferred} scheduled={q.scheduled} canceled={q.canceled}"
        )
    lines.append("workers:")
    if not report.workers:
        lines.append("  (none)")
    for w in report.workers:
        lines.append(
            f"  {w.name} state={w.state} queues={','.join(w.queues)} job={w.current_job or '-'} "
            f"ok={w.successful_jobs} failed={w.failed_jobs} heartbeat={w.last_heartbeat or '-'}"
        )
        lines.extend(f"    {k}: {v}" for k, v in w.stats.items())
    return "\n".join(lines)
