"""Wires one worker process together: Redis connection, engine, executor, RQ worker."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import redis

from jobs import runtime
from worker.engine import Engine, EngineOptions
from worker.engine.device import on_cuda
from worker.executor import JobExecutor
from worker.job_claim import JobClaimer
from worker.metrics import MetricsServer, StatsPublisher, require_prometheus
from worker.rq_worker import BatchOptions, MlxqWorker
from worker.score_claim import ClaimBudget, ScoreClaimer
from worker.settings import WorkerSettings
from worker.stream_writer import StreamOptions

log = logging.getLogger(__name__)


def mlx_cache_limit(setting: int | None) -> int:
    """Bytes of freed buffers MLX keeps for reuse (`MLXQ_MLX_CACHE_LIMIT_BYTES`; unset: the default).

    On MLX's CUDA build a buffer the cache cannot keep is given back with `cudaFree`, which waits for
    the device, and a new one is managed memory that faults its pages in on first use, so a cache
    smaller than what a batch turns over (a 64-row decode batch of the 1B shape holds ~1 GiB of KV and
    copies it whenever its membership or length changes) costs every step that frees. Measured on the
    H200 (`bench/HISTORY.md`, 64 jobs through the queue, in turns with 1 GiB): +30% (16 GiB; and +16%
    for a 256-job backlog) in one machine start, +6% (this default) in another, +12% (32 GiB) in an
    earlier one. So the default there is an eighth of MLX's memory limit (17.8 GB on an H200);
    elsewhere (unified memory, shared with the system) 1 GiB."""
    if setting is not None:
        return setting
    if on_cuda():
        return max(1 << 30, mx.get_memory_limit() // 8)
    return 1 << 30


def redis_from_url(url: str) -> redis.Redis:
    """A connection for redis://, rediss:// (TLS) and unix:// URLs, with users/passwords in the URL.

    No socket timeout on reads: RQ's dequeue blocks on BLMOVE for minutes.
    """
    return redis.Redis.from_url(
        url, socket_connect_timeout=5, socket_keepalive=True, health_check_interval=30
    )


class ServiceWorker(MlxqWorker):
    """`MlxqWorker` whose RQ heartbeats also refresh its stats hash (see `StatsPublisher.on_heartbeat`)."""

    stats: StatsPublisher | None = None

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if self.stats is not None:
            self.stats.on_heartbeat(timeout or self.worker_ttl + 60, pipeline)


@dataclass
class WorkerService:
    settings: WorkerSettings
    conn: redis.Redis
    engine: Engine
    worker: MlxqWorker
    executor: JobExecutor
    stats: StatsPublisher

    @classmethod
    def start(cls, settings: WorkerSettings, engine: Engine | None = None) -> WorkerService:
        """Load the model (unless given) and build the worker; nothing is dequeued yet."""
        conn = redis_from_url(settings.redis_url)
        # MLX keeps freed buffers for reuse; varied prompt and batch shapes would otherwise grow it unbounded.
        mx.set_cache_limit(mlx_cache_limit(settings.mlx_cache_limit_bytes))
        if settings.metrics_port is not None:
            require_prometheus()  # before the model loads: a missing extra should fail fast
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
                    decode_overlap=settings.decode_overlap,
                    dense_rows=settings.dense_rows,
                    idle_prefill_tokens=settings.idle_prefill_tokens,
                    score_kv_bytes=settings.score_kv_bytes,
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
        worker = ServiceWorker(
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
                empty_wait_s=settings.batch_empty_wait_s,
                min_join=settings.batch_min_join,
            )
            worker.job_claimer = JobClaimer(conn, worker.serializer)
        stats = StatsPublisher(
            conn,
            worker.name,
            lambda: _stats_fields(worker, executor),
            model_path=settings.model,
            ttl_s=worker.worker_ttl + 60,  # as RQ's heartbeat gives the worker's own key
        )
        worker.stats = stats
        worker.after_job = stats.publish
        worker.publish_stats = worker.after_job
        return cls(settings, conn, engine, worker, executor, stats)

    def work(self, *, burst: bool = False, max_jobs: int | None = None) -> int:
        """Serve jobs until stopped; returns a process exit code."""
        runtime.install(self.executor)
        _reclaim_name(self.conn, self.worker)
        metrics = self._start_metrics()
        self.stats.publish()
        try:
            self.worker.work(burst=burst, max_jobs=max_jobs, logging_level=self.settings.log_level)
        finally:
            runtime.install(None)
            if metrics is not None:
                metrics.stop()
            self.stats.remove()
            self.engine.close()
        return 0

    def _start_metrics(self) -> MetricsServer | None:
        if self.settings.metrics_port is None:
            return None
        server = MetricsServer(self.stats, self.worker, self.conn)
        self.stats.metrics_port = server.start(self.settings.metrics_port, self.settings.metrics_addr)
        return server


def _reclaim_name(conn: redis.Redis, worker: MlxqWorker) -> None:
    """Free a fixed worker name still registered by this host's previous, dead process (SIGKILL, OOM).

    RQ refuses a name that is registered and alive, so a unit restarted after a crash would fail until
    the dead process's key expired. Only a registration from this host whose process is gone is freed.
    """
    raw = conn.hmget(worker.key, ["hostname", "pid", "death"])
    host, pid, death = (v.decode() if isinstance(v, bytes) else v for v in raw)
    if host != socket.gethostname() or death is not None or not (pid or "").isdigit():
        return
    if int(pid) != os.getpid() and _pid_alive(int(pid)):
        return  # a live worker of that name: RQ refuses to start a second one, as it should
    log.warning("freeing worker name left by a dead process name=%s pid=%s", worker.name, pid)
    worker.register_death()  # same name, same key: marks it dead so RQ's register_birth may take it


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _stats_fields(worker: MlxqWorker, executor: JobExecutor) -> dict[str, Any]:
    """The worker's live numbers for `mlxq status` and Prometheus (published by `StatsPublisher`)."""
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
    return stats
