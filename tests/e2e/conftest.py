"""Fixtures the end-to-end tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_process import WorkerProcess


@pytest.fixture
def worker(model_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A worker process serving the queue `default` with the test module's model and Redis, ready."""
    w = WorkerProcess(model_dir, redis_url, tmp_path / "worker.log", "--queue", "default")
    w.wait_ready()
    yield w
    w.stop()
