"""A real `mlxq worker` process for end-to-end tests (imported by test modules, like reference.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

from mlxq.jobs.redis_url import sync_client

ROOT = Path(__file__).resolve().parent.parent


class WorkerProcess:
    """`python -m mlxq.producer.cli worker ...` in its own process, its log kept in a file. Every one
    started is in `RUNNING` until it has exited; conftest stops those left when a test ends (a test
    failing half-way must not leave a worker taking a later test's jobs, nor an open log file and a
    live child whose warnings land on whichever later test collects them)."""

    RUNNING: ClassVar[set[WorkerProcess]] = set()

    def __init__(self, model_dir: Path, redis_url: str, log_path: Path, *args: str, **env: str) -> None:
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "mlxq.producer.cli",
            "worker",
            "--model",
            str(model_dir),
            "--redis-url",
            redis_url,
            *args,
        ]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "MLXQ_HEARTBEAT_S": "1", **env}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.redis_url = redis_url
        WorkerProcess.RUNNING.add(self)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the worker registered itself with RQ (model loaded, listening)."""
        conn = sync_client(self.redis_url)  # a Sentinel URL too
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            if conn.keys("rq:worker:*"):
                return
            time.sleep(0.05)
        raise TimeoutError(f"worker not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is not None:
                self._log.close()
                WorkerProcess.RUNNING.discard(self)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()

    @classmethod
    def stop_all(cls, keep: set[WorkerProcess] | frozenset[WorkerProcess] = frozenset()) -> None:
        for w in list(cls.RUNNING - keep):
            w.stop()
