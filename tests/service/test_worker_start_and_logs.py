"""What an operator reads: one line for each mistake at worker start (no traceback unless at debug
level), RQ's log lines as `key=value` like mlxq's, and a job's expected failure as one warning line."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest

from mlxq.producer import Client, JobFailed
from mlxq.worker.cli import RqLines, configure_logging, main
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings

REDIS_DB = 6


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_start_mistakes_are_one_line_each(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["worker", "--model", str(tmp_path / "missing")]) == 2
    assert "is neither a local folder" in _one_line(capsys.readouterr().err)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["worker", "--model", str(gguf)]) == 2
    assert f"mlxq import-gguf {gguf} <folder>" in _one_line(capsys.readouterr().err)
    assert main(["worker", "--model", str(model_dir), "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    assert "cannot reach Redis" in _one_line(capsys.readouterr().err)


def test_import_gguf_mistakes_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "missing.gguf" in _one_line(capsys.readouterr().err)
    monkeypatch.setitem(sys.modules, "gguf", None)  # the `gguf` extra not installed
    assert main(["import-gguf", str(tmp_path / "any.gguf"), str(tmp_path / "out")]) == 2
    assert "needs the gguf package: pip install gguf" in _one_line(capsys.readouterr().err)


def test_rq_lines_are_key_value() -> None:
    args = ("w1", "quitting")
    record = logging.LogRecord("rq.worker", logging.INFO, __file__, 1, "Worker %s: done, %s", args, None)
    assert RqLines().filter(record)
    assert record.getMessage() == 'msg="Worker w1: done, quitting"'
    ours = logging.LogRecord("worker.rq_worker", logging.INFO, __file__, 1, "job=%s", ("a",), None)
    assert RqLines().filter(ours) and ours.getMessage() == "job=a"


def test_an_rq_line_is_quoted_once_whatever_handlers_and_setups_it_meets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two handlers on the root logger, and logging set up twice: each handler writes RQ's sentence
    quoted once (the filter rewrites a record in place, and every handler's filter sees the same one)."""
    root = logging.getLogger()
    streams = [io.StringIO(), io.StringIO()]
    handlers = [logging.StreamHandler(stream) for stream in streams]
    monkeypatch.setattr(root, "handlers", handlers)
    monkeypatch.setattr(root, "level", logging.INFO)
    configure_logging("INFO")
    configure_logging("INFO")
    assert all(sum(isinstance(f, RqLines) for f in h.filters) == 1 for h in handlers)
    logging.getLogger("rq.worker").info("Worker %s: %s", "w1", "Jobs OK (2): a b")
    assert [s.getvalue() for s in streams] == ['msg="Worker w1: Jobs OK (2): a b"\n'] * 2


def test_an_expected_job_failure_is_a_warning_line(
    redis_url: str, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir), redis_url=redis_url, max_context=64, _env_file=None
    )
    service = WorkerService.start(settings)
    with Client(redis_url) as client:
        job = client.submit_generate("word " * 200, max_tokens=2)
        with caplog.at_level(logging.INFO):
            assert service.work(burst=True) == 0
        with pytest.raises(JobFailed, match="context length"):
            job.result(timeout=5)
    failed = [r for r in caplog.records if job.id in r.getMessage() and r.levelno >= logging.WARNING]
    assert [(r.levelname, r.exc_info) for r in failed] == [("WARNING", None)], [
        r.getMessage() for r in failed
    ]
    assert "error=ContextTooLong: prompt is" in failed[0].getMessage()


@pytest.mark.parametrize("configured", [None, 0, 123_456_789])
def test_a_generation_batchs_kv_budget_follows_the_machine_unless_set(
    redis_url: str, model_dir: Path, configured: int | None
) -> None:
    """Unset, a batch may hold a quarter of MLX's memory limit in KV (a fixed size would seat 64 rows of
    one model and a quarter of them of a model with 4x the KV per token); 0 is no limit."""
    import mlx.core as mx

    from mlxq.jobs import keys
    from mlxq.worker.generation_jobs import GenerationJobs

    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir), redis_url=redis_url, batch_kv_bytes=configured, _env_file=None
    )
    with WorkerService.start(settings) as service:
        generations = service.worker.runners[keys.GENERATE_FUNC]
    assert isinstance(generations, GenerationJobs)
    want = int(mx.get_memory_limit()) // 4 if configured is None else configured
    assert generations.options.kv_budget_bytes == want
    assert want > 0 or configured == 0
