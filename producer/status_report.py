"""A read-only picture of queues and workers for `mlxq status`: RQ's registries plus mlxq's worker stats.

Each worker publishes its `mlxq:worker:<name>` hash (model, device, jobs done, decode speed, prefix
cache, memory; see docs/operations.md); RQ's own worker registration says its state, current job and
heartbeat. With one queue per model, two warnings matter: a queue holding jobs that no registered worker
listens on (a model nobody serves), and a queue whose workers announce different models. Redis's own
memory is shown too (`INFO memory`): a `maxmemory-policy` that can evict mlxq's keys is warned of, and a
Redis at its limit (writes refused, workers waiting) is said to be full.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer
from rq.worker import BaseWorker

from mlxq.jobs import keys
from mlxq.jobs.redis_memory import MemoryPolicy, read_policy


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
    unreadable: int = 0  # jobs put aside because RQ could not read them (`mlxq:dead:<queue>`)


@dataclass(frozen=True)
class WorkerHealth:
    """The numbers of a worker's stats hash, parsed; None where the worker did not publish one."""

    model: str | None = None
    device: str | None = None
    version: str | None = None
    jobs_done: int | None = None
    tokens_per_s: float | None = None
    cache_lookups: int | None = None
    cache_hits: int | None = None
    cache_hit_tokens: int | None = None
    cache_bytes: int | None = None
    cache_budget_bytes: int | None = None
    memory_active_bytes: int | None = None
    memory_peak_bytes: int | None = None
    memory_cache_bytes: int | None = None
    active_sequences: int | None = None
    max_batch_sequences: int | None = None
    score_batches: int | None = None
    score_jobs: int | None = None
    score_rows: int | None = None
    score_phase_s: dict[str, float] = field(default_factory=dict)  # seconds in each phase, all batches
    score_aside_s: float | None = None  # of claim, start, tokenize and end: seconds on helper threads
    score_aside_cpu_s: float | None = None  # the CPU time of those seconds
    score_waited_s: float | None = None  # seconds the batches waited for that work
    draft_tokens: int | None = None
    accepted_tokens: int | None = None

    @property
    def acceptance(self) -> float | None:
        """Share of the tokens drafted for speculative decoding that the model kept."""
        if not self.draft_tokens or self.accepted_tokens is None:
            return None
        return self.accepted_tokens / self.draft_tokens

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of prefix-cache lookups that reused at least one token."""
        if self.cache_lookups is None or self.cache_hits is None or self.cache_lookups == 0:
            return None
        return self.cache_hits / self.cache_lookups

    @classmethod
    def from_stats(cls, stats: dict[str, str]) -> WorkerHealth:
        def num(name: str) -> int | None:
            value = _float(stats.get(name))
            return int(value) if value is not None else None

        return cls(
            model=stats.get("model"),
            device=stats.get("device"),
            version=stats.get("version"),
            jobs_done=num("jobs_done"),
            tokens_per_s=_float(stats.get("tokens_per_s")),
            cache_lookups=num("cache_lookups"),
            cache_hits=num("cache_hits"),
            cache_hit_tokens=num("cache_hit_tokens"),
            cache_bytes=num("cache_bytes"),
            cache_budget_bytes=num("cache_budget_bytes"),
            memory_active_bytes=num("memory_bytes"),
            memory_peak_bytes=num("peak_memory_bytes"),
            memory_cache_bytes=num("memory_cache_bytes"),
            active_sequences=num("active_sequences"),
            max_batch_sequences=num("max_batch_sequences"),
            score_batches=num("score_batches"),
            score_jobs=num("score_jobs"),
            score_rows=num("score_rows"),
            score_phase_s={
                phase: seconds
                for phase in keys.SCORE_PHASES
                if (seconds := _float(stats.get(f"score_{phase}_s"))) is not None
            },
            score_aside_s=_float(stats.get("score_aside_s")),
            score_aside_cpu_s=_float(stats.get("score_aside_cpu_s")),
            score_waited_s=_float(stats.get("score_waited_s")),
            draft_tokens=num("draft_tokens"),
            accepted_tokens=num("accepted_tokens"),
        )


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
    host: str | None = None
    pid: int | None = None
    heartbeat_age_s: float | None = None
    health: WorkerHealth = field(default_factory=WorkerHealth)


@dataclass(frozen=True)
class UnservedQueue:
    """A queue with jobs waiting and no registered worker listening on it."""

    name: str
    queued: int


@dataclass(frozen=True)
class MixedQueue:
    """A queue whose workers announce different models: model -> the workers serving it."""

    name: str
    models: dict[str, list[str]]


@dataclass(frozen=True)
class StatusReport:
    queues: list[QueueReport]
    workers: list[WorkerReport]
    unserved: list[UnservedQueue] = field(default_factory=list)
    mixed: list[MixedQueue] = field(default_factory=list)
    redis: MemoryPolicy | None = None
    workers_unread: str | None = None  # why the workers could not be read, if they could not

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.redis is not None:
            out["redis"]["evicts"] = self.redis.evicts
            out["redis"]["full"] = self.redis.full
            out["redis"]["warning"] = self.redis.warning()
        for entry, worker in zip(out["workers"], self.workers, strict=True):
            entry["health"]["cache_hit_rate"] = worker.health.cache_hit_rate
            entry["health"]["acceptance"] = worker.health.acceptance
        return out


def _float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


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
        unreadable=int(queue.connection.xlen(keys.dead_letter_key(queue.name))),
    )


def _text_map(raw: dict[Any, Any]) -> dict[str, str]:
    def text(v: Any) -> str:
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    return {text(k): text(v) for k, v in sorted(raw.items())}


def _worker_report(conn: redis.Redis, worker: BaseWorker, now: datetime) -> WorkerReport:
    stats = _text_map(conn.hgetall(keys.worker_stats_key(worker.name)))
    beat = worker.last_heartbeat
    if beat is not None and beat.tzinfo is None:
        beat = beat.replace(tzinfo=timezone.utc)  # RQ stores UTC without an offset
    return WorkerReport(
        name=worker.name,
        state=worker.get_state(),
        queues=worker.queue_names(),
        current_job=worker.get_current_job_id() or stats.get("current_job") or None,
        last_heartbeat=beat.isoformat() if beat else None,
        successful_jobs=worker.successful_job_count,
        failed_jobs=worker.failed_job_count,
        stats=stats,
        host=worker.hostname,
        pid=worker.pid,
        heartbeat_age_s=round((now - beat).total_seconds(), 1) if beat else None,
        health=WorkerHealth.from_stats(stats),
    )


def unserved_queues(queues: list[QueueReport], workers: list[WorkerReport]) -> list[UnservedQueue]:
    """Queues with waiting jobs that no registered worker listens on."""
    served = {name for w in workers for name in w.queues}
    return [UnservedQueue(q.name, q.queued) for q in queues if q.queued > 0 and q.name not in served]


def mixed_queues(workers: list[WorkerReport]) -> list[MixedQueue]:
    """Queues served by workers that announce different models (one queue should mean one model)."""
    by_queue: dict[str, dict[str, list[str]]] = {}
    for w in workers:
        if w.health.model is None:
            continue
        for queue in w.queues:
            by_queue.setdefault(queue, {}).setdefault(w.health.model, []).append(w.name)
    return [MixedQueue(q, models) for q, models in sorted(by_queue.items()) if len(models) > 1]


def collect(conn: redis.Redis, queue_names: list[str] | None = None) -> StatusReport:
    """Every known queue (or those named) and every registered worker."""
    if queue_names:
        queues = [Queue(name, connection=conn, serializer=JSONSerializer) for name in queue_names]
    else:
        queues = sorted(Queue.all(connection=conn, serializer=JSONSerializer), key=lambda q: q.name)
    memory = read_policy(conn)
    queue_reports = [_queue_report(q) for q in queues]
    now = datetime.now(timezone.utc)
    workers_unread = None
    try:
        workers = sorted(Worker.all(connection=conn, serializer=JSONSerializer), key=lambda w: w.name)
        worker_reports = [_worker_report(conn, w, now) for w in workers]
    except redis.exceptions.OutOfMemoryError:  # RQ reads workers in MULTI, which a full Redis refuses
        worker_reports, workers_unread = [], "Redis is full: it refuses the transactions RQ reads workers in"
    return StatusReport(
        queues=queue_reports,
        workers=worker_reports,
        unserved=unserved_queues(queue_reports, worker_reports),
        mixed=mixed_queues(worker_reports),
        redis=memory,
        workers_unread=workers_unread,
    )


# --- text ------------------------------------------------------------------------------------------


def human_bytes(n: int | None) -> str:
    """`1536` -> `1.5 KiB`; None -> `-`."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _health_lines(h: WorkerHealth) -> list[str]:
    lines = []
    if h.model is not None or h.device is not None:
        version = f"  mlxq {h.version}" if h.version else ""
        lines.append(f"model: {h.model or '-'}  device: {h.device or '-'}{version}")
    if h.jobs_done is not None:
        speed = f"{h.tokens_per_s:.1f}" if h.tokens_per_s is not None else "-"
        lines.append(f"jobs_done: {h.jobs_done}  tokens/s: {speed} (last generation)")
    if h.active_sequences is not None:
        limit = f" of {h.max_batch_sequences}" if h.max_batch_sequences is not None else ""
        lines.append(f"generation batch: {h.active_sequences}{limit} sequences active")
    if h.acceptance is not None:
        kept = f"{h.accepted_tokens}/{h.draft_tokens} drafted tokens kept"
        lines.append(f"speculation: acceptance {h.acceptance:.0%} ({kept})")
    if h.cache_lookups is not None:
        rate = h.cache_hit_rate
        share = f"{rate:.0%}" if rate is not None else "-"
        lines.append(
            f"prefix cache: hit rate {share} ({h.cache_hits or 0}/{h.cache_lookups} lookups, "
            f"{h.cache_hit_tokens or 0} tokens reused)  "
            f"bytes: {human_bytes(h.cache_bytes)} of {human_bytes(h.cache_budget_bytes)}"
        )
    elif h.model is not None:
        lines.append("prefix cache: off")
    if h.score_batches:
        per_batch = "  ".join(
            f"{phase} {1000 * seconds / h.score_batches:.2f}" for phase, seconds in h.score_phase_s.items()
        )
        lines.append(
            f"score batches: {h.score_batches} ({h.score_jobs or 0} jobs, {h.score_rows or 0} rows)  "
            f"ms a batch: {per_batch}"
        )
        if h.score_aside_s:
            hidden = max(h.score_aside_s - (h.score_waited_s or 0.0), 0.0)
            cpu = 1000 * (h.score_aside_cpu_s or 0.0) / h.score_batches
            lines.append(
                f"score overlap: {1000 * h.score_aside_s / h.score_batches:.2f} ms a batch of claim, start, "
                f"tokenize and end beside the batches ({cpu:.2f} "
                f"CPU), {1000 * hidden / h.score_batches:.2f} hidden ({hidden / h.score_aside_s:.0%})"
            )
    if h.memory_active_bytes is not None:
        lines.append(
            f"memory: active {human_bytes(h.memory_active_bytes)}, "
            f"peak {human_bytes(h.memory_peak_bytes)}, cache {human_bytes(h.memory_cache_bytes)}"
        )
    return lines


def render(report: StatusReport) -> str:
    """The report as aligned text for a terminal."""
    lines = ["queues:"]
    if not report.queues:
        lines.append("  (none)")
    for q in report.queues:
        lines.append(
            f"  {q.name:<16} queued={q.queued} started={q.started} finished={q.finished} "
            f"failed={q.failed} deferred={q.deferred} scheduled={q.scheduled} canceled={q.canceled}"
            + (
                f" unreadable={q.unreadable} (XRANGE {keys.dead_letter_key(q.name)} - +)"
                if q.unreadable
                else ""
            )
        )
    lines.append("workers:")
    if report.workers_unread is not None:
        lines.append(f"  (not read: {report.workers_unread})")
    elif not report.workers:
        lines.append("  (none)")
    for w in report.workers:
        age = f"{w.heartbeat_age_s:.0f}s ago" if w.heartbeat_age_s is not None else "-"
        lines.append(
            f"  {w.name} state={w.state} queues={','.join(w.queues)} job={w.current_job or '-'} "
            f"ok={w.successful_jobs} failed={w.failed_jobs} heartbeat={age} "
            f"host={w.host or '-'} pid={w.pid if w.pid is not None else '-'}"
        )
        lines.extend(f"    {line}" for line in _health_lines(w.health))
    for u in report.unserved:
        lines.append(f"warning: queue {u.name} has {u.queued} jobs and no worker")
    for m in report.mixed:
        served = "; ".join(f"{model} ({', '.join(names)})" for model, names in sorted(m.models.items()))
        lines.append(f"warning: queue {m.name} is served by different models: {served}")
    lines.extend(_redis_lines(report.redis))
    return "\n".join(lines)


def _redis_lines(memory: MemoryPolicy | None) -> list[str]:
    if memory is None:
        return []
    if memory.unknown:
        return [f"redis: {memory.unknown_note()}"]
    limit = human_bytes(memory.maxmemory) if memory.maxmemory else "no limit"
    lines = [
        f"redis: maxmemory-policy={memory.policy} used={human_bytes(memory.used_memory)} maxmemory={limit}"
    ]
    warning = memory.warning()
    if warning is not None:
        lines.append(f"warning: {warning}")
    if memory.full:
        lines.append(
            "warning: Redis is full: writes are refused (producers get OOM errors, workers wait with "
            "their jobs); free memory or raise maxmemory"
        )
    return lines
