"""The `mlxq` CLI, run in-process with `main([...])` (and once as a subprocess), against real Redis.

A thread plays the worker: it takes the job off the queue and writes its stream and result."""

from __future__ import annotations

import _thread
import json
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import WorkerSide, generate_result
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs import keys
from mlxq.jobs.schema import ScoreRow
from mlxq.producer import Client, ProducerSettings
from mlxq.producer.bulk_kinds import ScoreKind
from mlxq.producer.cli import NEEDS_MLX, main

REDIS_DB = 14


@pytest.fixture
def serve_one(redis_conn: redis.Redis, worker_side: WorkerSide) -> Iterator[Callable[..., None]]:
    """Start a thread that takes the next job of `default` and runs `play(job_id)` for it."""
    threads: list[threading.Thread] = []

    def start(play: Callable[[str], object]) -> None:
        def run() -> None:
            popped = redis_conn.blpop([keys.rq_queue_key("default")], timeout=3)
            assert popped is not None
            job_id = popped[1].decode()
            worker_side.start(job_id)
            play(job_id)

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()

    yield start
    for t in threads:
        t.join(timeout=4)


def only_job(conn: redis.Redis) -> Job:
    (key,) = conn.keys("rq:job:*")
    return Job.fetch(key.decode().split(":")[-1], connection=conn, serializer=JSONSerializer)


def test_generate_streams_the_text_then_prints_stats(
    redis_url: str, redis_conn: redis.Redis, worker_side: WorkerSide, serve_one: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    def play(job_id: str) -> None:
        worker_side.tokens(job_id, "Hel", "lo")
        result = generate_result("Hello")
        drafted = result.usage.model_copy(update={"draft_tokens": 4, "accepted_tokens": 1})
        worker_side.done(job_id, result.model_copy(update={"usage": drafted}))

    serve_one(play)
    argv = [
        "--redis-url",
        redis_url,
        "generate",
        "Hi",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--stop",
        "\n",
        "--max-draft-tokens",
        "2",
        "--logprobs",
        "3",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    for part in ("finish=stop", "prompt_tokens=7", "completion_tokens=3", "cached_tokens=4", "ttft=0.050s"):
        assert part in err
    assert "draft_tokens=4 accepted_tokens=1" in err
    assert "tokens/s=42.5" in err and "job " in err
    assert only_job(redis_conn).args == [
        {
            "prompt": "Hi",
            "max_tokens": 5,
            "temperature": 0.0,
            "stop": ["\n"],
            "max_draft_tokens": 2,
            "logprobs": 3,
        }
    ]


def test_generate_chat_as_json(
    redis_url: str, redis_conn: redis.Redis, worker_side: WorkerSide, serve_one: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    serve_one(lambda job_id: worker_side.done(job_id, generate_result("Paris")))
    assert main(["--redis-url", redis_url, "generate", "Capital?", "--system", "Be brief", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out) == generate_result("Paris").model_dump(mode="json")
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Capital?"}]
    assert only_job(redis_conn).args == [{"messages": messages}]


def test_allow_special_tokens_travels_only_when_asked(
    redis_url: str, redis_conn: redis.Redis, worker_side: WorkerSide, serve_one: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    serve_one(lambda job_id: worker_side.done(job_id, generate_result("ok")))
    prompt = "<|im_start|>user\nhi<|im_end|>"
    assert main(["--redis-url", redis_url, "generate", prompt, "--allow-special-tokens", "--json"]) == 0
    capsys.readouterr()
    assert only_job(redis_conn).args == [{"prompt": prompt, "allow_special_tokens": True}]
    assert ScoreKind().request([ScoreRow(prompt=prompt, candidates=[" a"])]).allow_special_tokens is False
    kind = ScoreKind(allow_special_tokens=True)
    assert kind.request([ScoreRow(prompt=prompt, candidates=[" a"])]).allow_special_tokens is True


def test_generate_shows_restarts_and_fails_with_exit_1(
    redis_url: str,
    worker_side: WorkerSide,
    serve_one: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    def play(job_id: str) -> None:
        worker_side.tokens(job_id, "abc")
        worker_side.restart(job_id, attempt=2)
        worker_side.error(job_id, "ContextTooLong: prompt is 9000 tokens")

    serve_one(play)
    assert main(["--redis-url", redis_url, "generate", "Hi"]) == 1
    out, err = capsys.readouterr()
    assert out == "abc\n"
    assert "attempt 2" in err and "failed: ContextTooLong: prompt is 9000 tokens" in err


def test_ctrl_c_during_generate_cancels_the_job(
    redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Ctrl-C as an interactive shell delivers it: Python's own handler, whatever this process was
    # launched with (`make test &` starts it with SIGINT ignored, and then nothing would interrupt).
    launched_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        assert main(["--redis-url", redis_url, "generate", "Hi"]) == 130
    finally:
        timer.join()
        signal.signal(signal.SIGINT, launched_with)
    assert "cancel: canceled" in capsys.readouterr().err
    assert only_job(redis_conn).get_status() == "canceled"


def test_generate_timeout_cancels_and_exits_1(
    redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--redis-url", redis_url, "generate", "Hi", "--timeout", "0.3"]) == 1
    assert "no answer within 0.3 s" in capsys.readouterr().err
    assert only_job(redis_conn).get_status() == "canceled"


def test_tail_from_the_start_and_from_a_saved_id(
    redis_url: str, worker_side: WorkerSide, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(redis_url) as client:
        job_id = client.submit_generate("Hi").id
    first, _ = worker_side.tokens(job_id, "Hel", "lo")
    done_id = worker_side.done(job_id, generate_result("Hello"))
    assert main(["--redis-url", redis_url, "tail", job_id]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello\n" and f"last id {done_id}" in err
    assert main(["--redis-url", redis_url, "tail", job_id, "--from", first, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["event"], e.get("text")) for e in lines] == [("token", "lo"), ("done", None)]
    assert lines[-1]["id"] == done_id


def test_status_shows_queues_and_workers(
    redis_url: str, redis_conn: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(redis_url) as client:
        client.submit_generate("a")
        client.submit_generate("b")
        client.submit_generate("c").cancel()
    queue = Queue("default", connection=redis_conn, serializer=JSONSerializer)
    worker = SimpleWorker([queue], connection=redis_conn, serializer=JSONSerializer, name="host-a")
    worker.register_birth()
    redis_conn.hset(
        keys.worker_stats_key("host-a"), mapping={"model": "tiny", "device": "cpu", "jobs_done": 3}
    )
    try:
        assert main(["--redis-url", redis_url, "status"]) == 0
        text = capsys.readouterr().out
        assert "default" in text and "queued=2" in text and "canceled=1" in text
        assert "host-a" in text and "model: tiny" in text and "jobs_done: 3" in text
        assert main(["--redis-url", redis_url, "status", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    finally:
        worker.register_death()
    assert report["queues"][0]["name"] == "default" and report["queues"][0]["queued"] == 2
    (entry,) = report["workers"]
    assert entry["name"] == "host-a" and entry["queues"] == ["default"] and entry["stats"]["device"] == "cpu"


def test_cancel_and_result_commands(
    redis_url: str, worker_side: WorkerSide, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(redis_url) as client:
        queued, running, done = (client.submit_generate(p).id for p in ("a", "b", "c"))
    worker_side.start(running)
    worker_side.done(done, generate_result("C"))
    assert main(["--redis-url", redis_url, "cancel", queued]) == 0
    assert main(["--redis-url", redis_url, "cancel", running]) == 0
    assert main(["--redis-url", redis_url, "cancel", "nope"]) == 1
    out = capsys.readouterr().out
    assert "canceled before it ran" in out and "asked the worker to stop" in out and "no such job" in out
    assert main(["--redis-url", redis_url, "result", done]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "C"
    assert main(["--redis-url", redis_url, "result", queued]) == 1
    assert "canceled before it ran" in capsys.readouterr().err
    assert main(["--redis-url", redis_url, "result", running, "--timeout", "0.2"]) == 1


def test_connection_and_usage_errors_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLXQ_REDIS_RETRY_ATTEMPTS", "1")
    assert main(["--redis-url", "redis://app:secret@127.0.0.1:1/0", "status"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach Redis at redis://app:***@127.0.0.1:1/0" in err and "secret" not in err
    with pytest.raises(SystemExit) as info:
        main(["generate"])
    assert info.value.code == 2
    assert main(["--redis-url", "redis://127.0.0.1:1/0", "generate", "Hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_worker_commands_are_handed_to_worker_cli_only_when_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("mlxq.worker.cli")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlxq.worker.cli", fake)
    assert main(["--redis-url", "redis://h/1", "worker", "--model", "m"]) == 0
    assert main(["import-gguf", "a.gguf", "out"]) == 0
    assert seen == [
        ["worker", "--model", "m", "--redis-url", "redis://h/1"],
        ["import-gguf", "a.gguf", "out"],
    ]

    def needs_mlx(argv: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'mlx'", name="mlx.core")

    fake.main = needs_mlx  # type: ignore[attr-defined]
    assert main(["worker", "--model", "m"]) == 2
    assert NEEDS_MLX in capsys.readouterr().err


def test_the_cli_runs_as_a_module_without_importing_the_worker(redis_url: str) -> None:
    status = subprocess.run(
        [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "status"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "queues:" in status.stdout and "workers:" in status.stdout
    probe = (
        "import sys, producer, producer.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'worker')))"
    )
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert imported.stdout.strip() == "[]"


def test_options_after_the_command_and_results_for_a_person(
    redis_url: str, worker_side: WorkerSide, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--redis-url`/`--tenant` are taken after the command too (there they win); `result` prints token
    ids on one line, not one per line."""
    with Client(redis_url, settings=ProducerSettings(tenant="acme")) as client:
        done = client.submit_generate("c").id
    result = generate_result("C").model_copy(update={"token_ids": list(range(40))})
    worker_side.done(done, result)
    assert main(["--redis-url", "redis://127.0.0.1:1/0", "result", done, "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["token_ids"] == list(range(40))
    assert '"token_ids": [0, 1, 2,' in out and len(out.splitlines()) < 30
    assert main(["status", "--redis-url", redis_url, "--tenant", "acme", "--json"]) == 0
    assert "queues" in json.loads(capsys.readouterr().out)


def test_status_into_a_closed_pipe_ends_quietly(redis_url: str, redis_conn: redis.Redis) -> None:
    """`mlxq status | head -1`: output larger than a pipe's buffer, the reader gone after one line."""
    with redis_conn.pipeline() as pipe:
        for i in range(3000):
            pipe.sadd(keys.RQ_QUEUES_SET, keys.rq_queue_key(f"q{i:04d}"))
        pipe.execute()
    shell = f"{sys.executable} -m producer.cli --redis-url {redis_url} status | head -1"
    run = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60, check=False)
    assert run.stdout.count("\n") == 1
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr


def test_score_file_says_what_an_openai_batch_line_is(
    redis_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(line) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--redis-url", redis_url, "score-file", str(source), "-o", str(out)]) == 1
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    message = errors[0]["response"]["body"]["error"]["message"]  # a Batch file: OpenAI's error lines
    assert "score-file runs POST /v1/completions lines" in message and "generate-file" in message
    (tmp_path / "out.errors.jsonl").unlink()
    assert (
        main(["--redis-url", redis_url, "score-file", str(source), "-o", str(out), "--format", "mlxq"]) == 1
    )
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert "an OpenAI Batch API request line" in errors[0]["error"], errors
    assert "generate-file takes the others" in errors[0]["error"]


def test_score_file_with_redis_unreachable_says_so_and_leaves_no_empty_output(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The run's retries say what they wait for, then one line says Redis is unreachable; the output
    file the run would have written is not left behind empty (an earlier run's output would stay)."""
    monkeypatch.setenv("MLXQ_REDIS_RETRY_ATTEMPTS", "1")
    monkeypatch.setenv("MLXQ_REDIS_RETRY_INITIAL_WAIT_S", "0.001")
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "prompt": "x", "candidates": ["y"]}\n')
    out = tmp_path / "out.jsonl"
    assert main(["--redis-url", "redis://127.0.0.1:1/0", "score-file", str(src), "-o", str(out)]) == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err
    assert "redis unreachable; trying again" in caplog.text
    assert not out.exists()
