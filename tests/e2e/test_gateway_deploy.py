"""deploy/systemd/mlxq-gateway.service cannot rot: its own command line, with its env file's settings,
runs a gateway that answers health and readiness on the env file's port setting and stops cleanly on the
unit's KillSignal within its TimeoutStopSec."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis_server import free_port

REDIS_DB = 6  # only read: the gateway checks that Redis answers
ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "mlxq-gateway.service"
MLXQ_BIN = Path(sys.executable).parent / "mlxq"


def _section(name: str) -> dict[str, str]:
    out, current = {}, ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
        elif current == name:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip().strip("'\"")
    return env


def test_the_unit_runs_mlxq_serve_from_its_env_file() -> None:
    service = _section("Service")
    assert service["ExecStart"].startswith("__MLXQ_BIN__ serve")
    assert service["EnvironmentFile"] == "/etc/mlxq/gateway.env"
    assert (SYSTEMD / Path(service["EnvironmentFile"]).name).exists()
    assert service["Restart"] == "on-failure"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    (tmp_path / UNIT.name).write_text(UNIT.read_text().replace("__MLXQ_BIN__", str(MLXQ_BIN)))
    run = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / UNIT.name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if any(w in line for w in ("Unknown", "Invalid", "Failed", "not absolute", "bad-setting"))
    ]
    assert not problems, "\n".join(problems)


def test_the_exec_start_serves_health_and_readiness_and_stops_on_sigterm(
    redis_url: str, tmp_path: Path
) -> None:
    service = _section("Service")
    env = _env_file(SYSTEMD / "gateway.env")
    port = free_port()
    env.update(MLXQ_REDIS_URL=redis_url, MLXQ_GATEWAY_HOST="127.0.0.1", MLXQ_GATEWAY_PORT=str(port))
    argv = shlex.split(service["ExecStart"].replace("__MLXQ_BIN__", str(MLXQ_BIN)))
    base = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(ROOT),
    }  # this checkout's code behind the venv's entry point
    log = open(tmp_path / "gateway.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(argv, env={**base, **env}, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health.json() == {"status": "ok"}
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5.0)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        proc.send_signal(getattr(signal, service["KillSignal"]))
        # uvicorn shuts down, then re-raises the signal: systemd counts death by SIGTERM as a clean stop
        assert proc.wait(int(service["TimeoutStopSec"])) in (0, -signal.SIGTERM), (
            tmp_path / "gateway.log"
        ).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
