"""The commands `mlxq` hands elsewhere before parsing: `worker` and `import-gguf` to `worker.cli`
(imported only then: it needs MLX), `eval` to lm-evaluation-harness."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

WORKER_COMMANDS = ("worker", "import-gguf", "eval")
NEEDS_MLX = (
    "mlxq: the worker needs MLX: in the mlxq repository (or with its wheel), pip install '.[cpu]' on Linux, "
    "'.[worker]' on macOS (README: Install)"
)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Listed for --help only: main() hands these to worker.cli before parsing.
    sub.add_parser("worker", help="run a worker (needs MLX; see `mlxq worker --help`)", add_help=False)
    sub.add_parser("import-gguf", help="convert a GGUF file to a model folder (needs MLX)", add_help=False)
    sub.add_parser(
        "eval",
        help="run lm-evaluation-harness with `--model mlxq` through the queue (the `eval` extra); "
        "every lm-eval flag is passed through",
        add_help=False,
    )


def split_worker_command(argv: list[str]) -> tuple[list[str], str | None] | None:
    """`[worker|import-gguf, ...]` and the global --redis-url, if argv runs one of those; else None."""
    i, redis_url = 0, None
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--redis-url" and i + 1 < len(argv):
            redis_url, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--redis-url="):
            redis_url = argv[i].split("=", 1)[1]
        i += 1
    if i < len(argv) and argv[i] in WORKER_COMMANDS:
        return argv[i:], redis_url
    return None


def run_eval_command(argv: list[str], redis_url: str | None) -> int:
    """Hand `mlxq eval ...` to lm-eval's command line with the `mlxq` model registered
    (`producer.lm_eval_model`); the global --redis-url is the model's default Redis."""
    if redis_url is not None:
        os.environ["MLXQ_REDIS_URL"] = redis_url
    try:
        module = importlib.import_module("mlxq.producer.lm_eval_model")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        print(
            "mlxq: `mlxq eval` needs lm-evaluation-harness: pip install lm-eval==0.4.13 (or, in the mlxq "
            "repository, pip install '.[eval]')",
            file=sys.stderr,
        )
        return 2
    return int(module.run_eval(argv[1:]))


def run_worker_command(argv: list[str], redis_url: str | None) -> int:
    """Hand `mlxq worker ...`/`mlxq import-gguf ...` to `worker.cli`, imported only now (it needs MLX)."""
    if argv[0] == "eval":
        return run_eval_command(argv, redis_url)
    if redis_url is not None and argv[0] == "worker" and "--redis-url" not in argv:
        argv = [*argv, "--redis-url", redis_url]
    try:
        module = importlib.import_module("mlxq.worker.cli")
        return int(module.main(argv))
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "mlx":
            raise
        print(NEEDS_MLX, file=sys.stderr)
        return 2
