"""Probe: what the prefix cache costs a generation batch, piece by piece (no Redis).

    python -m bench.prefix_cache_ab [--model tiny|llama-1b|PATH] [--runs 4] [--staggered]

The worker's `GenerationBatch` on `bench.batch_generate`'s 64 prompts (distinct from their first few
tokens), stepped freely until empty, in one process with the cache configured per run, runs taking
turns: on; off; on without offering finished rows; on without any offer (lookups find only what
earlier runs left); on, emptied before the run. Prints tokens/s per run (the first round meets every
shape and is dropped) and the median; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from .batch_generate import _payloads
from .batch_trace import _run
from .checkpoints import checkpoint

CONFIGS = ["on", "off", "no finish offers", "no offers at all", "on, emptied first"]


class _NoOffers:
    """A prefix cache that is looked up but never stored into."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def offer(self, tokens: list[int], cache: list[Any]) -> int:
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_cache_ab")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--staggered", action="store_true", help="jobs' max tokens spread over 1/4..1 of it")
    args = ap.parse_args(argv)
    from worker.engine import generation_batch
    from worker.engine.engine import Engine, EngineOptions

    path = checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")
    engine = Engine.load(str(path), EngineOptions(prefix_cache_bytes=1 << 30))
    cache = engine.prefix_cache
    assert cache is not None
    finish = generation_batch.GenerationBatch._finish

    def finish_without_offer(self: Any, seq: Any, reason: Any, _: Any) -> Any:
        return finish(self, seq, reason, None)

    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(args.runs):
        for n, name in enumerate(CONFIGS):
            generation_batch.GenerationBatch._finish = finish  # type: ignore[method-assign]
            engine.prefix_cache = {"off": None, "no offers at all": _NoOffers(cache)}.get(name, cache)
            if name == "no finish offers":
                generation_batch.GenerationBatch._finish = finish_without_offer  # type: ignore[method-assign]
            if name == "on, emptied first":
                cache.evict_all()
            payloads = _payloads(64, 128, 48, f"c{r}-{n}-", args.staggered)
            wall, tokens, _ = _run(engine, payloads, False)
            if r:
                rates[name].append(tokens / wall)
            print(f"round {r + 1} {name}: {wall:.3f} s, {tokens / wall:,.0f} tok/s", flush=True)
    generation_batch.GenerationBatch._finish = finish  # type: ignore[method-assign]
    lengths = "staggered lengths" if args.staggered else "equal lengths"
    print(f"\n| prefix cache ({args.model}, 64 jobs, {lengths}) | tok/s, rounds 2.. | median |")
    print("| --- | --- | --- |")
    for name in CONFIGS:
        runs = " / ".join(f"{t:,.0f}" for t in rates[name])
        print(f"| {name} | {runs} | {statistics.median(rates[name]) if rates[name] else 0:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
