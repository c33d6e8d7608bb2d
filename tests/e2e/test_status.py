"""Worker health: the stats hash a worker publishes, `mlxq status`, and the Prometheus endpoint."""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer
from worker_process import WorkerProcess

from mlxq.jobs import keys
from mlxq.jobs.schema import TokenEvent
from mlxq.producer import Client
from mlxq.producer.cli import main
from mlxq.producer.status_report import collect, human_bytes, render

REDIS_DB = 8
HAVE_PROMETHEUS = importlib.util.find_spec("prometheus_client") is not None  # the `metrics` extra
PROMPT = "The capital of France is Paris. " * 4


def _eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        time.sleep(0.05)


def _stats(conn: redis.Redis, name: str) -> dict[str, str]:
    raw = conn.hgetall(keys.worker_stats_key(name))
    return {k.decode(): v.decode() for k, v in raw.items()}


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# --- the report, from a registered worker's hash ---------------------------------------------------


def test_report_parses_worker_health_and_flags_queues_nobody_serves(
    redis_url: str, redis_conn: redis.Redis, client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    client.submit_generate("a", queue="llama-3.2-1b")
    client.submit_generate("b", queue="qwen3-0.6b")
    client.submit_generate("c", queue="qwen3-0.6b")
    queue = Queue("llama-3.2-1b", connection=redis_conn, serializer=JSONSerializer)
    worker = SimpleWorker([queue], connection=redis_conn, serializer=JSONSerializer, name="mac-1")
    worker.register_birth()
    other = SimpleWorker([queue], connection=redis_conn, serializer=JSONSerializer, name="mac-2")
    other.register_birth()
    redis_conn.hset(keys.worker_stats_key("mac-2"), mapping={"model": "Llama-3.2-1B-Instruct-bf16"})
    redis_conn.hset(
        keys.worker_stats_key("mac-1"),
        mapping={
            "model": "Llama-3.2-1B-Instruct-4bit",
            "device": "Device(gpu, 0)",
            "queues": "llama-3.2-1b",
            "version": "0.1.0",
            "jobs_done": "12",
            "tokens_per_s": "84.5",
            "cache_lookups": "8",
            "cache_hits": "6",
            "cache_hit_tokens": "900",
            "cache_bytes": str(3 << 20),
            "cache_budget_bytes": str(1 << 30),
            "memory_bytes": str(1536 << 20),
            "peak_memory_bytes": str(2 << 30),
            "memory_cache_bytes": "0",
            "draft_tokens": "40",
            "accepted_tokens": "30",
        },
    )
    try:
        report = collect(redis_conn)
        assert main(["--redis-url", redis_url, "status", "--json"]) == 0
        as_json = json.loads(capsys.readouterr().out)
    finally:
        worker.register_death()
        other.register_death()
    w, w2 = report.workers
    assert w.host and w.pid and w.heartbeat_age_s is not None and w.heartbeat_age_s < 60
    h = w.health
    assert (h.model, h.jobs_done, h.tokens_per_s, h.cache_hit_rate) == (
        "Llama-3.2-1B-Instruct-4bit",
        12,
        84.5,
        0.75,
    )
    assert (h.memory_active_bytes, h.memory_peak_bytes, h.cache_bytes) == (1536 << 20, 2 << 30, 3 << 20)
    assert [(u.name, u.queued) for u in report.unserved] == [("qwen3-0.6b", 2)]

    text = render(report)
    assert "model: Llama-3.2-1B-Instruct-4bit  device: Device(gpu, 0)" in text
    assert "jobs_done: 12  tokens/s: 84.5" in text
    assert "hit rate 75% (6/8 lookups, 900 tokens reused)  bytes: 3.0 MiB of 1.0 GiB" in text
    assert "memory: active 1.5 GiB, peak 2.0 GiB" in text
    assert "speculation: acceptance 75% (30/40 drafted tokens kept)" in text
    assert text.count("speculation:") == 1  # mac-2 drafted nothing
    assert "warning: queue qwen3-0.6b has 2 jobs and no worker" in text
    assert "llama-3.2-1b has" not in text
    assert (
        "warning: queue llama-3.2-1b is served by different models: "
        "Llama-3.2-1B-Instruct-4bit (mac-1); Llama-3.2-1B-Instruct-bf16 (mac-2)"
    ) in text
    assert w2.health.model == "Llama-3.2-1B-Instruct-bf16" and w2.health.jobs_done is None
    assert "mac-2 state=" in text and "model: Llama-3.2-1B-Instruct-bf16  device: -" in text

    assert as_json["unserved"] == [{"name": "qwen3-0.6b", "queued": 2}]
    assert as_json["mixed"][0]["models"]["Llama-3.2-1B-Instruct-bf16"] == ["mac-2"]
    assert as_json["workers"][0]["health"]["cache_hit_rate"] == 0.75
    assert as_json["workers"][0]["health"]["acceptance"] == 0.75
    assert as_json["workers"][0]["stats"]["device"] == "Device(gpu, 0)"


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (None, 0, 1023, 1536, 5 << 20, 3 << 30)] == [
        "-",
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]


# --- a real worker ---------------------------------------------------------------------------------


@pytest.fixture
def worker(model_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    w = WorkerProcess(
        model_dir,
        redis_url,
        tmp_path / "worker.log",
        "--queue",
        "tiny",
        "--name",
        "health-1",
        MLXQ_WORKER_TTL_S="20",  # idle heartbeat every 5 s
        # Any free port; the worker announces it in its hash.
        **({"MLXQ_METRICS_PORT": "0"} if HAVE_PROMETHEUS else {}),
    )
    w.wait_ready()
    yield w
    w.stop()


def _two_jobs(
    client: Client, redis_conn: redis.Redis, no_eos: dict[int, float]
) -> tuple[dict[str, str], int]:
    """The same prompt twice (the second hits the prefix cache); the stats once both are counted."""
    jobs = [
        client.submit_generate(PROMPT, max_tokens=8, temperature=0, logit_bias=no_eos, queue="tiny")
        for _ in range(2)
    ]
    first, again = (job.result(timeout=30) for job in jobs)
    assert again.usage.cached_tokens > 0 and first.usage.cached_tokens == 0
    _eventually(lambda: _stats(redis_conn, "health-1").get("jobs_done") == "2", what="stats after job 2")
    return _stats(redis_conn, "health-1"), again.usage.cached_tokens


def test_worker_publishes_its_health_and_mlxq_status_shows_it(
    worker: WorkerProcess,
    client: Client,
    redis_url: str,
    redis_conn: redis.Redis,
    model_dir: Path,
    no_eos: dict[int, float],
    capsys: pytest.CaptureFixture[str],
) -> None:
    stats, cached_tokens = _two_jobs(client, redis_conn, no_eos)
    assert stats["model"] == model_dir.name and stats["model_path"] == str(model_dir)
    assert stats["queues"] == "tiny" and stats["device"].startswith("Device(")
    assert float(stats["tokens_per_s"]) > 0
    assert int(stats["cache_lookups"]) == 2 and int(stats["cache_hits"]) == 1
    assert int(stats["cache_hit_tokens"]) == cached_tokens and int(stats["cache_bytes"]) > 0
    assert {"memory_bytes", "peak_memory_bytes", "memory_cache_bytes", "version", "started_at"} <= set(stats)
    assert redis_conn.ttl(keys.worker_stats_key("health-1")) > 0  # it expires if the worker dies

    assert main(["--redis-url", redis_url, "status"]) == 0
    text = capsys.readouterr().out
    assert "health-1 state=idle queues=tiny" in text and f"model: {model_dir.name}" in text
    assert "jobs_done: 2" in text and "hit rate 50% (1/2 lookups" in text


@pytest.mark.skipif(not HAVE_PROMETHEUS, reason="needs the metrics extra: pip install '.[metrics]'")
def test_the_metrics_endpoint_serves_the_same_numbers(
    worker: WorkerProcess,
    client: Client,
    redis_conn: redis.Redis,
    model_dir: Path,
    no_eos: dict[int, float],
) -> None:
    stats, _ = _two_jobs(client, redis_conn, no_eos)
    metrics = _scrape(int(stats["metrics_port"]))
    labels = frozenset({("worker", "health-1"), ("model", model_dir.name)})
    assert metrics[("mlxq_worker_jobs_done_total", labels)] == 2
    assert metrics[("mlxq_worker_jobs_succeeded_total", labels)] == 2
    assert metrics[("mlxq_worker_busy", labels)] == 0
    assert metrics[("mlxq_prefix_cache_hits_total", labels)] == 1
    assert metrics[("mlxq_prefix_cache_lookups_total", labels)] == 2
    assert metrics[("mlxq_prefix_cache_bytes", labels)] == int(stats["cache_bytes"])
    assert metrics[("mlxq_worker_memory_peak_bytes", labels)] == int(stats["peak_memory_bytes"])
    assert metrics[("mlxq_worker_decode_tokens_per_second", labels)] == float(stats["tokens_per_s"])
    assert metrics[("mlxq_queue_jobs", labels | {("queue", "tiny")})] == 0
    info = {k: v for k, v in metrics.items() if k[0] == "mlxq_worker_info"}
    ((_, info_labels),) = info
    assert dict(info_labels)["device"] == stats["device"] and dict(info_labels)["queues"] == "tiny"


def test_stats_hash_lives_as_long_as_the_worker_busy_or_idle(
    worker: WorkerProcess, client: Client, redis_conn: redis.Redis, no_eos: dict[int, float]
) -> None:
    key = keys.worker_stats_key("health-1")
    _eventually(lambda: redis_conn.exists(key) == 1, what="stats at start")

    # Busy: the job watch's heartbeats extend the hash while a long job runs.
    job = client.submit_generate(PROMPT, max_tokens=1900, temperature=0, logit_bias=no_eos, queue="tiny")
    next(i for i in job.stream(timeout=30) if isinstance(i.event, TokenEvent))
    redis_conn.expire(key, 2)
    _eventually(lambda: redis_conn.pttl(key) > 2500, timeout=5, what="TTL extended by a heartbeat")
    assert job.status() == "started"  # so it was the running job's heartbeat, not the after-job publish
    job.cancel()
    assert job.result(timeout=30).finish_reason == "cancelled"

    # Idle: RQ's dequeue loop heartbeats (every ttl-15 s) and publishes a fresh snapshot.
    _eventually(lambda: _stats(redis_conn, "health-1").get("jobs_done") == "1", what="after-job publish")
    redis_conn.delete(key)
    _eventually(lambda: redis_conn.exists(key) == 1, timeout=15, what="idle refresh")
    assert _stats(redis_conn, "health-1")["jobs_done"] == "1"

    worker.signal()
    assert worker.wait() == 0
    assert redis_conn.exists(key) == 0  # a clean exit removes it at once
