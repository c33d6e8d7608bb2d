"""Batched generation: N concurrent generation jobs through the queue against mlx-lm's `BatchGenerator`.

For each size N, in turns each repetition, the same N prompts (greedy, EOS masked, so every job writes
`batch_tokens` tokens) run
- through the queue: enqueued in one pipeline, as a bulk producer puts them, to a worker that batches
  up to the largest N (`MLXQ_MAX_BATCH_SEQUENCES`), every job's stream read back;
- in this process, no Redis: the engine's `GenerationBatch`, stepped until every request is done;
- in this process: mlx-lm's `BatchGenerator` on the same prompt ids (`completion_batch_size=N`).

"tok/s" is all generated tokens over enqueue (or call) to the last job's end, prefill included;
"decode tok/s" counts only the tokens that arrived once every job had its first one (the steady batched
decode). The first round runs every size once as measured, so the measured rounds meet no new shapes.
Beside them, the primitives one decode step builds at each N, and mlx-lm's one-row step (`step_ops.py`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxq.jobs import keys
from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine.generation_batch import GenerationBatch

from .common import Bench, median, worker_memory
from .fig_generate import gen_payload
from .queue_client import BenchWorker, cleanup, enqueue_many, follow
from .step_ops import step_ops

QUEUE, ENGINE, MLX_LM = (
    "mlxq via Redis (batching worker)",
    "mlxq engine GenerationBatch",
    "mlx-lm BatchGenerator",
)


@dataclass
class Run:
    """One path's run of N jobs: when each job's first token came and when it ended, and its token ids."""

    wall_s: float
    tokens: int
    ttfts: list[float]
    token_ids: list[list[int]]
    window_tokens: int = 0  # tokens that arrived after every job had its first one
    window_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)


def _window(arrivals: list[tuple[float, int]], all_started: float, end: float) -> tuple[int, float]:
    return sum(k for t, k in arrivals if t > all_started), max(0.0, end - all_started)


def _queue(b: Bench, w: BenchWorker, payloads: list[dict[str, Any]]) -> Run:
    # The worker shares the device with this process: the buffers this process's own paths freed go
    # back first (MLX keeps them otherwise; with a 17 GB model the worker's prefill found no room).
    mx.clear_cache()
    since = time.time()
    t0 = time.perf_counter()
    job_ids = enqueue_many(w.queue, keys.GENERATE_FUNC, payloads)
    traces = follow(b.conn, job_ids, t0, b.sizes.timeout_s)
    failed = [tr.done for tr in traces.values() if (tr.done or {}).get("event") != "done"]
    if failed:
        raise RuntimeError(f"{len(failed)} generation jobs failed, first: {failed[0]}")
    results = [json.loads(b.conn.get(keys.result_key(j)) or b"{}") for j in job_ids]
    arrivals = [a for tr in traces.values() for a in tr.token_entries()]
    end = max(tr.entries[-1][0] for tr in traces.values())
    firsts = [tr.token_entries()[0][0] for tr in traces.values()]
    records = [r for r in w.finished(since, len(job_ids)) if r.get("fn") == "finish_streams"]
    phases: dict[str, float] = {"finish_streams_s": sum(r["s"] for r in records)}
    for r in records:
        for k, v in r.get("phases", {}).items():
            phases[k] = phases.get(k, 0) + v
    cleanup(b.conn, job_ids)
    return Run(
        end - t0,
        sum(r["usage"]["completion_tokens"] for r in results),
        [t - t0 for t in firsts],
        [r["token_ids"] for r in results],
        *_window(arrivals, max(firsts), end),
        phases=phases,
        memory=worker_memory(records),
    )


def _engine(b: Bench, payloads: list[dict[str, Any]]) -> Run:
    """The engine's `GenerationBatch`, all requests admitted at once, stepped until empty; no Redis."""
    mx.synchronize()
    t0 = time.perf_counter()
    batch = GenerationBatch(b.engine, len(payloads))
    for i, p in enumerate(payloads):
        batch.admit(str(i), GenerateRequest.model_validate(p), lambda _t, _ids: None, lambda: False)
    results: dict[str, Any] = {}
    ended: dict[str, float] = {}
    arrivals: list[tuple[float, int]] = []
    all_started: float | None = None
    while len(batch):
        decoding = len(batch.decoding)
        for done in batch.step():
            if done.error is not None:
                raise done.error
            results[done.key], ended[done.key] = done.result, time.perf_counter()
        batch.settle()
        now = time.perf_counter()
        if all_started is None and not batch.waiting and batch.prefilling is None:
            all_started = now
        elif all_started is not None:
            arrivals.append((now, decoding))
    end = max(ended.values())
    res = [results[str(i)] for i in range(len(payloads))]
    return Run(
        end - t0,
        sum(r.usage.completion_tokens for r in res),
        [r.timings.ttft_s or 0.0 for r in res],
        [list(r.token_ids) for r in res],
        *_window(arrivals, all_started or end, end),
        # a constrained batch's host time on the critical path, ms a step (none for free batches)
        phases=batch.decode.ahead.critical.per_step_ms(),
    )


def _mlx_lm(b: Bench, payloads: list[dict[str, Any]]) -> Run:
    """mlx-lm's `BatchGenerator` on the same prompt ids, greedy, the same EOS mask as a bias."""
    from mlx_lm.generate import BatchGenerator, generation_stream

    model = b.mlxlm.model
    prompts = [b.engine.prompt_tokens(GenerateRequest.model_validate(p)) for p in payloads]
    bias = mx.zeros((model.args.vocab_size,), dtype=mx.float32)
    bias[mx.array(list(b.no_eos))] = -100.0
    mx.synchronize()
    t0 = time.perf_counter()
    gen = BatchGenerator(
        model,
        max_tokens=b.sizes.batch_tokens,
        sampler=lambda logprobs: mx.argmax(logprobs + bias, axis=-1),
        completion_batch_size=len(prompts),
    )
    uids = gen.insert(prompts, [b.sizes.batch_tokens] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    first: dict[int, float] = {}
    ended: dict[int, float] = {}
    arrivals: list[tuple[float, int]] = []
    while responses := gen.next_generated():
        now = time.perf_counter()
        arrivals.append((now, len(responses)))
        for r in responses:
            out[r.uid].append(r.token)
            first.setdefault(r.uid, now)
            if r.finish_reason is not None:
                ended[r.uid] = now
    gen.close()
    mx.synchronize(generation_stream)
    end = max(ended.values())
    return Run(
        end - t0,
        sum(len(v) for v in out.values()),
        [first[u] - t0 for u in uids],
        [out[u] for u in uids],
        *_window(arrivals, max(first.values()), end),
    )


def batch_generation(b: Bench) -> dict[str, Any]:
    s = b.sizes
    w = b.only_worker("batching", env={"MLXQ_MAX_BATCH_SEQUENCES": str(max(s.batch_jobs))})
    paths = {
        QUEUE: lambda p: _queue(b, w, p),
        ENGINE: lambda p: _engine(b, p),
        MLX_LM: lambda p: _mlx_lm(b, p),
    }
    # MLXQ_BENCH_BATCH_PATHS, e.g. "queue,engine": where the device's memory cannot hold mlx-lm's batch
    # of a large model beside the engine's and the worker's copies (its rows then have no mlx-lm ratio)
    if wanted := os.environ.get("MLXQ_BENCH_BATCH_PATHS"):
        named = {"queue": QUEUE, "engine": ENGINE, "mlx-lm": MLX_LM}
        paths = {named[w]: paths[named[w]] for w in wanted.split(",")}
    runs: dict[tuple[int, str], list[Run]] = {}
    for rep in range(s.batch_reps + 1):  # the first round warms up
        for n in s.batch_jobs:
            payloads = [gen_payload(b, b.maker.prompt(s.gen_prompt), s.batch_tokens) for _ in range(n)]
            for name, run in paths.items():
                result = run(payloads)
                if rep:
                    runs.setdefault((n, name), []).append(result)
    rows: dict[str, Any] = {}
    for (n, name), rs in runs.items():
        base = runs.get((n, MLX_LM), [])
        ratios = (
            [r.tokens * m.wall_s / (r.wall_s * m.tokens) for r, m in zip(rs, base, strict=True)]
            if base
            else []
        )
        # None where the engine's path was left out (`MLXQ_BENCH_BATCH_PATHS`): nothing to compare with
        engine = runs.get((n, ENGINE))
        same_ids = None
        if engine:
            same_ids = sum(a == e for a, e in zip(rs[-1].token_ids, engine[-1].token_ids, strict=True))
        rows[f"{n} jobs, {name}"] = {
            "jobs": n,
            "tok_s": median([r.tokens / r.wall_s for r in rs]),
            "all_tok_s": [r.tokens / r.wall_s for r in rs],
            "vs_mlx_lm": median(ratios),
            "decode_tok_s": median([r.window_tokens / r.window_s if r.window_s else None for r in rs]),
            "ttft_p50_s": median([statistics.median(r.ttfts) for r in rs]),
            "wall_s": median([r.wall_s for r in rs]),
            "same_ids_as_engine": same_ids,
            "phases": rs[-1].phases,
            **rs[-1].memory,
        }
    return {
        "prompt_tokens": s.gen_prompt,
        "max_tokens": s.batch_tokens,
        "reps": s.batch_reps,
        "rows": rows,
        "step_ops": step_ops(b.engine, b.mlxlm.model, s.batch_jobs),
    }
