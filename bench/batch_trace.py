"""Probe: where a generation batch's time goes, step by step (no Redis).

    python -m bench.batch_trace [--model tiny|llama-1b|PATH] [--jobs 64] [--max-tokens 128]
        [--prompt-words 48] [--runs 3] [--staggered] [--prefix-cache off|on|ab] [--ab-kernel] [--phases]

The worker's `GenerationBatch` on `bench.batch_generate`'s prompts, all admitted at once and stepped
until empty, `--runs` times (the first meets every shape for the first time). Per run: wall time and
tokens/s stepping freely, then once more with a device sync after every step, to split the time into
steps that prefilled (with how many prompts) and decode-only steps (by row count).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

from .batch_generate import _NoSink, _payloads
from .checkpoints import checkpoint


def _run(
    engine: object, payloads: list[dict], sync: bool
) -> tuple[float, int, list[tuple[int, int, int, float]]]:
    from jobs.schema import GenerateRequest
    from worker.engine.generation_batch import GenerationBatch

    batch = GenerationBatch(engine, len(payloads), 2 << 30)  # type: ignore[arg-type]
    for i, p in enumerate(payloads):
        batch.admit(f"r{i}", GenerateRequest(**p), _NoSink(), lambda: False)
    steps: list[tuple[int, int, int, float]] = []  # (prompts started, decode rows, rows that left, ms)
    tokens = 0
    mx.synchronize()
    t0 = time.perf_counter()
    while len(batch):
        waiting, rows = len(batch.waiting), len(batch.decoding)
        s0 = time.perf_counter()
        ended = batch.step()
        for done in ended:
            if done.error is not None:
                raise done.error
            tokens += done.result.usage.completion_tokens if done.result else 0
        batch.settle()  # as the worker does once it has written the results
        if sync:
            mx.synchronize()
        steps.append((waiting - len(batch.waiting), rows, len(ended), (time.perf_counter() - s0) * 1000))
    mx.synchronize()
    return time.perf_counter() - t0, tokens, steps


class _Phases:
    """Seconds and calls of wrapped functions; `sync` ones are timed between device syncs, so a
    function's time is its own work, not what was queued before it (nested ones overlap)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label: str, sync: bool = True) -> None:
        original = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            if sync:
                mx.synchronize()
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if sync:
                    mx.synchronize()
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _phases_run(engine: object, payloads: list[dict]) -> tuple[float, _Phases]:
    """One run, each phase of a step timed between device syncs."""
    from worker.engine import generation_batch
    from worker.engine.generate import DecodeBatch

    phases = _Phases()
    phases.wrap(generation_batch, "prefill_rows", "prefill_rows (graph)")
    phases.wrap(generation_batch, "with_memory_retry", "prefill rows forward (graph + eval)")
    phases.wrap(engine, "begin_cache", "begin_cache (prefix cache lookup)")
    if engine.prefix_cache is not None:  # type: ignore[attr-defined]
        phases.wrap(engine.prefix_cache, "offer", "prefix_cache.offer")  # type: ignore[attr-defined]
    for name in ("add", "step", "remove"):
        phases.wrap(DecodeBatch, name, f"DecodeBatch.{name}")
    phases.wrap(engine, "finish_reason_after", "finish_reason_after (CPU, per row)", sync=False)
    phases.wrap(engine, "generate_result", "generate_result (CPU)", sync=False)
    try:
        wall, _, _ = _run(engine, payloads, True)
    finally:
        phases.undo()
    return wall, phases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch_trace")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--staggered", action="store_true", help="jobs' max tokens spread over 1/4..1 of it")
    ap.add_argument(
        "--prefix-cache",
        choices=["off", "on", "ab"],
        default="off",
        help="the engine's prefix cache (1 GiB) off, on, or alternating runs with and without it",
    )
    ap.add_argument(
        "--ab-kernel",
        action="store_true",
        help="alternate runs with and without the ragged-attention kernel (where it runs: CUDA)",
    )
    ap.add_argument("--phases", action="store_true", help="one more run, each phase timed between syncs")
    args = ap.parse_args(argv)
    from worker.engine import ragged_attention
    from worker.engine.engine import Engine, EngineOptions

    path = checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")
    use_cache = args.prefix_cache != "off"
    engine = Engine.load(str(path), EngineOptions(prefix_cache_bytes=(1 << 30) if use_cache else 0))
    cache = engine.prefix_cache
    print(f"model={args.model} jobs={args.jobs} max_tokens={args.max_tokens} device={mx.default_device()}")
    print("\n| run | ragged kernel | prefix cache | wall s | tok/s | steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    on = ragged_attention.available()
    for r in range(args.runs):
        for kernel in [on, False] if args.ab_kernel and on else [on]:
            for cached in [True, False] if args.prefix_cache == "ab" else [use_cache]:
                ragged_attention.available = lambda kernel=kernel: kernel  # type: ignore[assignment]
                engine.prefix_cache = cache if cached else None
                tag = f"t{r}-{kernel}-{cached}-"
                payloads = _payloads(args.jobs, args.max_tokens, args.prompt_words, tag, args.staggered)
                wall, tokens, steps = _run(engine, payloads, False)
                print(f"| {r + 1} | {kernel} | {cached} | {wall:.3f} | {tokens / wall:,.0f} | {len(steps)} |")
    ragged_attention.available = lambda: on  # type: ignore[assignment]
    engine.prefix_cache = cache
    payloads = _payloads(args.jobs, args.max_tokens, args.prompt_words, "sync-", args.staggered)
    wall, tokens, steps = _run(engine, payloads, True)
    print(f"\nSynced after every step (prefix cache {cache is not None}): wall {wall:.3f} s, ", end="")
    print(f"{tokens / wall:,.0f} tok/s, {len(steps)} steps")
    print("\n| step | prompts started | decode rows | rows that left | ms |\n| --- | --- | --- | --- | --- |")
    for i, (started, rows, left, ms) in enumerate(steps):
        if started or i < 3:
            print(f"| {i} | {started} | {rows} | {left} | {ms:.2f} |")
    by_rows: dict[tuple[int, bool], list[float]] = defaultdict(list)
    for started, rows, left, ms in steps:
        if not started:
            by_rows[(rows, left > 0)].append(ms)
    print("\n| decode-only steps: rows | rows left in it | steps | median ms | total ms |")
    print("| --- | --- | --- | --- | --- |")
    for (rows, left), times in sorted(by_rows.items()):
        print(f"| {rows} | {left} | {len(times)} | {statistics.median(times):.2f} | {sum(times):.1f} |")
    prefill_ms = sum(ms for started, _, _, ms in steps if started)
    leaving_ms = sum(ms for started, _, left, ms in steps if left and not started)
    print(f"\nsteps that started prompts: {prefill_ms:.1f} ms of {wall * 1000:.1f} ms")
    print(f"decode steps in which rows left: {leaving_ms:.1f} ms")
    if args.phases:
        payloads = _payloads(args.jobs, args.max_tokens, args.prompt_words, "phases-", args.staggered)
        wall, phases = _phases_run(engine, payloads)
        print(f"\nPhases, synced around each (wall {wall * 1000:.1f} ms; nested phases overlap):\n")
        print("| phase | calls | total ms | ms per call |\n| --- | --- | --- | --- |")
        for label, seconds in sorted(phases.seconds.items(), key=lambda kv: -kv[1]):
            n = phases.calls[label]
            print(f"| {label} | {n} | {seconds * 1000:.1f} | {seconds * 1000 / n:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
