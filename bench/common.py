"""What every figure shares: sizes, the loaded engine and baseline, long-lived workers, memory probes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import redis

from mlxq.worker.engine import Engine

from .baseline import MlxLm
from .prompts import PromptMaker
from .queue_client import BenchWorker


@dataclass(frozen=True)
class Sizes:
    """How big each figure is: `gpu` is the targets' own size; `cpu`, `cpu-real` and `smoke` scale it down."""

    name: str
    gen_prompt: int = 128
    gen_tokens: int = 256
    gen_reps: int = 3
    prefill: tuple[int, ...] = (512, 2048, 8192)
    prefill_reps: int = 3
    score_rows: int = 64
    score_prefix: int = 2048
    score_own: int = 64
    score_candidates: int = 8
    score_baseline_rows: int = 64  # rows that run one full forward each (a rate: fewer rows on CPU)
    score_reps: int = 8  # rotating turns of the shared-prefix paths (`fig_score._shared_prefix_turns`)
    cache_prefix: int = 8192
    cache_tail: int = 16
    queue_jobs: int = 5000
    queue_jobs_unbatched: int = 1000
    queue_prompt: int = 16
    profile_jobs: int = 0  # > 0: one more pass under cProfile, to show where the worker's time goes
    batch_jobs: tuple[int, ...] = (1, 8, 64)  # concurrent generation jobs, one run per size
    batch_tokens: int = 128
    batch_reps: int = 3
    structured_jobs: tuple[int, ...] = (1, 64)  # constrained generation jobs at once (`fig_structured`)
    speculation_jobs: tuple[int, ...] = (1, 8, 64)  # generation jobs at once (`fig_speculation`)
    speculation_tokens: int = 128
    speculation_reps: int = 10  # rotating turns per row (`fig_speculation`), after one that warms up
    speculation_kinds: tuple[str, ...] = ("copy-heavy", "prose")  # prompt kinds (`fig_speculation`)
    speculation_modes: tuple[str, ...] = ()  # short names of modes besides plain (`fig_speculation.MODES`)
    logprob_prompt: int = 8192  # prompt logprobs of one prompt this long (`fig_logprobs`)
    logprob_reps: int = 3
    timeout_s: float = 600.0


SIZES = {
    "gpu": Sizes("gpu"),
    "cpu": Sizes(
        "cpu",
        gen_prompt=64,
        gen_tokens=128,
        prefill=(128, 512, 2048),
        prefill_reps=2,
        score_prefix=512,
        score_baseline_rows=16,
        cache_prefix=2048,
        profile_jobs=1000,
        batch_jobs=(1, 8),
        batch_tokens=64,
        speculation_jobs=(1, 4),
        speculation_tokens=64,
        speculation_reps=3,
    ),
    "cpu-real": Sizes(
        "cpu-real",
        gen_prompt=32,
        gen_tokens=32,
        gen_reps=2,
        prefill=(32, 128),
        prefill_reps=1,
        score_rows=16,
        score_prefix=128,
        score_own=16,
        score_baseline_rows=2,
        cache_prefix=256,
        queue_jobs=0,
        profile_jobs=0,
        batch_jobs=(1, 4),
        batch_tokens=16,
        batch_reps=1,
        speculation_jobs=(1, 4),
        speculation_tokens=64,
        speculation_reps=3,
        logprob_reps=1,  # one turn each: an 8k-token prompt takes minutes on this CPU
    ),
    "smoke": Sizes(
        "smoke",
        gen_prompt=16,
        gen_tokens=16,
        gen_reps=1,
        prefill=(32, 64),
        prefill_reps=1,
        score_rows=8,
        score_prefix=64,
        score_own=8,
        score_baseline_rows=4,
        score_reps=1,
        cache_prefix=256,
        queue_jobs=100,
        queue_jobs_unbatched=50,
        profile_jobs=50,
        batch_jobs=(1, 4),
        batch_tokens=8,
        batch_reps=1,
        structured_jobs=(1, 4),
        speculation_jobs=(1, 2),
        speculation_tokens=8,
        speculation_reps=1,
        logprob_prompt=512,
        logprob_reps=1,
        timeout_s=120.0,
    ),
}


@dataclass
class Bench:
    """The state figures run against: one engine and one mlx-lm model in this process, workers beside."""

    model_path: str
    tiny_path: str  # the queue-overhead figure always runs the tiny model
    sizes: Sizes
    redis_url: str
    workdir: Path
    engine: Engine
    mlxlm: MlxLm
    maker: PromptMaker
    conn: redis.Redis
    workers: dict[str, BenchWorker] = field(default_factory=dict)

    def worker(self, label: str = "default", env: dict[str, str] | None = None) -> BenchWorker:
        """A long-lived worker on the main model (started once, reused by every figure)."""
        w = self.workers.get(label)
        if w is None:
            w = BenchWorker(self.model_path, self.redis_url, self.workdir, label, env=env).start()
            self.workers[label] = w
            w.wait_ready()
        return w

    def only_worker(self, label: str, env: dict[str, str] | None = None) -> BenchWorker:
        """`worker(label)` with every other worker stopped first: each holds its own copy of the model,
        and a large model (the 17 GB MoE) cannot hold a fourth copy beside this process's two."""
        for other in [k for k in self.workers if k != label]:
            self.workers.pop(other).stop()
        return self.worker(label, env)

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()

    @property
    def no_eos(self) -> dict[int, float]:
        """Logit bias that keeps a random model from stopping early: fixed-length runs."""
        return {i: -100.0 for i in self.engine.tokenizer.eos_ids}


@contextmanager
def memory() -> Iterator[dict[str, int]]:
    """MLX memory of this process over a block: peak, and resident before it (weights, caches)."""
    mx.synchronize()
    out = {"active0": mx.get_active_memory()}
    mx.reset_peak_memory()
    yield out
    mx.synchronize()
    out["peak"] = mx.get_peak_memory()


def mem_fields(peak: int, active0: int) -> dict[str, float]:
    return {"peak_mib": round(peak / 2**20, 1), "over_resident_mib": round(max(0, peak - active0) / 2**20, 1)}


def worker_memory(records: list[dict[str, Any]]) -> dict[str, float]:
    """Peak over a worker's engine calls, and how far it went above what was resident at the call."""
    calls = [r for r in records if "peak" in r]
    if not calls:
        return {}
    top = max(calls, key=lambda r: r["peak"])
    return mem_fields(top["peak"], top["active0"])


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def now() -> float:
    return time.perf_counter()


@contextmanager
def phase_timers(targets: dict[str, tuple[Any, str]]) -> Iterator[dict[str, dict[str, float]]]:
    """Time calls of `owner.attr` for each named target while the block runs (patched, then restored).

    Only for code that synchronises itself (an `mx.eval`, `.item()` or `.tolist()` inside), so that
    the wall time of a call is the time of its work. Nested targets each count their own full time.
    """
    out: dict[str, dict[str, float]] = {name: {"s": 0.0, "calls": 0} for name in targets}
    saved = []
    for name, (owner, attr) in targets.items():
        original = getattr(owner, attr)
        saved.append((owner, attr, original))

        def timed(*args: Any, _fn: Any = original, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                out[_name]["s"] += time.perf_counter() - t0
                out[_name]["calls"] += 1

        setattr(owner, attr, timed)
    try:
        yield out
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)
