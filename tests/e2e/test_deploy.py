"""deploy/ cannot rot: the unit files' and the plist's own command lines run real workers to completion,
and the Redis config + ACL file are loaded into a private redis-server where a real producer, real
workers and an operator do everything mlxq does under those users, with no permission ever refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import plistlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import yaml
from rq.command import send_shutdown_command
from rq.job import Job
from rq.serializers import JSONSerializer

from mlxq.jobs.schema import RestartEvent, TokenEvent
from mlxq.producer import Client, JobFailed

REDIS_DB = 7
ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MLXQ_BIN = Path(sys.executable).parent / "mlxq"  # this venv's entry point stands for __MLXQ_BIN__
PROMPT = "The capital of France is Paris. " * 4
HAVE_PROMETHEUS = importlib.util.find_spec("prometheus_client") is not None  # the `metrics` extra
PASSWORDS = {u: f"CHANGE-ME-{u}" for u in ("admin", "producer", "worker", "ops")}  # users.acl's placeholders


@pytest.fixture(scope="module", autouse=True)
def mlxq_bin() -> Path:
    if not MLXQ_BIN.exists():
        pytest.fail(f"{MLXQ_BIN} is missing: install the project in the venv (pip install -e . --no-deps)")
    return MLXQ_BIN


# --- reading deploy files the way systemd and launchd do ---------------------------------------------


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections as (key, value) lists, in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
        else:
            key, _, value = line.partition("=")
            sections[current].append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit[section] if k == key]


def expand_specifiers(text: str, instance: str = "") -> str:
    """systemd's specifiers as the units use them (%H host, %i/%I instance, %% percent); others fail."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "%":
            out.append(text[i])
            i += 1
            continue
        spec = text[i + 1]
        values = {"H": socket.gethostname(), "i": instance, "I": instance, "%": "%"}
        if spec not in values:
            raise AssertionError(f"unit uses specifier %{spec}; teach this test what systemd makes of it")
        out.append(values[spec])
        i += 2
    return "".join(out)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile and the worker's .env both read them."""
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def substitute(text: str, home: Path | None = None) -> str:
    text = text.replace("__MLXQ_BIN__", str(MLXQ_BIN))
    return text.replace("__MLXQ_HOME__", str(home)) if home is not None else text


def base_env(tmp_path: Path) -> dict[str, str]:
    """What a service manager gives a process: no MLXQ_* from the test's own environment."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "LANG": "C.UTF-8"}


def test_overrides(env: dict[str, str], redis_url: str, model_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The env file's own values, except where this test must point: its Redis DB and its tiny model."""
    out = {**env, "MLXQ_REDIS_URL": redis_url, "MLXQ_MODEL": str(model_dir), "MLXQ_HEARTBEAT_S": "1"}
    if "HF_HOME" in out:
        out["HF_HOME"] = str(tmp_path / "hf")
    if "MLXQ_METRICS_PORT" in out:  # a fixed port could be taken on a test machine
        if HAVE_PROMETHEUS:
            out["MLXQ_METRICS_PORT"] = "0"
        else:
            del out["MLXQ_METRICS_PORT"]
    return out


test_overrides.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


class Proc:
    """A command line run as a service manager would run it, its output kept in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.argv, self.log_path = argv, log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_registered(self, conn: redis.Redis, name: str, timeout: float = 60.0) -> None:
        """Until this process registered as worker `name` with RQ (so its model is loaded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.argv} exited {self.proc.returncode}:\n{self.log()}")
            pid, death = conn.hmget(f"rq:worker:{name}", ["pid", "death"])
            if pid == str(self.proc.pid).encode() and death is None:
                return
            time.sleep(0.05)
        raise AssertionError(f"worker {name} not registered after {timeout}s:\n{self.log()}")

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.argv} still running after {timeout}s:\n{self.log()}") from None
        finally:
            if self.proc.poll() is not None:
                self._log.close()

    def kill(self) -> None:
        """SIGKILL (a crash, or the end of a test), then wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def _eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        time.sleep(0.05)


# --- systemd ------------------------------------------------------------------------------------------


UNITS = ("mlxq-worker.service", "mlxq-worker@.service")


@pytest.mark.parametrize("name", UNITS)
def test_unit_has_the_settings_a_worker_needs(name: str) -> None:
    unit = read_unit(DEPLOY / "systemd" / name)
    service = dict(unit["Service"])
    assert service["Restart"] == "on-failure" and service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) >= 600  # room for a job to finish after the first SIGTERM
    assert "/etc/mlxq/worker.env" in unit_values(unit, "Service", "EnvironmentFile")
    assert "MemoryDenyWriteExecute" not in service  # MLX compiles kernels at run time
    assert unit_values(unit, "Service", "ExecStart")[0].startswith("__MLXQ_BIN__ worker")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verify_accepts_the_unit(name: str, tmp_path: Path) -> None:
    unit_name = name.replace("@.", "@llama-3.2-1b.")  # a template is verified as an instance
    (tmp_path / unit_name).write_text(substitute((DEPLOY / "systemd" / name).read_text()))
    run = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / unit_name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if any(w in line for w in ("Unknown", "Invalid", "Failed", "not absolute", "bad-setting", "Ignoring"))
    ]
    assert not problems, "\n".join(problems)


def _exec_start(name: str, instance: str = "") -> list[str]:
    (line,) = unit_values(read_unit(DEPLOY / "systemd" / name), "Service", "ExecStart")
    return shlex.split(substitute(expand_specifiers(line.lstrip("-@+!:"), instance)))


def _unit_env(name: str, instance: str = "") -> dict[str, str]:
    """The unit's EnvironmentFile= files in order, from deploy/systemd/ (where /etc/mlxq/ points)."""
    env: dict[str, str] = {}
    for spec in unit_values(read_unit(DEPLOY / "systemd" / name), "Service", "EnvironmentFile"):
        optional = spec.startswith("-")
        path = DEPLOY / "systemd" / Path(expand_specifiers(spec.lstrip("-"), instance)).name
        if path.exists():
            env.update(read_env_file(path))
        else:
            assert optional, f"{name} needs {spec}, which deploy/systemd/ does not provide"
    return env


def test_the_service_exec_start_serves_the_env_file_queue(
    redis_url: str,
    redis_conn: redis.Redis,
    model_dir: Path,
    no_eos: dict[int, float],
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    env = test_overrides(_unit_env("mlxq-worker.service"), redis_url, model_dir, tmp_path)
    (queue,) = json.loads(env["MLXQ_QUEUES"])
    with Client(redis_url) as client:
        job = client.submit_generate(PROMPT, max_tokens=5, logit_bias=no_eos, queue=queue)
        argv = [*_exec_start("mlxq-worker.service"), "--burst"]
        procs.append(p := Proc(argv, {**base_env(tmp_path), **env}, tmp_path, tmp_path / "w.log"))
        assert p.wait() == 0, p.log()
        assert job.result(timeout=5).usage.completion_tokens == 5
    rq_job = Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert rq_job.worker_name == socket.gethostname()  # --name %H

    # RQ's own tools still read everything.
    info = subprocess.run(
        [str(MLXQ_BIN.parent / "rq"), "info", "--url", redis_url], capture_output=True, text=True, timeout=60
    )
    assert info.returncode == 0, info.stderr
    assert queue in info.stdout and "1 queues" in info.stdout


def test_the_template_serves_its_instance_queue_and_comes_back_after_a_crash(
    redis_url: str, redis_conn: redis.Redis, model_dir: Path, tmp_path: Path, procs: list[Proc]
) -> None:
    instance = "llama-3.2-1b"
    env = {
        **base_env(tmp_path),
        **test_overrides(_unit_env("mlxq-worker@.service", instance), redis_url, model_dir, tmp_path),
    }
    argv = _exec_start("mlxq-worker@.service", instance)
    name = f"{socket.gethostname()}-{instance}"
    with Client(redis_url) as client:
        procs.append(first := Proc(argv, env, tmp_path, tmp_path / "w.log"))
        first.wait_registered(redis_conn, name)
        assert client.submit_generate(PROMPT, max_tokens=3, queue=instance).result(timeout=30)
        assert redis_conn.hget(f"mlxq:worker:{name}", "model_path") == str(model_dir).encode()
        if HAVE_PROMETHEUS:  # set by the instance's own env file, llama-3.2-1b.env
            assert redis_conn.hget(f"mlxq:worker:{name}", "metrics_port")

        first.kill()  # a crash: RQ's registration of the name stays behind
        assert redis_conn.exists(f"rq:worker:{name}") and not redis_conn.hexists(f"rq:worker:{name}", "death")

        # Restart=on-failure runs the same line again: the name is free at once, not after RQ's TTL.
        procs.append(again := Proc(argv, env, tmp_path, tmp_path / "w.log"))
        again.wait_registered(redis_conn, name, timeout=30)
        assert client.submit_generate(PROMPT, max_tokens=3, queue=instance).result(timeout=30)
        assert "freeing worker name left by a dead process" in again.log()

        again.proc.send_signal(signal.SIGTERM)  # `systemctl stop`
        assert again.wait(30) == 0
    assert redis_conn.hexists(f"rq:worker:{name}", "death") or not redis_conn.exists(f"rq:worker:{name}")


# --- launchd ------------------------------------------------------------------------------------------


def test_the_plist_program_arguments_run_a_worker(
    redis_url: str, redis_conn: redis.Redis, model_dir: Path, no_eos: dict[int, float], tmp_path: Path
) -> None:
    home = tmp_path / "mlxq-worker"
    (home / "logs").mkdir(parents=True)
    plist = plistlib.loads(
        substitute((DEPLOY / "launchd" / "com.mlxq.worker.plist").read_text(), home).encode()
    )
    assert plist["Label"] == "com.mlxq.worker" and plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on failure only
    assert plist["ThrottleInterval"] >= 10 and plist["ExitTimeOut"] >= 600
    assert plist["ProgramArguments"][0] == str(MLXQ_BIN)

    # The settings file the README puts in the working directory, pointed at this test's Redis and model.
    example = read_env_file(DEPLOY / "launchd" / "worker.env")
    settings = test_overrides(example, redis_url, model_dir, tmp_path)
    (home / ".env").write_text("".join(f"{k}='{v}'\n" for k, v in settings.items()))
    (queue,) = json.loads(example["MLXQ_QUEUES"])

    with Client(redis_url) as client:
        job = client.submit_generate(PROMPT, max_tokens=4, logit_bias=no_eos, queue=queue)
        cwd = Path(plist["WorkingDirectory"])
        env = {**base_env(tmp_path), **plist["EnvironmentVariables"]}
        with open(plist["StandardOutPath"], "ab") as out, open(plist["StandardErrorPath"], "ab") as err:
            run = subprocess.run(
                [*plist["ProgramArguments"], "--burst"], env=env, cwd=cwd, stdout=out, stderr=err
            )
        log = Path(plist["StandardErrorPath"]).read_text()
        assert run.returncode == 0, log
        assert job.result(timeout=5).usage.completion_tokens == 4
    assert (
        Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer).worker_name
        == example["MLXQ_NAME"]
    )
    assert f"generate done job={job.id}" in log


# --- containers (documentation only: no container engine here) -----------------------------------------


def test_compose_file_mounts_files_that_exist() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"redis", "rq-dashboard"} <= set(compose["services"])
    redis_service = compose["services"]["redis"]
    for volume in redis_service["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("."):
            assert (DEPLOY / source).exists(), source
    command = redis_service["command"]
    assert "/usr/local/etc/redis/redis.conf" in command and "--aclfile" in command


# --- Redis: the config and the ACL, proven by use ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["redis-server", "valkey-server"])
def acl_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[int]:
    """A private server started with deploy/redis/redis.conf and users.acl; yields its port.

    Redis and Valkey both, where installed: they differ in what clients send (redis-py's
    `CLIENT SETINFO` exists from Redis 7.2 and in Valkey, and must be allowed there).
    """
    server = shutil.which(request.param)
    if server is None:
        pytest.skip(f"{request.param} is not installed")
    port = _free_port()
    data = tmp_path / "redis"
    data.mkdir()
    argv = [
        server,
        str(DEPLOY / "redis" / "redis.conf"),
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)),
        *("--aclfile", str(DEPLOY / "redis" / "users.acl"), "--daemonize", "no"),
    ]
    log = open(tmp_path / "redis.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (tmp_path / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        yield port
    finally:
        admin.close()
        proc.terminate()
        proc.wait(10)
        log.close()


def _url(user: str, port: int) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@127.0.0.1:{port}/0"


def _scrape(port: int) -> dict[tuple[str, str], float]:
    """Samples by (name, queue label or "")."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, s.labels.get("queue", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_producer_worker_and_ops_users_can_do_all_they_need_and_no_more(
    acl_redis: int,
    model_dir: Path,
    no_eos: dict[int, float],
    tmp_path: Path,
    procs: list[Proc],
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = acl_redis
    admin = redis.Redis.from_url(_url("admin", port))
    ops = redis.Redis.from_url(_url("ops", port))
    assert admin.config_get("appendonly") == {"appendonly": "yes"}  # the config file is in force
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()  # the default user is off

    def worker(name: str, *args: str, **env: str) -> Proc:
        argv = [str(MLXQ_BIN), "worker", "--model", str(model_dir), "--name", name, *args]
        full_env = {
            **base_env(tmp_path),
            "MLXQ_REDIS_URL": _url("worker", port),
            "MLXQ_HEARTBEAT_S": "1",
            **env,
        }
        p = Proc(argv, full_env, tmp_path, tmp_path / f"{name}.log")
        procs.append(p)
        return p

    with Client(_url("producer", port)) as client:
        # Queued before any worker: score jobs to batch (Lua claim), failures, a retry, cancels.
        scores = [
            client.submit_score([{"prompt": PROMPT, "candidates": [" the", " a"]}], queue="acl")
            for _ in range(3)
        ]
        bad = client.submit_score([{"prompt": "x", "candidates": [" Paris"]}], queue="acl")
        bad_retried = client.submit_score([{"prompt": "x", "candidates": [" Paris"]}], queue="acl", retry=1)
        client.submit_generate("never", queue="nobody").cancel()
        client.submit_generate("waits", queue="nobody")

        metrics_env = {"MLXQ_METRICS_PORT": "0"} if HAVE_PROMETHEUS else {}
        a = worker("acl-a", "--queue", "acl", **metrics_env)  # one queue, blocking: BLMOVE
        a.wait_registered(admin, "acl-a")
        text = "".join(
            client.submit_generate(PROMPT, max_tokens=6, logit_bias=no_eos, queue="acl").text_deltas(
                timeout=30
            )
        )
        assert text
        assert all(len(s.result(timeout=30).rows[0].logits) == 2 for s in scores)
        for job in (bad, bad_retried):
            with pytest.raises(JobFailed, match="does not add exactly one token"):
                job.result(timeout=30)
        assert "score batch claimed=" in a.log()

        running = client.submit_generate(PROMPT, max_tokens=1900, logit_bias=no_eos, queue="acl")
        next(i for i in running.stream(timeout=30) if isinstance(i.event, TokenEvent))
        assert running.cancel().value == "requested"
        assert running.result(timeout=30).finish_reason == "cancelled"

        # A job the worker cannot read (written by hand, a date in another format): put aside.
        admin.hset(
            "rq:job:acl-unreadable",
            mapping={
                "data": '["jobs.score", null, [{"rows": []}], {}]',
                "status": "queued",
                "origin": "acl",
                "created_at": "2026-01-01T12:00:00+00:00",
            },
        )
        admin.rpush("rq:queue:acl", "acl-unreadable")
        _eventually(lambda: admin.xlen("mlxq:dead:acl") == 1, what="the unreadable job put aside")

        rows = [{"custom_id": f"r{i}", "prompt": PROMPT, "candidates": [" the", " a"]} for i in range(5)]
        summary = client.score_dataset(rows, tmp_path / "out.jsonl", queue="acl", rows_per_job=2)
        assert (summary.succeeded, summary.failed) == (5, 0)

        if HAVE_PROMETHEUS:  # the metrics endpoint reads RQ's counters and queue lengths as `worker`
            metrics_port = int(admin.hget("mlxq:worker:acl-a", "metrics_port") or 0)

            # RQ's counters follow the result keys by a few milliseconds (worker/finalizer.py); the job
            # cancelled while it ran ends canceled, not among the successful ones
            def counted() -> bool:
                m = _scrape(metrics_port)
                return (
                    m[("mlxq_worker_jobs_succeeded_total", "")] >= 7
                    and m[("mlxq_worker_jobs_failed_total", "")] >= 2
                )

            _eventually(counted, what="RQ counting 7 finished and 2 failed jobs")
            assert _scrape(metrics_port)[("mlxq_queue_jobs", "acl")] == 0

        # Every other way RQ dequeues: several queues blocking (BLPOP), burst on one (LMOVE), on two
        # (LPOP); and a generation batch, which claims queued jobs with the Lua move between steps.
        others: dict[str, tuple[list[str], list[str], dict[str, str], int]] = {
            "acl-b": (["acl-b1", "acl-b2"], [], {}, 1),
            "acl-c": (["acl-c"], ["--burst"], {}, 1),
            "acl-d": (["acl-d1", "acl-d2"], ["--burst"], {}, 1),
            "acl-f": (["acl-f"], ["--burst"], {"MLXQ_MAX_BATCH_SEQUENCES": "4"}, 4),
        }
        jobs = {
            n: [
                client.submit_generate(PROMPT, max_tokens=20, logit_bias=no_eos, queue=queues[-1])
                for _ in range(count)
            ]
            for n, (queues, _, _, count) in others.items()
        }
        started = {}
        for n, (queues, extra, env, _) in others.items():
            started[n] = worker(n, *(a for q in queues for a in ("--queue", q)), *extra, **env)
        for n, batch in jobs.items():
            for job in batch:
                assert job.result(timeout=60).usage.completion_tokens == 20, started[n].log()
        for n in ("acl-c", "acl-d", "acl-f"):
            assert started[n].wait() == 0, started[n].log()
        assert "generation batch claimed=3" in started["acl-f"].log()

        # A worker killed mid-job: its name is taken over at restart, its job re-run (retry) after RQ's
        # maintenance finds it abandoned.
        crash_env = {"MLXQ_MAINTENANCE_INTERVAL_S": "1", "MLXQ_WORKER_TTL_S": "20"}
        e = worker("acl-e", "--queue", "acl-e", **crash_env)
        e.wait_registered(admin, "acl-e")
        long = client.submit_generate(PROMPT, max_tokens=1500, logit_bias=no_eos, queue="acl-e", retry=1)
        next(i for i in long.stream(timeout=30) if isinstance(i.event, TokenEvent))
        e.kill()
        e2 = worker("acl-e", "--queue", "acl-e", **crash_env)
        e2.wait_registered(admin, "acl-e", timeout=30)
        events = [i.event for i in long.stream(timeout=90)]
        assert any(isinstance(ev, RestartEvent) for ev in events)
        assert long.result(timeout=10).finish_reason == "length"

        # The operator: mlxq status, RQ's own `rq info`, and RQ's shutdown command over pub/sub.
        from mlxq.producer.cli import main

        for user in ("ops", "producer"):
            assert main(["--redis-url", _url(user, port), "status"]) == 0
            out = capsys.readouterr().out
            assert "acl-a state=idle" in out and "warning: queue nobody has 1 jobs and no worker" in out
        info = subprocess.run(
            [str(MLXQ_BIN.parent / "rq"), "info", "--url", _url("ops", port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert info.returncode == 0, info.stderr
        assert "acl-a" in info.stdout and "acl-e" in info.stdout and "nobody" in info.stdout
        for name, proc in (("acl-a", a), ("acl-b", started["acl-b"]), ("acl-e", e2)):
            send_shutdown_command(ops, name)
            assert proc.wait(30) == 0, proc.log()

    # Nothing anyone did above was refused, not even a refusal some library swallowed.
    denied = admin.acl_log()
    assert denied == [], json.dumps(denied, default=str, indent=1)

    # And no more than that: each user is kept to its own keys and commands.
    producer = redis.Redis.from_url(_url("producer", port))
    worker_conn = redis.Redis.from_url(_url("worker", port))
    for attempt in (
        lambda: producer.hset("mlxq:worker:acl-a", "model", "forged"),
        lambda: producer.set("mlxq:result:any", '{"text": "forged"}'),  # only workers write results
        lambda: producer.xadd("mlxq:stream:any", {"event": "done"}),
        lambda: producer.sadd("rq:job:any:dependents", "other"),
        lambda: producer.lpush("rq:wip:acl", "x"),
        lambda: producer.publish("rq:pubsub:acl-a", "{}"),
        lambda: producer.keys("*"),
        lambda: producer.flushdb(),
        lambda: worker_conn.set("mlxq:cancel:any", "1"),
        lambda: worker_conn.set("other:key", "1"),
        lambda: worker_conn.config_get("*"),
        lambda: worker_conn.flushall(),
        lambda: ops.flushdb(),
        lambda: ops.keys("*"),
        lambda: ops.config_set("appendonly", "no"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
