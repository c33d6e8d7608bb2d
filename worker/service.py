"""Wires one worker process together: Redis connection, engine, executor, RQ worker."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import redis

from jobs import keys, runtime

from .engine import Engine, EngineOptions
from .executor import JobExecutor
from .job_claim import JobClaimer
from .rq_worker import BatchOptions, MlxqWorker
from .score_claim import ClaimBudget, ScoreClaimer
from .settings import WorkerSettings
from .stream_writer import StreamOptions

log = logging.getLogger(__name__)


def redis_from_url(url: str) -> redis.Redis:
    """A connection for redis://, rediss:// (TLS) and unix:// URLs, with users/passwords in the URL.

    No socket timeout on reads: RQ's dequeue blocks on BLMOVE for minutes.
    """
    return redis.Redis.from_url(
        url, socket_connect_timeout=5, socket_keepalive=True, health_check_interval=30
    )


@dataclass
class WorkerService:
    settings: WorkerSettings
    conn: redis.Redis
    engine: Engine
    worker: MlxqWorker
    executor: JobExecutor

    @classmethod
    def start(cls, settings: WorkerSettings, engine: Engine | None = None) -> WorkerService:
        """Load the model (unless given) and build the worker; nothing is dequeued yet."""
        conn = redis_from_url(settings.redis_url)
        if engine is None:
            dtype = None if settings.dtype == "auto" else settings.dtype
            engine = Engine.load(
                settings.model,
                EngineOptions(
                    dtype=dtype,
                    prefill_chunk=settings.prefill_chunk,
                    max_context=settings.max_context,
                    prefix_cache_bytes=settings.prefix_cache_bytes,
                    max_score_rows=settings.max_score_rows,
                    max_score_candidates=settings.max_score_candidates,
                ),
            )
        stream_options = StreamOptions(
            maxlen=settings.stream_maxlen,
            ttl_s=settings.stream_ttl_s,
            result_ttl_s=settings.result_ttl_s,
            flush_tokens=settings.stream_flush_tokens,
            flush_ms=settings.stream_flush_ms,
            retry_attempts=settings.redis_retry_attempts,
            retry_max_wait_s=settings.redis_retry_max_wait_s,
        )
        worker = MlxqWorker(
            settings.queues,
            connection=conn,
            name=settings.name,
            stream_options=stream_options,
            heartbeat_s=settings.heartbeat_s,
            cancel_poll_s=settings.cancel_poll_s,
            worker_ttl=settings.worker_ttl_s,
            maintenance_interval=settings.maintenance_interval_s,
            default_result_ttl=settings.result_ttl_s,
            default_job_timeout=settings.job_timeout_s,
        )
        executor = JobExecutor(engine, conn, stream_options, cancelled=worker.is_cancelled)
        worker.executor = executor
        if settings.score_batch_rows > 0:
            budget = ClaimBudget(max_rows=settings.score_batch_rows, max_jobs=settings.score_batch_jobs)
            worker.score_claimer = ScoreClaimer(conn, worker.serializer, budget)
        if settings.max_batch_sequences > 1:
            worker.batch_options = BatchOptions(
                max_sequences=settings.max_batch_sequences,
                kv_budget_bytes=settings.batch_kv_bytes,
                admit_every=settings.batch_admit_every,
            )
            worker.job_claimer = JobClaimer(conn, worker.serializer)
        worker.after_job = lambda: _publish_stats(conn, worker, executor)
        worker.publish_stats = worker.after_job
        return cls(settings, conn, engine, worker, executor)

    def work(self, *, burst: bool = False, max_jobs: int | None = None) -> int:
        """Serve jobs until stopped; returns a process exit code."""
        runtime.install(self.executor)
        _publish_stats(self.conn, self.worker, self.executor)
        try:
            self.worker.work(burst=burst, max_jobs=max_jobs, logging_level=self.settings.log_level)
        finally:
            runtime.install(None)
            self.conn.delete(keys.worker_stats_key(self.worker.name))
        return 0


def _publish_stats(conn: redis.Redis, worker: MlxqWorker, executor: JobExecutor) -> None:
    """Live numbers for `mlxq status`: a hash per worker, expiring if the worker dies."""
    stats = {
        "model": executor.engine.name,
        "device": str(mx.default_device()),
        "queues": ",".join(worker.queue_names()),
        "jobs_done": executor.jobs_done,
        "active_sequences": worker.active_sequences,
        "max_batch_sequences": worker.batch_options.max_sequences,
        "tokens_per_s": f"{executor.last_tokens_per_s or 0.0:.1f}",
        "memory_bytes": mx.get_active_memory(),
        "peak_memory_bytes": mx.get_peak_memory(),
    }
    cache = executor.engine.prefix_cache
    if cache is not None:
        stats.update({f"cache_{k}": v for k, v in cache.stats.as_dict().items()})
        stats["cache_budget_bytes"] = cache.budget_bytes
    try:
        pipe = conn.pipeline(transaction=False)
        pipe.hset(keys.worker_stats_key(worker.name), mapping=stats)
        pipe.expire(keys.worker_stats_key(worker.name), max(worker.worker_ttl, 60))
        pipe.execute()
    except redis.RedisError as e:
        log.warning("could not publish worker stats error=%s", e)
