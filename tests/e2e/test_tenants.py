"""Producers of different tenants share one Redis and one fleet of workers without reaching each other's
jobs: the tenant users `mlxq tenant-acl` prints (`producer/tenant.py`), loaded beside the shipped
`deploy/redis/users.acl` into a private redis-server, do everything a producer does with no refusal,
and every cross-tenant action (forging a result or a stream, rewriting, deleting, cancelling or jumping
another tenant's queued job, reading its results) is refused with NOPERM. The one cross-tenant write
the ACL cannot refuse, pushing another tenant's job id onto one's own queue, the worker refuses: it
runs a job only from its own queue, and leaves the job's records alone.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis_server import free_port
from worker_process import WorkerProcess

from mlxq.jobs import keys
from mlxq.jobs.schema import DoneEvent, RestartEvent, TokenEvent
from mlxq.producer import AsyncClient, Client, ProducerSettings
from mlxq.producer.job_state import CancelOutcome

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "redis"
PROMPT = "The capital of France is Paris. " * 4
PASSWORDS = {"admin": "CHANGE-ME-admin", "worker": "CHANGE-ME-worker", "acme": "pw-acme", "beta": "pw-beta"}

pytestmark = pytest.mark.slow


def _url(user: str, port: int) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{port}/0"


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    """A private redis-server with deploy/redis's config and ACL file, and the users of tenants
    `acme` and `beta` added as the operator would (`mlxq tenant-acl <name>` lines)."""
    port = free_port()
    acl = tmp_path / "users.acl"
    lines = [(DEPLOY / "users.acl").read_text().rstrip("\n")]
    for tenant in ("acme", "beta"):
        argv = [sys.executable, "-m", "mlxq.producer.cli", "tenant-acl", tenant]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        lines.append(out.stdout.strip().replace(">CHANGE-ME ", f">{PASSWORDS[tenant]} ", 1))
    acl.write_text("\n".join(lines) + "\n")
    argv = [
        "redis-server",
        str(DEPLOY / "redis.conf"),
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)),
        *("--aclfile", str(acl), "--appendonly", "no", "--daemonize", "no"),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    admin = redis.Redis.from_url(_url("admin", port))
    try:
        for _ in range(200):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield port
    finally:
        admin.close()
        proc.terminate()
        proc.wait(10)


def _eventually(check: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        time.sleep(0.05)


def _start_worker(model_dir: Path, port: int, tmp_path: Path, name: str, *queues: str) -> WorkerProcess:
    args = ["--name", name, *(a for q in queues for a in ("--queue", q))]
    worker = WorkerProcess(model_dir, _url("worker", port), tmp_path / f"{name}.log", *args)
    admin = redis.Redis.from_url(_url("admin", port))
    _eventually(lambda: admin.exists(f"rq:worker:{name}") == 1, what=f"worker {name} registered")
    return worker


def _events(conn: redis.Redis, job_id: str) -> list[str]:
    return [f[b"event"].decode() for _, f in conn.xrange(keys.stream_key(job_id))]


def test_tenants_share_workers_and_cannot_reach_each_others_jobs(
    port: int, model_dir: Path, no_eos: dict[int, float], tmp_path: Path
) -> None:
    admin = redis.Redis.from_url(_url("admin", port))
    acme = Client(_url("acme", port), settings=ProducerSettings(tenant="acme"))
    beta = Client(_url("beta", port), settings=ProducerSettings(tenant="beta"))
    workers: list[WorkerProcess] = []
    try:
        # Before any worker: a job left waiting in acme's queue `later`, and one cancelled there.
        waiting = acme.submit_generate(PROMPT, max_tokens=3, logit_bias=no_eos, queue="later")
        assert waiting.id.startswith("acme_")
        assert admin.lrange("rq:queue:acme_later", 0, -1) == [waiting.id.encode()]
        assert acme.submit_generate("never", queue="later").cancel() == CancelOutcome.CANCELED

        workers.append(_start_worker(model_dir, port, tmp_path, "shared", "acme_default", "beta_default"))

        # Everything a producer does, under its tenant's user: streams, scores, bulk, cancels, async.
        text = "".join(acme.submit_generate(PROMPT, max_tokens=5, logit_bias=no_eos).text_deltas(timeout=60))
        assert text
        scored = acme.submit_score([{"prompt": PROMPT, "candidates": [" the", " a"]}])
        assert len(scored.result(timeout=60).rows[0].logits) == 2
        rows = [{"custom_id": f"r{i}", "prompt": PROMPT, "candidates": [" the", " a"]} for i in range(3)]
        summary = acme.score_dataset(rows, tmp_path / "out.jsonl", rows_per_job=2)
        assert (summary.succeeded, summary.failed) == (3, 0)
        running = acme.submit_generate(PROMPT, max_tokens=1900, logit_bias=no_eos)
        next(i for i in running.stream(timeout=60) if isinstance(i.event, TokenEvent))
        assert running.cancel() == CancelOutcome.REQUESTED
        assert running.result(timeout=60).finish_reason == "cancelled"
        done = beta.submit_generate(PROMPT, max_tokens=4, logit_bias=no_eos)
        assert done.result(timeout=60).usage.completion_tokens == 4

        async def async_flow() -> int:
            async with AsyncClient(_url("beta", port), settings=ProducerSettings(tenant="beta")) as client:
                job = await client.submit_generate(PROMPT, max_tokens=2, logit_bias=no_eos)
                return (await job.result(timeout=60)).usage.completion_tokens

        assert asyncio.run(async_flow()) == 2
        denied = admin.acl_log()
        assert denied == [], json.dumps(denied, default=str, indent=1)

        # Every reach into the other tenant's jobs is refused, and forging one's own result too.
        conn = beta.connection
        victim = waiting.id
        for attempt in (
            lambda: conn.set(keys.result_key(victim), '{"text": "forged"}'),
            lambda: conn.set(keys.result_key("beta_mine"), '{"text": "forged"}'),
            lambda: conn.xadd(keys.stream_key("beta_mine"), {"event": "{}"}),
            lambda: conn.hset(keys.rq_job_key(victim), "data", "[]"),
            lambda: conn.hset(keys.rq_job_key(victim), "status", "finished"),
            lambda: conn.lrem("rq:queue:acme_later", 1, victim),
            lambda: conn.delete("rq:queue:acme_later"),
            lambda: conn.lpush("rq:queue:acme_later", "beta_jump"),
            lambda: conn.set(keys.cancel_key(victim), "1"),
            lambda: beta.job(victim).cancel(),
            lambda: conn.get(keys.result_key(scored.id)),
            lambda: conn.xrevrange(keys.stream_key(victim)),
            lambda: conn.hget(keys.rq_job_key(victim), "status"),
            lambda: conn.sadd(keys.rq_job_key("beta_mine") + ":dependents", victim),
            lambda: conn.delete(keys.rq_job_key(done.id)),
            lambda: conn.hset(keys.worker_stats_key("shared"), "model", "forged"),
            lambda: conn.keys("*"),
            lambda: conn.flushdb(),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()

        # The one write the ACL allows: another tenant's job ids pushed onto one's own queue. The worker
        # drops them from there and records why; the finished job stays finished with one `done`, the
        # waiting one waits in its own queue, untouched, and runs once when its queue is served.
        finished = acme.submit_generate(PROMPT, max_tokens=2, logit_bias=no_eos)
        finished.result(timeout=60)
        conn.rpush("rq:queue:beta_default", finished.id, victim)
        _eventually(lambda: admin.xlen("mlxq:dead:beta_default") == 2, what="both pushed ids dropped")
        reasons = [f[b"reason"].decode() for _, f in admin.xrange("mlxq:dead:beta_default")]
        assert all("belongs to queue 'acme_" in r for r in reasons), reasons
        assert admin.hget(keys.rq_job_key(finished.id), "status") == b"finished"
        assert _events(admin, finished.id).count("done") == 1
        assert admin.hget(keys.rq_job_key(victim), "status") == b"queued"
        assert admin.lrange("rq:queue:acme_later", 0, -1) == [victim.encode()]
        assert not admin.exists(keys.stream_key(victim))

        workers.append(_start_worker(model_dir, port, tmp_path, "later", "acme_later"))
        assert waiting.result(timeout=60).usage.completion_tokens == 3
        events = [i.event for i in waiting.stream(timeout=10)]
        assert sum(isinstance(e, DoneEvent) for e in events) == 1
        assert not any(isinstance(e, RestartEvent) for e in events)
    finally:
        for w in workers:
            w.stop()
        acme.close()
        beta.close()
        admin.close()


@pytest.mark.parametrize("order", ["priority", "round_robin"])
def test_queue_order_round_robin_serves_tenants_in_turn(
    order: str, redis_url: str, model_dir: Path, no_eos: dict[int, float]
) -> None:
    """`MLXQ_QUEUE_ORDER=round_robin`: a worker serving two tenants' queues takes from each in turn
    (RQ's own round-robin dequeue); by default the first queue is served while it has jobs."""
    from mlxq.worker.engine import Engine
    from mlxq.worker.service import WorkerService
    from mlxq.worker.settings import WorkerSettings

    submitted: dict[str, list[str]] = {}
    for tenant in ("acme", "beta"):
        with Client(redis_url, settings=ProducerSettings(tenant=tenant)) as client:
            jobs = [client.submit_generate("hi", max_tokens=1, logit_bias=no_eos) for _ in range(3)]
            submitted[tenant] = [job.id for job in jobs]
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir),
        redis_url=redis_url,
        queues=["acme_default", "beta_default"],
        queue_order=order,
        max_batch_sequences=1,  # one job per dequeue, so the dequeue order is the run order
        _env_file=None,
    )
    service = WorkerService.start(settings, engine=Engine.load(str(model_dir)))
    assert service.work(burst=True) == 0
    conn = redis.Redis.from_url(redis_url)
    ids = submitted["acme"] + submitted["beta"]
    started = {i: conn.hget(keys.rq_job_key(i), "started_at") for i in ids}
    tenants = [i.split("_")[0] for i in sorted(ids, key=lambda i: started[i] or b"")]
    expected = ["acme", "beta"] * 3 if order == "round_robin" else ["acme"] * 3 + ["beta"] * 3
    assert tenants == expected
