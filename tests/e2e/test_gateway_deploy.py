"""deploy/ cannot rot for the gateway: mlxq-gateway.service's own command line, with its env file's
settings, runs a gateway that answers health and readiness and stops cleanly on the unit's KillSignal
within its TimeoutStopSec; and users.acl's `gateway` user does everything the gateway does with no
refusal (Redis's ACL LOG stays empty)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis_server import free_port

REDIS_DB = 6  # only read: the gateway checks that Redis answers
ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
DEPLOY_REDIS = ROOT / "deploy" / "redis"
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


@pytest.fixture
def acl_port(tmp_path: Path) -> Iterator[int]:
    """A private redis-server with deploy/redis's config and its ACL file, as deployed."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    port = free_port()
    (tmp_path / "redis").mkdir()
    argv = [
        "redis-server",
        str(DEPLOY_REDIS / "redis.conf"),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(tmp_path / "redis"),
        "--aclfile",
        str(DEPLOY_REDIS / "users.acl"),
        "--daemonize",
        "no",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    admin = redis.Redis.from_url(_acl_url("admin", port))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        yield port
    finally:
        admin.close()
        proc.terminate()
        proc.wait(10)


def _acl_url(user: str, port: int) -> str:
    return f"redis://{user}:CHANGE-ME-{user}@127.0.0.1:{port}/0"


def test_the_gateway_user_does_all_the_gateway_does_with_no_refusal(
    acl_port: int, model_dir: Path, no_eos: dict[int, float], tmp_path: Path
) -> None:
    """Chat (whole and streamed), a resumed stream, a scored prompt, the in-flight limit, models, files
    and a batch, all through a gateway logged in as users.acl's `gateway` user; then Redis's ACL LOG is
    empty."""
    import openai
    from gateway_process import GatewayProcess
    from worker_process import WorkerProcess

    from mlxq.producer.gateway import api_keys

    admin = redis.Redis.from_url(_acl_url("admin", acl_port))
    token, _ = api_keys.create(admin, "acl-test", max_jobs=1)  # the operator's own login creates keys
    worker = WorkerProcess(model_dir, _acl_url("worker", acl_port), tmp_path / "worker.log", "--queue", "gw")
    gateway = GatewayProcess(
        _acl_url("gateway", acl_port), tmp_path / "gateway.log", MLXQ_GATEWAY_DATA_DIR=str(tmp_path / "data")
    )
    try:
        gateway.wait_ready()  # the worker is waited for below, through what it advertises
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
        deadline = time.monotonic() + 30
        while not sdk.models.list().data:  # the worker's advertisement
            assert time.monotonic() < deadline and worker.proc.poll() is None, worker.log()
            time.sleep(0.1)
        model = model_dir.name
        bias = {str(k): v for k, v in no_eos.items()}
        whole = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logit_bias=bias
        )
        assert whole.usage is not None and whole.usage.completion_tokens == 4
        chunks = list(
            sdk.completions.create(
                model=model,
                prompt="hi",
                max_tokens=4,
                logit_bias=bias,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        resumed = httpx.get(
            f"{gateway.url}/v1/streams/{chunks[0].id}",
            headers={"authorization": f"Bearer {token}", "last-event-id": "0-0"},
            timeout=30,
        )
        assert resumed.status_code == 200 and resumed.text.rstrip().endswith("data: [DONE]")
        scored = sdk.completions.create(model=model, prompt="hi there", max_tokens=0, echo=True, logprobs=1)
        assert scored.choices[0].logprobs is not None  # a score job: submitted with no stream context
        # the in-flight limit (1): ended jobs are looked up and cleared, so this one may run
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "again"}], max_tokens=2
        )
        line = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": "hi", "max_tokens": 3, "logit_bias": bias},
        }
        uploaded = sdk.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while (batch := sdk.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, gateway.log()
            time.sleep(0.1)
        out = json.loads(sdk.files.content(batch.output_file_id or "").text)
        assert out["custom_id"] == "a" and out["response"]["body"]["usage"]["completion_tokens"] == 3
        refused = admin.acl_log()
        assert refused == [], refused
        assert "NOPERM" not in gateway.log()
    finally:
        gateway.stop()
        worker.stop()
        admin.close()


def test_no_access_log_leaves_out_the_line_per_request(redis_url: str, tmp_path: Path) -> None:
    """At log level info uvicorn writes a line per request; `--no-access-log` (a busy gateway) does not."""
    from gateway_process import GatewayProcess

    logs = {}
    for name, flags in (("on", ()), ("off", ("--no-access-log",))):
        gateway = GatewayProcess(redis_url, tmp_path / f"{name}.log", "--log-level", "info", *flags)
        try:
            gateway.wait_ready()
            assert httpx.get(f"{gateway.url}/health").status_code == 200
        finally:
            gateway.stop()
        logs[name] = gateway.log()
    assert '"GET /health HTTP/1.1" 200' in logs["on"]
    assert "GET /health" not in logs["off"] and "Application startup complete" in logs["off"]
