"""Batched generation: aggregate tokens/s and per-job latency for N concurrent jobs, four ways.

    python -m bench.batch_generate [--model tiny|llama-1b|PATH] [--sizes 1,8,32,64] [--max-tokens 64]
        [--staggered] [--batch N] [--redis-url URL|private] [--out DIR --label NAME] [--no-inproc]
        [--no-alone] [--repeats R] [--ab-env MLXQ_KEY=VALUE[,...]]

For each size N the same N jobs run
- through the queue, one at a time: one real worker (`bench.worker_proc`, i.e. `mlxq worker` plus
  timers) with `MLXQ_MAX_BATCH_SEQUENCES=1`;
- through the queue, batched: a worker with `MLXQ_MAX_BATCH_SEQUENCES=--batch` (default: the largest
  size). Jobs are enqueued at once (one pipeline, as a bulk producer would) and every job's stream is
  read back (XREAD from 0-0, each entry timed on arrival);
- in this process, no Redis: the worker's own `GenerationBatch` on an `Engine`, all N admitted at once,
  stepped until empty (what the batched worker does, minus RQ and the streams);
- in this process: mlx-lm's `BatchGenerator` (continuous batching, mlx-lm 0.32.2) on the same prompt
  ids, `completion_batch_size=N`, its default `prefill_batch_size` (8), greedy with the same EOS mask.

Jobs are greedy (or sampled: `--temperature`, `--top-p`, job i seeded with i; mlx-lm then samples with
its own `make_sampler`) with EOS masked (`logit_bias`), so each writes exactly `--max-tokens` tokens (with
`--staggered`, job i writes `staggered_max_tokens(i)`: 1/4 .. 1 of it, so rows leave at different steps,
as real jobs do; mlx-lm gets the same lengths); the paths'
token ids are compared with the one-at-a-time run's (rows identical / N). A size larger than `--batch`
is a backlog: jobs wait until a row is free (in the worker's queue; in this process admitted as rows
free up; mlx-lm with `completion_batch_size=--batch`), so rows join while others decode, as in a bulk
run; `--no-alone` skips the one-at-a-time worker, which dominates such runs. "agg tok/s" is all generated
tokens over enqueue (or call) → last job done, prefill included; "decode tok/s" is the tokens that
arrived after every job had its first token, over that window (the steady batched decode). Each worker
first runs every size once as measured (same lengths, other prompts: every shape a run meets, buffer
growth and departures included, is compiled once per process; warm-ups of 4 tokens left some to the
first measured run, on the GPU up to 2x slower than the next), then the measured runs.
`--ab-env` adds a second batched worker with other settings (an A/B in one run; with
`MLXQ_DECODE_OVERLAP` the in-process engine runs both ways too).
With `--repeats R` every path runs R times, in turns (all workers and the in-process models stay
loaded): on a host whose speed drifts between minutes (the lent GPU's, by up to 2x) one pass per path
compares moments, not paths. A summary then gives each path's median (min-max) and its ratio to
mlx-lm's run of the same repetition. All paths keep the same MLX buffer cache (`--mlx-cache-limit`, the
worker's setting; the in-process paths set it too, so the comparison is like for like).
The batched worker's phase timers (`bench/worker_proc.py`: batch steps, prefill, forward, stream
flushes, the per-step `flush_streams` pipeline and its XADD count, claims, retire) split its wall
time. `--out` writes `LABEL.json` and `LABEL.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from rq import Queue

from jobs import keys

from .checkpoints import checkpoint
from .queue_client import BenchWorker, private_redis

WORDS = [
    "the",
    "queue",
    "holds",
    "jobs",
    "and",
    "a",
    "worker",
    "takes",
    "them",
    "one",
    "by",
    "one",
    "or",
    "many",
    "at",
    "once",
]
EOS_MASK = {"0": -100.0, "1": -100.0, "2": -100.0}


@dataclass
class Run:
    mode: str
    jobs: int
    wall_s: float
    tokens: int
    latencies: list[float]
    ttfts: list[float]
    token_ids: list[list[int]]
    decode_window_tokens: int = 0  # tokens that arrived after every job had its first one
    decode_window_s: float = 0.0
    prompt_tokens: list[int] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # the worker's timers (queue paths)
    same_rows: int | None = None  # rows whose token ids equal the one-at-a-time run's
    rep: int = 0  # which repetition (`--repeats`)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.decode_window_s <= 0 or self.decode_window_tokens <= 0:
            return None
        return self.decode_window_tokens / self.decode_window_s


def staggered_max_tokens(i: int, max_tokens: int) -> int:
    """Job i's length in a staggered run: spread over 1/4 .. 1 of `max_tokens`, so rows leave a batch at
    different steps, as real jobs (EOS, stop strings, their own limits) do."""
    return max(1, max_tokens // 4 + (i * 37) % max(1, max_tokens * 3 // 4))


def _payloads(
    n: int,
    max_tokens: int,
    prompt_words: int,
    tag: str,
    staggered: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[dict[str, Any]]:
    """Distinct prompts (they differ from the first token: no shared prefix), EOS masked, greedy or with
    `temperature` (and `top_p`), job i seeded with i; with `staggered`, lengths spread by
    `staggered_max_tokens`."""
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(prompt_words)]
        sampling = {"temperature": temperature, "top_p": top_p, "seed": i} if temperature > 0 else {}
        out.append(
            {
                "prompt": f"{tag}{i}: " + " ".join(words),
                "max_tokens": staggered_max_tokens(i, max_tokens) if staggered else max_tokens,
                "temperature": 0,
                "logit_bias": dict(EOS_MASK),
                **sampling,
            }
        )
    return out


def _decode_window(arrivals: list[tuple[float, int]], all_started: float, end: float) -> tuple[int, float]:
    """Tokens that arrived strictly after `all_started`, and the window's length."""
    n = sum(count for t, count in arrivals if t > all_started)
    return n, max(0.0, end - all_started)


def run_jobs(worker: BenchWorker, payloads: list[dict[str, Any]], mode: str, timeout: float) -> Run:
    """Enqueue all payloads at once; follow every stream to its end."""
    datas = [
        Queue.prepare_data(keys.GENERATE_FUNC, args=(p,), timeout=3600, result_ttl=600) for p in payloads
    ]
    conn = worker.conn
    since = time.time()
    t0 = time.perf_counter()
    with conn.pipeline() as pipe:
        jobs = worker.queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    ids = [str(j.id) for j in jobs]
    first: dict[str, float] = {}
    ended: dict[str, float] = {}
    arrivals: list[tuple[float, int]] = []
    cursor = {keys.stream_key(j): "0-0" for j in ids}
    owner = {keys.stream_key(j): j for j in ids}
    deadline = time.monotonic() + timeout
    while cursor:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(cursor)} of {len(ids)} jobs unfinished after {timeout}s")
        for key, entries in conn.xread(cursor, block=1000, count=1000) or []:  # type: ignore[arg-type]
            now = time.perf_counter()
            key = key.decode()
            for entry_id, fields in entries:
                cursor[key] = entry_id.decode()
                event = fields[b"event"].decode()
                job_id = owner[key]
                if event == "token":
                    first.setdefault(job_id, now)
                    arrivals.append((now, len(json.loads(fields[b"ids"]))))
                elif event in ("done", "error"):
                    if event == "error":
                        raise RuntimeError(f"job {job_id} failed: {fields[b'message'].decode()}")
                    ended[job_id] = now
                    del cursor[key]
                    break
    results = [json.loads(conn.get(keys.result_key(j)) or b"{}") for j in ids]
    end = max(ended.values())
    all_started = max(first.values()) if len(first) == len(ids) else end
    window_tokens, window_s = _decode_window(arrivals, all_started, end)
    # The worker's timer record of the job that ran the batch is written once the batch has ended
    # every job through RQ too (its finalizer thread), after the last `done`.
    records = worker.records(since)
    deadline = time.monotonic() + 10
    while not any(rec.get("fn") == "execute_job" for rec in records) and time.monotonic() < deadline:
        time.sleep(0.02)
        records = worker.records(since)
    phases: dict[str, float] = {}
    for rec in records:
        if rec.get("fn") == "execute_job":
            phases["execute_job_s"] = phases.get("execute_job_s", 0.0) + rec["s"]
            phases["execute_job"] = phases.get("execute_job", 0) + 1
            for k, v in (rec.get("batch") or {}).items():
                phases[k] = phases.get(k, 0) + v
    return Run(
        mode=mode,
        jobs=len(ids),
        wall_s=end - t0,
        tokens=sum(r["usage"]["completion_tokens"] for r in results),
        latencies=[ended[j] - t0 for j in ids],
        ttfts=[first[j] - t0 for j in ids if j in first],
        token_ids=[r["token_ids"] for r in results],
        decode_window_tokens=window_tokens,
        decode_window_s=window_s,
        prompt_tokens=[r["usage"]["prompt_tokens"] for r in results],
        phases=phases,
    )


# --- in this process: the engine's GenerationBatch, and mlx-lm's BatchGenerator ----------------------


class _NoSink:
    def __call__(self, text: str, ids: list[int]) -> None:
        pass


def run_engine_batch(engine: Any, payloads: list[dict[str, Any]], max_batch: int) -> Run:
    """The worker's `GenerationBatch` stepped until every request is done; no Redis. Requests are
    admitted while it has free slots, as the worker admits queued jobs between steps (all at once
    when there are no more than `max_batch`)."""
    import mlx.core as mx

    from jobs.schema import GenerateRequest
    from worker.engine.generation_batch import GenerationBatch

    mx.synchronize()
    t0 = time.perf_counter()
    batch = GenerationBatch(engine, max(max_batch, 1), 2 << 30)
    keys_ = [f"r{i}" for i in range(len(payloads))]
    queued = list(zip(keys_, payloads, strict=True))

    def admit() -> None:
        while queued and batch.free_slots > 0:
            key, p = queued.pop(0)
            batch.admit(key, GenerateRequest(**p), _NoSink(), lambda: False)

    admit()
    results: dict[str, Any] = {}
    ended: dict[str, float] = {}
    first_all: float | None = None
    arrivals: list[tuple[float, int]] = []
    while len(batch):
        decoding_before = len(batch.decoding)
        for done in batch.step():
            if done.error is not None:
                raise done.error
            results[done.key] = done.result
            ended[done.key] = time.perf_counter()
        batch.settle()  # as the worker does once it has written the results
        admit()
        now = time.perf_counter()
        if first_all is None and not queued and not batch.waiting and batch.prefilling is None:
            first_all = now
        elif first_all is not None:
            arrivals.append((now, decoding_before))
    end = max(ended.values())
    window_tokens, window_s = _decode_window(arrivals, first_all or end, end)
    res = [results[k] for k in keys_]
    return Run(
        mode="engine GenerationBatch (no queue)",
        jobs=len(payloads),
        wall_s=end - t0,
        tokens=sum(r.usage.completion_tokens for r in res),
        latencies=[ended[k] - t0 for k in keys_],
        ttfts=[(r.timings.ttft_s or 0.0) for r in res],
        token_ids=[list(r.token_ids) for r in res],
        decode_window_tokens=window_tokens,
        decode_window_s=window_s,
        prompt_tokens=[r.usage.prompt_tokens for r in res],
    )


def run_mlx_lm_batch(
    model: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    max_batch: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> Run:
    """mlx-lm's `BatchGenerator` on the same prompt ids and lengths: greedy (or its own sampler with
    `temperature` and `top_p`, one draw for all rows), EOS masked by the same bias, no stop; at most
    `max_batch` sequences at once (its own queue holds the rest)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generation_stream
    from mlx_lm.sample_utils import make_sampler

    vocab = model.args.vocab_size
    bias = mx.zeros((vocab,), dtype=mx.float32)
    bias[mx.array([int(k) for k in EOS_MASK])] = -100.0
    draw = make_sampler(temp=temperature, top_p=top_p)

    def sampler(logprobs: mx.array) -> mx.array:  # one batched call for all rows
        return draw(logprobs + bias)

    mx.synchronize()
    t0 = time.perf_counter()
    gen = BatchGenerator(
        model,
        max_tokens=max(max_tokens),
        sampler=sampler,
        completion_batch_size=min(len(prompts), max_batch or len(prompts)),
    )
    uids = gen.insert(prompts, max_tokens)
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
    all_started = max(first.values())
    window_tokens, window_s = _decode_window(arrivals, all_started, end)
    return Run(
        mode=_MLX_LM,
        jobs=len(prompts),
        wall_s=end - t0,
        tokens=sum(len(v) for v in out.values()),
        latencies=[ended[u] - t0 for u in uids],
        ttfts=[first[u] - t0 for u in uids],
        token_ids=[out[u] for u in uids],
        decode_window_tokens=window_tokens,
        decode_window_s=window_s,
        prompt_tokens=[len(p) for p in prompts],
    )


# --- report ------------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def render(runs: list[Run]) -> str:
    head = (
        "| mode | jobs | rep | prompt tok | tokens | wall s | agg tok/s | x alone | decode tok/s | lat p50 s "
        "| lat max s | TTFT p50 s | TTFT max s | same ids |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    alone = {(r.jobs, r.rep): r for r in runs if r.mode == "queue, one at a time"}
    for r in runs:
        base = alone.get((r.jobs, r.rep))
        speedup = f"{r.tokens_per_s / base.tokens_per_s:.2f}" if base else "-"
        same = "-" if r.same_rows is None else f"{r.same_rows}/{r.jobs}"
        dec = r.decode_tokens_per_s
        lines.append(
            f"| {r.mode} | {r.jobs} | {r.rep} | {statistics.mean(r.prompt_tokens):.0f} | {r.tokens} "
            f"| {r.wall_s:.2f} | {r.tokens_per_s:,.0f} | {speedup} | {'-' if dec is None else f'{dec:,.0f}'} "
            f"| {statistics.median(r.latencies):.2f} | {max(r.latencies):.2f} "
            f"| {statistics.median(r.ttfts) if r.ttfts else float('nan'):.3f} "
            f"| {max(r.ttfts) if r.ttfts else float('nan'):.3f} | {same} |"
        )
    return "\n".join(lines)


_MLX_LM = "mlx-lm BatchGenerator"


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per (jobs, mode) over the repetitions: aggregate tok/s (median, min, max), decode-window tok/s
    (median), and the ratio to mlx-lm's run of the same repetition (median, min, max)."""
    groups: dict[tuple[int, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.jobs, r.mode), []).append(r)
    mlx = {(r.jobs, r.rep): r for r in runs if r.mode == _MLX_LM}
    out = []
    for (jobs, mode), rs in groups.items():
        rates = [r.tokens_per_s for r in rs]
        decode = [d for r in rs if (d := r.decode_tokens_per_s) is not None]
        ratios = [r.tokens_per_s / mlx[jobs, r.rep].tokens_per_s for r in rs if (jobs, r.rep) in mlx]
        out.append(
            {
                "jobs": jobs,
                "mode": mode,
                "runs": len(rs),
                "tok_s": [statistics.median(rates), min(rates), max(rates)],
                "decode_tok_s": statistics.median(decode) if decode else None,
                "vs_mlx_lm": [statistics.median(ratios), min(ratios), max(ratios)] if ratios else None,
            }
        )
    return out


def render_summary(runs: list[Run]) -> str:
    head = (
        "| jobs | mode | runs | agg tok/s median (min-max) | decode tok/s median "
        "| x mlx-lm, same repetition: median (min-max) |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- |"]
    for row in summary(runs):
        med, lo, hi = row["tok_s"]
        dec = "-" if row["decode_tok_s"] is None else f"{row['decode_tok_s']:,.0f}"
        vs = "-"
        if row["vs_mlx_lm"] is not None and row["mode"] != _MLX_LM:
            vs = "{:.2f} ({:.2f}-{:.2f})".format(*row["vs_mlx_lm"])
        rates = f"{med:,.0f} ({lo:,.0f}-{hi:,.0f})"
        lines.append(f"| {row['jobs']} | {row['mode']} | {row['runs']} | {rates} | {dec} | {vs} |")
    return "\n".join(lines)


def render_phases(runs: list[Run]) -> str:
    """The batched worker's phase timers, seconds (calls), per size."""
    cols = [
        "execute_job",
        "batch_step",
        "prefill",
        "decode_add",
        "decode_step",
        "forward",
        "depart",
        "finish",
        "offer",
        "graph",
        "launch",
        "launcher_launch",
        "launch_wait",
        "gc",
        "stream_flush",
        "stream_write",
        "stream_entries",
        "claim",
        "admit",
        "retire",
        "settle",
    ]
    rows = [r for r in runs if r.mode.startswith("queue, batched") and r.phases]
    if not rows:
        return ""
    names = [c if c == "stream_entries" else f"{c} s (calls)" for c in cols]
    head = "| jobs | rep | wall s | " + " | ".join(names) + " |"
    lines = [head, "|" + " --- |" * (len(cols) + 3)]
    for r in rows:
        cells = [
            f"{int(r.phases.get(c, 0))}"
            if c == "stream_entries"
            else f"{r.phases.get(c + '_s', 0.0):.3f} ({int(r.phases.get(c, 0))})"
            for c in cols
        ]
        lines.append(f"| {r.jobs} | {r.rep} | {r.wall_s:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _metadata(model_arg: str) -> dict[str, Any]:
    import platform
    import subprocess

    import mlx.core as mx

    meta: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": model_arg,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "python": platform.python_version(),
        "commit": os.environ.get("MLXQ_BENCH_COMMIT"),
    }
    try:
        import mlx_lm

        meta["mlx_lm"] = mlx_lm.__version__
    except ImportError:
        meta["mlx_lm"] = None
    if meta["commit"] is None:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            meta["commit"] = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | llama-1b | a model folder [tiny]")
    p.add_argument("--sizes", default="1,8,32", help="concurrent jobs per run, comma-separated [1,8,32]")
    p.add_argument("--batch", type=int, help="MLXQ_MAX_BATCH_SEQUENCES of the batched worker [max size]")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--staggered", action="store_true", help="jobs' max tokens spread over 1/4..1 of --max-tokens"
    )
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampled jobs (job i seeded with i); 0: greedy [0]"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature [1.0]")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/7", help="URL, or `private`")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--out", help="folder for LABEL.json and LABEL.md (not written without it)")
    p.add_argument("--label", default="batch-generate")
    p.add_argument("--no-inproc", action="store_true", help="skip the in-process engine and mlx-lm paths")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every path this many times, in turns; a summary gives medians and ratios [1]",
    )
    p.add_argument(
        "--no-alone", action="store_true", help="skip the one-at-a-time worker (no `x alone`, no `same ids`)"
    )
    p.add_argument(
        "--mlx-cache-limit",
        type=int,
        help="bytes of freed MLX buffers kept for reuse, in the workers (MLXQ_MLX_CACHE_LIMIT_BYTES) and in "
        "this process alike [the worker's default]",
    )
    p.add_argument(
        "--ab-env",
        default="",
        help="KEY=VALUE[,KEY=VALUE]: one more batched worker with these settings, run in turns with the "
        "others; MLXQ_DECODE_OVERLAP=... also runs the in-process engine that way",
    )
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "mlxq" / "bench-models"))
    args = p.parse_args(argv)
    if args.mlx_cache_limit is None:
        from worker.service import mlx_cache_limit

        args.mlx_cache_limit = mlx_cache_limit(None)  # the workers' default on this device
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the workers on the way out
    if args.redis_url == "private":
        with private_redis() as url:
            args.redis_url = url
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    batch = args.batch or max(sizes)
    model = str(checkpoint(args.model, Path(args.cache_dir)))
    workdir = Path(tempfile.mkdtemp(prefix="mlxq-batch-bench-"))
    print(f"model={model} sizes={sizes} batch={batch} max_tokens={args.max_tokens}", flush=True)
    redis.Redis.from_url(args.redis_url).ping()
    runs: list[Run] = []
    result: dict[str, Any] = {
        "meta": _metadata(args.model),
        "args": {k: v for k, v in vars(args).items() if k != "cache_dir"},
        "batch": batch,
    }
    modes: list[tuple[str, int, dict[str, str]]] = [] if args.no_alone else [("queue, one at a time", 1, {})]
    modes.append((f"queue, batched ({batch})", batch, {}))
    ab = _ab_env(args.ab_env)
    if ab:
        modes.append((f"queue, batched ({batch}), {args.ab_env}", batch, ab))
    workers: dict[str, BenchWorker] = {}
    try:
        for n_mode, (mode, max_batch, extra) in enumerate(modes):
            worker = BenchWorker(
                model,
                args.redis_url,
                workdir,
                f"gen{max_batch}-{n_mode}",
                env={
                    "MLXQ_MAX_BATCH_SEQUENCES": str(max_batch),
                    "MLXQ_MLX_CACHE_LIMIT_BYTES": str(args.mlx_cache_limit),
                    **extra,
                },
            )
            workers[mode] = worker
            worker.start().wait_ready(600)
            t_warm = time.perf_counter()
            for n in sizes:  # every batch and prompt shape once, so the measured runs compile nothing new
                warm = _warm_payloads(n, args)
                run_jobs(worker, warm, mode, args.timeout)
            print(f"{mode}: warm-up {time.perf_counter() - t_warm:.1f}s", file=sys.stderr, flush=True)
        inproc = None if args.no_inproc else InProcess(model, sizes, batch, args)
        # Every repetition runs every path once, in turns: the paths compared are measured minutes apart
        # at most, on a host whose speed drifts (the lent GPU's by up to 2x between minutes).
        for rep in range(args.repeats):
            for n in sizes:
                tag = f"size{n}-r{rep}-"  # new prompts each time: no prefix cache hit from a repetition
                payloads = _payloads(
                    n, args.max_tokens, args.prompt_words, tag, args.staggered, **_sampling(args)
                )
                for mode, worker in workers.items():
                    runs.append(replace(run_jobs(worker, payloads, mode, args.timeout), rep=rep))
                    print(f"{mode} jobs={n}: {runs[-1].tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)
                if inproc is not None:
                    runs += [replace(r, rep=rep) for r in inproc.run(payloads, n)]
    finally:
        for worker in workers.values():
            worker.stop()
            worker.queue.delete(delete_jobs=True)
    alone = {(r.jobs, r.rep): r for r in runs if r.mode == "queue, one at a time"}
    for r in runs:
        base = alone.get((r.jobs, r.rep))
        if base is not None and base is not r:
            r.same_rows = sum(a == b for a, b in zip(base.token_ids, r.token_ids, strict=True))
    order = {"queue, one at a time": 0, _MLX_LM: 3, "engine GenerationBatch (no queue)": 2}
    runs.sort(key=lambda r: (r.jobs, r.rep, order.get(r.mode, 1)))
    text = (
        f"model={args.model} max_tokens={args.max_tokens}{' (staggered)' if args.staggered else ''} "
        f"prompt_words={args.prompt_words} batch={batch} mlx_cache_limit={args.mlx_cache_limit:,} "
        f"temperature={args.temperature} top_p={args.top_p} repeats={args.repeats} "
        "(latency and TTFT from enqueue, or from the call in this process)\n\n"
        + render(runs)
        + ("\n\n" + render_summary(runs) if args.repeats > 1 else "")
        + "\n\nBatched worker, phase timers (seconds, calls):\n\n"
        + render_phases(runs)
    )
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for r in runs:
            d = asdict(r)
            d.pop("token_ids")
            d["tokens_per_s"] = r.tokens_per_s
            d["decode_tokens_per_s"] = r.decode_tokens_per_s
            rows.append(d)
        result["runs"] = rows
        result["summary"] = summary(runs)
        (out / f"{args.label}.json").write_text(json.dumps(result, indent=1))
        (out / f"{args.label}.md").write_text(text + "\n")
    return 0


def _ab_env(spec: str) -> dict[str, str]:
    """`--ab-env`'s KEY=VALUE pairs."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    if any(len(kv) != 2 or not kv[0].startswith("MLXQ_") for kv in pairs):
        raise SystemExit(f"--ab-env takes MLXQ_KEY=VALUE[,MLXQ_KEY=VALUE], got {spec!r}")
    return {k.strip(): v.strip() for k, v in pairs}


def _warm_payloads(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The measured runs' payloads as a repetition after the last one would have them: other prompts,
    the same token counts (a tag of another length moved 64 prompts from 129-130 tokens to 125-126,
    so a burst prefill's 64 x 192 forward was first met in the first measured run, ~0.5 s on the H200)."""
    tag = f"size{n}-r{args.repeats}-"
    return _payloads(n, args.max_tokens, args.prompt_words, tag, args.staggered, **_sampling(args))


def _sampling(args: argparse.Namespace) -> dict[str, float]:
    return {"temperature": args.temperature, "top_p": args.top_p}


class InProcess:
    """The engine's GenerationBatch and mlx-lm's BatchGenerator in this process, warmed up as the workers
    are (every size once, as measured)."""

    def __init__(self, model: str, sizes: list[int], batch: int, args: argparse.Namespace) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from worker.engine.engine import Engine

        from .baseline import MlxLm

        mx.set_cache_limit(args.mlx_cache_limit)  # as the workers do (`WorkerService.start`)
        self.engine = Engine.load(model)
        self.batch, self.args = batch, args
        dtype = next(v.dtype for _, v in tree_flatten(self.engine.model.parameters()))
        try:
            self.mlxlm: MlxLm | None = MlxLm.load(model, dtype)
        except ImportError as e:
            print(f"mlx-lm not installed, its path skipped ({e})", file=sys.stderr)
            self.mlxlm = None
        for n in sizes:
            self.run(_warm_payloads(n, args), n, quiet=True)

    def run(self, payloads: list[dict[str, Any]], n: int, quiet: bool = False) -> list[Run]:
        from jobs.schema import GenerateRequest

        runs = [run_engine_batch(self.engine, payloads, min(n, self.batch))]
        overlap = _ab_env(self.args.ab_env).get("MLXQ_DECODE_OVERLAP")
        if overlap is not None:  # the same engine, its decode batches overlapping or not
            default = self.engine.decode_overlap
            on = overlap.lower() in ("1", "true", "yes", "on")
            self.engine.decode_overlap = on
            if self.engine.prefix_cache is not None:  # the first run's prompts: no hits for this one
                self.engine.prefix_cache.evict_all()
            try:
                ab = run_engine_batch(self.engine, payloads, min(n, self.batch))
            finally:
                self.engine.decode_overlap = default
            runs.append(replace(ab, mode=f"{ab.mode}, MLXQ_DECODE_OVERLAP={overlap}"))
        if self.mlxlm is not None:
            prompts = [self.engine.prompt_tokens(GenerateRequest(**p)) for p in payloads]
            lengths = [p["max_tokens"] for p in payloads]
            sampling = _sampling(self.args)
            runs.append(run_mlx_lm_batch(self.mlxlm.model, prompts, lengths, self.batch, **sampling))
        if not quiet:
            for r in runs:
                print(f"{r.mode} jobs={n}: {r.tokens_per_s:,.0f} tok/s", file=sys.stderr, flush=True)
        return runs


if __name__ == "__main__":
    raise SystemExit(main())
