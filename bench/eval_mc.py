"""`python -m bench.eval_mc`: a multiple-choice evaluation workload, mlxq's lm-eval model through the queue
against `mlx_lm.evaluate.MLXLM` (mlx-lm's own lm-eval backend), on one checkpoint, in one run.

The workload is shaped like lm-eval's multiple-choice tasks: a few-shot prefix shared by every question,
then a question, then 4 continuations of 5-30 tokens each; lm-eval hands a backend all of an
evaluation's (context, continuation) requests in one `loglikelihood` call, and so does this. Both paths
get that same list: mlx-lm computes each question's context once and its continuations as one batch;
mlxq submits continuation rows as score jobs to a worker (a `bench.worker_proc` subprocess), which
shares the few-shot prefix across all rows and jobs. The figure is requests per second over the whole
call (mlxq: submit to last result read back), in turns of alternating order, each turn on a workload of
its own (so no path meets an earlier turn's text in a cache); the first turn warms up and is dropped.
Both paths' loglikelihoods are compared too: they agree where the two tokenize a request alike (mlx-lm
encodes context + continuation without lm-eval's whitespace move).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
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


class MlxLmPath:
    """mlx-lm's own lm-eval backend, loaded once."""

    name = "mlx_lm.evaluate MLXLM"

    def __init__(self, model: Path) -> None:
        from mlx_lm.evaluate import MLXLM

        self.lm = MLXLM(str(model), use_chat_template=False)

    def loglikelihood(self, requests: list[Request]) -> list[Any]:
        return list(self.lm.loglikelihood(requests))


class MlxqPath:
    """mlxq's lm-eval model, score jobs to one worker through Redis."""

    name = "mlxq (lm-eval model, queue, one worker)"

    def __init__(self, lm: Any) -> None:
        self.lm = lm

    def loglikelihood(self, requests: list[Request]) -> list[Any]:
        return list(self.lm.loglikelihood(requests))


def timed(path: MlxLmPath | MlxqPath, requests: list[Request]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    got = path.loglikelihood(requests)
    return time.perf_counter() - t0, got


def rotate(
    paths: list[MlxLmPath | MlxqPath], questions: int, repeats: int
) -> tuple[list[dict[str, float]], list[float]]:
    """`repeats` + 1 turns, each on a workload of its own (a new few-shot prefix and new questions, so no
    path finds an earlier turn's text in a cache), the paths' order alternating; turn 0 warms up and is
    dropped. Returns each kept turn's seconds per path and the loglikelihood differences of all turns."""
    turns: list[dict[str, float]] = []
    diffs: list[float] = []
    for turn in range(repeats + 1):
        requests = workload(questions, seed=turn)
        order = paths if turn % 2 == 0 else paths[::-1]
        seconds: dict[str, float] = {}
        got: dict[str, list[Any]] = {}
        for path in order:
            mx.clear_cache()
            seconds[path.name], got[path.name] = timed(path, requests)
        a, b = (got[p.name] for p in paths)
        diffs += [abs(x[0] - y[0]) for x, y in zip(a, b, strict=True)]
        if turn > 0:
            turns.append(seconds)
        print(
            f"turn {turn}{' (warm-up)' if turn == 0 else ''}: "
            + ", ".join(f"{name} {len(requests) / s:.1f} req/s" for name, s in seconds.items()),
            flush=True,
        )
    return turns, diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.eval_mc", description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny | llama-1b | smollm2 | a model folder [tiny]")
    p.add_argument("--questions", type=int, default=64, help="questions (4 requests each) [64]")
    p.add_argument("--repeats", type=int, default=10, help="timed turns after a warm-up turn [10]")
    p.add_argument("--redis-url", default="private", help="a Redis URL, or `private` [private]")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--label", default=None)
    args = p.parse_args(argv)
    model = checkpoint(args.model, Path.home() / ".cache" / "mlxq" / "bench-models")
    requests = len(workload(args.questions))
    mlx_lm = MlxLmPath(model)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        url = stack.enter_context(private_redis()) if args.redis_url == "private" else args.redis_url
        turns, diffs = rotate(
            [mlx_lm, stack.enter_context(mlxq_path(model, url, Path(tmp)))], args.questions, args.repeats
        )
    ratios = [t[MlxLmPath.name] / t[MlxqPath.name] for t in turns]
    rates = {name: [requests / t[name] for t in turns] for name in (MlxLmPath.name, MlxqPath.name)}
    result = {
        "model": args.model,
        "device": str(mx.default_device()),
        "commit": commit_label(),
        "questions": args.questions,
        "requests": requests,
        "repeats": len(turns),
        "mlx_lm_requests_per_s": statistics.median(rates[MlxLmPath.name]),
        "mlxq_requests_per_s": statistics.median(rates[MlxqPath.name]),
        "mlx_lm_requests_per_s_range": [min(rates[MlxLmPath.name]), max(rates[MlxLmPath.name])],
        "mlxq_requests_per_s_range": [min(rates[MlxqPath.name]), max(rates[MlxqPath.name])],
        "speedup": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
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
            f"# {label}: multiple-choice loglikelihood, {requests} requests ({args.questions} questions x 4)",
            "",
            f"{result['repeats']} turns in rotating order, each on its own workload (a warm-up turn dropped);"
            " median (range) of the turns.",
            "",
            "| path | requests/s |",
            "| --- | --- |",
            f"| {MlxLmPath.name} | {_spread(result, 'mlx_lm_requests_per_s')} |",
            f"| {MlxqPath.name} | {_spread(result, 'mlxq_requests_per_s')} |",
            "",
            f"mlxq / mlx-lm: {_spread(result, 'speedup', 'x')}. |loglikelihood difference|: median "
            f"{result['loglikelihood_abs_diff_median']:.2g}, max {result['loglikelihood_abs_diff_max']:.2g}.",
        ]
    )
    (out / f"{label}.md").write_text(table + "\n")
    print(table)
    return 0


def _spread(result: dict[str, Any], key: str, unit: str = "") -> str:
    lo, hi = result[f"{key}_range"]
    return (
        f"{result[key]:.2f}{unit} ({lo:.2f}-{hi:.2f})" if unit else f"{result[key]:.1f} ({lo:.1f}-{hi:.1f})"
    )


@contextlib.contextmanager
def mlxq_path(model: Path, redis_url: str, workdir: Path) -> Iterator[MlxqPath]:
    from mlxq.producer.lm_eval_model import MlxqLM

    with BenchWorker(str(model), redis_url, workdir, "eval").start() as worker:
        worker.wait_ready()
        yield MlxqPath(MlxqLM(redis_url=redis_url, queue=worker.queue_name))


if __name__ == "__main__":
    sys.exit(main())
