"""Figures 1, 2 and 4: generation (decode rate, time to first token), prefill rate, warm prefix cache."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.generation_batch import generate
from mlxq.worker.engine.prefill import prefill

from .common import Bench, median, mem_fields, memory, phase_timers, worker_memory
from .queue_client import cleanup, enqueue, follow


def gen_payload(b: Bench, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logit_bias": {str(k): v for k, v in b.no_eos.items()},
    }


def rate(times: list[tuple[float, int]]) -> float | None:
    """Tokens after the first arrival over the time from first to last arrival."""
    if len(times) < 2:
        return None
    return sum(k for _, k in times[1:]) / max(times[-1][0] - times[0][0], 1e-9)


def gap_rate(times: list[tuple[float, int]]) -> float | None:
    """1 / the median time per token between arrivals: robust to a busy machine's stalls."""
    gaps = [(t1 - t0) / k for (t0, _), (t1, k) in itertools.pairwise(times) if k]
    return 1 / statistics.median(gaps) if gaps and statistics.median(gaps) > 0 else None


def _engine_generate(engine: Engine, request: GenerateRequest) -> dict[str, Any]:
    arrivals: list[tuple[float, int]] = []
    phases = {"prefix cache offer": (PrefixCache, "offer")}
    with memory() as mem, phase_timers(phases) as timers:
        t0 = time.perf_counter()
        result = generate(
            engine, request, lambda _text, ids: arrivals.append((time.perf_counter(), len(ids)))
        )
        t_end = time.perf_counter()
    return {
        "ttft_s": arrivals[0][0] - t0 if arrivals else None,
        "decode_tok_s": rate(arrivals),
        "decode_median_gap_tok_s": gap_rate(arrivals),
        "tokens": result.usage.completion_tokens,
        "cached_tokens": result.usage.cached_tokens,
        "worker_ttft_s": result.timings.ttft_s,
        "worker_decode_tok_s": result.timings.decode_tokens_per_s,
        "reported_prefill_s": result.timings.prefill_s,
        "after_last_token_s": t_end - arrivals[-1][0] if arrivals else None,
        "offer_s": timers["prefix cache offer"]["s"],
        **mem_fields(mem["peak"], mem["active0"]),
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float)) or runs[0][k] is None]
    out = {k: median([r[k] for r in runs]) for k in keys}
    out["reps"] = len(runs)
    return out


def _mlx_lm_run(b: Bench, text: str, max_tokens: int) -> dict[str, Any]:
    ids = b.engine.tokenizer.encode(text)
    with memory() as mem:
        t0, times = b.mlxlm.generate_times(ids, max_tokens)
    return {
        "ttft_s": times[0] - t0,
        "decode_tok_s": rate([(t, 1) for t in times]),
        "decode_median_gap_tok_s": gap_rate([(t, 1) for t in times]),
        "tokens": len(times),
        **mem_fields(mem["peak"], mem["active0"]),
    }


def _queue_run(b: Bench, text: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    w = b.worker()
    since = time.time()
    t0 = time.perf_counter()
    job_id = enqueue(w.queue, "jobs.generate", gen_payload(b, text, max_tokens))
    trace = follow(b.conn, [job_id], t0, b.sizes.timeout_s)[job_id]
    done = trace.done or {}
    if done.get("event") != "done":
        raise RuntimeError(f"generation job failed: {done}")
    return job_id, {
        "ttft_s": trace.ttft_s(),
        "decode_tok_s": trace.decode_tokens_per_s(),
        "decode_median_gap_tok_s": gap_rate(trace.token_entries()),
        "tokens": trace.completion_tokens(),
        "first_entry_tokens": trace.token_entries()[0][1] if trace.token_entries() else None,
        "cached_tokens": int(done["cached_tokens"]),
        "worker_ttft_s": float(done["ttft_s"]) if done.get("ttft_s") else None,
        "worker_decode_tok_s": float(done["decode_tokens_per_s"])
        if done.get("decode_tokens_per_s")
        else None,
        **worker_memory(w.finished(since, 1)),
    }


def generation(b: Bench) -> dict[str, Any]:
    """One job at a time: mlx-lm `generate_step`, the engine alone, and through Redis + a worker.

    The three paths take turns on the same prompt each repetition, so load from other processes on a
    shared machine falls on all of them alike; the first repetition warms up and is not counted.
    """
    s = b.sizes
    b.worker()  # started (model loaded) before anything is timed
    names = ["mlx-lm generate_step", "mlxq engine.generate", "mlxq via Redis (worker + XREAD)"]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    job_ids = []
    for rep in range(s.gen_reps + 1):
        text = b.maker.prompt(s.gen_prompt)
        request = GenerateRequest.model_validate(gen_payload(b, text, s.gen_tokens))
        job_id, queued = _queue_run(b, text, s.gen_tokens)
        job_ids.append(job_id)
        results = [_mlx_lm_run(b, text, s.gen_tokens), _engine_generate(b.engine, request), queued]
        if rep:
            for name, result in zip(names, results, strict=True):
                runs[name].append(result)
    cleanup(b.conn, job_ids)
    rows = {name: _summary(r) for name, r in runs.items()}
    base = rows["mlx-lm generate_step"]["decode_tok_s"]
    gap_base = rows["mlx-lm generate_step"]["decode_median_gap_tok_s"]
    for row in rows.values():
        row["decode_vs_mlx_lm"] = row["decode_tok_s"] / base if base and row["decode_tok_s"] else None
        gap = row["decode_median_gap_tok_s"]
        row["median_gap_vs_mlx_lm"] = gap / gap_base if gap and gap_base else None
    return {"prompt_tokens": s.gen_prompt, "max_tokens": s.gen_tokens, "rows": rows}


def _random_ids(b: Bench, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    vocab = b.engine.model.args.vocab_size
    return [rng.randrange(3, vocab) for _ in range(n)]


def prefill_rates(b: Bench) -> dict[str, Any]:
    """Prompt tokens per second to the first token: mlx-lm, the engine's chunked prefill, engine.generate."""
    s = b.sizes
    engine = b.engine
    cold = Engine(
        engine.model,
        engine.tokenizer,
        engine.config,
        engine.name,
        replace(engine.options, prefix_cache_bytes=0),
    )

    def engine_prefill(ids: list[int]) -> float:
        t0 = time.perf_counter()
        logits = prefill(engine.model, ids, engine.model.make_cache(), engine.options.prefill_chunk)
        mx.argmax(logits, axis=-1).item()
        return time.perf_counter() - t0

    def engine_generate(n: int) -> float:
        request = GenerateRequest(prompt=b.maker.prompt(n), max_tokens=1, temperature=0.0)
        t0 = time.perf_counter()
        generate(cold, request, lambda _t, _i: None)
        return time.perf_counter() - t0

    def engine_model_mlx_lm_plan(ids: list[int]) -> float:
        """Diagnostic: mlxq's model run the way mlx-lm prefills (all but the last token with only the
        KV cache evaluated, then the last token alone), to tell the plan from the kernels."""
        t0 = time.perf_counter()
        cache = engine.model.make_cache()
        prefill(engine.model, ids[:-1], cache, engine.options.prefill_chunk)  # lazy: logits never read
        mx.eval([c.state for c in cache])
        logits = engine.model(mx.array(ids[-1:], dtype=mx.int32)[None], cache=cache)[:, -1, :]
        mx.argmax(logits, axis=-1).item()
        return time.perf_counter() - t0

    paths = {
        "mlx-lm generate_step": lambda n, seed: b.mlxlm.time_to_first_token(_random_ids(b, n, seed)),
        "mlxq prefill (engine's chunked prefill)": lambda n, seed: engine_prefill(_random_ids(b, n, seed)),
        "mlxq engine.generate (text, max_tokens=1)": lambda n, _seed: engine_generate(n),
        "diagnostic: mlxq model, mlx-lm's plan (n-1 cache-only, then 1)": lambda n, seed: (
            engine_model_mlx_lm_plan(_random_ids(b, n, seed))
        ),
    }
    table: dict[str, Any] = {}
    for n in s.prefill:
        times: dict[str, list[float]] = {name: [] for name in paths}
        peaks: dict[str, tuple[int, int]] = {}
        for rep in range(s.prefill_reps + 1):  # the paths take turns; the first round warms up
            for name, fn in paths.items():
                with memory() as mem:
                    dt = fn(n, rep)
                if rep:
                    times[name].append(dt)
                    peaks[name] = max(peaks.get(name, (0, 0)), (mem["peak"], mem["active0"]))
        for name in paths:
            dt = median(times[name]) or 0.0
            table.setdefault(str(n), {})[name] = {
                "tokens": n,
                "s": dt,
                "tok_s": n / dt,
                **mem_fields(*peaks[name]),
            }
        base = table[str(n)]["mlx-lm generate_step"]["tok_s"]
        for row in table[str(n)].values():
            row["vs_mlx_lm"] = row["tok_s"] / base
    return {"chunk": engine.options.prefill_chunk, "reps": s.prefill_reps, "rows": table}


def warm_cache(b: Bench) -> dict[str, Any]:
    """The same long prefix twice (different short tails): the second job's TTFT against the first's.

    Each repetition takes a fresh prefix; the first repetition warms up (kernels for these shapes).
    """
    s = b.sizes
    m = b.maker
    w = b.worker()
    engine_pairs, queue_pairs, job_ids = [], [], []
    for rep in range(s.gen_reps + 1):
        prefix = m.pieces(s.cache_prefix - m.special)
        first, second = prefix + m.pieces(s.cache_tail), prefix + m.pieces(s.cache_tail)
        runs = [
            _engine_generate(b.engine, GenerateRequest.model_validate(gen_payload(b, t, 4)))
            for t in (first, second)
        ]
        queued = []
        for text in (first, second):
            since = time.time()
            t0 = time.perf_counter()
            job_id = enqueue(w.queue, "jobs.generate", gen_payload(b, text, 4))
            job_ids.append(job_id)
            trace = follow(b.conn, [job_id], t0, s.timeout_s)[job_id]
            done = trace.done or {}
            if done.get("event") != "done":
                raise RuntimeError(f"generation job failed: {done}")
            queued.append(
                {
                    "ttft_s": trace.ttft_s(),
                    "worker_ttft_s": float(done["ttft_s"]),
                    "cached_tokens": int(done["cached_tokens"]),
                    **worker_memory(w.finished(since, 1)),
                }
            )
        if rep:
            engine_pairs.append(_pair(*runs))
            queue_pairs.append(_pair(*queued))
    cleanup(b.conn, job_ids)
    rows = {
        "mlxq engine.generate": _median_pair(engine_pairs),
        "mlxq via Redis (worker + XREAD)": _median_pair(queue_pairs),
    }
    return {"prefix_tokens": s.cache_prefix, "tail_tokens": s.cache_tail, "reps": s.gen_reps, "rows": rows}


def _median_pair(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the median second/first ratio (its numbers kept together)."""
    ranked = sorted(pairs, key=lambda p: p["ttft_ratio"])
    return {**ranked[len(ranked) // 2], "ratios": [p["ttft_ratio"] for p in pairs]}


def _pair(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    out = {"first": first, "second": second, "ttft_ratio": second["ttft_s"] / first["ttft_s"]}
    if first.get("worker_ttft_s") and second.get("worker_ttft_s"):
        out["worker_ttft_ratio"] = second["worker_ttft_s"] / first["worker_ttft_s"]
    return out
