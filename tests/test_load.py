"""Load: two workers, thousands of mixed jobs. Each finishes exactly once, every stream is complete and
ordered, worker memory stays flat after warm-up, and the prefix cache stays within its byte budget.

`MLXQ_LOAD_JOBS` sets the job count (default 10,000).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from jobs import keys
from producer import Client
from worker.tiny_model import write_random_checkpoint

REDIS_DB = 2
JOBS = int(os.environ.get("MLXQ_LOAD_JOBS", "10000"))
CACHE_BUDGET = 256 << 10  # small, so it is full (and evicting) early in the run
PREFIXES = ["The capital of France is Paris. " * 3, "Queues hold jobs; workers take them. " * 3, "東京 🙂 "]

pytestmark = pytest.mark.slow


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _submit(client: Client, rng: random.Random, i: int) -> tuple[str, str]:
    prefix = rng.choice(PREFIXES)
    if rng.random() < 0.7:
        job = client.submit_generate(
            f"{prefix}{i}",
            max_tokens=rng.randint(1, 4),
            temperature=rng.choice([0, 1]),
            seed=i,
            stop=rng.choice([[], ["e"]]),
        )
        return job.id, "generate"
    rows = [{"prompt": f"{prefix}{i} {j}", "candidates": [" the", " a"]} for j in range(rng.randint(1, 3))]
    return client.submit_score(rows).id, "score"


def _check_stream(conn: redis.Redis, job_id: str, kind: str) -> None:
    entries = [
        {k.decode(): v.decode() for k, v in f.items()} for _, f in conn.xrange(keys.stream_key(job_id))
    ]
    events = [e["event"] for e in entries]
    assert events[-1] == "done" and events.count("done") == 1 and "restart" not in events, (job_id, events)
    result = json.loads(conn.get(keys.result_key(job_id)))
    if kind == "generate":
        tokens = [e for e in entries if e["event"] == "token"]
        assert "".join(t["text"] for t in tokens) == result["text"]
        index = 0
        for t in tokens:  # contiguous and in order: nothing missing, nothing twice
            assert int(t["index"]) == index
            index += len(json.loads(t["ids"]))
        assert index == len(result["token_ids"])


def _slope_per_job(samples: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (bytes) against jobs done, over the second half of the samples.

    The first half is warm-up: bounded caches fill there, as every job brings a new word (its number).
    The tokenizers library's BPE word cache (10,000 words; ~2.5 MiB in a process of its own) fills
    between ~2,500 and ~5,000 jobs, where the workers' RSS steps up ~6 MiB and then stays flat.
    `Tokenizer.encode_short` kept 8,192 texts until it kept 1,024: it filled until ~25,000 jobs, and
    a slope from the first quarter on read that as a leak (1,040 B a job, once, in CI).
    """
    tail = samples[len(samples) // 2 :]
    n = len(tail)
    mx = sum(x for x, _ in tail) / n
    my = sum(y for _, y in tail) / n
    den = sum((x - mx) ** 2 for x, _ in tail) or 1.0
    return sum((x - mx) * (y - my) for x, y in tail) / den


def test_two_workers_ten_thousand_mixed_jobs(
    tmp_path: Path,
    redis_url: str,
    redis_conn: redis.Redis,
    spawn_worker: Any,
    reliability_report: dict[str, Any],
) -> None:
    model = write_random_checkpoint(tmp_path / "tiny", {"max_position_embeddings": 256})
    env = {
        "MLXQ_PREFIX_CACHE_BYTES": str(CACHE_BUDGET),
        "MLXQ_LOG_LEVEL": "WARNING",
        "MLXQ_MLX_CACHE_LIMIT_BYTES": str(16 << 20),
    }
    workers = [spawn_worker(model, redis_url, name=f"load{i}", **env) for i in range(2)]
    for w in workers:
        w.wait_ready()
    rng = random.Random(1234)
    t0 = time.monotonic()
    with Client(redis_url) as client:
        jobs = [_submit(client, rng, i) for i in range(JOBS)]
    samples: list[list[tuple[int, int]]] = [[], []]
    finished_key = "rq:finished:default"
    while True:
        done = redis_conn.zcard(finished_key)
        for w, s in zip(workers, samples, strict=True):
            s.append((done, _rss(w.proc.pid)))
        if done >= JOBS:
            break
        assert time.monotonic() - t0 < 1800, f"only {done}/{JOBS} jobs finished"
        assert all(w.proc.poll() is None for w in workers), "a worker died"
        time.sleep(0.5)
    wall = time.monotonic() - t0
    for job_id, kind in jobs:
        assert redis_conn.hget(keys.rq_job_key(job_id), "status") == b"finished"
        _check_stream(redis_conn, job_id, kind)
    assert redis_conn.zcard("rq:failed:default") == 0
    stats = [
        redis_conn.hgetall(keys.worker_stats_key(n.decode().removeprefix("rq:worker:")))
        for n in redis_conn.smembers("rq:workers")
    ]
    cache_bytes = [int(s.get(b"cache_bytes", b"0")) for s in stats]
    assert all(b <= CACHE_BUDGET for b in cache_bytes), cache_bytes
    slopes = [_slope_per_job(s) for s in samples]
    rss_mb = [s[-1][1] / 2**20 for s in samples]
    # Flat: under 1 KiB per job after warm-up (a leak of one token's logits per job would be ~1.5 KiB).
    assert all(slope < 1024 for slope in slopes), slopes
    reliability_report["load"] = {
        "jobs": JOBS,
        "workers": 2,
        "wall_s": round(wall, 1),
        "jobs_per_s": round(JOBS / wall, 1),
        "rss_mb_end": [round(r, 1) for r in rss_mb],
        "rss_slope_bytes_per_job": [round(s, 1) for s in slopes],
        "prefix_cache_bytes": cache_bytes,
        "prefix_cache_budget": CACHE_BUDGET,
    }
