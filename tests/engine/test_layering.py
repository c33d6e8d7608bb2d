"""The house's import rules, read from the source: producer -> jobs <- worker, the queue service above
the engine, and no import circle inside a package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path) -> str:
    """The installed name of a source file: the top-level folders are `mlxq.jobs`, `mlxq.worker`, ..."""
    parts = ["mlxq", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (relative imports resolved), at any depth of the file."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _offending(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in _sources(package):
        bad = sorted(m for m in _imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            out[str(path.relative_to(ROOT))] = bad
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        (
            "worker/engine",
            (
                "redis",
                "rq",
                "tenacity",
                "mlxq.jobs.keys",
                *(
                    f"mlxq.worker.{m}"
                    for m in (
                        "service",
                        "rq_worker",
                        "rq_loop",
                        "rq_batches",
                        "job_host",
                        "job_results",
                        "generation_jobs",
                        "score_jobs",
                        "job_claim",
                        "score_claim",
                        "job_watch",
                        "finalizer",
                        "stream_writer",
                        "metrics",
                        "settings",
                        "cli",
                        "allowlist",
                        "modelfiles",
                    )
                ),
            ),
        ),
        ("jobs", ("mlx", "mlxq.worker", "mlxq.producer")),
        ("producer", ("mlx", "mlxq.worker")),
    ],
)
def test_a_package_imports_nothing_above_or_beside_it(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offending(package, forbidden) == {}


def test_the_queue_service_reaches_mlx_only_through_the_engine() -> None:
    service = sorted((ROOT / "worker").glob("*.py"))  # worker/engine and worker/modelfiles are below
    assert {
        str(path.relative_to(ROOT)): bad
        for path in service
        if (bad := sorted(m for m in _imports(path) if m == "mlx" or m.startswith("mlx.")))
    } == {}


def test_the_producer_dispatches_to_the_worker_cli_only_when_asked() -> None:
    """`producer.cli` hands `worker` and `import-gguf` to `worker.cli`, imported inside the call."""
    trees = [ast.parse(path.read_text()) for path in _sources("producer/cli")]
    assert trees
    top = {
        alias.name if isinstance(node, ast.Import) else node.module
        for tree in trees
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in top if m and m.startswith("mlxq.worker")}


@pytest.mark.parametrize("package", ["jobs", "producer", "worker"])
def test_no_import_circle_inside_a_package(package: str) -> None:
    modules = {_module(p): p for p in _sources(package)}
    graph = {
        name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()
    }
    # A package's own __init__ re-exporting its children is not a circle of the code.
    for name in graph:
        graph[name] = {
            m for m in graph[name] if not (name.startswith(m + ".") and modules[m].name == "__init__.py")
        }
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        seen[name] = 1
        for nxt in sorted(graph[name]):
            if seen.get(nxt) == 1:
                return [*path, name, nxt]
            if nxt not in seen and (circle := visit(nxt, [*path, name])) is not None:
                return circle
        seen[name] = 2
        return None

    for name in sorted(graph):
        if name not in seen:
            assert visit(name, []) is None


def test_everything_imports_the_packages_by_their_installed_names() -> None:
    """`jobs`, `worker` and `producer` are installed as `mlxq.*` only; an import of the bare name would
    work in a checkout and fail (or find a user's own `jobs.py`) once installed."""
    bare = ("jobs", "worker", "producer")
    sources = [p for d in ("jobs", "worker", "producer", "tests", "bench") for p in (ROOT / d).rglob("*.py")]
    offending = {
        str(path.relative_to(ROOT)): sorted(m for m in _imports(path) if m.split(".")[0] in bare)
        for path in [*sources, ROOT / "demo.py"]
    }
    assert {path: bad for path, bad in offending.items() if bad} == {}
