"""Wires one worker process together: Redis connection, engine, the job components, the RQ worker.

The service builds every component once and hands each what it needs: the engine (MLX, below), the RQ
worker (`MlxqWorker`, the `JobHost`), `JobResults` (streams and result keys), `ScoreJobs` and
`GenerationJobs` (the one path of each job kind: a lone job is a batch of one), and the stats publisher.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import redis
from rq.worker import DequeueStrategy

from mlxq.jobs import keys, redis_url
from mlxq.jobs.replication import Replicas, default_replica_acks
from mlxq.worker.bounded_job import BoundedJob
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.device import limit_buffer_cache
from mlxq.worker.engine.prefill_plan import batch_kv_by_default
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.warm_up import WarmUpShapes, batch_sizes, warm_up
from mlxq.worker.generation_jobs import BatchOptions, GenerationJobs
from mlxq.worker.job_claim import JobClaimer
from mlxq.worker.job_results import JobResults
from mlxq.worker.metrics import MetricsServer, StatsPublisher, require_prometheus
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.score_claim import ClaimBudget, ScoreClaimer
from mlxq.worker.score_jobs import ScoreJobs
from mlxq.worker.settings import WorkerSettings
from mlxq.worker.stream_writer import StreamOptions, retrying

log = logging.getLogger(__name__)

_DEQUEUE_STRATEGY = {
    "priority": DequeueStrategy.DEFAULT,
    "round_robin": DequeueStrategy.ROUND_ROBIN,
    "random": DequeueStrategy.RANDOM,
}  # `MLXQ_QUEUE_ORDER` in RQ's words


def redis_from_url(url: str) -> redis.Redis:
    """A connection for redis://, rediss:// (TLS), unix:// and redis+sentinel:// URLs, with users and
    passwords in the URL (`jobs.redis_url`). Through Sentinel, every new connection goes to the current
    primary, and one that meets a demoted primary is dropped (a connection error, retried).

    No socket timeout on reads: RQ's dequeue blocks on BLMOVE for minutes.
    """
    return redis_url.sync_client(
        url, socket_connect_timeout=5, socket_keepalive=True, health_check_interval=30
    )


def draft_policy(settings: WorkerSettings) -> DraftPolicy:
    """The speculation policy the settings ask for (`MLXQ_DRAFT_*`)."""
    return DraftPolicy(
        max_depth=settings.draft_max_tokens,
        max_batch=settings.draft_max_batch,
        min_acceptance=settings.draft_min_acceptance,
        max_run=settings.draft_step_tokens,
        gate=settings.draft_gate,
    )


def load_engine(settings: WorkerSettings) -> Engine:
    """The engine the settings ask for (model, dtype, chunking, caches, batching limits)."""
    return Engine.load(
        settings.model,
        EngineOptions(
            dtype=None if settings.dtype == "auto" else settings.dtype,
            prefill_chunk=settings.prefill_chunk,
            max_context=settings.max_context,
            prefix_cache_bytes=settings.prefix_cache_bytes,
            max_score_rows=settings.max_score_rows,
            max_score_candidates=settings.max_score_candidates,
            decode_overlap=settings.decode_overlap,
            masks_in_place=settings.masks_in_place,
            build_ahead=settings.build_ahead,
            compiled_steps=settings.compiled_steps,
            dense_rows=settings.dense_rows,
            idle_prefill_tokens=settings.idle_prefill_tokens,
            score_kv_bytes=settings.score_kv_bytes,
            sync_score_phases=settings.sync_score_phases,
            max_prompt_chars=settings.max_prompt_chars,
            max_stop_chars=settings.max_stop_chars,
            max_stops=settings.max_stops,
            max_messages=settings.max_messages,
            speculation=settings.speculation,
            draft_model=settings.draft_model,
            draft_policy=draft_policy(settings),
        ),
    )


@dataclass
class WorkerService:
    settings: WorkerSettings
    conn: redis.Redis
    engine: Engine
    worker: MlxqWorker
    results: JobResults
    stats: StatsPublisher

    @classmethod
    def start(cls, settings: WorkerSettings, engine: Engine | None = None) -> WorkerService:
        """Load the model (unless given) and build the worker; nothing is dequeued yet."""
        conn = redis_from_url(settings.redis_url)
        BoundedJob.max_payload_bytes = settings.max_payload_bytes  # every job this process reads
        limit_buffer_cache(settings.mlx_cache_limit_bytes)
        if settings.metrics_port is not None:
            require_prometheus()  # before the model loads: a missing extra should fail fast
        engine = engine if engine is not None else load_engine(settings)
        stream_options = StreamOptions(
            maxlen=settings.stream_maxlen,
            ttl_s=settings.stream_ttl_s,
            result_ttl_s=settings.result_ttl_s,
            flush_tokens=settings.stream_flush_tokens,
            flush_ms=settings.stream_flush_ms,
            retry_attempts=settings.redis_retry_attempts,
            retry_max_wait_s=settings.redis_retry_max_wait_s,
            full_wait_s=settings.redis_full_wait_s,
            replication=Replicas(
                conn,
                settings.replica_acks if settings.replica_acks is not None else default_replica_acks(conn),
            ),
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
            max_job_timeout=settings.max_job_timeout_s,
        )
        results = JobResults(conn, stream_options, engine.cache_log_fields)
        score_claimer = None
        if settings.score_batch_rows > 0:
            budget = ClaimBudget(max_rows=settings.score_batch_rows, max_jobs=settings.score_batch_jobs)
            score_claimer = ScoreClaimer(conn, worker.serializer, budget, worker.dead_letters)
        scores = ScoreJobs(
            engine, worker, results, score_claimer, settings.max_nesting_depth, settings.score_pipeline
        )
        options = BatchOptions(
            max_sequences=settings.max_batch_sequences,
            kv_budget_bytes=(
                batch_kv_by_default() if settings.batch_kv_bytes is None else settings.batch_kv_bytes
            ),
            admit_every=settings.batch_admit_every,
            empty_wait_s=settings.batch_empty_wait_s,
            min_join=settings.batch_min_join,
        )
        generations = GenerationJobs(
            engine,
            worker,
            results,
            scores,
            JobClaimer(conn, worker.serializer, dead_letters=worker.dead_letters),
            options,
            settings.max_nesting_depth,
        )
        worker.runners = {keys.GENERATE_FUNC: generations, keys.SCORE_FUNC: scores}
        stats = StatsPublisher(
            conn,
            worker.name,
            lambda: _stats_fields(worker, engine, results, scores, options.max_sequences),
            model_path=settings.model,
            ttl_s=worker.worker_ttl + 60,  # as RQ's heartbeat gives the worker's own key
        )
        worker.stats = stats
        return cls(settings, conn, engine, worker, results, stats)

    def close(self) -> None:
        """Close the service's Redis connections (the worker's, its components' and its stats' are
        the one client `start` made). A process that serves until it exits need not call it; a
        process that goes on after a service (tests, the bench's worker) does, or its sockets wait
        for the collector."""
        self.conn.close()

    def __enter__(self) -> WorkerService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def work(self, *, burst: bool = False, max_jobs: int | None = None) -> int:
        """Serve jobs until stopped; returns a process exit code: 0 when stopped or done, 1 when RQ's
        loop quit on an error (so a service manager restarts the worker)."""
        self.warm_up()
        retrying(self.worker.stream_options)(_reclaim_name, self.conn, self.worker)
        metrics = self._start_metrics()
        self.worker.evictions.check(force=True)  # warned of at once, and in the first stats
        self.stats.publish()
        # What start-up made (the model's modules, the tokenizer, imported code) lives as long as the
        # worker: the collector's full passes need not walk it (each took tens of milliseconds, on
        # whichever thread allocated at the time: a score batch's helper, say). Its garbage goes first.
        gc.collect()
        gc.freeze()
        try:
            self.worker.work(
                burst=burst,
                max_jobs=max_jobs,
                logging_level=self.settings.log_level,
                dequeue_strategy=_DEQUEUE_STRATEGY[self.settings.queue_order],
            )
        finally:
            gc.unfreeze()  # collected as anything else again, for a process that goes on without it
            if metrics is not None:
                metrics.stop()
            self.stats.remove()
            self.engine.close()
            self.close()  # a service serves once: its engine is closed too
        if self.worker.fatal_error is not None:
            log.error("worker quit on an error error=%r", self.worker.fatal_error)
            return 1
        return 0

    def warm_up(self) -> None:
        """Run the engine's common shapes once before the first job (`warm_up.py`), unless the settings
        turn it off. A warm-up that fails is logged and the worker goes on: its jobs only start colder."""
        if not (self.engine.on_gpu if self.settings.warm_up is None else self.settings.warm_up):
            return
        shapes = WarmUpShapes(
            max_sequences=self.settings.max_batch_sequences,
            score_rows=min(64, max(1, self.settings.score_batch_rows)),
        )
        try:
            parts = warm_up(self.engine, shapes)
        except Exception:
            log.exception("warm-up failed; taking jobs without it")
            return
        log.info(
            "warm-up done seconds=%.2f %s batch_sizes=%s score_rows=%d",
            sum(parts.values()),
            " ".join(f"{part}_s={s:.2f}" for part, s in parts.items()),
            ",".join(map(str, batch_sizes(shapes.max_sequences, self.engine.pad_shapes))),
            shapes.score_rows,
        )

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
    if int(pid or 0) != os.getpid() and _pid_alive(int(pid or 0)):
        return  # a live worker of that name: RQ refuses to start a second one, as it should
    log.warning("freeing worker name left by a dead process name=%s pid=%s", worker.name, pid)
    # Same name, same key: marks it dead so RQ's register_birth may take it.
    worker.register_death()  # type: ignore[no-untyped-call]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _stats_fields(
    worker: MlxqWorker, engine: Engine, results: JobResults, scores: ScoreJobs, max_sequences: int
) -> dict[str, Any]:
    """The worker's live numbers for `mlxq status` and Prometheus (published by `StatsPublisher`)."""
    return {
        "model": engine.name,
        "queues": ",".join(worker.queue_names()),
        "jobs_done": results.jobs_done,
        "active_sequences": worker.active_sequences,
        "max_batch_sequences": max_sequences,
        "tokens_per_s": f"{results.last_tokens_per_s or 0.0:.1f}",
        "draft_tokens": results.draft_tokens,
        "accepted_tokens": results.accepted_tokens,
        **worker.full.fields(),
        **worker.evictions.fields(),
        **scores.phases.fields(),
        **engine.status(),
    }
