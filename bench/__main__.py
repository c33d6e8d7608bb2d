"""`python -m bench`: mlxq against mlx-lm on one checkpoint, in one run; tables printed, JSON written.

See bench/README.md for what each figure measures and how to run it here and on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import redis
from mlx.utils import tree_flatten

from mlxq.worker.engine import Engine, EngineOptions

from . import (
    fig_batch,
    fig_decode_ab,
    fig_first_job,
    fig_generate,
    fig_logprobs,
    fig_score,
    fig_speculation,
    fig_structured,
    report,
)
from .baseline import MlxLm
from .checkpoints import checkpoint
from .common import SIZES, Bench
from .prompts import PromptMaker
from .queue_client import private_redis

FIGURES: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "generation": fig_generate.generation,
    "prefill": fig_generate.prefill_rates,
    "warm_cache": fig_generate.warm_cache,
    "scoring": fig_score.scoring,
    "queue": fig_score.queue_overhead,
    "batch": fig_batch.batch_generation,
    "decode_ab": fig_decode_ab.decode_ab,
    "structured": fig_structured.structured,
    "first_job": fig_first_job.first_job,
    "speculation": fig_speculation.speculation,
    "prompt_logprobs": fig_logprobs.prompt_logprobs,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument(
        "--model",
        default="tiny",
        help="a name in checkpoints.SHAPES or QUANTIZED | smollm2 | a model folder [tiny]",
    )
    p.add_argument("--sizes", default="cpu", choices=sorted(SIZES), help="figure sizes [cpu]")
    p.add_argument(
        "--batch-jobs",
        help="comma-separated numbers of concurrent jobs for the batch figure, in place of the sizes' own",
    )
    p.add_argument(
        "--batch-reps", type=int, help="repetitions of the batch and structured figures [the sizes']"
    )
    p.add_argument(
        "--speculation-jobs",
        help="comma-separated numbers of concurrent jobs for the speculation figure, in place of the "
        "sizes' own",
    )
    p.add_argument(
        "--speculation-reps", type=int, help="rotating turns of the speculation figure [the sizes']"
    )
    p.add_argument(
        "--speculation-kinds",
        help="comma-separated prompt kinds of the speculation figure [copy-heavy,prose]",
    )
    p.add_argument(
        "--speculation-modes",
        help="comma-separated modes of the speculation figure besides plain: lookup, forced, draft, "
        "dflash, mtp, mtp-forced (a model with an MTP layer), self (the model as its own draft) "
        "[all but self]",
    )
    p.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated figures [{','.join(FIGURES)}]")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for JSON and tables")
    p.add_argument("--label", help="file name of the results [SIZES-MODEL]")
    p.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/15",
        help="the Redis to use, or `private`: start a throw-away redis-server for this run [DB 15 of :6379]",
    )
    p.add_argument("--render", metavar="JSON", help="only print (and rewrite the .md of) a saved result")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "mlxq" / "bench-models"))
    return p.parse_args(argv)


def _write(out: Path, label: str, result: dict[str, Any]) -> None:
    result["targets"] = report.targets(result["figures"])
    (out / f"{label}.json").write_text(json.dumps(result, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `timeout` sends SIGTERM: exit through `finally` so workers stop and what was measured is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render:
        saved = Path(args.render)
        text = report.render(json.loads(saved.read_text()))
        saved.with_suffix(".md").write_text(text + "\n")
        print(text)
        return 0
    if args.redis_url == "private":
        with private_redis() as url:
            args.redis_url = url
            return run(args)
    return run(args)


def _env_on(name: str) -> bool:
    """Whether a boolean environment setting the workers also read is on (the in-process engine's)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_flag(name: str) -> bool | None:
    """A boolean setting the workers also read whose default is the engine's (`MLXQ_MASKS_IN_PLACE`,
    `MLXQ_COMPILED_STEPS`), as a worker reads it, so a figure can be taken both ways on one machine;
    unset: None, the engine's own default."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"{name} must be true or false, got {value!r}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    sizes = SIZES[args.sizes]
    if args.batch_jobs:
        sizes = dataclasses.replace(sizes, batch_jobs=tuple(int(n) for n in args.batch_jobs.split(",")))
    if args.batch_reps:
        sizes = dataclasses.replace(sizes, batch_reps=args.batch_reps)
    if args.speculation_jobs:
        jobs = tuple(int(n) for n in args.speculation_jobs.split(","))
        sizes = dataclasses.replace(sizes, speculation_jobs=jobs)
    if args.speculation_reps:
        sizes = dataclasses.replace(sizes, speculation_reps=args.speculation_reps)
    if args.speculation_kinds:
        kinds = tuple(k.strip() for k in args.speculation_kinds.split(","))
        sizes = dataclasses.replace(sizes, speculation_kinds=kinds)
    if args.speculation_modes:
        modes = tuple(m.strip() for m in args.speculation_modes.split(","))
        sizes = dataclasses.replace(sizes, speculation_modes=modes)
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in only if f not in FIGURES]
    if unknown:
        print(f"unknown figures {unknown}; choose from {list(FIGURES)}", file=sys.stderr)
        return 2
    cache_dir = Path(args.cache_dir)
    try:
        model_path = checkpoint(args.model, cache_dir)
    except (ImportError, FileNotFoundError) as e:
        print(f"skipped: model {args.model!r} is not available here ({e})", file=sys.stderr)
        return 0
    tiny_path = checkpoint("tiny", cache_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = args.label or f"{sizes.name}-{Path(args.model).name}"
    workdir = Path(tempfile.mkdtemp(prefix="mlxq-bench-"))

    t_load = time.perf_counter()
    compiled = _env_flag("MLXQ_COMPILED_STEPS")
    options = EngineOptions(
        masks_in_place=_env_flag("MLXQ_MASKS_IN_PLACE"),
        build_ahead=_env_on("MLXQ_BUILD_AHEAD"),
        compiled_steps=compiled,
    )
    engine = Engine.load(str(model_path), options)
    dtype = next(v.dtype for _, v in tree_flatten(engine.model.parameters()))
    mlxlm = MlxLm.load(str(model_path), dtype)
    mx.clear_cache()  # what loading freed: the workers beside this process need the device's memory
    print(
        f"loaded {model_path} ({dtype}) on {mx.default_device()} in {time.perf_counter() - t_load:.1f}s"
        f" (masks in place: {engine.masks_in_place}, built ahead: {engine.build_ahead},"
        f" compiled steps asked: {'default' if compiled is None else compiled})",
        flush=True,
    )
    conn = redis.Redis.from_url(args.redis_url)
    conn.ping()
    bench = Bench(
        str(model_path),
        str(tiny_path),
        sizes,
        args.redis_url,
        workdir,
        engine,
        mlxlm,
        PromptMaker(engine.tokenizer, seed=1),
        conn,
    )
    result: dict[str, Any] = {
        "meta": report.metadata(args.model, mlxlm.dtype, sizes.name, mlxlm.version),
        "redis": "private server" if "127.0.0.1:6379" not in args.redis_url else args.redis_url,
        "sizes": sizes.__dict__,
        "figures": {},
    }
    try:
        for name in only:
            t0 = time.perf_counter()
            print(f"--- {name} ...", flush=True)
            try:
                result["figures"][name] = FIGURES[name](bench)
            except Exception as e:
                traceback.print_exc()
                result["figures"][name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
            result["figures"][name]["seconds"] = time.perf_counter() - t0
            result["figures"][name]["loadavg_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"--- {name} took {time.perf_counter() - t0:.1f}s", flush=True)
            _write(out, label, result)
    finally:
        bench.close()
        logs = [
            f"===== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-60:])
            for p in sorted(workdir.glob("worker-*.log"))
        ]
        (out / f"{label}-workers.log").write_text("\n".join(logs) + "\n")
    _write(out, label, result)
    text = report.render(result)
    (out / f"{label}.md").write_text(text + "\n")
    print(text)
    for prof_label, prof in result["figures"].get("queue", {}).get("cprofile", {}).items():
        print(f"\n### cProfile of the worker, {prof_label} (top by own time)\n```\n{prof[:6000]}\n```")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
