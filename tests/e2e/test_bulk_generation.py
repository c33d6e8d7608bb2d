"""Bulk generation of datasets end to end: real Redis, a real worker process on a tiny random checkpoint.

The run loop, files, order and resuming are the ones bulk scoring uses (`test_bulk_scoring.py` covers
them at length); these tests cover what generation adds: one job per row, per-row options over the
run's defaults, results equal to the same request run alone, and the CLI's `generate-file`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from jsonl_files import read_jsonl, write_jsonl
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_process import ROOT, WorkerProcess

from mlxq.jobs import keys
from mlxq.jobs.schema import GenerateRequest
from mlxq.producer import AsyncClient, Client
from mlxq.worker.engine.generation_batch import generate

REDIS_DB = 15  # the bulk tests' DB (the modules run one after the other; each flushes it)


def test_rows_come_back_in_order_with_what_each_request_gives_alone(
    model_dir: Path,
    worker: WorkerProcess,
    client: Client,
    redis_conn: redis.Redis,
    no_eos: dict[int, float],
    tmp_path: Path,
) -> None:
    from mlxq.worker.engine import Engine, EngineOptions

    rows: list[dict[str, Any]] = [
        {"custom_id": f"p{i}", "prompt": f"Question {i}: the capital of France is"} for i in range(12)
    ]
    rows[3]["max_tokens"] = 2  # a row's own option wins over the run's default
    rows[5] = {"custom_id": "chat", "messages": [{"role": "user", "content": "Name a city."}], "note": "x"}
    rows[7]["stop"] = ["zzz"]
    too_long = {"custom_id": "long", "prompt": "word " * 5000}  # past the 4,096-token context
    lines: list[Any] = [
        *rows[:4],
        {"custom_id": "neither", "max_tokens": 3},  # line 5: no prompt, no messages
        too_long,  # 6: fails in the worker
        {"custom_id": "bad-opt", "prompt": "x", "max_tokens": 0},  # 7
        *rows[4:],
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    defaults = {"max_tokens": 5, "temperature": 0.0, "logit_bias": no_eos}
    summary = client.generate_dataset(src, out, in_flight=6, **defaults)

    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == [r["custom_id"] for r in rows]
    engine = Engine.load(str(model_dir), EngineOptions(prefix_cache_bytes=0))
    for row, g in zip(rows, got, strict=True):
        own = {k: v for k, v in row.items() if k not in ("custom_id", "note")}
        request = GenerateRequest.model_validate({**defaults, **own})
        alone = generate(engine, request, lambda _text, _ids: None)
        assert (g["text"], g["token_ids"], g["finish_reason"]) == (alone.text, alone.token_ids, "length")
        assert g["usage"]["prompt_tokens"] == alone.usage.prompt_tokens
        assert len(g["token_ids"]) == row.get("max_tokens", 5)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["line"], e["custom_id"]) for e in errors] == [(5, "neither"), (6, "long"), (7, "bad-opt")]
    assert "exactly one of `prompt` or `messages`" in errors[0]["error"]
    assert "ContextTooLong" in errors[1]["error"] and "4096" in errors[1]["error"]
    assert "max_tokens" in errors[2]["error"]
    assert (summary.succeeded, summary.failed, summary.jobs) == (12, 3, 13)
    assert summary.generated_tokens == sum(len(g["token_ids"]) for g in got) == 11 * 5 + 2
    assert summary.input_tokens == sum(g["usage"]["prompt_tokens"] for g in got)
    assert not redis_conn.keys("mlxq:result:*") and not redis_conn.keys("mlxq:stream:*")  # collected


def test_the_cli_generates_a_file_and_a_rerun_skips_what_is_done(
    worker: WorkerProcess, redis_url: str, tmp_path: Path
) -> None:
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": f"Item {i} is"} for i in range(9)]
    )
    out = tmp_path / "out.jsonl"
    cli = [
        sys.executable,
        "-m",
        "mlxq.producer.cli",
        "--redis-url",
        redis_url,
        "generate-file",
        str(src),
        "-o",
        str(out),
    ]
    proc = subprocess.run(
        [*cli, "--max-tokens", "3", "--temperature", "0", "--in-flight", "4", "--progress"],
        capture_output=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert (
        "\r9/9 rows" in stderr
        and "tokens/s" in stderr
        and "rows 9: 9 succeeded, 0 failed, 0 skipped" in stderr
    )
    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == [f"r{i}" for i in range(9)]
    generated = sum(g["usage"]["completion_tokens"] for g in got)
    assert 9 <= generated <= 27 and f"{generated} generated" in stderr  # EOS may end a row early
    again = subprocess.run(
        [*cli, "--max-tokens", "3"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert again.returncode == 0 and "0 succeeded, 0 failed, 9 skipped" in again.stderr, again.stderr
    assert read_jsonl(out) == got
    bad = subprocess.run(
        [*cli, "--max-tokens", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert bad.returncode == 2 and "max_tokens" in bad.stderr, bad.stderr


def test_the_async_client_generates_a_dataset_of_mappings(
    worker: WorkerProcess, redis_url: str, tmp_path: Path
) -> None:
    rows = [{"custom_id": f"a{i}", "prompt": f"Row {i}", "max_tokens": 2} for i in range(4)]

    async def run() -> Any:
        async with AsyncClient(redis_url) as client:
            return await client.generate_dataset(rows, tmp_path / "out.jsonl", temperature=0.0)

    summary = asyncio.run(run())
    assert (summary.rows, summary.succeeded, summary.failed) == (4, 4, 0)
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["a0", "a1", "a2", "a3"]
    with Client(redis_url) as client, pytest.raises(ValueError, match="options for every row: prompt"):
        client.generate_dataset(rows, tmp_path / "other.jsonl", prompt="x")


def test_a_row_whose_job_someone_cancels_fails_and_a_rerun_does_it(
    worker: WorkerProcess,
    client: Client,
    redis_conn: redis.Redis,
    no_eos: dict[int, float],
    tmp_path: Path,
) -> None:
    rows = [
        {"custom_id": "short", "prompt": "One", "max_tokens": 3},
        {"custom_id": "long", "prompt": "Two", "max_tokens": 3000},
        {"custom_id": "after", "prompt": "Three", "max_tokens": 3},
    ]
    out = tmp_path / "out.jsonl"
    done: dict[str, Any] = {}
    run = threading.Thread(
        target=lambda: done.update(
            summary=client.generate_dataset(rows, out, logit_bias=no_eos, temperature=0.0)
        )
    )
    run.start()

    def long_job_streaming() -> str | None:
        for job_id in Queue("default", connection=redis_conn).started_job_registry.get_job_ids():
            job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
            if job.args[0].get("max_tokens") == 3000 and redis_conn.xlen(keys.stream_key(job_id)):
                return job_id
        return None

    deadline = time.monotonic() + 30
    while (job_id := long_job_streaming()) is None:
        assert time.monotonic() < deadline, "the long row's job never started streaming"
        time.sleep(0.02)
    client.job(job_id).cancel()  # someone else cancels it: the row is not done
    run.join(60)
    summary = done["summary"]
    assert (summary.succeeded, summary.failed) == (2, 1)
    (error,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "long" and error["error"].startswith("the job was cancelled after ")
    rows[1]["max_tokens"] = 4
    again = client.generate_dataset(rows, out, logit_bias=no_eos, temperature=0.0)
    assert (again.skipped, again.succeeded, again.failed) == (2, 1, 0)
    assert [r["custom_id"] for r in read_jsonl(out)] == ["short", "long", "after"]  # back in input order


def test_a_long_row_does_not_hold_back_the_short_ones_behind_it(
    worker: WorkerProcess,
    client: Client,
    redis_conn: redis.Redis,
    no_eos: dict[int, float],
    tmp_path: Path,
) -> None:
    """Lines are written in input order, so finished rows wait in memory behind a long one; a run holds
    16 rounds of in-flight jobs of them (scoring: 2) before it stops reading."""
    rows = [{"custom_id": "long", "prompt": "Long", "max_tokens": 4000}]
    rows += [{"custom_id": f"s{i}", "prompt": f"Short {i}", "max_tokens": 1} for i in range(40)]
    out = tmp_path / "out.jsonl"
    done: dict[str, Any] = {}
    run = threading.Thread(
        target=lambda: done.update(
            summary=client.generate_dataset(rows, out, in_flight=6, logit_bias=no_eos, temperature=0.0)
        )
    )
    run.start()
    finished = Queue("default", connection=redis_conn).finished_job_registry
    deadline = time.monotonic() + 30
    while finished.count < 40:  # every short row (with 2 rounds: 12), the long one still generating
        assert time.monotonic() < deadline, f"{finished.count} short rows done behind the long one"
        assert run.is_alive()
        time.sleep(0.02)
    assert not out.read_text()  # nothing written yet: the long row comes first
    running = Queue("default", connection=redis_conn).started_job_registry.get_job_ids()
    assert len(running) == 1
    client.job(running[0]).cancel()
    run.join(60)
    assert (done["summary"].succeeded, done["summary"].failed) == (40, 1)
    assert [r["custom_id"] for r in read_jsonl(out)] == [f"s{i}" for i in range(40)]


def test_openai_batch_lines_are_read_from_their_body(
    worker: WorkerProcess, client: Client, no_eos: dict[int, float], tmp_path: Path
) -> None:
    chat = [{"role": "user", "content": "Name a city."}]
    lines = [
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": chat, "max_completion_tokens": 3},
        },
        {
            "custom_id": "text",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Paris is", "max_tokens": 2},
        },
        {"custom_id": "emb", "url": "/v1/embeddings", "body": {"model": "m", "input": "Paris"}},
        {"custom_id": "n2", "url": "/v1/chat/completions", "body": {"messages": chat, "n": 2}},
    ]
    out, plain_out = tmp_path / "out.jsonl", tmp_path / "plain.jsonl"
    summary = client.generate_dataset(lines, out, temperature=0.0, logit_bias=no_eos)
    plain = [
        {"custom_id": "chat", "messages": chat, "max_tokens": 3},
        {"custom_id": "text", "prompt": "Paris is", "max_tokens": 2},
    ]
    client.generate_dataset(plain, plain_out, temperature=0.0, logit_bias=no_eos)
    got, want = read_jsonl(out), read_jsonl(plain_out)
    assert [(g["custom_id"], g["token_ids"]) for g in got] == [(w["custom_id"], w["token_ids"]) for w in want]
    assert [len(g["token_ids"]) for g in got] == [3, 2]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert errors[0] == {
        "custom_id": "emb",
        "line": 3,
        "error": "url '/v1/embeddings' is not one mlxq serves (/v1/chat/completions or /v1/completions)",
    }
    assert errors[1]["custom_id"] == "n2" and "n: Extra inputs are not permitted" in errors[1]["error"]
    assert (summary.succeeded, summary.failed) == (2, 2)
