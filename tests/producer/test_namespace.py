"""mlxq installs under one name: `mlxq.producer`, `mlxq.jobs`, `mlxq.worker`, and `from mlxq import
Client`. A user's own `jobs.py`, `worker.py` or `producer.py` in the working directory changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USERS_OWN = "raise ImportError('this is the user\\'s own {name}.py, not mlxq\\'s')\n"


@pytest.fixture
def users_directory(tmp_path: Path) -> Path:
    """A working directory holding modules named like mlxq's folders, as a user's project might."""
    for name in ("jobs", "worker", "producer"):
        (tmp_path / f"{name}.py").write_text(USERS_OWN.format(name=name))
    return tmp_path


def _env_without_checkout() -> dict[str, str]:
    """The environment with the repository root off PYTHONPATH: what is imported is what is installed."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_the_client_imports_beside_a_users_jobs_py(users_directory: Path, redis_url: str) -> None:
    code = (
        "from mlxq import Client, AsyncClient, JobFailed\n"
        "import mlxq.jobs, mlxq.producer\n"
        "import sys\n"
        "assert mlxq.jobs.keys.GENERATE_FUNC == 'jobs.generate'\n"
        "assert 'mlx' not in sys.modules and 'mlxq.worker' not in sys.modules, 'the producer pulled mlx in'\n"
        f"with Client({redis_url!r}) as client:\n"
        "    client.connection.ping()\n"
        "print('ok', Client.__module__)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=users_directory,
        env=_env_without_checkout(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["ok", "mlxq.producer.client"]


def test_the_cli_runs_beside_a_users_jobs_py(users_directory: Path) -> None:
    mlxq = Path(sys.executable).with_name("mlxq")
    run = subprocess.run(
        [str(mlxq), "--help"],
        cwd=users_directory,
        env=_env_without_checkout(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "generate" in run.stdout and "worker" in run.stdout


def test_a_name_mlxq_does_not_have_is_an_attribute_error() -> None:
    import mlxq

    with pytest.raises(AttributeError, match="no attribute 'Clinet'"):
        _ = mlxq.Clinet  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_wheel_holds_only_the_mlxq_package(tmp_path: Path) -> None:
    """The built wheel puts one top-level package on sys.path, `mlxq`, with the three folders in it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("mlxq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"mlxq"}
    for module in ("mlxq/__init__.py", "mlxq/jobs/keys.py", "mlxq/producer/client.py", "mlxq/worker/cli.py"):
        assert module in names
    assert "mlxq/worker/engine/models/llama.py" in names  # sub-packages come along
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mlxq = mlxq.producer.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_mlxq_re_exports_exactly_the_producers_api() -> None:
    """`mlxq.__all__` repeats `mlxq.producer.__all__` (so that `import mlxq` stays light): they agree,
    and every name resolves to the producer's own object."""
    import mlxq
    import mlxq.producer

    assert sorted(mlxq.__all__) == sorted(mlxq.producer.__all__)
    for name in mlxq.__all__:
        assert getattr(mlxq, name) is getattr(mlxq.producer, name)
