"""What a worker tells the world about itself: its `mlxq:worker:<name>` hash and, optionally, Prometheus.

`StatsPublisher` writes the hash that `mlxq status` reads: at start, after every job, and on every RQ
heartbeat, so it lives exactly as long as RQ's own registration of the worker (an idle worker refreshes
it from RQ's dequeue loop; a busy one extends it from the job watch thread). `MetricsServer` serves the
same numbers as Prometheus metrics, labelled by worker and model, from the last published snapshot plus
a few live readings (state, RQ's job counts, queue lengths): a scrape never touches MLX.

The hash's fields are a public contract (documented in docs/operations.md); every value is a string.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any, Protocol

import redis

from mlxq.jobs import keys

log = logging.getLogger(__name__)

NEEDS_PROMETHEUS = (
    "MLXQ_METRICS_PORT is set but prometheus-client is missing: pip install prometheus-client "
    "(or mlxq's `metrics` extra: pip install '.[metrics]' in its repository)"
)

# Hash field -> (metric name, kind, help). Other numeric fields become gauges named `mlxq_worker_<field>`.
_KNOWN: dict[str, tuple[str, str, str]] = {
    "jobs_done": ("mlxq_worker_jobs_done", "counter", "jobs this worker finished on its engine"),
    "tokens_per_s": (
        "mlxq_worker_decode_tokens_per_second",
        "gauge",
        "decode speed of the last generation job",
    ),
    "draft_tokens": ("mlxq_worker_draft_tokens", "counter", "tokens drafted for speculative decoding"),
    "accepted_tokens": ("mlxq_worker_accepted_tokens", "counter", "drafted tokens the model kept"),
    "memory_bytes": ("mlxq_worker_memory_active_bytes", "gauge", "MLX memory in use"),
    "peak_memory_bytes": ("mlxq_worker_memory_peak_bytes", "gauge", "MLX peak memory since start"),
    "memory_cache_bytes": ("mlxq_worker_memory_cache_bytes", "gauge", "MLX buffer cache held for reuse"),
    "cache_lookups": ("mlxq_prefix_cache_lookups", "counter", "prefix cache lookups"),
    "cache_hits": ("mlxq_prefix_cache_hits", "counter", "prefix cache lookups that reused tokens"),
    "cache_hit_tokens": ("mlxq_prefix_cache_hit_tokens", "counter", "prompt tokens taken from the cache"),
    "cache_inserted_tokens": ("mlxq_prefix_cache_inserted_tokens", "counter", "tokens stored in the cache"),
    "cache_evictions": ("mlxq_prefix_cache_evictions", "counter", "prefix cache nodes evicted"),
    "cache_bytes": ("mlxq_prefix_cache_bytes", "gauge", "KV bytes the prefix cache holds"),
    "cache_nodes": ("mlxq_prefix_cache_nodes", "gauge", "nodes in the prefix cache trie"),
    "cache_budget_bytes": ("mlxq_prefix_cache_budget_bytes", "gauge", "the prefix cache's byte budget"),
    "started_at": ("mlxq_worker_start_time_seconds", "gauge", "when the worker started (unix time)"),
    "updated_at": ("mlxq_worker_stats_updated_time_seconds", "gauge", "when these numbers were taken"),
    "redis_full": ("mlxq_redis_full", "gauge", "1 while Redis refuses this worker's writes (OOM)"),
    "redis_oom_refusals": ("mlxq_redis_oom_refusals", "counter", "OOM replies this worker met"),
    "score_batches": ("mlxq_score_batches", "counter", "score batches run"),
    "score_jobs": ("mlxq_score_jobs", "counter", "score jobs finished in batches"),
    "score_rows": ("mlxq_score_rows", "counter", "rows of the score jobs finished in batches"),
    **{
        f"score_{phase}_s": (f"mlxq_score_{phase}_seconds", "counter", f"time score batches spent in {phase}")
        for phase in keys.SCORE_PHASES
    },
    "score_aside_s": (
        "mlxq_score_aside_seconds",
        "counter",
        "time score batches' claim, start and end spent on helper threads, beside the batches",
    ),
    "score_aside_cpu_s": (
        "mlxq_score_aside_cpu_seconds",
        "counter",
        "CPU time of the claim, start and end score batches did on helper threads",
    ),
    "score_waited_s": (
        "mlxq_score_waited_seconds",
        "counter",
        "time score batches waited for their claim, start and end done beside them",
    ),
}
_INFO_FIELDS = ("device", "queues", "model_path", "version", "mlx_version")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def require_prometheus() -> None:
    """Raise a clear error when the metrics endpoint is asked for but its extra is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError as e:
        raise RuntimeError(NEEDS_PROMETHEUS) from e


class StatsPublisher:
    """Writes one worker's stats hash; `fields` builds the worker's own numbers (main thread only)."""

    def __init__(
        self,
        conn: redis.Redis,
        worker_name: str,
        fields: Callable[[], Mapping[str, Any]],
        *,
        model_path: str,
        ttl_s: int,
    ) -> None:
        self.conn = conn
        self.key = keys.worker_stats_key(worker_name)
        self.fields = fields
        self.ttl_s = ttl_s
        self.metrics_port: int | None = None
        self._static = {
            "model_path": model_path,
            "version": _version("mlxq"),
            "started_at": f"{time.time():.3f}",
        }
        self._latest: dict[str, str] = {}
        self._lock = threading.Lock()
        self._written = (-1e9, 0)  # (monotonic time, TTL) of the last write: RQ beats right after a job

    @property
    def latest(self) -> dict[str, str]:
        """The last snapshot published (a copy, safe to read from any thread)."""
        with self._lock:
            return dict(self._latest)

    def snapshot(self) -> dict[str, str]:
        """The worker's fields plus process facts, as strings. `fields` reads MLX: main thread only."""
        stats = {**self._static, **{k: str(v) for k, v in self.fields().items()}}
        stats["updated_at"] = f"{time.time():.3f}"
        if self.metrics_port is not None:
            stats["metrics_port"] = str(self.metrics_port)
        return stats

    def publish(self, ttl_s: int | None = None, pipeline: Any = None) -> None:
        """Write a fresh snapshot (main thread). A Redis error is logged, never raised: jobs go on.
        With a `pipeline` (a transaction: the hash is then exactly this snapshot, never a mix), the
        writes go in it, for its owner to send and to handle its errors."""
        stats = self.snapshot()
        with self._lock:
            self._latest = stats
        ttl_s = ttl_s or self.ttl_s
        if pipeline is not None:
            self._write(pipeline, stats, ttl_s)
            self._written = (time.monotonic(), ttl_s)
            return
        try:
            pipe = self.conn.pipeline(transaction=True)  # the hash is exactly this snapshot, never a mix
            self._write(pipe, stats, ttl_s)
            pipe.execute()
            self._written = (time.monotonic(), ttl_s)
        except redis.RedisError as e:
            log.warning("could not publish worker stats error=%s", e)

    def _write(self, pipe: Any, stats: dict[str, str], ttl_s: int) -> None:
        pipe.delete(self.key)
        pipe.hset(self.key, mapping=stats)
        pipe.expire(self.key, ttl_s)

    def keep_alive(self, ttl_s: int, pipeline: Any = None) -> None:
        """Extend the hash's life (any thread; inside the caller's pipeline when given one)."""
        (pipeline if pipeline is not None else self.conn).expire(self.key, ttl_s)

    def on_heartbeat(self, ttl_s: int, pipeline: Any = None) -> None:
        """RQ heartbeat hook: a fresh snapshot from the main thread's idle loop, else only a longer TTL."""
        if pipeline is None and threading.current_thread() is threading.main_thread():
            at, written_ttl = self._written
            if time.monotonic() - at > 1.0 or ttl_s > written_ttl:  # else it was written just now
                self.publish(ttl_s)
        else:
            self.keep_alive(ttl_s, pipeline)

    def remove(self) -> None:
        try:
            self.conn.delete(self.key)
        except redis.RedisError as e:
            log.warning("could not remove worker stats error=%s", e)


class LiveWorker(Protocol):
    """What a scrape reads from the RQ worker object itself (no MLX)."""

    @property
    def name(self) -> str: ...

    @property
    def key(self) -> str: ...

    def get_state(self) -> str: ...

    def queue_names(self) -> list[str]: ...


def _number(text: str | bytes | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


# RQ's own counters in its worker hash -> (metric name, help).
_RQ_COUNTERS = {
    "successful_job_count": ("mlxq_worker_jobs_succeeded", "jobs RQ recorded as finished by this worker"),
    "failed_job_count": ("mlxq_worker_jobs_failed", "jobs RQ recorded as failed by this worker"),
    "total_working_time": ("mlxq_worker_working_seconds", "seconds this worker spent running jobs"),
}


class _Collector:
    """Turns the latest snapshot, plus live readings, into metric families at each scrape."""

    def __init__(self, publisher: StatsPublisher, worker: LiveWorker, conn: redis.Redis) -> None:
        self.publisher = publisher
        self.worker = worker
        self.conn = conn

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        stats = self.publisher.latest
        names, values = ["worker", "model"], [self.worker.name, stats.get("model", "")]

        info = InfoMetricFamily("mlxq_worker", "what this worker serves", labels=names)
        info.add_metric(values, {k: stats.get(k, "") for k in _INFO_FIELDS})
        yield info
        for field, text in sorted(stats.items()):
            value = _number(text)
            if value is None or field in _INFO_FIELDS or field == "metrics_port":
                continue
            name, kind, doc = _KNOWN.get(field, (f"mlxq_worker_{field}", "gauge", f"worker stat {field}"))
            kind_of = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = kind_of(name, doc, labels=names)
            family.add_metric(values, value)
            yield family

        busy = GaugeMetricFamily("mlxq_worker_busy", "1 while the worker runs a job", labels=names)
        busy.add_metric(values, 1.0 if self.worker.get_state() == "busy" else 0.0)
        yield busy
        yield from self._from_redis(names, values)

    def _from_redis(self, names: list[str], values: list[str]) -> Iterator[Any]:
        """RQ's job counters for this worker and the length of each queue it serves: one round trip."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        queues = self.worker.queue_names()
        try:
            pipe = self.conn.pipeline(transaction=False)
            pipe.hmget(self.worker.key, list(_RQ_COUNTERS))
            for queue in queues:
                pipe.llen(keys.rq_queue_key(queue))
            counts, *lengths = pipe.execute()
        except redis.RedisError as e:  # Redis away: the rest of the scrape is still worth having
            log.warning("metrics: Redis readings unavailable error=%s", e)
            return
        for (name, doc), raw in zip(_RQ_COUNTERS.values(), counts, strict=True):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, _number(raw) or 0.0)
            yield counter
        family = GaugeMetricFamily(
            "mlxq_queue_jobs", "jobs waiting in a queue this worker serves", labels=[*names, "queue"]
        )
        for queue, length in zip(queues, lengths, strict=True):
            family.add_metric([*values, queue], float(length))
        yield family


class MetricsServer:
    """A Prometheus endpoint (`prometheus_client.start_http_server`) over a private registry."""

    def __init__(self, publisher: StatsPublisher, worker: LiveWorker, conn: redis.Redis) -> None:
        require_prometheus()
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(publisher, worker, conn))
        self._server: Any = None
        self.port: int | None = None

    def start(self, port: int, addr: str) -> int:
        """Serve on `addr:port` (port 0: a free one) in a daemon thread; returns the port."""
        from prometheus_client import start_http_server

        self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = int(self._server.server_port)
        log.info("metrics endpoint addr=%s port=%d", addr, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
