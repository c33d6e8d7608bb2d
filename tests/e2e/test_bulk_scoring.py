"""Bulk scoring of datasets end to end: real Redis, a real worker process on a tiny random checkpoint."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from jsonl_files import read_jsonl, write_jsonl
from rq.registry import CanceledJobRegistry
from worker_process import ROOT, WorkerProcess

from mlxq.jobs import keys
from mlxq.jobs.schema import ScoredRow, ScoreRequest
from mlxq.producer import AsyncClient, Client
from mlxq.producer.bulk_files import BulkSummary

REDIS_DB = 15
BASE = "The capital of France is Paris. " * 3
QUEUE_KEY = keys.rq_queue_key("default")


@pytest.fixture
def start_worker(model_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[Callable[[], WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        started.append(WorkerProcess(model_dir, redis_url, tmp_path / "worker.log", "--queue", "default"))
        started[-1].wait_ready()
        return started[-1]

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def worker(start_worker: Callable[[], WorkerProcess]) -> WorkerProcess:
    return start_worker()


def rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """Rows whose prompts share a long prefix (and, in pairs, a longer one)."""
    return [
        {"custom_id": f"r{i}", "prompt": BASE + f"Question {i // 2}: which is", "candidates": [" the", " a"]}
        for i in range(start, start + n)
    ]


def ids(path: Path) -> list[str]:
    return [r["custom_id"] for r in read_jsonl(path)]


def strip_cache(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "cached_tokens"}  # depends on what was warm


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_few_hundred_rows_wait_under_backpressure_then_match_one_row_scores_in_order(
    model_dir: Path,
    start_worker: Callable[[], WorkerProcess],
    client: Client,
    redis_conn: redis.Redis,
    tmp_path: Path,
) -> None:
    from mlxq.worker.engine import Engine, EngineOptions

    data = rows(300)
    src, out = write_jsonl(tmp_path / "in.jsonl", data), tmp_path / "out.jsonl"
    done: dict[str, BulkSummary | BaseException] = {}

    def run() -> None:
        try:
            done["summary"] = client.score_dataset(src, out, rows_per_job=16, in_flight=6)
        except BaseException as e:
            done["summary"] = e

    thread = threading.Thread(target=run)
    thread.start()
    # No worker yet: exactly `in_flight` jobs are queued, no more.
    eventually(lambda: redis_conn.llen(QUEUE_KEY) == 6)
    time.sleep(0.3)
    assert redis_conn.llen(QUEUE_KEY) == 6
    start_worker()
    thread.join(60)
    summary = done["summary"]
    assert isinstance(summary, BulkSummary), summary
    assert (summary.rows, summary.succeeded, summary.failed, summary.jobs) == (300, 300, 0, 19)
    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == [r["custom_id"] for r in data]
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    reference: dict[str, ScoredRow] = {}  # rows come in pairs with the same prompt: score each once
    for row, g in zip(data, got, strict=True):
        if row["prompt"] not in reference:
            one = {"prompt": row["prompt"], "candidates": row["candidates"]}
            reference[row["prompt"]] = engine.score(ScoreRequest.model_validate({"rows": [one]})).rows[0]
        alone = reference[row["prompt"]]
        assert g["logits"] == pytest.approx(alone.logits, abs=1e-5)
        assert g["logprobs"] == pytest.approx(alone.logprobs, abs=1e-5)
        assert g["input_tokens"] == alone.input_tokens
    # The shared prefix is computed once per batch: almost every row reports it as cached.
    assert sum(g["cached_tokens"] > len(BASE) // 8 for g in got) >= 290
    assert summary.cached_tokens == sum(g["cached_tokens"] for g in got) and summary.cached_share > 0.5
    assert not redis_conn.keys("mlxq:result:*") and not redis_conn.keys("mlxq:stream:*")  # collected


def test_a_bad_row_fails_alone_and_malformed_lines_are_reported_with_line_numbers(
    model_dir: Path, worker: WorkerProcess, client: Client, tmp_path: Path
) -> None:
    from mlxq.worker.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    bad = {"custom_id": "bad", "prompt": BASE + "The capital is", "candidates": [" a", " Paris"]}
    assert len(tok.encode(bad["prompt"] + " Paris")) > len(tok.encode(bad["prompt"])) + 1  # not one token
    good = rows(29)
    lines: list[Any] = [
        good[0],
        '{"custom_id": "x", "prompt": ',  # line 2: not JSON
        {"prompt": "p", "candidates": [" a"]},  # 3: no custom_id
        bad,  # 4: fails in the worker
        "",  # 5: blank, ignored
        good[0],  # 6: duplicate custom_id
        {"custom_id": "no-cands", "prompt": "p"},  # 7
        [1, 2],  # 8
        *good[1:],
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    summary = client.score_dataset(src, out, rows_per_job=16)
    assert ids(out) == [r["custom_id"] for r in good]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["line"], e["custom_id"]) for e in errors] == [
        (2, None), (3, None), (4, "bad"), (6, "r0"), (7, "no-cands"), (8, None)
    ]  # fmt: skip
    reasons = [e["error"] for e in errors]
    assert reasons[0].startswith("not valid JSON") and reasons[1] == "missing custom_id"
    assert "InvalidCandidate: candidate ' Paris' does not add exactly one token" in reasons[2]
    assert "row 0" not in reasons[2]
    assert reasons[3] == "duplicate custom_id 'r0' (first on line 1)"
    assert (
        "a row asks exactly one of `candidates`" in reasons[4]
        and reasons[5] == "expected a JSON object, got list"
    )
    # The bad row's job (16 rows) failed and was sent again one row per job; the other job passed.
    assert (summary.succeeded, summary.failed, summary.jobs) == (29, 6, 2 + 16)


def test_the_cli_scores_every_row_kind_as_the_engine_does_and_max_tokens_fails_a_long_row(
    model_dir: Path, worker: WorkerProcess, redis_url: str, tmp_path: Path
) -> None:
    from mlxq.worker.engine import Engine

    kinds: list[dict[str, Any]] = [
        {"prompt": BASE + "Which is", "candidates": [" the", " a"]},
        {"prompt": BASE + "The capital of Italy is", "continuations": [" Rome", " Paris, of course"]},
        {"prompt": BASE * 3, "rolling": True, "window": 16},
        {"prompt": BASE, "prompt_logprobs": True, "top_logprobs": 2, "token_ids": [3, 4]},
    ]
    lines = [{"custom_id": f"k{i}", **row} for i, row in enumerate(kinds)]
    lines.append({"custom_id": "long", "prompt": BASE * 4, "continuations": [" x"]})
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "score-file", str(src)]
    proc = subprocess.run(
        [*cli, "-o", str(out), "--errors", str(tmp_path / "err.jsonl"), "--rows-per-job", "1",
         "--max-tokens", "60"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # the long row failed
    engine = Engine.load(str(model_dir))
    want = engine.score(ScoreRequest.model_validate({"rows": kinds, "max_tokens": 60})).rows
    got = read_jsonl(out)
    assert [r["custom_id"] for r in got] == [f"k{i}" for i in range(len(kinds))]
    assert set(got[0]) == {"custom_id", "logits", "logprobs", "input_tokens", "cached_tokens"}  # as ever
    for record, row in zip(got, want, strict=True):
        expected = row.model_dump(mode="json")
        record = {k: v for k, v in record.items() if k != "custom_id"}
        assert set(record) == set(expected)
        assert json.dumps(strip_cache(record)) == json.dumps(strip_cache(expected)) or _close(
            record, expected
        )
    (error,) = read_jsonl(tmp_path / "err.jsonl")
    n = len(engine.tokenizer.encode(BASE * 4 + " x")) - 1
    assert (
        error["custom_id"] == "long"
        and f"{n} tokens through the model, more than max_tokens=60" in error["error"]
    )


def _close(a: Any, b: Any) -> bool:
    """Equal up to float rounding (1e-4), key by key."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(k == "cached_tokens" or _close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-4
    return bool(a == b)


def test_an_interrupted_run_leaves_a_clean_prefix_and_a_rerun_completes_it_in_order(
    worker: WorkerProcess, client: Client, redis_conn: redis.Redis, tmp_path: Path
) -> None:
    data = rows(200)
    src, out = write_jsonl(tmp_path / "in.jsonl", data), tmp_path / "out.jsonl"
    all_ids = [r["custom_id"] for r in data]
    stop = threading.Event()

    def presses_ctrl_c_at_row_120() -> Iterator[dict[str, Any]]:
        for i, row in enumerate(data):
            if i == 120:
                stop.set()
            yield row

    first = client.score_dataset(presses_ctrl_c_at_row_120(), out, rows_per_job=8, in_flight=4, stop=stop)
    # Rows read before the press may all be scored by the time the run stops (a fast worker): <= 120.
    assert first.interrupted and 0 < first.succeeded <= 120 and first.unfinished > 0
    assert ids(out) == all_ids[: first.succeeded]  # a clean prefix, nothing else
    assert redis_conn.llen(QUEUE_KEY) == 0  # the outstanding jobs were cancelled
    prefix = out.read_bytes()
    out.write_bytes(prefix + b'{"custom_id": "r1')  # and a crash in the middle of a line
    second = client.score_dataset(src, out, rows_per_job=8, in_flight=4)
    assert not second.interrupted
    assert (second.skipped, second.succeeded) == (first.succeeded, 200 - first.succeeded)
    assert ids(out) == all_ids and out.read_bytes().startswith(prefix)

    # A row that failed before: kept out with retry_errors off, scored and put in its place by default.
    full = read_jsonl(out)
    write_jsonl(out, full[:5] + full[6:])
    errors = write_jsonl(tmp_path / "out.errors.jsonl", [{"custom_id": "r5", "line": 6, "error": "boom"}])
    kept = client.score_dataset(src, out, retry_errors=False)
    assert (kept.skipped, kept.succeeded, kept.jobs) == (200, 0, 0) and "r5" not in ids(out)
    retried = client.score_dataset(src, out)
    assert (retried.skipped, retried.succeeded, retried.jobs) == (199, 1, 1)
    # r5 alone now, in a batch before: equal up to float rounding (a batch's rows read their shared
    # prefix in place, their sums go in another order than a lone row's)
    assert _close([strip_cache(r) for r in read_jsonl(out)], [strip_cache(r) for r in full])
    assert not errors.exists()


def test_the_cli_scores_a_file_with_progress_and_a_summary(
    worker: WorkerProcess, redis_url: str, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [*rows(40), "not json"])
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "score-file", str(src)]
    proc = subprocess.run(
        [*cli, "-o", str(out), "--errors", str(tmp_path / "err.jsonl"), "--rows-per-job", "8", "--progress"],
        capture_output=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    stderr = proc.stderr.decode()  # bytes: text mode would turn the progress line's \r into \n
    assert proc.returncode == 1, stderr  # one line failed
    assert "\r41/41 rows" in stderr and "rows/s" in stderr
    assert "rows 41: 40 succeeded, 1 failed, 0 skipped" in stderr and "jobs 5 in" in stderr
    assert ids(out) == [f"r{i}" for i in range(40)]
    assert read_jsonl(tmp_path / "err.jsonl")[0]["line"] == 41
    again = subprocess.run(
        [*cli, "-o", str(out), "--errors", str(tmp_path / "err.jsonl"), "--rows-per-job", "0"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert again.returncode == 2 and "rows_per_job must be 1..64" in again.stderr


def test_ctrl_c_in_the_cli_cancels_outstanding_jobs_keeps_the_output_and_exits_130(
    redis_url: str, redis_conn: redis.Redis, tmp_path: Path
) -> None:
    src, out = write_jsonl(tmp_path / "in.jsonl", rows(50)), tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "score-file", str(src),
         "-o", str(out), "--in-flight", "3", "--rows-per-job", "4"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        eventually(lambda: redis_conn.llen(QUEUE_KEY) == 3)  # no worker: three jobs wait
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "interrupted: 50 rows unfinished" in stderr, stderr
    assert redis_conn.llen(QUEUE_KEY) == 0
    assert CanceledJobRegistry("default", connection=redis_conn).count == 3
    assert out.exists() and out.read_text() == ""


def test_async_client_cancelling_the_task_cancels_its_jobs_and_a_rerun_completes(
    start_worker: Callable[[], WorkerProcess], redis_url: str, redis_conn: redis.Redis, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"

    async def cancelled_then_complete() -> BulkSummary:
        async with AsyncClient(redis_url) as client:
            task = asyncio.ensure_future(client.score_dataset(rows(30), out, rows_per_job=5, in_flight=2))
            while redis_conn.llen(QUEUE_KEY) < 2:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert redis_conn.llen(QUEUE_KEY) == 0
            start_worker()
            return await client.score_dataset(rows(30), out, rows_per_job=5)

    summary = asyncio.run(cancelled_then_complete())
    assert (summary.succeeded, summary.skipped, summary.jobs) == (30, 0, 6)
    assert ids(out) == [f"r{i}" for i in range(30)]


def test_a_job_that_ends_without_an_event_is_seen_through_rq_and_its_rows_go_again_one_per_job(
    client: Client, redis_conn: redis.Redis, tmp_path: Path
) -> None:
    stop = threading.Event()
    done: dict[str, BulkSummary] = {}
    args = (rows(4), tmp_path / "out.jsonl")
    thread = threading.Thread(
        target=lambda: done.update(s=client.score_dataset(*args, rows_per_job=4, in_flight=1, stop=stop))
    )
    thread.start()
    try:
        eventually(lambda: redis_conn.llen(QUEUE_KEY) == 1)  # no worker
        (first,) = redis_conn.lrange(QUEUE_KEY, 0, -1)
        assert client.job(first.decode()).cancel().value == "canceled"  # by someone else: no stream event
        eventually(lambda: redis_conn.llen(QUEUE_KEY) == 1)  # RQ's status is asked every 2 s
        (again,) = redis_conn.lrange(QUEUE_KEY, 0, -1)
        assert again != first
        resent = json.loads(zlib.decompress(redis_conn.hget(keys.rq_job_key(again.decode()), "data") or b""))
        assert resent[2][0]["rows"] == [{"prompt": rows(1)[0]["prompt"], "candidates": [" the", " a"]}]
    finally:
        stop.set()
        thread.join(10)
    assert done["s"].interrupted and done["s"].jobs == 2
