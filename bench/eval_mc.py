"""`python -m bench.eval_mc`: a multiple-choice evaluation workload, mlxq's lm-eval model through the queue
against `mlx_lm.evaluate.MLXLM` (mlx-lm's own lm-eval backend), on one checkpoint, in one run.

The workload is shaped like lm-eval's multiple-choice tasks: a few-shot prefix shared by every question,
then a question, then 4 continuations of 5-30 tokens each; lm-eval hands a backend all of an
evaluation's (context, continuation) requests in one `loglikelihood` call, and so does this. Both paths
get that same list: mlx-lm computes each question's context once and its continuations as one batch;
mlxq submits continuation rows as score jobs to a worker (a `bench.worker_proc` subprocess), which
shares the few-shot prefix across all rows and jobs. The figure is requests per second over the whole
call (mlxq: submit to last result read back). Both paths' loglikelihoods are compared too: they agree
where the two tokenize a request alike (mlx-lm encodes context + continuation without lm-eval's
whitespace move).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .checkpoints import checkpoint
from .queue_client import BenchWorker, private_redis
from .report import _git_commit as commit_label

WORDS = [
    *("queue", "worker", "model", "prefix", "cache", "token", "batch", "stream", "result", "job", "redis"),
    *("score", "row", "answer", "question", "paris", "france", "river", "mountain", "city", "light"),
    *("water", "stone", "garden", "window", "letter", "music"),
]


@dataclass(frozen=True)
class Request:
    """What lm-eval hands a backend: `args` is (context, continuation)."""

    args: tuple[str, str]


def workload(questions: int, shots: int = 4, seed: int = 0) -> list[Request]:
    import random

    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    fewshot = "".join(f"Question: {words(6, 12)}?\nAnswer: {words(2, 8)}\n\n" for _ in range(shots))
    out = []
    for _ in range(questions):
        context = f"{fewshot}Question: {words(6, 14)}?\nAnswer:"
        out += [Request((context, " " + words(3, 20))) for _ in range(4)]
    return out


def run_mlx_lm(model: Path, requests: list[Request]) -> tuple[float, list[tuple[float, bool]]]:
    from mlx_lm.evaluate import MLXLM

    lm = MLXLM(str(model), use_chat_template=False)
    lm.loglikelihood(requests[:8])  # warm-up
    t0 = time.perf_counter()
    got = lm.loglikelihood(requests)
    return time.perf_counter() - t0, got


def run_mlxq(model: Path, requests: list[Request], redis_url: str, workdir: Path) -> tuple[float, list[Any]]:
    from mlxq.producer.lm_eval_model import MlxqLM

    with BenchWorker(str(model), redis_url, workdir, "eval").start() as worker:
        worker.wait_ready()
        lm = MlxqLM(redis_url=redis_url, queue=worker.queue_name)
        lm.loglikelihood(requests[:8])  # warm-up (the few-shot prefix then sits in the prefix cache)
        t0 = time.perf_counter()
        got = lm.loglikelihood(requests)
        return time.perf_counter() - t0, got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eval_mc", description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny | llama-1b | smollm2 | a model folder [tiny]")
    p.add_argument("--questions", type=int, default=64, help="questions (4 requests each) [64]")
    p.add_argument("--redis-url", default="private", help="a Redis URL, or `private` [private]")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    model = checkpoint(args.model, Path.home() / ".cache" / "mlxq" / "bench-models")
    requests = workload(args.questions)
    with tempfile.TemporaryDirectory() as tmp:
        mlx_s, mlx_got = run_mlx_lm(model, requests)
        mx.clear_cache()
        if args.redis_url == "private":
            with private_redis() as url:
                mlxq_s, mlxq_got = run_mlxq(model, requests, url, Path(tmp))
        else:
            mlxq_s, mlxq_got = run_mlxq(model, requests, args.redis_url, Path(tmp))
    diffs = [abs(a[0] - b[0]) for a, b in zip(mlx_got, mlxq_got, strict=True)]
    result = {
        "model": args.model,
        "device": str(mx.default_device()),
        "commit": commit_label(),
        "questions": args.questions,
        "requests": len(requests),
        "mlx_lm_requests_per_s": len(requests) / mlx_s,
        "mlxq_requests_per_s": len(requests) / mlxq_s,
        "speedup": mlx_s / mlxq_s,
        "loglikelihood_abs_diff_median": statistics.median(diffs),
        "loglikelihood_abs_diff_max": max(diffs),
    }
    label = (
        args.label
        or f"{'gpu' if 'gpu' in result['device'] else 'cpu'}-eval-mc-{args.model}-{result['commit']}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = "\n".join(
        [
            f"# {label}: multiple-choice loglikelihood, {len(requests)} requests "
            f"({args.questions} questions x 4)",
            "",
            "| path | requests/s |",
            "| --- | --- |",
            f"| mlx_lm.evaluate MLXLM | {result['mlx_lm_requests_per_s']:.1f} |",
            f"| mlxq (lm-eval model, queue, one worker) | {result['mlxq_requests_per_s']:.1f} |",
            "",
            f"mlxq / mlx-lm: {result['speedup']:.2f}x. |loglikelihood difference|: median "
            f"{result['loglikelihood_abs_diff_median']:.2g}, max {result['loglikelihood_abs_diff_max']:.2g}.",
        ]
    )
    (out / f"{label}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
