"""Diagnostics behind the headline figures: which part of a path costs what.

- decode: the token loop and the model swapped between mlx-lm and mlxq (a 2x2), the stream they run
  on, the engine's sampler with a logit bias, and the engine writing to a real Redis stream in-process;
- warm cache: engine.generate's time to first token split into tokenization, cache lookup, prefill
  and the first decode step (each phase forced to finish before the next, so each is timed alone).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import mlx.core as mx

import worker.engine.engine
from jobs.schema import GenerateRequest
from worker.engine import Engine
from worker.engine.cache.prefix_cache import PrefixCache
from worker.engine.generate import decode, prefill
from worker.engine.sampler import Sampler
from worker.stream_writer import StreamOptions, StreamWriter

from .common import Bench, median, phase_timers
from .fig_generate import gap_rate, gen_payload, rate
from .queue_client import cleanup

Variant = Callable[[list[int]], list[float]]


class Greedy:
    """The plainest sampler: argmax, nothing observed."""

    def __call__(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def observe(self, token: mx.array) -> None:
        pass


def _mlxq_loop(model: Any, make_cache: Callable[[], list[Any]], ids: list[int], n: int, sampler: Any,
               stream: Any = None) -> list[float]:  # fmt: skip
    """worker.engine.generate's decode loop (one step in flight) on any model; arrival time of each token."""
    ctx: AbstractContextManager[Any] = mx.stream(stream) if stream is not None else nullcontext()
    times = []
    with ctx:
        cache = make_cache()
        if hasattr(model, "hidden"):
            logits = prefill(model, ids, cache, 2048)
        else:  # mlx-lm's model: one call over the prompt, last position
            logits = model(mx.array(ids)[None], cache=cache)[:, -1, :]
        for _token in decode(model, logits, cache, sampler, n):
            times.append(time.perf_counter())
    mx.synchronize()
    return times


def decode_matrix(b: Bench) -> dict[str, Any]:
    """Decode rate of each combination, taking turns each repetition (the first warms up)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    s = b.sizes
    n = s.gen_tokens
    mq, ml = b.engine.model, b.mlxlm.model
    default_stream = mx.default_stream(mx.default_device())

    def mlx_lm_loop(model: Any, cache: Callable[[], list[Any]], stream: Any = None) -> Variant:
        def run(ids: list[int]) -> list[float]:
            kwargs = {"stream": stream} if stream is not None else {}
            gen = generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache(), **kwargs)
            times = [time.perf_counter() for _ in gen]
            mx.synchronize()
            return times

        return run

    def mlxq_loop(
        model: Any, cache: Callable[[], list[Any]], sampler: Callable[[], Any], stream: Any = None
    ) -> Variant:
        return lambda ids: _mlxq_loop(model, cache, ids, n, sampler(), stream)

    def with_bias() -> Sampler:
        return Sampler(mq.args.vocab_size, temperature=0.0, logit_bias=b.no_eos)

    def to_redis_polled(ids: list[int]) -> list[float]:
        """As `to_redis`, with a thread polling Redis every 0.1 s beside it (as the worker's JobWatch)."""
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.1):
                b.conn.exists("mlxq:cancel:bench-none")

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            return to_redis(ids)
        finally:
            stop.set()
            thread.join()

    def to_redis(ids: list[int]) -> list[float]:
        """engine.generate with a real StreamWriter as its sink (Redis writes in the loop), no RQ."""
        text = b.engine.tokenizer.decode(ids)
        request = GenerateRequest.model_validate(gen_payload(b, text, s.gen_tokens))
        job_id = f"bench-diag-{time.time_ns()}"
        writer = StreamWriter(b.conn, job_id, StreamOptions())
        writer.open(attempt=1)
        times: list[float] = []

        def sink(text: str, new: list[int]) -> None:
            times.append(time.perf_counter())
            writer(text, new)

        b.engine.generate(request, sink)
        writer.flush()
        cleanup(b.conn, [job_id])
        return times

    ml_cache = lambda: make_prompt_cache(ml)  # noqa: E731
    variants: dict[str, Variant] = {
        "mlx-lm loop + mlx-lm model (= generate_step)": mlx_lm_loop(ml, ml_cache),
        "mlx-lm loop + mlx-lm model, on the default stream": mlx_lm_loop(ml, ml_cache, default_stream),
        "mlx-lm loop + mlxq model and KV cache": mlx_lm_loop(mq, mq.make_cache),
        "mlxq loop + mlx-lm model, greedy": mlxq_loop(ml, ml_cache, Greedy),
        "mlxq loop + mlxq model, greedy": mlxq_loop(mq, mq.make_cache, Greedy),
        "mlxq loop + mlxq model, engine Sampler with logit_bias": mlxq_loop(mq, mq.make_cache, with_bias),
        "mlxq loop + mlxq model, greedy, on mlx-lm's generation stream": mlxq_loop(
            mq, mq.make_cache, Greedy, _generation_stream()
        ),
        "mlxq engine.generate, sink = real Redis StreamWriter (no RQ)": to_redis,
        "... and a thread polling Redis every 0.1 s (as the worker's JobWatch)": to_redis_polled,
    }
    runs: dict[str, list[tuple[float | None, float | None]]] = {k: [] for k in variants}
    for rep in range(s.gen_reps + 1):
        ids = b.engine.tokenizer.encode(b.maker.prompt(s.gen_prompt))
        for name, fn in variants.items():
            times = [(t, 1) for t in fn(ids)]
            if rep:
                runs[name].append((rate(times), gap_rate(times)))
    rows = {
        k: {"decode_tok_s": median([r for r, _ in v]), "decode_median_gap_tok_s": median([g for _, g in v])}
        for k, v in runs.items()
    }
    base = rows["mlx-lm loop + mlx-lm model (= generate_step)"]
    for row in rows.values():
        row["vs_mlx_lm"] = (row["decode_tok_s"] or 0) / (base["decode_tok_s"] or 1)
        row["median_gap_vs_mlx_lm"] = (row["decode_median_gap_tok_s"] or 0) / (
            base["decode_median_gap_tok_s"] or 1
        )
    return rows


def _generation_stream() -> Any:
    from mlx_lm.generate import generation_stream

    return generation_stream


def _evaluated(fn: Callable[..., Any], pick: Callable[[Any], Any]) -> Callable[..., Any]:
    """`fn` whose result (the part `pick` selects) is evaluated before it returns."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        mx.eval(pick(out))
        return out

    return wrapper


def warm_cache_phases(b: Bench) -> dict[str, Any]:
    """engine.generate on a long prefix, cold then warm, with each phase forced to finish and timed."""
    s = b.sizes
    m = b.maker
    engine = b.engine
    out: dict[str, Any] = {}
    for rep in range(2):  # the first warms up
        prefix = m.pieces(s.cache_prefix - m.special)
        for label in ("first (cold)", "second (same prefix, new tail)"):
            text = prefix + m.pieces(s.cache_tail)
            request = GenerateRequest.model_validate(gen_payload(b, text, 2))
            first: list[float] = []

            def sink(_text: str, _ids: list[int], first: list[float] = first) -> None:
                first.append(time.perf_counter())

            targets = {
                "prompt_tokens (tokenize)": (Engine, "prompt_tokens"),
                "cache lookup + KV gathered": (Engine, _BEGIN),
                "prefill (+ logits evaluated)": (worker.engine.engine, "prefill"),
                "prefix cache offer (after the last token)": (PrefixCache, "offer"),
            }
            with _patched(engine), phase_timers(targets) as phases:
                t0 = time.perf_counter()
                result = engine.generate(request, sink)
                total = time.perf_counter() - t0
            if rep:
                out[label] = {
                    "ttft_ms": 1000 * (first[0] - t0),
                    "total_ms": 1000 * total,
                    "cached_tokens": result.usage.cached_tokens,
                    "phases_ms": {k: round(1000 * v["s"], 2) for k, v in phases.items()},
                }
    return out


# The engine's "KV cache for this prompt" step (renamed while this was written).
_BEGIN = "begin_cache" if hasattr(Engine, "begin_cache") else "_begin"


class _patched:
    """Make `_begin` and `prefill` finish their work before returning (for timing only)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self._begin, self._prefill = getattr(Engine, _BEGIN), worker.engine.engine.prefill
        setattr(Engine, _BEGIN, _evaluated(self._begin, lambda out: [c.state for c in out[0]]))
        worker.engine.engine.prefill = _evaluated(worker.engine.engine.prefill, lambda out: out)  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        setattr(Engine, _BEGIN, self._begin)
        worker.engine.engine.prefill = self._prefill


def diagnostics(b: Bench) -> dict[str, Any]:
    return {"decode": decode_matrix(b), "warm_cache_phases": warm_cache_phases(b)}
